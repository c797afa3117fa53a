"""Swap-to-CPU preemption: block bookkeeping, scheduler on plain objects, KV copies, and whole engines.

The scheduler tests reuse test_scheduler's fake runner (a simulated paged KV cache that checks every
context position it reads), extended with a CPU block store that the swap pairs copy to and from.
"""
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.cli import build_parser, engine_config_from_args
from minivllm.config import EngineConfig
from minivllm.core.block_manager import BlockManager
from minivllm.core.scheduler import Scheduler, SchedulerConfig
from minivllm.core.sequence import SequenceGroup, SequenceStatus
from minivllm.worker.swap import SwapSpace
from tests.conftest import make_tiny_hf_checkpoint
from tests.test_scheduler import FakeRunner, make_group, workload


class SwappingFakeRunner(FakeRunner):
    def __init__(self, block_manager):
        super().__init__(block_manager)
        self.cpu_kv = {}

    def execute(self, out):
        bs = self.block_size
        for src, dst in out.blocks_to_swap_out:  # first: this step may reuse the GPU blocks
            for row in range(bs):
                self.cpu_kv[dst * bs + row] = self.kv.pop(src * bs + row, None)
        for src, dst in out.blocks_to_swap_in:
            for row in range(bs):
                self.kv[dst * bs + row] = self.cpu_kv.pop(src * bs + row)
        return super().execute(out)


def _run(scheduler, groups, async_scheduling=False, abort_swapped_at=None, max_steps=3000):
    runner = SwappingFakeRunner(scheduler.block_manager)
    for group in groups:
        scheduler.add_seq_group(group)
    in_flight, aborted = None, []
    for step_index in range(max_steps):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            break
        if abort_swapped_at is not None and step_index >= abort_swapped_at and scheduler.swapped and not aborted:
            aborted.append(scheduler.swapped[0].request_id)
            scheduler.abort_request(aborted[0])
        out = scheduler.schedule()
        launched = (out, runner.execute(out)) if not out.is_empty else None
        if not async_scheduling and launched is not None:
            scheduler.update(*launched)
            launched = None
        if in_flight is not None:
            scheduler.update(*in_flight)
        in_flight = launched
        bm = scheduler.block_manager
        bm.check_integrity(scheduler.running, scheduler.swapped)
        assert all(seq.status is SequenceStatus.SWAPPED and not seq.block_table for seq in scheduler.swapped)
    else:
        raise AssertionError("requests did not finish")
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.cpu_pool.num_free_blocks == bm.cpu_pool.num_blocks
    bm.check_integrity([], [])
    return {g.request_id: {s.index: s.output_token_ids for s in g.seqs} for g in groups}, aborted


def _groups(seed, count=10):
    return [make_group(**r) for r in workload(seed, count)]


def _scheduler(num_blocks, num_cpu_blocks=0, **config):
    config.setdefault("max_model_len", 64)
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, 4, num_cpu_blocks=num_cpu_blocks))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swapping_scheduler_gives_the_unpreempted_outputs(seed, async_scheduling):
    reference, _ = _run(_scheduler(256, max_num_batched_tokens=32), _groups(seed))
    swapping = _scheduler(20, 64, max_num_batched_tokens=32, preemption_mode="swap", swap_min_tokens=4)
    outputs, _ = _run(swapping, _groups(seed), async_scheduling)
    assert outputs == reference
    assert swapping.num_swap_outs > 0 and swapping.num_preemptions >= swapping.num_swap_outs


@pytest.mark.parametrize("chunked", [True, False])
def test_swapping_under_priority_policy_and_without_chunking(chunked):
    options = dict(policy="priority", enable_chunked_prefill=chunked, max_num_batched_tokens=64)
    reference, _ = _run(_scheduler(256, **options), _groups(3, 14))
    swapping = _scheduler(20, 64, preemption_mode="swap", swap_min_tokens=4, **options)
    outputs, _ = _run(swapping, _groups(3, 14), async_scheduling=True)
    assert outputs == reference and swapping.num_swap_outs > 0


def test_short_or_shared_victims_recompute_and_a_full_swap_space_falls_back():
    scheduler = _scheduler(20, 64, max_num_batched_tokens=32, preemption_mode="swap", swap_min_tokens=10**6)
    _run(scheduler, _groups(0))
    assert scheduler.num_preemptions > 0 and scheduler.num_swap_outs == 0
    # Two CPU blocks hold few victims: the others recompute, and the mix still gives the same outputs.
    scheduler = _scheduler(20, 2, max_num_batched_tokens=32, preemption_mode="swap", swap_min_tokens=0)
    outputs, _ = _run(scheduler, _groups(0))
    assert 0 < scheduler.num_swap_outs < scheduler.num_preemptions
    assert outputs == _run(_scheduler(256, max_num_batched_tokens=32), _groups(0))[0]


