"""`EngineAdapters`: the engine's side of adapters, what `LLMEngine`'s adapter API and `add_request`
hand to the `LoRAManager`.

It holds the manager (None with LoRA off) and the engine's request table (the same dict, read only:
which adapters unfinished requests use). It owns the rules between requests and adapters: a
request's adapter is registered on arrival (or replaced by its successor), a pinned version must
match the registered content, a request scale is refused where the adapter has no strength to scale,
and an adapter in use is removed or replaced only once its requests finish. Engine thread, except
where a method says any thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Collection
from dataclasses import replace
from typing import TYPE_CHECKING

from loraserve.engine.engine_stats import residency_levels
from loraserve.engine.sequence import CacheSalt, Request, ScaledSalt
from loraserve.errors import LoRAAdapterError, LoRAAdapterVersionError

if TYPE_CHECKING:
    from loraserve.lora.manager import LoRAManager
    from loraserve.lora.request import LoRARequest


class EngineAdapters:
    def __init__(self, lora: LoRAManager | None, requests: dict[str, Request]) -> None:
        self.lora = lora
        self._requests = requests  # the engine's table, never rebound there

    def manager(self) -> LoRAManager:
        if self.lora is None:
            raise LoRAAdapterError("LoRA is not enabled; start the engine with enable_lora=True.")
        return self.lora

    def in_use(self) -> set[int]:
        return {r.lora_request.lora_id for r in self._requests.values() if r.lora_request is not None}

    def settle(self) -> None:
        """After a step or an abort: requests ended, so the host cache learns the queue's adapters as
        they are now (until the next step, the prefetch thread evicts by that list, and one that still
        named a finished request's adapter would protect it over one a new request needs), and a
        removal whose requests all ended finishes."""
        if self.lora is None:
            return
        self.lora.refresh_demand()
        if self.lora.has_pending_removals:
            self.lora.finish_removals(self.in_use())

    def for_request(self, lora_request: LoRARequest) -> tuple[LoRARequest, CacheSalt]:
        """A new request's adapter registered (its successor, if replaced in place meanwhile), and its
        cache salt; LoRAAdapterError (or LoRAAdapterVersionError) when it cannot serve the request."""
        if self.lora is None:
            raise LoRAAdapterError(
                f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is not enabled (enable_lora=True)."
            )
        scale = lora_request.scale  # the request's, never the registered adapter's
        # replaced in place meanwhile: the new one
        version = lora_request.version  # checked against what is registered, never registered
        lora_request = self.lora.successor(replace(lora_request, scale=1.0, version=None))
        salt: CacheSalt = self.lora.register(lora_request)
        if version is not None:
            check_lora_version(lora_request, version, salt.result())
        if scale != 1.0:
            if self.lora.uses_dora(lora_request.lora_id):
                raise LoRAAdapterError(
                    f"LoRA adapter {lora_request.lora_name!r} is a DoRA adapter, whose output scale depends "
                    "on the adapter's strength: it cannot be scaled per request (use scale 1)."
                )
            if self.lora.replaces_rows(lora_request.lora_id):
                raise LoRAAdapterError(
                    f"LoRA adapter {lora_request.lora_name!r} replaces vocab weights (trainable tokens or "
                    "modules_to_save), which have no strength to scale: it cannot be scaled per request "
                    "(use scale 1)."
                )
            lora_request = replace(lora_request, scale=scale)
            salt = ScaledSalt(salt, scale)
        return lora_request, salt

    def add(self, lora_request: LoRARequest) -> bool:
        """`LLMEngine.add_lora`."""
        lora_request = replace(lora_request, scale=1.0, version=None)
        manager = self.manager()
        if manager.is_registered(lora_request.lora_id):
            if not lora_request.load_inplace:
                return False
            manager.replace(lora_request.lora_id, lora_request, lora_request.lora_id in self.in_use())
            return True
        manager.register(lora_request, explicit=True)
        return True

    def replace(self, old_lora_id: int, lora_request: LoRARequest) -> bool:
        """`LLMEngine.replace_lora`."""
        manager = self.manager()
        manager.replace(old_lora_id, lora_request, old_lora_id in self.in_use())
        return True

    def is_registered(self, lora_id: int) -> bool:
        """Any thread."""
        return self.lora is not None and self.lora.is_registered(lora_id)

    def prefetch(self, lora_request: LoRARequest, also_keep: Collection[int] = ()) -> None:
        """Any thread; a no-op with LoRA off."""
        if self.lora is not None:
            self.lora.prefetch(lora_request, also_keep)

    def remove(self, lora_id: int) -> bool:
        return self.manager().remove(lora_id, lora_id in self.in_use())

    def removed(self, lora_id: int) -> concurrent.futures.Future[None]:
        return self.manager().removal(lora_id)

    def list(self) -> list[LoRARequest]:
        return self.lora.list_requests() if self.lora is not None else []

    def version_residency(self) -> dict[str, str]:
        """Any thread."""
        return self.lora.resident_versions() if self.lora is not None else {}

    def residency(self) -> dict[str, str]:
        """Any thread."""
        return residency_levels(self.lora.resident_adapters()) if self.lora is not None else {}


def check_lora_version(lora_request: LoRARequest, version: str, digest: str) -> None:
    """LoRAAdapterVersionError unless the adapter registered under the request's id holds content
    `version` (a digest prefix) names: a request pinned to a version never runs on other weights."""
    if not digest.startswith(version):
        raise LoRAAdapterVersionError(
            f"The model `{lora_request.lora_name}@{version}` does not exist: LoRA adapter "
            f"'{lora_request.lora_name}' (id {lora_request.lora_id}) holds version {digest[:12]}."
        )
