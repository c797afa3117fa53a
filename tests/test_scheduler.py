"""Scheduler on plain Python objects, driven by a fake runner that keeps a simulated paged KV cache.

The fake runner stores, in each slot, a hash of the whole prefix ending at that token (what real
attention KV depends on) and checks, before sampling, that every context position read through the
block table holds the right value. The next token is a function of that context, so any block-table,
copy-on-write, prefix-cache or recompute mistake either trips the check or changes the output.
"""
import random

import pytest

from minivllm.core.block_manager import BlockManager
from minivllm.core.interfaces import ModelOutput
from minivllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerFullError
from minivllm.core.sequence import SampleLogprobs, SequenceGroup, SequenceStatus
from minivllm.sampling_params import SamplingParams

EOS = 5000  # never produced by the fake model unless a test asks for it


def prefix_hashes(token_ids):
    # Seeded with an int: on Python 3.11 hash(None) follows None's address, so tokens (and whether a test's
    # preconditions hold) changed from process to process.
    out, h = [], 1
    for token in token_ids:
        h = hash((h, token))
        out.append(h)
    return out


def next_token(context_hash, index):
    return (context_hash * 31 + 7919 * index) % 1000


class FakeRunner:
    def __init__(self, block_manager, with_logprobs=False):
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.kv = {}  # slot -> prefix hash
        self.with_logprobs = with_logprobs
        self.last_sampled = {}  # seq_id -> its newest sampled token (what a pending position holds)

    def slot(self, seq, position):
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, out):
        for src, dst in out.blocks_to_copy:  # before the forward pass, as the contract says
            for row in range(self.block_size):
                self.kv[dst * self.block_size + row] = self.kv.get(src * self.block_size + row)
        expected = []
        for seq, start, num_new in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens):
            context = list(seq.token_ids)
            if start + num_new > len(context):  # async scheduling: the last token is still in flight
                context.append(self.last_sampled[seq.seq_id])
            assert num_new > 0 and start + num_new <= len(context)
            hashes = prefix_hashes(context[:start + num_new])
            for position in range(start, start + num_new):
                # KV is only ever written into a private block that no cache entry points to.
                block = self.block_manager.blocks[seq.block_table[position // self.block_size]]
                assert block.ref_count == 1 and block.block_hash is None, f"{seq} writes into {block}"
                self.kv[self.slot(seq, position)] = hashes[position]
            expected.append(hashes)
        sampled, logprobs = [], []
        for seq, hashes, num_samples in zip(out.seqs, expected, out.num_samples):
            for position, h in enumerate(hashes):  # attention reads the whole context from the cache
                assert self.kv.get(self.slot(seq, position)) == h, f"{seq}: wrong KV at position {position}"
            tokens = [next_token(hashes[-1], seq.index + k) for k in range(num_samples)]
            if tokens:
                self.last_sampled[seq.seq_id] = tokens[0]
            sampled.append(tokens)
            logprobs.append([SampleLogprobs([t], [-0.5], 1) for t in tokens])
        return ModelOutput(sampled, logprobs if self.with_logprobs else None)


def make_group(request_id, prompt, max_tokens=8, n=1, priority=0, arrival=0.0, stop_token_ids=None,
               min_tokens=0, eos=EOS):
    params = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_token_ids)
    params.all_stop_token_ids = {eos, *params.stop_token_ids}
    return SequenceGroup(request_id, None, list(prompt), params, arrival_time=arrival, priority=priority)


def make_scheduler(num_blocks=64, block_size=4, **config):
    config.setdefault("max_model_len", min(64, num_blocks * block_size))
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


def step(scheduler, runner):
    out = scheduler.schedule()
    config = scheduler.config
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(set(map(id, out.seqs))) == len(out.seqs)
    groups = scheduler.update(out, runner.execute(out))
    assert scheduler.num_running <= config.max_num_seqs
    scheduler.block_manager.check_integrity(scheduler.running)
    return out, groups


def run(scheduler, groups_by_step, max_steps=2000, async_scheduling=False):
    """Add each group at its step, run until done; returns {request_id: {index: output ids}}.

    With `async_scheduling`, step N+1 is scheduled and executed before step N's tokens reach update(),
    as the engine does on a GPU."""
    runner = FakeRunner(scheduler.block_manager)
    pending = sorted(groups_by_step, key=lambda item: item[0])
    all_groups = []
    in_flight = None
    for step_index in range(max_steps):
        while pending and pending[0][0] <= step_index:
            group = pending.pop(0)[1]
            scheduler.add_seq_group(group)
            all_groups.append(group)
        if not pending and not scheduler.has_unfinished_requests() and in_flight is None:
            break
        if not async_scheduling:
            step(scheduler, runner)
            continue
        out = scheduler.schedule()
        assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        launched = (out, runner.execute(out)) if not out.is_empty else None
        if in_flight is not None:
            scheduler.update(*in_flight)
            scheduler.block_manager.check_integrity(scheduler.running)
        in_flight = launched
    else:
        raise AssertionError("requests did not finish")
    bm = scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_integrity([])
    assert all(group.is_finished and group.metrics.finished_time is not None for group in all_groups)
    return {g.request_id: {s.index: s.output_token_ids for s in g.seqs} for g in all_groups}


def workload(seed, count=10):
    rng = random.Random(seed)
    shared = [rng.randrange(1000) for _ in range(12)]
    requests = []
    for i in range(count):
        prompt = (shared[:rng.randrange(13)] if i % 2 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
        requests.append(dict(request_id=f"r{i}", prompt=prompt, max_tokens=rng.randrange(1, 20),
                             n=rng.choice([1, 1, 2, 3]), priority=rng.randrange(3), arrival=float(i)))
    return requests


def reference_outputs(requests):
    """The unconstrained run: plenty of blocks, budget and sequence slots, everything added at once."""
    scheduler = make_scheduler(num_blocks=512, block_size=4, max_model_len=64, max_num_batched_tokens=4096)
    return run(scheduler, [(0, make_group(**r)) for r in requests])


# ---- budget, chunked prefill, joining and leaving ----------------------------------------------------

def test_chunked_prefill_splits_long_prompt_while_decodes_continue():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=16, max_model_len=128)
    runner = FakeRunner(scheduler.block_manager)
    scheduler.add_seq_group(make_group("a", [1, 2, 3], max_tokens=50, arrival=0))
    scheduler.add_seq_group(make_group("b", [4, 5], max_tokens=50, arrival=1))
    step(scheduler, runner)
    scheduler.add_seq_group(make_group("long", range(100, 160), max_tokens=2, arrival=2))
    chunks = []
    while scheduler.get_group("long").seqs[0].num_output_tokens == 0:
        out, _ = step(scheduler, runner)
        assert out.num_scheduled_tokens[:2] == [1, 1]  # the decodes get their token every step
        assert out.num_samples[:2] == [1, 1]
        chunks.append((out.num_scheduled_tokens[2], out.num_samples[2]))
    assert chunks == [(14, 0)] * 4 + [(4, 1)]


def test_decodes_keep_a_token_behind_a_higher_priority_long_prompt():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=16, max_model_len=128, policy="priority")
    runner = FakeRunner(scheduler.block_manager)
    for i in range(3):
        scheduler.add_seq_group(make_group(f"low{i}", [i, i + 1], max_tokens=50, priority=5, arrival=i))
    step(scheduler, runner)
    scheduler.add_seq_group(make_group("urgent", range(200, 264), max_tokens=2, priority=0, arrival=9))
    step(scheduler, runner)  # admitted with what the decodes left
    for _ in range(3):
        out, _ = step(scheduler, runner)
        assert out.seqs[0].request_id == "urgent" and out.num_scheduled_tokens == [13, 1, 1, 1]


