"""End-to-end engine behaviour on the real default model (CPU, fp32), checked against transformers."""
from __future__ import annotations


import pytest
import torch

from minivllm import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "How many legs does a spider have?"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "Explain gravity in one sentence."}],
]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def make_llm(**kwargs) -> LLM:
    # Async scheduling is pinned on (its default is off on CPU) so CI exercises the GPU's engine loop.
    options = dict(kv_cache_memory=64 * 2**20, max_model_len=1024, seed=0, async_scheduling=True)
    options.update(kwargs)
    return LLM(**options)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    out = []
    for chat in CHATS:
        out.append(list(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)))
    return out


@pytest.fixture(scope="module")
def reference_tokens(prompt_ids, hf_model) -> list[list[int]]:
    model = hf_model
    refs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            refs.append(out[0, len(ids):].tolist())
    return refs


def _run_staggered(llm: LLM, prompts: list[list[int]], params: SamplingParams, steps_between: int = 2):
    """Add one request every few engine steps, so later ones join a batch that is already decoding."""
    engine = llm.llm_engine
    finished = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, ids = pending.pop(0)
            engine.add_request(f"stagger-{id(prompts)}-{i}", ids, params)
        for _ in range(steps_between if pending else 1):
            for out in engine.step():
                if out.finished:
                    finished[int(out.request_id.rsplit("-", 1)[1])] = out
    return [finished[i] for i in range(len(prompts))]


def _truncate_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for k, t in enumerate(tokens):
        if t in eos:
            return tokens[:k + 1]
    return tokens


def test_greedy_batch_matches_transformers(llm, prompt_ids, reference_tokens):
    eos = llm.llm_engine.eos_token_ids
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY, use_tqdm=False)
    for out, ref in zip(outputs, reference_tokens):
        assert out.outputs[0].token_ids == _truncate_at_eos(ref, eos)


def test_staggered_small_chunks_and_prefix_hits_match_transformers(prompt_ids, reference_tokens):
    llm = make_llm(max_num_batched_tokens=7, max_num_seqs=4)
    eos = llm.llm_engine.eos_token_ids
    first = _run_staggered(llm, prompt_ids, GREEDY)
    hits_before = llm.llm_engine.block_manager.prefix_cache_hits
    second = _run_staggered(llm, prompt_ids, GREEDY, steps_between=1)  # same prompts: prefix-cache hits
    assert llm.llm_engine.block_manager.prefix_cache_hits > hits_before
    assert any(out.num_cached_tokens > 0 for out in second)
    for a, b, ref in zip(first, second, reference_tokens):
        assert a.outputs[0].token_ids == _truncate_at_eos(ref, eos)
        assert b.outputs[0].token_ids == _truncate_at_eos(ref, eos)


def runner_logits(engine, group, num_decodes: int) -> torch.Tensor:
    """The logits the runner computes for a prefill of `group`'s prompt and `num_decodes` greedy decode steps
    (one row each), driving the runner directly; the sequence ends with every sampled token appended."""
    from minivllm.core.interfaces import SchedulerOutput
    runner, bm = engine.runner, engine.block_manager
    seq = group.seqs[0]
    captured = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h: captured.append(original(h)) or captured[-1]
    try:
        n_new = seq.num_tokens
        for step in range(num_decodes + 1):
            assert bm.allocate_slots(seq, n_new)
            out = runner.execute(SchedulerOutput(seqs=[seq], num_scheduled_tokens=[n_new], num_samples=[1]))
            seq.num_computed_tokens += n_new
            seq.append_token(out.sampled_token_ids[0][0])
            n_new = 1
    finally:
        runner.model.compute_logits = original
        bm.free(seq)
    return torch.cat(captured)


def test_logits_match_transformers_prefill_and_decode(llm, prompt_ids, hf_model):
    """Logits of a prefill and of 20 decode steps through the engine's runner equal transformers'."""
    from minivllm.core.sequence import SequenceGroup
    ref_model = hf_model
    ids = prompt_ids[1]
    group = SequenceGroup("logits", None, ids, SamplingParams(temperature=0.0))
    seq = group.seqs[0]
    ours = runner_logits(llm.llm_engine, group, 20)  # the last position of the prefill, then each decode step
    with torch.inference_mode():
        ref_logits = ref_model(torch.tensor([seq.token_ids[:-1]])).logits[0]
    ref = ref_logits[len(ids) - 1:]
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 1e-3 * max(1.0, scale)


def test_generate_runs_with_the_heap_frozen_and_hands_it_back(llm):
    """Full collections during generate() skip the heap that existed before it (gc.freeze: one took 210-340
    ms on the H100's host, engine/gc_heap.py); afterwards the heap is unfrozen, so an engine dropped later,
    even in a reference cycle, is still collected."""
    import gc
    frozen_at_step = []
    step = llm.llm_engine.step
    llm.llm_engine.step = lambda: frozen_at_step.append(gc.get_freeze_count()) or step()
    try:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    finally:
        del llm.llm_engine.step
    assert frozen_at_step and min(frozen_at_step) > 10_000   # torch, transformers and the model's objects
    assert gc.get_freeze_count() == 0


