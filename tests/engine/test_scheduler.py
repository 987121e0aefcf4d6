"""Scheduler and block manager without a model: budgets, adapter limit, fairness, preemption, prefix cache."""

from __future__ import annotations

import itertools

import pytest

from loraserve.config import SchedulerConfig
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.scheduler import MAX_LORA_REORDER_STEPS, SampledToken, Scheduler
from loraserve.engine.sequence import Request, Sequence
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams

_ids = itertools.count()


class Salt:
    """A cache salt whose digest is known once `ready` is set (as a fresh adapter's, being hashed)."""

    def __init__(self, text: str, ready: bool = True) -> None:
        self.text, self.ready = text, ready

    def done(self) -> bool:
        return self.ready

    def result(self) -> str:
        assert self.ready, "the block manager waited for a digest still being hashed"
        return self.text


def _seq(num_prompt: int, lora_id: int = 0, max_tokens: int = 4, salt: Salt | None = None,
         token: int = 7) -> Sequence:
    lora = LoRARequest(f"a{lora_id}", lora_id, f"/x/{lora_id}") if lora_id else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(str(next(_ids)), None, [token] * num_prompt, params, lora, arrival_time=0.0,
                      cache_salt=salt)
    seq = Sequence(next(_ids), request, 0, list(request.prompt_token_ids), num_prompt, None, None)
    request.seqs.append(seq)
    return seq


def _step(scheduler: Scheduler) -> list[tuple[Sequence, int]]:
    """One fake engine step: schedule, then sample token 1 for every sequence whose context is computed."""
    out = scheduler.schedule()
    sampled = []
    for item in out.scheduled:
        seq = item.seq
        if seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens:
            is_last = seq.num_output_tokens + 1 >= (seq.params.max_tokens or 0)
            sampled.append(SampledToken(seq, 1, 0.0, None, "length" if is_last else None))
    scheduler.update(out.scheduled, sampled)
    return [(i.seq, i.num_new_tokens) for i in out.scheduled]


def _scheduler(max_loras: int | None = None, num_blocks: int = 64, budget: int = 64, max_seqs: int = 8,
               chunked: bool = True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
                          enable_chunked_prefill=chunked)
    return Scheduler(cfg, BlockManager(num_blocks, 4), max_loras)


def test_budget_chunking_and_max_seqs() -> None:
    sched = _scheduler(budget=10, max_seqs=2)
    seqs = [_seq(25), _seq(3), _seq(3)]
    for s in seqs:
        sched.add(s)
    first = _step(sched)
    assert first == [(seqs[0], 10)]  # the long prompt is chunked to the whole budget
    assert _step(sched) == [(seqs[0], 10)]
    third = _step(sched)
    assert third == [(seqs[0], 5), (seqs[1], 3)]  # budget left over goes to the next, max 2 seqs


def test_never_more_than_max_loras_adapters_and_no_starvation() -> None:
    sched = _scheduler(max_loras=2, max_seqs=8, num_blocks=256)
    for i in range(4):
        sched.add(_seq(4, lora_id=1 + i % 2, max_tokens=6))
    starved = _seq(4, lora_id=3, max_tokens=2)
    sched.add(starved)
    finished_at = None
    for step in range(60):
        # Keep adapters 1 and 2 busy with a steady stream of new requests.
        sched.add(_seq(4, lora_id=1 + step % 2, max_tokens=6))
        scheduled = _step(sched)
        assert len({s.lora_id for s, _ in scheduled if s.lora_id}) <= 2
        if starved.is_finished and finished_at is None:
            finished_at = step
    assert finished_at is not None and finished_at < 30


