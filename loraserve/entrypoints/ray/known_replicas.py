"""Which replicas this process routes to: the request routers in it register here.

A module of its own because Ray Serve pickles the request router class by value (cloudpickle's
`register_pickle_by_value` on its module): the class the handle instantiates carries copies of
`router.py`'s globals, so a registry kept there would be a copy nobody else sees. Functions imported
from here are pickled by reference, so every router in the process reaches this one registry.
"""

from __future__ import annotations

import weakref
from typing import Protocol


class _Router(Protocol):
    def replica_ids(self) -> list[str]: ...

    def note_sent(self, adapter: str, replica_id: str) -> None: ...


_routers: weakref.WeakSet[_Router] = weakref.WeakSet()


def track_router(router: _Router) -> None:
    """Count `router`'s replicas in `known_replica_ids` for as long as it lives."""
    _routers.add(router)


def known_replica_ids() -> set[str]:
    """The replicas the routers in this process currently route to."""
    return {rid for router in list(_routers) for rid in router.replica_ids()}


def note_loaded(adapter: str, replica_id: str) -> None:
    """Tell every router that `replica_id` has just loaded `adapter` (a version key): its first
    request routes there before the replica's next residency report says so (a load is addressed by
    name, its requests by name@digest, which no report can have named yet)."""
    for router in list(_routers):
        router.note_sent(adapter, replica_id)