def test_small_batch_prefills_prompts_arriving_together_one_after_another():
    scheduler = make_scheduler(num_blocks=128, max_num_batched_tokens=64, max_model_len=128,
                               small_batch_prefill_tokens=16, small_batch_max_seqs=2)
    runner = FakeRunner(scheduler.block_manager)
    for i in range(3):
        scheduler.add_seq_group(make_group(f"p{i}", range(16 * i, 16 * i + 16), max_tokens=20, arrival=i))
    firsts = []
    for _ in range(3):  # one whole prompt per step, the earlier ones decoding alongside
        out, _ = step(scheduler, runner)
        firsts.append([(s.request_id, n) for s, n in zip(out.seqs, out.num_scheduled_tokens)])
    assert firsts == [[("p0", 16)], [("p0", 1), ("p1", 16)], [("p0", 1), ("p1", 1), ("p2", 16)]]
    # More sequences running than small_batch_max_seqs: the full budget takes every waiting prompt.
    scheduler.add_seq_group(make_group("p3", range(60, 76), max_tokens=20, arrival=3))
    scheduler.add_seq_group(make_group("p4", range(80, 96), max_tokens=20, arrival=4))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == [1, 1, 1, 16, 16]


def test_small_batch_budget_keeps_outputs_identical():
    requests = workload(seed=3)
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=64, max_model_len=64,
                               small_batch_prefill_tokens=5, small_batch_max_seqs=4)
    assert run(scheduler, [(i, make_group(**r)) for i, r in enumerate(requests)]) == reference_outputs(requests)