def test_aborting_a_swapped_request_frees_its_cpu_blocks():
    scheduler = _scheduler(20, 64, max_num_batched_tokens=32, preemption_mode="swap", swap_min_tokens=4)
    outputs, aborted = _run(scheduler, _groups(1), abort_swapped_at=0)
    assert aborted and scheduler.num_swap_outs > 0
    reference, _ = _run(_scheduler(256, max_num_batched_tokens=32), _groups(1))
    assert {k: v for k, v in outputs.items() if k not in aborted} == {k: v for k, v in reference.items()
                                                                      if k not in aborted}


def test_block_manager_swap_bookkeeping():
    bm = BlockManager(8, 4, num_cpu_blocks=4)
    seq = SequenceGroup("a", None, list(range(10)), SamplingParams()).seqs[0]
    assert bm.allocate_slots(seq, 10)
    gpu_table = list(seq.block_table)
    bm.swap_out(seq)
    out, swap_in = bm.take_swaps()
    assert [g for g, _ in out] == gpu_table and not swap_in and not seq.block_table
    cpu_table = [c for _, c in out]
    assert bm.num_free_blocks == 8 and bm.cpu_pool.num_free_blocks == 1
    bm.check_integrity([], [seq])
    seq.num_computed_tokens = 10
    assert bm.can_swap_in(seq, 2) and not bm.can_swap_in(seq, 40)
    bm.swap_in(seq)
    assert bm.take_swaps() == ([], list(zip(cpu_table, seq.block_table)))
    assert bm.cpu_pool.num_free_blocks == 4
    bm.check_integrity([seq], [])
    # A forked sibling shares the blocks: neither may be swapped.
    child = seq.fork(1)
    bm.fork(seq, child)
    assert not bm.can_swap_out(seq) and not bm.can_swap_out(child)


def test_swap_space_round_trips_kv_bytes_exactly():
    torch.manual_seed(0)
    kv = torch.randn(2, 3, 6, 4, 2, 8)  # [2, layers, blocks, block_size, heads, dim]
    draft = torch.randn(2, 1, 6, 4, 1, 16)
    original, original_draft = kv.clone(), draft.clone()
    space = SwapSpace([kv, draft], num_blocks=4)
    assert space.cpu_caches[0].shape == (2, 3, 4, 4, 2, 8) and space.nbytes == 4 * (2 * 3 * 4 * 2 * 8 + 2 * 4 * 16) * 4
    # Swap blocks 1, 4, 5 out; in the same step block 4 is reused by the swap-in of what block 0 held
    # before it went out in an earlier step.
    space.apply([(0, 3)], [])
    kv[:, :, 0], draft[:, :, 0] = 0, 0
    space.apply([(1, 0), (4, 1), (5, 2)], [(3, 4)])
    assert torch.equal(kv[:, :, 4], original[:, :, 0]) and torch.equal(draft[:, :, 4], original_draft[:, :, 0])
    kv[:, :, [1, 5]] = -1
    space.apply([], [(0, 5), (1, 1), (2, 0)])
    for dst, src in [(5, 1), (1, 4), (0, 5)]:
        assert torch.equal(kv[:, :, dst], original[:, :, src])
        assert torch.equal(draft[:, :, dst], original_draft[:, :, src])


def test_config_and_cli():
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="offload")
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(swap_space=-1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(preemption_mode="swap", tensor_parallel_size=2)
    args = build_parser().parse_args(["serve", "--preemption-mode", "swap", "--swap-space", "0.5"])
    config = engine_config_from_args(args)
    assert config.preemption_mode == "swap" and config.swap_space == 0.5


# ---- whole engines on a tiny random llama --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-swap")
    make_tiny_hf_checkpoint(folder, "llama3")
    return str(folder)


def _llm(model, **kwargs):
    options = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory=4 * 2**20, max_model_len=128,
                   seed=0, max_num_batched_tokens=64, block_size=4, max_num_seqs=8)
    options.update(kwargs)
    return LLM(model, **options)


def _prompts(count):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 120, (8 + 3 * i,), generator=g).tolist() for i in range(count)]


