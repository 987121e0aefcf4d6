"""vLLM's --scheduling-policy priority (lower first, then arrival; the usual turns within a level;
the lowest-priority latest running sequence preempted first) and a request's own cache_salt."""

from __future__ import annotations

import itertools

import pytest

from loraserve.config import SchedulerConfig
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.scheduler import SampledToken, Scheduler
from loraserve.engine.sequence import Request, RequestSalt, Sequence
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams

_ids = itertools.count()


def _request(priority: int, n: int = 1, arrival: float = 0.0, lora_id: int = 0, num_prompt: int = 4,
             max_tokens: int = 2) -> list[Sequence]:  # fmt: skip
    lora = LoRARequest(f"a{lora_id}", lora_id, f"/x/{lora_id}") if lora_id else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = Request(str(next(_ids)), None, [7] * num_prompt, params, lora, arrival, priority=priority)
    for index in range(n):
        request.seqs.append(Sequence(next(_ids), request, index, [7] * num_prompt, num_prompt, None, None))
    return request.seqs


def _scheduler(
    policy: str, max_seqs: int = 8, num_blocks: int = 256, max_loras: int | None = None
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=512, max_model_len=256,
                             scheduling_policy=policy)  # fmt: skip
    return Scheduler(config, BlockManager(num_blocks, 4), max_loras)


def _step(scheduler: Scheduler) -> list[Sequence]:
    out = scheduler.schedule()
    sampled = []
    for item in out.scheduled:
        seq = item.seq
        if seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens:
            last = seq.num_output_tokens + 1 >= (seq.params.max_tokens or 0)
            sampled.append(SampledToken(seq, 1, 0.0, None, "length" if last else None))
    scheduler.update(out.scheduled, sampled)
    return [item.seq for item in out.scheduled]


def _admission(scheduler: Scheduler, steps: int = 50) -> list[Sequence]:
    order: list[Sequence] = []
    for _ in range(steps):
        for seq in _step(scheduler):
            if seq not in order:
                order.append(seq)
        if not (scheduler.waiting or scheduler.running):
            break
    return order


def test_lower_priority_values_are_admitted_first_then_arrival_order() -> None:
    scheduler = _scheduler("priority", max_seqs=1)
    late_low, early_high, late_high, mid = (
        _request(5, arrival=1.0), _request(0, arrival=2.0), _request(0, arrival=3.0), _request(2, arrival=4.0)
    )  # fmt: skip
    for seqs in (late_low, early_high, late_high, mid):
        for seq in seqs:
            scheduler.add(seq)
    assert _admission(scheduler) == [*early_high, *late_high, *mid, *late_low]


def test_fcfs_ignores_priorities() -> None:
    scheduler = _scheduler("fcfs", max_seqs=1)
    requests = [_request(p, arrival=float(i)) for i, p in enumerate((5, 0, 2))]
    for seqs in requests:
        for seq in seqs:
            scheduler.add(seq)
    assert _admission(scheduler) == [seq for seqs in requests for seq in seqs]


def test_requests_take_turns_within_a_level() -> None:
    """Two requests of 3 choices at one level take turns (each free pair of slots goes to both, by the
    sequences each already runs), rather than the first request's three choices going first; the
    better level goes before both."""
    scheduler = _scheduler("priority", max_seqs=2)
    big_a, big_b = _request(1, n=3, arrival=1.0), _request(1, n=3, arrival=2.0)
    urgent = _request(0, arrival=3.0)
    for seq in (*big_a, *big_b, *urgent):
        scheduler.add(seq)
    order = _admission(scheduler)
    assert order[0] is urgent[0]
    assert order[1:] == [big_a[0], big_a[1], big_b[0], big_a[2], big_b[1], big_b[2]]


def test_adapter_demand_orders_within_a_level_only() -> None:
    """With one adapter slot, the busier adapter goes first among equals, never ahead of a better level."""
    scheduler = _scheduler("priority", max_seqs=8, max_loras=1)
    lone = _request(1, arrival=1.0, lora_id=1)
    busy = [_request(1, arrival=2.0 + i, lora_id=2) for i in range(3)]
    urgent = _request(0, arrival=9.0, lora_id=3)
    for seqs in (lone, *busy, urgent):
        for seq in seqs:
            scheduler.add(seq)
    first = _step(scheduler)
    assert first == urgent  # the better level takes the only slot
    order = _admission(scheduler)
    busy_seqs = [s for seqs in busy for s in seqs]
    assert order.index(busy_seqs[0]) < order.index(lone[0])  # demand order among equals


def test_the_lowest_priority_running_sequence_is_preempted_first() -> None:
    scheduler = _scheduler("priority", num_blocks=8)
    low = _request(3, arrival=0.0, num_prompt=8, max_tokens=10)
    high = _request(0, arrival=1.0, num_prompt=8, max_tokens=10)
    for seq in (*low, *high):
        scheduler.add(seq)
    _step(scheduler)
    assert scheduler.running == [*high, *low]  # priority order, though low arrived first
    preempted = []
    for _ in range(30):
        out_before = set(scheduler.waiting)
        _step(scheduler)
        preempted.extend(s for s in scheduler.waiting if s not in out_before)
        if preempted:
            break
    assert preempted == low and scheduler.num_preemptions >= 1


@pytest.mark.parametrize("adapter", [None, "digest-1"])
def test_a_request_salt_keys_the_prefix_cache(adapter: str | None) -> None:
    class Digest:
        def done(self) -> bool:
            return True

        def result(self) -> str:
            return str(adapter)

    base = Digest() if adapter else None
    blocks = BlockManager(32, 4)

    def seq_with(salt: object) -> Sequence:
        params = SamplingParams(max_tokens=2)
        request = Request(str(next(_ids)), None, [9] * 13, params, None, 0.0, cache_salt=salt)  # type: ignore[arg-type]
        seq = Sequence(next(_ids), request, 0, [9] * 13, 13, None, None)
        request.seqs.append(seq)
        return seq

    tenant_a = RequestSalt(base, "tenant-a")
    first = seq_with(tenant_a)
    first.block_ids = blocks.allocate(first, 13) or []
    first.num_computed_tokens = 13
    blocks.commit_computed(first, tenant_a)
    blocks.free(first)
    same = seq_with(RequestSalt(base, "tenant-a"))
    assert blocks.reuse_cached_prefix(same, RequestSalt(base, "tenant-a")) == first.block_ids[:3]
    other = seq_with(RequestSalt(base, "tenant-b"))
    assert blocks.reuse_cached_prefix(other, RequestSalt(base, "tenant-b")) == []
    unsalted = seq_with(base)
    assert blocks.reuse_cached_prefix(unsalted, base) == []


def test_the_engine_serves_priorities_and_refuses_them_under_fcfs(tiny_model) -> None:
    from loraserve.entrypoints.llm import LLM

    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    for request_id, priority in (("later", 4), ("first", -1), ("second", 0)):
        llm.engine.add_request(request_id, [9, 10, 11], params, priority=priority)
    finished: list[str] = []
    while llm.engine.has_unfinished_requests():
        finished.extend(out.request_id for out in llm.engine.step() if out.finished)
    assert finished == ["first", "second", "later"]
    fcfs = LLM(path, dtype="float32")
    with pytest.raises(ValueError, match="Got priority 2 but Priority scheduling is not enabled."):
        fcfs.engine.add_request("x", [9, 10], params, priority=2)