def test_preemption_frees_blocks_and_recomputes() -> None:
    sched = _scheduler(num_blocks=6, budget=64)
    a, b = _seq(8, max_tokens=8), _seq(8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    for _ in range(40):
        if not (sched.waiting or sched.running):
            break
        _step(sched)
    assert a.is_finished and b.is_finished
    assert sched.num_preemptions > 0
    assert sched.blocks.num_free_blocks == 6


def test_prefix_cache_keyed_by_salt() -> None:
    blocks = BlockManager(32, 4)
    v1, v2 = Salt("adapter-v1"), Salt("adapter-v2")
    first = _seq(13, salt=v1)
    first.block_ids = blocks.allocate(first, 13) or []
    first.num_computed_tokens = 13
    blocks.commit_computed(first, v1)
    blocks.free(first)
    same = _seq(13, salt=Salt("adapter-v1"))
    same.block_ids = blocks.reuse_cached_prefix(same, Salt("adapter-v1"))
    assert same.block_ids == first.block_ids[:3]  # 3 full blocks; the last token stays to compute
    other = _seq(13, salt=v2)
    assert blocks.reuse_cached_prefix(other, v2) == []
    base = _seq(13)
    assert blocks.reuse_cached_prefix(base, None) == []
    blocks.free(same)
    blocks.free(other)
    blocks.free(base)
    assert blocks.num_free_blocks == 32


def test_a_salt_still_hashing_neither_reuses_nor_commits_until_known() -> None:
    """A fresh adapter's first request runs before its digest is known: no cache hit is possible
    then, and its blocks enter the cache on the first commit after the digest is done."""
    blocks = BlockManager(32, 4)
    cached = _seq(13, salt=Salt("adapter"))
    cached.block_ids = blocks.allocate(cached, 13) or []
    cached.num_computed_tokens = 13
    blocks.commit_computed(cached, Salt("adapter"))
    hashing = Salt("adapter", ready=False)
    fresh = _seq(13, salt=hashing)
    fresh.block_ids = blocks.reuse_cached_prefix(fresh, hashing)
    assert fresh.block_ids == []  # the same content is cached, but its digest is not known yet
    blocks.free(fresh)
    unknown = _seq(13, salt=hashing, token=8)
    unknown.block_ids = blocks.allocate(unknown, 13) or []
    unknown.num_computed_tokens = 13
    blocks.commit_computed(unknown, hashing)
    blocks.free(unknown)
    hashing.ready = True
    probe_unknown = _seq(13, salt=Salt("adapter"), token=8)
    assert blocks.reuse_cached_prefix(probe_unknown, Salt("adapter")) == []  # never committed
    blocks.free(probe_unknown)
    blocks.free(cached)
    again = _seq(17, salt=Salt("late"))
    again.block_ids = blocks.allocate(again, 17) or []
    again.num_computed_tokens = 17
    late = Salt("late", ready=False)
    blocks.commit_computed(again, late)
    late.ready = True
    blocks.commit_computed(again, late)  # catches up from the first block
    blocks.free(again)
    probe = _seq(17, salt=Salt("late"))
    assert len(blocks.reuse_cached_prefix(probe, Salt("late"))) == 4


def _request_seqs(num_seqs: int, num_prompt: int, max_tokens: int, group_id: str | None = None,
                  one_request: bool = True) -> list[Sequence]:
    """`num_seqs` sequences: n choices of one request, or (one_request=False) one request each."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs: list[Sequence] = []
    request = None
    for index in range(num_seqs):
        if request is None or not one_request:
            request = Request(str(next(_ids)), None, [7] * num_prompt, params, None, arrival_time=0.0,
                              group_id=group_id)
        seq = Sequence(next(_ids), request, index, list(request.prompt_token_ids), num_prompt, None, None)
        request.seqs.append(seq)
        seqs.append(seq)
    return seqs


def _steps_until_scheduled(sched: Scheduler, seq: Sequence, limit: int = 100) -> int:
    for step in range(1, limit + 1):
        if any(s is seq for s, _ in _step(sched)):
            return step
    raise AssertionError(f"not scheduled within {limit} steps")


@pytest.mark.parametrize("shape", ["n_choices", "one_api_call"])
def test_a_request_with_many_sequences_does_not_starve_a_later_one(shape: str) -> None:
    """Requests take turns for free slots: the short one runs as soon as a slot frees, not after the
    big request's other 36 waiting sequences (FCFS would take 10 more rounds of 4)."""
    sched = _scheduler(budget=256, max_seqs=4, num_blocks=256)
    if shape == "n_choices":
        big = _request_seqs(40, num_prompt=4, max_tokens=3)
    else:  # 40 prompts of one completions call: separate requests, one group
        big = _request_seqs(40, num_prompt=4, max_tokens=3, group_id="cmpl-1", one_request=False)
    for seq in big:
        sched.add(seq)
    first = _step(sched)
    assert [s for s, _ in first] == big[:4]
    short = _seq(4, max_tokens=1)
    sched.add(short)
    # The running four finish at step 3 (3 tokens each); the short one takes a freed slot at step 3.
    assert _steps_until_scheduled(sched, short) <= 3
    assert short.is_finished


def test_separate_requests_keep_arrival_order() -> None:
    """Taking turns does not reorder requests of one sequence each: FCFS among them."""
    sched = _scheduler(budget=256, max_seqs=2, num_blocks=256)
    seqs = _request_seqs(6, num_prompt=4, max_tokens=2, one_request=False)
    for seq in seqs:
        sched.add(seq)
    order = []
    for _ in range(20):
        for seq, _ in _step(sched):
            if seq not in order:
                order.append(seq)
    assert order == seqs


def test_free_slots_go_to_the_adapter_with_most_waiting_requests() -> None:
    """Two slots, five waiting requests: the adapter three of them share takes a slot before the
    later single-request adapter, so four sequences run instead of two."""
    sched = _scheduler(max_loras=2, max_seqs=8, budget=64)
    lone_a, lone_b = _seq(3, lora_id=1), _seq(3, lora_id=2)
    busy = [_seq(3, lora_id=3) for _ in range(3)]
    for seq in (lone_a, lone_b, *busy):
        sched.add(seq)
    admitted = {seq for seq, _ in _step(sched)}
    assert admitted == {lone_a, *busy}  # the busy adapter's 3 requests, then the first lone one
    assert lone_b in sched.waiting


def test_demand_ordering_never_holds_a_sequence_past_the_reorder_bound() -> None:
    """A lone adapter keeps losing to busier ones only for MAX_LORA_REORDER_STEPS steps."""
    sched = _scheduler(max_loras=1, max_seqs=8, budget=64, num_blocks=256)
    lone = _seq(3, lora_id=1, max_tokens=1)
    sched.add(lone)
    num_steps = 0
    while not lone.is_finished and num_steps < MAX_LORA_REORDER_STEPS + 4:
        for _ in range(2):  # a new busy adapter arrives every step, with two requests
            sched.add(_seq(3, lora_id=100 + num_steps, max_tokens=1))
        _step(sched)
        num_steps += 1
    assert lone.is_finished
    assert num_steps >= 2  # it was passed over at first: the ordering did act
    assert num_steps <= MAX_LORA_REORDER_STEPS + 2


def test_a_request_ending_before_its_digest_is_known_still_fills_the_cache() -> None:
    """A short first request under a fresh adapter (one step here) has no later commit to catch up
    in, so its end waits for the digest; the next request with that adapter reuses its blocks."""

    class Hashing(Salt):
        def result(self) -> str:
            self.ready = True  # the wait: the hash finishes
            return self.text

    sched = _scheduler()
    hashing = Hashing("fresh", ready=False)
    short = _seq(13, max_tokens=1, salt=hashing)
    sched.add(short)
    _step(sched)
    assert short.is_finished and hashing.ready
    again = _seq(13, max_tokens=1, salt=Salt("fresh"))
    sched.add(again)
    assert _step(sched) == [(again, 1)]  # 12 of its 13 tokens came from the cache


def test_a_digest_that_failed_only_costs_its_prefix_caching() -> None:
    class Failed(Salt):
        def result(self) -> str:
            raise OSError("the hashing thread could not read the file")

    blocks = BlockManager(32, 4)
    seq = _seq(13, salt=Failed("x"))
    assert blocks.reuse_cached_prefix(seq, Failed("x")) == []
    seq.block_ids = blocks.allocate(seq, 13) or []
    seq.num_computed_tokens = 13
    blocks.commit_computed(seq, Failed("x"))  # no exception: the blocks just stay out of the cache
    blocks.free(seq)
    probe = _seq(13, salt=Salt("x"))
    assert blocks.reuse_cached_prefix(probe, Salt("x")) == []


def test_adapters_in_demand_lists_running_then_busiest_waiting() -> None:
    """What the LoRA host cache keeps longest: adapters of running sequences, then those of waiting
    ones by how many wait (the order in which free slots go to them), arrival order between equals."""
    sched = _scheduler(max_seqs=1)  # no slot limit: the first to arrive runs first
    seqs = [_seq(4, lora_id) for lora_id in (5, 3, 0, 7, 7, 3, 3)]
    for seq in seqs:
        sched.add(seq)
    assert sched.adapters_in_demand() == [3, 7, 5]  # 5, 7 and 3 wait; 0 is the base model
    assert [seq for seq, _ in _step(sched)] == [seqs[0]]
    assert sched.adapters_in_demand() == [5, 3, 7]
    for seq in seqs:
        sched.finish(seq, "abort")
    assert sched.adapters_in_demand() == []