def test_token_budget_and_outputs_match_unconstrained_run():
    requests = workload(seed=1)
    scheduler = make_scheduler(num_blocks=512, max_num_batched_tokens=7, max_model_len=64)
    assert run(scheduler, [(i, make_group(**r)) for i, r in enumerate(requests)]) == reference_outputs(requests)


def test_request_added_while_others_decode_joins_next_step():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler.block_manager)
    scheduler.add_seq_group(make_group("a", [1, 2, 3], max_tokens=10))
    step(scheduler, runner)
    step(scheduler, runner)
    scheduler.add_seq_group(make_group("b", [7, 8, 9, 10, 11], max_tokens=10, arrival=1))
    out, groups = step(scheduler, runner)
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_scheduled_tokens == [1, 5]
    assert [g.request_id for g in groups] == ["a", "b"]
    assert scheduler.get_group("b").metrics.first_scheduled_time is not None


def test_finished_request_leaves_running_immediately():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler.block_manager)
    scheduler.add_seq_group(make_group("short", [1, 2], max_tokens=2))
    scheduler.add_seq_group(make_group("long", [3, 4], max_tokens=10, arrival=1))
    step(scheduler, runner)
    out, groups = step(scheduler, runner)
    short = groups[0]
    assert short.request_id == "short" and short.is_finished
    seq = short.seqs[0]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 2
    assert seq.block_table == [] and seq not in scheduler.running and scheduler.num_running == 1
    assert short.metrics.finished_time >= short.metrics.first_token_time
    assert scheduler.get_group("short") is None
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.seqs] == ["long"]


def test_logprobs_are_attached_to_tokens():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler.block_manager, with_logprobs=True)
    group = make_group("a", [1, 2, 3], max_tokens=3, n=2)
    scheduler.add_seq_group(group)
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    for seq in group.seqs:
        assert [lp.token_ids[0] for lp in seq.output_logprobs] == seq.output_token_ids


# ---- preemption and recompute ------------------------------------------------------------------------

def test_preemption_picks_latest_arrival_and_recompute_is_exact():
    requests = [dict(request_id=f"r{i}", prompt=[10 * i + k for k in range(6)], max_tokens=10, arrival=float(i))
                for i in range(4)]
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=3)
    runner = FakeRunner(scheduler.block_manager)
    groups = [make_group(**r) for r in requests]
    for group in groups:
        scheduler.add_seq_group(group)
    victim = None
    while victim is None:
        before = {s.request_id: s.num_output_tokens for s in scheduler.running}
        out, _ = step(scheduler, runner)
        if scheduler.num_preemptions:
            victim = scheduler.waiting[0]
    assert victim.request_id == "r2" and victim.num_preemptions == 1
    # No admission in a step that preempts; the victim waits ahead of the later r3.
    assert "r3" not in [s.request_id for s in out.seqs]
    assert [s.request_id for s in scheduler.waiting] == ["r2", "r3"]
    assert victim.status is SequenceStatus.WAITING and victim.num_computed_tokens == 0 and not victim.block_table
    kept = victim.num_output_tokens
    assert kept == before["r2"] > 0
    # Recompute: prompt and outputs are prefilled again, then exactly one new token is sampled.
    while victim.status is not SequenceStatus.RUNNING:
        out, _ = step(scheduler, runner)
    index = out.seqs.index(victim)
    assert out.num_samples[index] == 1 and victim.num_output_tokens == kept + 1
    assert victim.group.num_cached_tokens == 0  # set at the first admission only
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert {g.request_id: {0: g.seqs[0].output_token_ids} for g in groups} == reference_outputs(requests)
    assert scheduler.block_manager.num_free_blocks == 8


def test_priority_preemption_victim_is_lowest_priority():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32, policy="priority")
    runner = FakeRunner(scheduler.block_manager)
    scheduler.add_seq_group(make_group("low", range(6), max_tokens=20, priority=9, arrival=0))
    scheduler.add_seq_group(make_group("high", range(50, 56), max_tokens=20, priority=0, arrival=1))
    while not scheduler.num_preemptions:
        step(scheduler, runner)
    assert [s.request_id for s in scheduler.waiting] == ["low"]
    assert [s.request_id for s in scheduler.running] == ["high"]