def _assert_no_leaks(engine):
    bm = engine.block_manager
    bm.check_integrity([], [])
    assert bm.num_free_blocks == bm.num_blocks and bm.cpu_pool.num_free_blocks == bm.cpu_pool.num_blocks
    assert not engine.scheduler.swapped and engine.get_stats().num_swapped == 0


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "adaptive": False}
DRAFT_LAYERS = {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 2, "adaptive": False}


@pytest.mark.parametrize("variant", [dict(async_scheduling=False), dict(async_scheduling=True),
                                     dict(speculative_config=NGRAM), dict(speculative_config=DRAFT_LAYERS)],
                         ids=["sync", "async", "ngram", "draft_layers"])
def test_engine_greedy_outputs_with_swapping_equal_an_unpreempted_run(tiny_model, variant):
    prompts = _prompts(8)
    params = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True) for i in range(len(prompts))]
    requests = [{"prompt_token_ids": p} for p in prompts]
    unpreempted = _llm(tiny_model)
    reference = unpreempted.generate(requests, params, use_tqdm=False)
    assert unpreempted.llm_engine.get_stats().num_preemptions == 0
    llm = _llm(tiny_model, num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.001, **variant)
    engine = llm.llm_engine
    assert engine.block_manager.cpu_pool.num_blocks > 0
    engine.scheduler.config.swap_min_tokens = 8  # long enough on this toy scale (the cost rule is for GPUs)
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [r.outputs[0].token_ids for r in reference]
    stats = engine.get_stats()
    assert stats.num_swap_outs > 0 and stats.num_preemptions >= stats.num_swap_outs
    _assert_no_leaks(engine)


def test_engine_aborts_of_swapped_requests_leak_nothing(tiny_model):
    llm = _llm(tiny_model, num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.001)
    engine = llm.llm_engine
    engine.scheduler.config.swap_min_tokens = 8
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(_prompts(8)):
        engine.add_request(f"r{i}", prompt, params)
    num_aborted = 0
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if engine.scheduler.swapped and num_aborted < 3:
            engine.abort_request(engine.scheduler.swapped[-1].request_id)
            num_aborted += 1
        engine.block_manager.check_integrity(engine.scheduler.running, engine.scheduler.swapped)
    assert num_aborted == 3 and not engine.has_unfinished_requests()
    _assert_no_leaks(engine)


@pytest.mark.gpu
def test_swap_space_on_cuda_round_trips_through_pinned_memory_and_the_side_stream():
    kv = torch.randn(2, 4, 64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    original = kv.clone()
    space = SwapSpace([kv], num_blocks=32)
    assert space.cpu_caches[0].is_pinned()
    out = [(b, i) for i, b in enumerate(range(0, 64, 2))]
    space.apply(out, [])
    kv.mul_(0)  # the main stream overwrites the freed blocks: ordered after the swap-out reads
    space.apply([], [(i, 63 - i) for i in range(32)])
    kv.add_(0)  # a main-stream kernel after the swap-in sees its data
    torch.cuda.synchronize()
    for i, b in enumerate(range(0, 64, 2)):
        assert torch.equal(kv[:, :, 63 - i], original[:, :, b])


@pytest.mark.gpu
def test_engine_on_cuda_with_async_scheduling_gives_the_unpreempted_outputs(tiny_model):
    prompts = _prompts(8)
    params = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True) for i in range(len(prompts))]
    requests = [{"prompt_token_ids": p} for p in prompts]
    cuda = dict(device="cuda", kv_cache_memory=None, gpu_memory_utilization=0.3, enforce_eager=True)
    reference = _llm(tiny_model, **cuda).generate(requests, params, use_tqdm=False)
    llm = _llm(tiny_model, **cuda, num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.001)
    llm.llm_engine.scheduler.config.swap_min_tokens = 8
    outputs = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [r.outputs[0].token_ids for r in reference]
    assert llm.llm_engine.get_stats().num_swap_outs > 0
    _assert_no_leaks(llm.llm_engine)


def test_metrics_expose_the_swapped_gauge(tiny_model):
    from minivllm.server.metrics import _EngineStatsCollector
    engine = _llm(tiny_model, num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.001).llm_engine
    engine.scheduler.config.swap_min_tokens = 8
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(_prompts(8)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(200):
        if engine.scheduler.swapped:
            break
        engine.step()
    families = {f.name: f for f in _EngineStatsCollector(engine.get_stats, "tiny").collect()}
    [sample] = families["minivllm:num_requests_swapped"].samples
    assert sample.value == len(engine.scheduler.swapped) > 0
    engine.shutdown()
    _assert_no_leaks(engine)