def test_continuous_batching_join_and_leave(llm):
    from minivllm.core.sequence import SequenceStatus
    engine = llm.llm_engine
    running = lambda: {s.request_id for s in engine.scheduler.running}  # noqa: E731
    engine.add_request("cb-long", "Count from one to twenty:", SamplingParams(temperature=0, max_tokens=10,
                                                                             ignore_eos=True))
    engine.add_request("cb-short", "Say hi.", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    for _ in range(2):
        engine.step()
    assert running() == {"cb-long", "cb-short"}
    engine.add_request("cb-late", "Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outputs = engine.step()
    # The late request was admitted and its whole prompt computed in the very next step, beside the decodes.
    late = engine.scheduler.get_group("cb-late").seqs[0]
    assert late.status is SequenceStatus.RUNNING and late.num_computed_tokens >= late.num_prompt_tokens
    # A finished request leaves the batch at once; the others keep running.
    for _ in range(10):
        if any(o.request_id == "cb-short" and o.finished for o in outputs):
            break
        outputs = engine.step()
    else:
        raise AssertionError("cb-short never finished")
    assert "cb-short" not in running() and "cb-long" in running()
    while engine.has_unfinished_requests():
        engine.step()


def test_preemption_keeps_outputs_and_frees_every_block(prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = make_llm().generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    longest = max(len(p) for p in prompt_ids) + 24
    tight = make_llm(num_gpu_blocks_override=(longest + 15) // 16 + 2, max_model_len=longest + 8)
    engine = tight.llm_engine
    outputs = tight.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in roomy]
    assert engine.block_manager.usage == 0.0
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks
    engine.block_manager.check_integrity()


def test_prefix_cache_computes_only_new_tokens(llm):
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    system = ("You are a helpful assistant for a small bakery. " * 40)
    system_ids = tok.encode(system)[:200]
    assert len(system_ids) == 200
    q1, q2 = tok.encode(" Question: what bread is best?"), tok.encode(" Question: when do you open?")
    params = SamplingParams(temperature=0.0, max_tokens=4)
    llm.generate({"prompt_token_ids": system_ids + q1}, params, use_tqdm=False)
    before = engine.num_prompt_tokens
    out = llm.generate({"prompt_token_ids": system_ids + q2}, params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 192  # the 12 full blocks of the shared 200-token system prompt
    assert engine.num_prompt_tokens - before == len(system_ids + q2) - 192
    uncached = make_llm(enable_prefix_caching=False).generate({"prompt_token_ids": system_ids + q2}, params,
                                                              use_tqdm=False)[0]
    assert uncached.num_cached_tokens == 0
    assert out.outputs[0].token_ids == uncached.outputs[0].token_ids


def test_n_samples_are_distinct_and_share_prompt_blocks(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    prompt = "Tell me a long story about a dragon who guards a mountain of gold and learns to share it."
    engine.add_request("fork", prompt, params)
    # The prompt is computed once, then forked into 3 samples that share its full blocks (the partial last
    # block is copied on the first divergent write). The prompt step is read back, and the samples forked, at
    # the start of the next call.
    engine.step()
    engine.step()
    seqs = engine.scheduler.get_group("fork").seqs
    assert len(seqs) == 3 and seqs[0].num_prompt_tokens > 16
    for _ in range(2):
        engine.step()
    shared = seqs[0].block_table[0]
    assert all(s.block_table[0] == shared for s in seqs)
    assert engine.block_manager.blocks[shared].ref_count == 3
    while engine.has_unfinished_requests():
        outputs = engine.step()
    texts = [c.token_ids for c in outputs[0].outputs]
    assert len({tuple(t) for t in texts}) == 3
    assert engine.block_manager.usage == 0.0


def test_async_and_sync_scheduling_give_identical_outputs(prompt_ids):
    """The overlapped loop (outputs trail one step) computes exactly what the plain loop does, also with
    seeded sampling, n > 1 forks, stop strings and penalties (which force a sync step)."""
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=10, n=2),
              SamplingParams(temperature=0.0, max_tokens=16, stop=[" the"]),
              SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5)]
    prompts = [{"prompt_token_ids": p} for p in prompt_ids[:4]]
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(async_scheduling=async_scheduling, max_num_batched_tokens=16, max_num_seqs=4)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs])
        assert llm.llm_engine.block_manager.usage == 0.0
    assert results[0] == results[1]


def test_a_completing_prompt_does_not_hold_back_running_decodes(prompt_ids):
    """Async scheduling: a running decode gets one token per step() call while another request's prompt is
    prefilled in chunks and completes, and that request's first token comes the call after the step that
    sampled it (read back before the next step is scheduled), not a step later."""
    llm = make_llm(max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.llm_engine
    engine.add_request("a", prompt_ids[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    counts, increments, sampled_first_at, first_seen_at = {"a": 0, "b": 0}, [], None, None
    for call in range(80):
        if call == 4:
            engine.add_request("b", list(range(1000, 1100)),
                               SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        outputs = engine.step()
        for request_id in counts:
            latest = max((len(o.outputs[0].token_ids) for o in outputs if o.request_id == request_id), default=None)
            if latest is None:
                continue
            if request_id == "a" and counts["a"]:
                increments.append(latest - counts["a"])
            if request_id == "b" and not counts["b"] and latest:
                first_seen_at = call
            counts[request_id] = latest
        in_flight = engine._in_flight
        if in_flight is not None and sampled_first_at is None:
            out = in_flight.scheduler_output
            if any(seq.group.request_id == "b" and n and seq.num_output_tokens == 0
                   for seq, n in zip(out.seqs, out.num_samples)):
                sampled_first_at = call
        if not engine.has_unfinished_requests():
            break
    assert counts == {"a": 40, "b": 4}
    assert sampled_first_at is not None and first_seen_at == sampled_first_at + 1
    assert increments and set(increments) == {1}   # never two tokens of "a" in one call
    assert engine.block_manager.usage == 0.0


def test_seeded_sampling_is_batch_independent(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=6)
    batch = llm.generate(["The weather today", "Once upon a time", "List some fruit"], [others, params, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("prompt, params, match", [
    ("", SamplingParams(), "empty"),
    ("word " * 1100, SamplingParams(), "context length"),
])
def test_bad_input_raises_and_engine_survives(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model="/no/such/model")
