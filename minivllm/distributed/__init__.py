"""Tensor parallelism on torch.distributed: process-group state and the collectives the layers use."""
from minivllm.distributed.communication_op import (broadcast_object, broadcast_tensor, gather_to_driver,
                                                   min_over_ranks, tensor_model_parallel_all_reduce)
from minivllm.distributed.parallel_state import (abort_distributed, attention_head_partition, destroy_distributed,
                                                 get_cpu_group, get_tp_group, get_tp_rank, get_tp_size,
                                                 init_distributed, is_driver, launched_by_torchrun,
                                                 progress_of_ranks, report_progress, set_collective_timeout,
                                                 split_evenly)

__all__ = ["abort_distributed", "attention_head_partition", "broadcast_object", "broadcast_tensor",
           "destroy_distributed", "gather_to_driver", "get_cpu_group", "get_tp_group", "get_tp_rank",
           "get_tp_size", "init_distributed", "is_driver", "launched_by_torchrun", "min_over_ranks",
           "progress_of_ranks", "report_progress", "set_collective_timeout", "split_evenly",
           "tensor_model_parallel_all_reduce"]
