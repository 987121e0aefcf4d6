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


_routers: weakref.WeakSet[_Router] = weakref.WeakSet()


def track_router(router: _Router) -> None:
    """Count `router`'s replicas in `known_replica_ids` for as long as it lives."""
    _routers.add(router)


def known_replica_ids() -> set[str]:
    """The replicas the routers in this process currently route to."""
    return {rid for router in list(_routers) for rid in router.replica_ids()}
