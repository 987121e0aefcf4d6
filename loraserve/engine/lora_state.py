"""The engine's view of adapters: which are registered, their identities, and deferred removals.

Adapters are validated and loaded when registered (never lazily inside a running batch). If the host
cache later evicts one, it is reloaded from disk before the step that needs it; a reload that fails
or finds different weights fails that adapter's requests only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError

if TYPE_CHECKING:
    from loraserve.lora.manager import LoRAModelManager
    from loraserve.lora.request import LoRARequest


class EngineLoRAState:
    def __init__(self, manager: LoRAModelManager) -> None:
        self.manager = manager
        self.requests: dict[int, LoRARequest] = {}
        self.salts: dict[int, str] = {}  # int id -> adapter identity digest (prefix-cache salt)
        self.pending_removal: set[int] = set()
        # Ids unloaded through the API: a request that resolved one before the unload must not
        # silently load it again. An explicit add_lora lifts this.
        self.removed: set[int] = set()

    def register(self, lora_request: LoRARequest, explicit: bool = False) -> str:
        """Load and validate an adapter (idempotent for the same id and path); return its cache salt."""
        lora_id = lora_request.lora_int_id
        if lora_id in self.pending_removal or (lora_id in self.removed and not explicit):
            raise LoRAAdapterNotFoundError(f"LoRA adapter {lora_request.lora_name!r} has been unloaded.")
        known = self.requests.get(lora_id)
        if known is not None:
            if known.lora_path != lora_request.lora_path or known.lora_name != lora_request.lora_name:
                raise LoRAAdapterError(
                    f"LoRA id {lora_id} is already registered as {known.lora_name!r} "
                    f"({known.lora_path}); use a new id for {lora_request.lora_name!r}."
                )
            return self.salts[lora_id]
        lora_model = self.manager.load_and_add(lora_request)
        self.removed.discard(lora_id)
        self.requests[lora_id] = lora_request
        self.salts[lora_id] = lora_model.identity.digest
        return lora_model.identity.digest

    def prepare_step(self, lora_ids: set[int]) -> tuple[dict[int, int], dict[int, Exception]]:
        """Put the step's adapters in host memory and compute slots.

        Returns (id -> slot for the adapters ready, id -> error for those whose reload failed).
        """
        self.manager.reserve(lora_ids)
        failed: dict[int, Exception] = {}
        for lora_id in lora_ids:
            if self.manager.has_adapter(lora_id):
                continue
            try:
                reloaded = self.manager.load_and_add(self.requests[lora_id], protected=lora_ids)
                if reloaded.identity.digest != self.salts[lora_id]:
                    self.manager.remove_adapter(lora_id)
                    raise LoRAAdapterError(
                        f"LoRA adapter {self.requests[lora_id].lora_name!r} changed on disk since it was "
                        f"loaded; load it again under a new name."
                    )
            except Exception as exc:  # noqa: BLE001 - any failure fails this adapter's requests only
                failed[lora_id] = exc
        ready = lora_ids - failed.keys()
        return self.manager.activate(ready), failed

    def end_step(self) -> None:
        self.manager.release()

    def request_removal(self, lora_int_id: int, in_use: bool) -> bool:
        """Remove now if unused, else after its running requests finish. False if unknown."""
        if lora_int_id not in self.requests or lora_int_id in self.pending_removal:
            return False
        if in_use:
            self.pending_removal.add(lora_int_id)
        else:
            self._remove(lora_int_id)
        return True

    def finish_removals(self, in_use: set[int]) -> list[int]:
        done = [i for i in self.pending_removal if i not in in_use]
        for lora_int_id in done:
            self._remove(lora_int_id)
        return done

    def _remove(self, lora_int_id: int) -> None:
        self.pending_removal.discard(lora_int_id)
        self.requests.pop(lora_int_id, None)
        self.salts.pop(lora_int_id, None)
        self.removed.add(lora_int_id)
        self.manager.remove_adapter(lora_int_id)

    def list(self) -> list[LoRARequest]:
        return [r for i, r in self.requests.items() if i not in self.pending_removal]
