"""`AdapterRegistry`: the adapters the engine serves, their identity digests, and removals in progress.

Registration is the engine's promise that an adapter's requests can run: the adapter was read and
validated once, and its content digest (the prefix-cache salt) is fixed. Ids unloaded through the
API stay refused until an explicit add, so a request that resolved one before the unload does not
silently load it again. A removal of an adapter that running requests still use is deferred until
they finish; its future completes when the adapter is gone. An adapter replaced under a new id
(load_inplace) leaves a redirect, so a request that resolved the old id just before the replacement
starts on the new weights instead of failing.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from dataclasses import dataclass, field

from loraserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from loraserve.lora.digest import PendingDigest
from loraserve.lora.request import LoRARequest

# A request carries a replaced id only between resolving its model name and reaching the engine, so
# the newest few thousand redirects cover it many times over, while a training loop that reloads
# forever keeps a bounded map.
MAX_REDIRECTS = 4096


@dataclass(slots=True)
class AdapterRegistry:
    requests: dict[int, LoRARequest] = field(default_factory=dict)
    # lora_id -> identity digest (the cache salt), possibly still being hashed
    digests: dict[int, PendingDigest] = field(default_factory=dict)
    pending_removals: dict[int, concurrent.futures.Future[None]] = field(default_factory=dict)
    removed_ids: set[int] = field(default_factory=set)
    replaced: OrderedDict[int, int] = field(default_factory=OrderedDict)  # old id -> its replacement's id

    def check_can_register(self, lora_request: LoRARequest, explicit: bool) -> PendingDigest | None:
        """The digest when this adapter is registered already, None when it may be registered now;
        raises when it is being (or was) unloaded, or its id names another adapter."""
        lora_id = lora_request.lora_id
        if lora_id in self.pending_removals or (lora_id in self.removed_ids and not explicit):
            raise LoRAAdapterNotFoundError(f"LoRA adapter {lora_request.lora_name!r} has been unloaded.")
        known = self.requests.get(lora_id)
        if known is None:
            return None
        if known.lora_path != lora_request.lora_path or known.lora_name != lora_request.lora_name:
            raise LoRAAdapterError(  # no path: error messages never show server paths
                f"LoRA id {lora_id} is already registered as {known.lora_name!r} (another adapter or "
                f"folder); use a new id for {lora_request.lora_name!r}."
            )
        return self.digests[lora_id]

    def add(self, lora_request: LoRARequest, digest: PendingDigest) -> None:
        self.removed_ids.discard(lora_request.lora_id)
        self.requests[lora_request.lora_id] = lora_request
        self.digests[lora_request.lora_id] = digest

    def redirect(self, old_id: int, new_id: int) -> None:
        self.replaced[old_id] = new_id
        while len(self.replaced) > MAX_REDIRECTS:
            self.replaced.popitem(last=False)

    def successor(self, lora_request: LoRARequest) -> LoRARequest:
        """The adapter that now serves `lora_request`'s id: itself, or the newest registered replacement."""
        lora_id = lora_request.lora_id
        while lora_id in self.replaced:
            lora_id = self.replaced[lora_id]
        if lora_id == lora_request.lora_id:
            return lora_request
        return self.requests.get(lora_id, lora_request)

    def listed(self) -> list[LoRARequest]:
        """Registered adapters not being removed, in registration order."""
        return [r for i, r in self.requests.items() if i not in self.pending_removals]

    def defer_removal(self, lora_id: int) -> None:
        self.pending_removals[lora_id] = concurrent.futures.Future()

    def forget(self, lora_id: int) -> None:
        """The adapter is gone: refuse its id until an explicit add, and complete a deferred removal."""
        self.requests.pop(lora_id, None)
        self.digests.pop(lora_id, None)
        self.removed_ids.add(lora_id)
        done = self.pending_removals.pop(lora_id, None)
        if done is not None and not done.done():
            done.set_result(None)
