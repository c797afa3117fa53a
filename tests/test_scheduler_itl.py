"""The ITL target (`max_itl_ms`): the step-cost model's inverse, the budget rule on plain objects with a
simulated device whose step cost is affine in tokens, preemption and prefix caching under the target, and
greedy outputs of a tiny model with the target on and off."""
import pytest

import tests.test_scheduler as base
from minivllm.core.scheduler import SchedulerConfig
from minivllm.core.step_costs import StepCosts
from minivllm.engine.llm import LLM
from minivllm.sampling_params import SamplingParams
from tests.conftest import make_tiny_hf_checkpoint
from tests.test_scheduler import FakeRunner, make_group, make_scheduler, reference_outputs, run, step, workload

FIXED_S, PER_TOKEN_S = 2e-3, 1e-4   # the simulated device: a step of n tokens takes FIXED_S + n * PER_TOKEN_S


def step_seconds(num_tokens: int) -> float:
    return FIXED_S + num_tokens * PER_TOKEN_S


class TimedRunner(FakeRunner):
    """The fake runner, reporting each step's simulated cost to the scheduler as the engine does."""

    def __init__(self, block_manager, scheduler):
        super().__init__(block_manager)
        self.scheduler = scheduler

    def execute(self, out):
        result = super().execute(out)
        self.scheduler.observe_step(out.total_num_scheduled_tokens, step_seconds(out.total_num_scheduled_tokens))
        return result


def test_tokens_within_inverts_measured_costs_and_never_guesses_high():
    costs = StepCosts()
    assert costs.tokens_within(1.0) is None
    costs.observe(10, 10, step_seconds(10), speculative=False)
    # One measured size: cost taken as proportional to tokens (an overestimate), and at most twice that size.
    assert costs.tokens_within(step_seconds(10) * 1.5) == 15
    assert costs.tokens_within(10.0) == 20
    assert costs.tokens_within(step_seconds(10) / 2) == 0
    for n in (100, 300):
        costs.observe(n, n, step_seconds(n), speculative=False)
    # Between and above measured sizes an affine cost is found exactly; above, still by doubling at most.
    for n in (50, 200, 450):
        assert abs(costs.tokens_within(step_seconds(n)) - n) <= 1
    assert costs.tokens_within(10.0) == 600
    costs.observe(7, 7, 1.0, speculative=True)   # verify steps are no plain step's cost
    assert abs(costs.tokens_within(step_seconds(200)) - 200) <= 1


def test_a_decode_is_never_delayed_past_the_target_when_a_smaller_chunk_fits():
    target_ms, min_chunk = 6.0, 8   # 40 tokens a step fit the target
    scheduler = make_scheduler(num_blocks=512, block_size=4, max_model_len=256, max_num_batched_tokens=512,
                               max_itl_ms=target_ms, itl_min_prompt_tokens=min_chunk)
    runner = TimedRunner(scheduler.block_manager, scheduler)
    for i in range(4):
        scheduler.add_seq_group(make_group(f"d{i}", [i + 1] * 5, max_tokens=200, arrival=i))
    step(scheduler, runner)
    checked = prompts_progressed = 0
    for i in range(3):
        scheduler.add_seq_group(make_group(f"p{i}", range(100 * i, 100 * i + 150), max_tokens=4, arrival=10 + i))
    while any(g.seqs[0].num_output_tokens == 0 for g in map(scheduler.get_group, ("p0", "p1", "p2")) if g):
        out, _ = step(scheduler, runner)
        decodes = [seq for seq, start in zip(out.seqs, out.num_computed_tokens) if start >= seq.num_prompt_tokens]
        num_prompt = out.total_num_scheduled_tokens - len(decodes)
        if decodes and num_prompt:
            checked += 1
            within = step_seconds(out.total_num_scheduled_tokens) <= target_ms / 1e3 + 1e-12
            # Over the target only with the minimum chunk, and then only when nothing smaller than it would fit.
            assert within or num_prompt <= min_chunk, (out.total_num_scheduled_tokens, num_prompt)
            prompts_progressed += num_prompt >= min_chunk
    assert checked >= 10 and prompts_progressed == checked   # prompts kept moving every mixed step
    # The same prompts without a target take the whole budget beside the decodes: far over the target.
    off = make_scheduler(num_blocks=512, block_size=4, max_model_len=256, max_num_batched_tokens=512)
    for i in range(4):
        off.add_seq_group(make_group(f"d{i}", [i + 1] * 5, max_tokens=200, arrival=i))
    off_runner = FakeRunner(off.block_manager)
    step(off, off_runner)
    off.add_seq_group(make_group("p0", range(150), max_tokens=4, arrival=10))
    out, _ = step(off, off_runner)
    assert step_seconds(out.total_num_scheduled_tokens) > 2 * target_ms / 1e3


def test_no_target_without_running_decodes_and_validation():
    scheduler = make_scheduler(num_blocks=512, block_size=4, max_model_len=256, max_num_batched_tokens=512,
                               max_itl_ms=1.0)
    scheduler.add_seq_group(make_group("a", range(200), max_tokens=2))
    out, _ = step(scheduler, FakeRunner(scheduler.block_manager))
    assert out.num_scheduled_tokens == [200]   # nobody's next token waits: the full budget
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(max_itl_ms=5.0, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    with pytest.raises(ValueError, match="positive"):
        SchedulerConfig(max_itl_ms=0.0)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("target_ms", [2.5, 4.0])
def test_preemption_and_prefix_caching_unaffected(monkeypatch, async_scheduling, target_ms):
    requests = workload(3, count=12)
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=5,
                               max_num_batched_tokens=32, policy="priority", max_itl_ms=target_ms,
                               itl_min_prompt_tokens=4)
    monkeypatch.setattr(base, "FakeRunner", lambda block_manager: TimedRunner(block_manager, scheduler))
    outputs = run(scheduler, [(i // 3, make_group(**r)) for i, r in enumerate(requests)],
                  async_scheduling=async_scheduling)
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.prefix_cache_hits > 0
    assert scheduler.step_costs.tokens_within(1.0) is not None   # the costs were learned as it ran
    assert outputs == reference_outputs(requests)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-itl")
    make_tiny_hf_checkpoint(folder, "llama3")
    return str(folder)


def test_greedy_outputs_unchanged_on_a_tiny_model(tiny_model):
    prompts = [[(7 * i + 3 * k) % 120 + 3 for k in range(150 + 9 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True) for i in range(len(prompts))]

    def generate(**options):
        llm = LLM(tiny_model, dtype="float32", skip_tokenizer_init=True, kv_cache_memory=4 * 2**20,
                  max_model_len=256, max_num_batched_tokens=256, seed=0, **options)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine = llm.llm_engine
        engine.block_manager.check_integrity()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        return [o.outputs[0].token_ids for o in outputs], engine

    reference, _ = generate()
    # A target no CPU step meets: every step with decodes takes the minimum chunk of prompt tokens.
    outputs, engine = generate(max_itl_ms=1e-3)
    assert outputs == reference
    assert engine.scheduler.step_costs.tokens_within(1.0) is not None   # the engine fed measured step times
    with pytest.raises(ValueError, match="chunked prefill"):
        LLM(tiny_model, skip_tokenizer_init=True, max_itl_ms=5.0, enable_chunked_prefill=False)