def test_no_admission_in_a_step_that_preempts():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_model_len=32, max_num_seqs=2, policy="priority")
    runner = FakeRunner(scheduler.block_manager)
    scheduler.add_seq_group(make_group("a", range(7), max_tokens=20, priority=1, arrival=0))
    scheduler.add_seq_group(make_group("b", range(50, 70), max_tokens=20, priority=5, arrival=1))
    step(scheduler, runner)
    scheduler.add_seq_group(make_group("urgent", [1, 2], max_tokens=20, priority=0, arrival=2))
    while not scheduler.num_preemptions:
        out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.seqs] == ["a"]  # b was preempted; urgent waits one step
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.seqs] == ["a", "urgent"]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed,chunked,policy", [(2, True, "fcfs"), (3, True, "priority"), (4, False, "fcfs")])
def test_full_run_under_pressure_matches_unconstrained_run(seed, chunked, policy, async_scheduling):
    requests = workload(seed, count=12)
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_model_len=64, max_num_seqs=5,
                               max_num_batched_tokens=64 if not chunked else 10,
                               enable_chunked_prefill=chunked, policy=policy)
    outputs = run(scheduler, [(i // 3, make_group(**r)) for i, r in enumerate(requests)],
                  async_scheduling=async_scheduling)
    assert scheduler.num_preemptions > 0  # the pool really was too small
    assert scheduler.block_manager.prefix_cache_hits > 0
    assert outputs == reference_outputs(requests)


# ---- policies, limits, abort -------------------------------------------------------------------------

@pytest.mark.parametrize("policy,first", [("fcfs", "late-low"), ("priority", "high")])
def test_policy_orders_admission(policy, first):
    scheduler = make_scheduler(max_num_seqs=1, policy=policy)
    scheduler.add_seq_group(make_group("late-low", [1, 2], priority=3, arrival=0))
    scheduler.add_seq_group(make_group("high", [3, 4], priority=1, arrival=1))
    out, _ = step(scheduler, FakeRunner(scheduler.block_manager))
    assert [s.request_id for s in out.seqs] == [first]


def test_max_num_seqs_counts_pending_forks():
    scheduler = make_scheduler(max_num_seqs=3)
    runner = FakeRunner(scheduler.block_manager)
    scheduler.add_seq_group(make_group("pair", [1, 2, 3], n=2, max_tokens=5))
    scheduler.add_seq_group(make_group("pair2", [4, 5, 6], n=2, max_tokens=5, arrival=1))
    out, _ = step(scheduler, runner)
    assert [s.request_id for s in out.seqs] == ["pair"] and out.num_samples == [2]
    assert scheduler.num_running == 2
    out, _ = step(scheduler, runner)
    assert scheduler.num_running == 2 and "pair2" not in [s.request_id for s in out.seqs]


def test_abort_in_every_state_frees_everything():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=8, max_num_seqs=2)
    runner = FakeRunner(scheduler.block_manager)
    scheduler.add_seq_group(make_group("decoding", [1, 2], max_tokens=50))
    scheduler.add_seq_group(make_group("prefilling", range(100, 130), max_tokens=5, arrival=1))
    scheduler.add_seq_group(make_group("waiting", [3, 4], arrival=2))
    step(scheduler, runner)
    step(scheduler, runner)
    mid = scheduler.get_group("prefilling").seqs[0]
    assert 0 < mid.num_computed_tokens < mid.num_tokens and mid.block_table
    for request_id in ("waiting", "prefilling"):
        group = scheduler.abort_request(request_id)
        assert all(s.status is SequenceStatus.FINISHED_ABORTED and not s.block_table for s in group.seqs)
        assert group.is_finished and group.metrics.finished_time is not None
    assert scheduler.num_waiting == 0 and [s.request_id for s in scheduler.running] == ["decoding"]
    # Abort between schedule() and update(): update skips it.
    out = scheduler.schedule()
    model_output = runner.execute(out)
    scheduler.abort_request("decoding")
    assert scheduler.update(out, model_output) == []
    assert not scheduler.has_unfinished_requests() and scheduler.abort_request("decoding") is None
    assert scheduler.block_manager.num_free_blocks == 64
    scheduler.block_manager.check_integrity([])


def test_abort_before_fork_finishes_an_n_greater_than_one_request():
    scheduler = make_scheduler()
    group = make_group("n3", [1, 2, 3], n=3)
    scheduler.add_seq_group(group)
    scheduler.abort_request("n3")
    assert group.is_finished and not scheduler.has_unfinished_requests()


def test_fork_shares_prompt_blocks_and_copies_on_first_divergent_write():
    scheduler = make_scheduler(num_blocks=16, block_size=4)
    runner = FakeRunner(scheduler.block_manager)
    group = make_group("n3", range(6), n=3, max_tokens=4)
    scheduler.add_seq_group(group)
    out, _ = step(scheduler, runner)
    assert out.num_samples == [3] and len(group.seqs) == 3 and scheduler.num_running == 3
    bm = scheduler.block_manager
    table = list(group.seqs[0].block_table)
    assert all(s.block_table == table for s in group.seqs)
    assert [bm.blocks[b].ref_count for b in table] == [3, 3]
    assert [s.output_token_ids[0] for s in group.seqs] == [next_token(prefix_hashes(range(6))[-1], k) for k in range(3)]
    out, _ = step(scheduler, runner)
    # The shared partial block is copied for the first two writers; the last one writes it in place.
    assert [src for src, _ in out.blocks_to_copy] == [table[1], table[1]]
    assert len({s.block_table[1] for s in group.seqs}) == 3
    assert bm.blocks[table[0]].ref_count == 3
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert [len(s.output_token_ids) for s in group.seqs] == [4, 4, 4]
    assert bm.num_free_blocks == 16


def test_prefix_cache_hit_is_counted_and_skipped():
    scheduler = make_scheduler(num_blocks=64, block_size=16, max_model_len=256)
    runner = FakeRunner(scheduler.block_manager)
    shared = list(range(48))
    first = make_group("first", shared + [900, 901], max_tokens=1)
    scheduler.add_seq_group(first)
    step(scheduler, runner)
    second = make_group("second", shared + [700, 701, 702], max_tokens=1, arrival=1)
    scheduler.add_seq_group(second)
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == [3] and out.num_samples == [1]
    assert second.num_cached_tokens == 48 and first.num_cached_tokens == 0
    assert second.seqs[0].num_output_tokens == 1
    assert scheduler.block_manager.prefix_cache_hits == 48


def test_chunked_prefill_disabled_computes_prompts_whole():
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=20, max_model_len=20,
                               enable_chunked_prefill=False)
    runner = FakeRunner(scheduler.block_manager)
    scheduler.add_seq_group(make_group("a", range(12), max_tokens=3))
    scheduler.add_seq_group(make_group("b", range(50, 62), max_tokens=3, arrival=1))
    scheduler.add_seq_group(make_group("c", [1], max_tokens=3, arrival=2))
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == [12]  # b does not fit whole; c may not skip it
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == [1, 12, 1]


