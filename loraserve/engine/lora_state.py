"""The engine's view of adapters: which are registered, their identities, and deferred removals.

Adapters are validated and loaded when registered (never lazily inside a running batch). If the host
cache later evicts one, it is reloaded from disk before the step that needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loraserve.errors import LoRAAdapterError

if TYPE_CHECKING:
    from loraserve.lora.manager import LoRAModelManager
    from loraserve.lora.request import LoRARequest


class EngineLoRAState:
    def __init__(self, manager: LoRAModelManager) -> None:
        self.manager = manager
        self.requests: dict[int, LoRARequest] = {}
        self.salts: dict[int, str] = {}  # int id -> adapter identity digest (prefix-cache salt)
        self.pending_removal: set[int] = set()

    def register(self, lora_request: LoRARequest) -> str:
        """Load and validate an adapter (idempotent for the same id and path); return its cache salt."""
        known = self.requests.get(lora_request.lora_int_id)
        if known is not None and lora_request.lora_int_id not in self.pending_removal:
            if known.lora_path != lora_request.lora_path or known.lora_name != lora_request.lora_name:
                raise LoRAAdapterError(
                    f"LoRA id {lora_request.lora_int_id} is already registered as {known.lora_name!r} "
                    f"({known.lora_path}); use a new id for {lora_request.lora_name!r}."
                )
            return self.salts[lora_request.lora_int_id]
        if lora_request.lora_int_id in self.pending_removal:
            raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r} is being unloaded.")
        lora_model = self.manager.load_and_add(lora_request)
        self.requests[lora_request.lora_int_id] = lora_request
        self.salts[lora_request.lora_int_id] = lora_model.identity.digest
        return lora_model.identity.digest

    def prepare_step(self, lora_ids: set[int]) -> dict[int, int]:
        """Make sure every adapter of the step is in host memory and a compute slot; return id -> slot."""
        for lora_id in lora_ids:
            if not self.manager.has_adapter(lora_id):
                self.manager.load_and_add(self.requests[lora_id], protected=lora_ids)
        return self.manager.activate(lora_ids)

    def request_removal(self, lora_int_id: int, in_use: bool) -> bool:
        """Remove now if unused, else after its running requests finish. False if unknown."""
        if lora_int_id not in self.requests:
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
        self.manager.remove_adapter(lora_int_id)

    def list(self) -> list[LoRARequest]:
        return [r for i, r in self.requests.items() if i not in self.pending_removal]
