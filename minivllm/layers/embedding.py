"""Token embedding and LM head. The head may share its weight with the embedding (tied embeddings,
e.g. SmolLM2, Qwen2.5-0.5B); then the checkpoint has no separate `lm_head.weight` to load.

A GPTQ checkpoint may store the head quantized (`lm_head: true`, as GPTQModel writes): the head then
holds the format's tensors instead of `weight`, is never tied, and runs the format's GEMM.

Under tensor parallelism the vocabulary splits into equal shards of ceil(vocab / ranks) rows (the
last padded): the embedding looks up the ids in its shard, zeroes the others and all-reduces; the
head computes its shard's logits and gathers them on the driver, which drops the padding columns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.distributed import gather_to_driver, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from minivllm.layers.linear import default_weight_loader
from minivllm.quantization import current_lm_head_method


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab, hidden]; this rank holds vocabulary rows [vocab_start, vocab_end)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_size = -(-num_embeddings // get_tp_size())
        self.vocab_start = get_tp_rank() * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if get_tp_size() == 1:
            default_weight_loader(param, loaded_weight, shard_id)
            return
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"shape mismatch: {self.num_embeddings} vocabulary rows expected, checkpoint has "
                             f"{tuple(loaded_weight.shape)}")
        rows = self.vocab_end - self.vocab_start
        param.data.zero_()   # padding rows of the last shard
        default_weight_loader(param.data[:rows], loaded_weight[self.vocab_start:self.vocab_end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = F.embedding(torch.where(in_shard, input_ids - self.vocab_start, 0), self.weight)
        return tensor_model_parallel_all_reduce(local.masked_fill_(~in_shard.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [S, hidden] -> logits [S, vocab], in the model dtype (None on ranks other than the driver)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.shard_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.quant_method = current_lm_head_method(self)
        if self.quant_method is not None:
            if get_tp_size() > 1:
                raise ValueError("a quantized LM head (lm_head: true) needs tensor_parallel_size 1")
            del self.weight
            self.input_size, self.output_size = embedding_dim, self.shard_size
            self.quant_method.create_weights(self, embedding_dim, self.shard_size)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        if self.quant_method is None:   # a quantized head keeps its own tensors
            self.weight = embedding.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden_states, self.bias)
        else:
            logits = F.linear(hidden_states, self.weight, self.bias)
        if get_tp_size() == 1:
            return logits
        logits = gather_to_driver(logits)
        return None if logits is None else logits[..., :self.num_embeddings]