def test_max_model_len_finishes_with_length():
    scheduler = make_scheduler(max_model_len=10)
    group = make_group("a", range(8), max_tokens=None)
    scheduler.add_seq_group(group)
    runner = FakeRunner(scheduler.block_manager)
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    seq = group.seqs[0]
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 10


def test_stop_token_and_eos_and_min_tokens():
    prompt = [1, 2, 3]
    tokens = list(prompt)
    for _ in range(4):
        tokens.append(next_token(prefix_hashes(tokens)[-1], 0))
    third = tokens[5]
    assert tokens[3:].count(third) == 1   # the third output token only: min_tokens=4 must then run to length
    cases = [dict(stop_token_ids=[third]), dict(eos=third), dict(stop_token_ids=[third], min_tokens=4)]
    results = []
    for case in cases:
        scheduler = make_scheduler()
        group = make_group("a", prompt, max_tokens=4, **case)
        scheduler.add_seq_group(group)
        runner = FakeRunner(scheduler.block_manager)
        while scheduler.has_unfinished_requests():
            step(scheduler, runner)
        seq = group.seqs[0]
        results.append((seq.status, seq.stop_reason, seq.num_output_tokens))
    assert results == [(SequenceStatus.FINISHED_STOPPED, third, 3), (SequenceStatus.FINISHED_STOPPED, None, 3),
                       (SequenceStatus.FINISHED_LENGTH, None, 4)]


def test_engine_finishes_a_sequence_for_a_stop_string():
    scheduler = make_scheduler()
    group = make_group("a", [1, 2], max_tokens=10)
    scheduler.add_seq_group(group)
    step(scheduler, FakeRunner(scheduler.block_manager))
    scheduler.finish_seq(group.seqs[0], SequenceStatus.FINISHED_STOPPED, stop_reason="###")
    assert group.is_finished and group.seqs[0].stop_reason == "###" and not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == 64


def test_admission_control_and_validation():
    scheduler = make_scheduler(max_num_waiting=1, max_model_len=16)
    scheduler.add_seq_group(make_group("a", [1]))
    with pytest.raises(SchedulerFullError):
        scheduler.add_seq_group(make_group("b", [1]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_seq_group(make_group("a", [2]))
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(max_model_len=16).add_seq_group(make_group("c", range(17)))
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=2).add_seq_group(make_group("d", [1], n=3))
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="KV cache"):
        Scheduler(SchedulerConfig(max_model_len=2048), BlockManager(num_blocks=4, block_size=16))
