"""`HostCache`: adapters in host memory, what it evicts (kept, needed by the queue), its counters, and
the live view of what a background read keeps."""

from __future__ import annotations

import pytest
from support.stand_in_model import StandInLlama, stand_in_lora_model

from loraserve.errors import LoRAAdapterError
from loraserve.lora.host_cache import HostCache


def test_host_cache_is_a_plain_lru_that_reports_evictions() -> None:
    model = StandInLlama()
    host = HostCache(2)
    assert (
        host.add(stand_in_lora_model(model, 1), keep=()) == []
        and host.add(stand_in_lora_model(model, 2), keep=()) == []
    )
    assert host.add(stand_in_lora_model(model, 1), keep=()) is None  # already cached: nothing changes
    assert host.hit(1) is not None and host.hit(7) is None and host.counters.num_host_hits == 1
    assert host.add(stand_in_lora_model(model, 3), keep=()) == [2]  # 2 is the least recently used
    assert host.add(stand_in_lora_model(model, 4), keep={3}) == [1] and host.ids() == [3, 4]
    host.set_needed((4,))
    assert host.add(stand_in_lora_model(model, 5), keep=()) == [3]  # the queue needs 4: 3 goes though newer
    with pytest.raises(LoRAAdapterError, match="no room in host memory"):
        host.add(stand_in_lora_model(model, 6), keep={4, 5})
    assert host.ids() == [4, 5] and host.counters.num_host_evictions == 3
    host.count_load(0.5)
    host.count_failure()
    assert host.counters.num_loads == 1 and host.counters.num_load_failures == 1
    assert host.drain_latencies() == [0.5] and host.drain_latencies() == []


def test_a_background_read_keeps_the_queue_as_it_is_when_the_read_is_cached() -> None:
    """What a prefetch keeps is read when its adapter is cached, not when its read began: an adapter
    whose requests finished during the read is no longer kept (CI once saw a prefetch evict an adapter
    the queue needed, to keep one it had needed when the read began)."""
    model = StandInLlama()
    host = HostCache(2)
    host.add(stand_in_lora_model(model, 1), keep=())
    host.add(stand_in_lora_model(model, 2), keep=())
    host.set_needed((1, 2, 3))
    sooner = host.needed_before(3)  # the prefetch of 3 begins: 1 and 2 are needed first
    assert list(sooner) == [1, 2] and 2 in sooner and len(sooner) == 2
    host.set_needed((2, 3))  # 1's requests finished during the read
    assert list(sooner) == [2] and 1 not in sooner
    assert host.add(stand_in_lora_model(model, 3), keep=frozenset(sooner)) == [
        1
    ]  # not 2, which is still needed
    assert list(host.needed_before(9)) == [2, 3]  # not needed itself: all the queue needs is kept
