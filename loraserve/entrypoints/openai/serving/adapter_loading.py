"""AdapterLoader: the registered adapters (name -> newest version, the versions held, their engine
ids) and every change to them: register, publish a version, replace in place, unload, retire.

`OpenAIServingModels` holds one and keeps name resolution and listing; it is handed the engine, how
to tell a served base-model name (`is_base_model`) and those names, so this module never imports it.

Every change to a name happens under that name's lock (`name_locks`, keyed by `names.confusable_key`),
so concurrent loads and first requests register an adapter once. A new name whose skeleton equals
that of a registered adapter or a served base name is refused before anything loads.

Each adapter name holds content versions (`adapter_versions`): the plain name is the newest,
`name@<digest prefix>` or `name@<label>` one held version; load_inplace publishes a new version.
A version no longer held is removed from the engine in the background, once its requests end.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from http import HTTPStatus

from loraserve.entrypoints.openai.metrics.metrics import ServerMetrics
from loraserve.entrypoints.openai.serving.adapter_versions import (
    AdapterVersion,
    AdapterVersions,
    check_label,
    split_version,
)
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.entrypoints.openai.serving.errors import INVALID_USER_INPUT, APIError
from loraserve.entrypoints.openai.serving.name_locks import NamedLocks
from loraserve.entrypoints.openai.serving.names import (
    canonical_name,
    check_path,
    checked_name,
    confusable_key,
)
from loraserve.entrypoints.openai.serving.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from loraserve.errors import LoRAAdapterNotFoundError
from loraserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


def not_found_message(lora_name: str) -> str:
    return f"The lora adapter '{lora_name}' cannot be found."


class AdapterLoader:
    """The adapters registered in the engine under their names and versions, and how they change."""

    def __init__(
        self,
        engine: EngineClient,
        is_base_model: Callable[[str | None], bool],
        base_names: list[str],
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self.is_base_model = is_base_model
        self.metrics = metrics
        self.lora_requests: dict[str, LoRARequest] = {}  # name -> its newest version
        self.versions = AdapterVersions()  # name -> the versions held, the newest last
        # confusable_key -> the registered adapter or base name it belongs to
        self._name_keys: dict[str, str] = {confusable_key(name): name for name in base_names}
        self._lora_ids = itertools.count(1)
        self._retiring: set[asyncio.Task[bool]] = set()  # removals of retired versions/mixes, until done
        self.name_locks = NamedLocks()  # confusable_key(name) -> lock held while it is resolved or loaded

    def next_id(self) -> int:
        """A fresh engine id (adapters and mixes share the sequence)."""
        return next(self._lora_ids)

    def confusable(self, name: str) -> str | None:
        """Why `name` may not be registered beside the names already served, or None."""
        other = self._name_keys.get(confusable_key(name))
        if other is None or other == name:
            return None
        kind = "served base model" if self.is_base_model(other) else "loaded adapter"
        return (
            f"the adapter name {ascii(name)} looks like the {kind} {ascii(other)} (the same after NFKC "
            "normalisation and mapping Cyrillic and Greek look-alike letters to Latin); choose a distinct name."
        )

    def refuse_confusable(self, name: str, param: str) -> None:
        problem = self.confusable(name)
        if problem is not None:
            raise APIError(
                problem[0].upper() + problem[1:], HTTPStatus.BAD_REQUEST, param, INVALID_USER_INPUT
            )

    async def add(
        self, name: str, path: str, base_model_name: str | None, label: str | None = None
    ) -> LoRARequest:
        """Register one adapter in the engine under a fresh id as the first version of `name`; nothing
        is kept if the engine refuses it. The caller holds the name's lock (or runs before serving)."""
        lora_request = LoRARequest(
            lora_name=name,
            lora_int_id=self.next_id(),
            lora_path=path,
            # The name resolvers match adapters against: the model as the user named it.
            base_model_name=base_model_name or self.engine.model_config.model,
        )
        await self._engine_add(lora_request)
        lora_request = await self._publish(lora_request, label)
        self._name_keys[confusable_key(name)] = name
        return lora_request

    async def _engine_add(self, lora_request: LoRARequest) -> None:
        start = time.perf_counter()
        await self.engine.add_lora(lora_request)
        if self.metrics is not None:
            self.metrics.lora_add_seconds.observe(time.perf_counter() - start)

    async def _publish(self, lora_request: LoRARequest, label: str | None) -> LoRARequest:
        """Make the registered `lora_request` its name's newest version, pinned to its digest (every
        request the name resolves to then runs on that content or fails); the oldest held version
        beyond `KEEP_VERSIONS` is retired. The same content as a held version is that version."""
        name = lora_request.lora_name
        try:
            digest = await self.engine.lora_digest(lora_request.lora_id)
        except BaseException:
            self.retire(lora_request)  # registered but never published: the engine forgets it too
            raise
        same = next((v for v in self.versions.held(name) if v.digest == digest), None)
        if same is not None:  # nothing new: keep the held registration (and its id, slot, cache)
            self.retire(lora_request)
            self.versions.remove(name, same)
            lora_request, label = same.request, label or same.label
        lora_request = replace(lora_request, version=digest)
        for old in self.versions.publish(AdapterVersion(lora_request, digest, label)):
            self.retire(old.request)  # removed once the requests running on it end
        self.lora_requests[name] = lora_request
        return lora_request

    def retire(self, lora_request: LoRARequest) -> None:
        """Remove an adapter from the engine in the background (its running requests finish first)."""
        task = asyncio.get_running_loop().create_task(self.engine.remove_lora(lora_request.lora_id))
        self._retiring.add(task)
        task.add_done_callback(self._retired)

    def _retired(self, task: asyncio.Task[bool]) -> None:
        self._retiring.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("Removing a retired LoRA adapter or mix failed: %s", task.exception())

    def held_versions(self, name: str) -> list[AdapterVersion]:
        """The versions of adapter `name` that can be addressed now, oldest first."""
        return self.versions.held(canonical_name(name))

    async def _replace(self, loaded: LoRARequest, path: str, label: str | None) -> LoRARequest:
        """load_inplace: a new version of the name under a new id, so that requests running on the old
        weights finish on them; the name points at the new version once the engine serves it, and the
        previous one stays addressable as name@digest (`adapter_versions` says how long)."""
        lora_request = LoRARequest(
            lora_name=loaded.lora_name,
            lora_int_id=self.next_id(),
            lora_path=path,
            base_model_name=loaded.base_model_name,
        )
        await self._engine_add(lora_request)  # the held versions stay registered beside it
        return await self._publish(lora_request, label)

    def _check_load(self, request: LoadLoRAAdapterRequest) -> tuple[str, str, str | None]:
        """(name, path, label) of a load request, each checked; APIError 400 otherwise."""
        name, path = (request.lora_name or "").strip(), (request.lora_path or "").strip()
        if not name or not path:
            raise APIError(
                "Both 'lora_name' and 'lora_path' must be provided.",
                HTTPStatus.BAD_REQUEST,
                None,
                INVALID_USER_INPUT,
            )
        name = checked_name(name, "lora_name")  # before anything registers, logs or counts them
        check_path(path, "lora_path")
        label = check_label(request.version)
        if self.engine.lora_config is None:
            raise APIError(
                "LoRA is not enabled; start the server with --enable-lora.",
                HTTPStatus.BAD_REQUEST,
                None,
                INVALID_USER_INPUT,
            )
        if self.is_base_model(name):
            raise APIError(
                f"'{name}' is the name of a served base model.",
                HTTPStatus.BAD_REQUEST,
                "lora_name",
                INVALID_USER_INPUT,
            )
        if "@" in name and name not in self.lora_requests:
            raise APIError(
                f"The adapter name {ascii(name)} contains '@', which addresses a version (name@version).",
                HTTPStatus.BAD_REQUEST,
                "lora_name",
                INVALID_USER_INPUT,
            )
        return name, path, label

    async def load(self, request: LoadLoRAAdapterRequest) -> str:
        """POST /v1/load_lora_adapter: validate, then register (or, with load_inplace, replace the
        weights of the adapter loaded under that name); APIError with the status otherwise."""
        name, path, label = self._check_load(request)
        async with self.name_locks.hold(confusable_key(name)):
            loaded = self.lora_requests.get(name)
            if loaded is not None and not request.load_inplace:
                raise APIError(
                    f"The lora adapter '{name}' has already been loaded.",
                    HTTPStatus.BAD_REQUEST,
                    "lora_name",
                    INVALID_USER_INPUT,
                )
            self.refuse_confusable(name, "lora_name")
            self.versions.check_label_free(name, label)
            try:
                if loaded is None:
                    await self.add(name, path, None, label)
                else:
                    await self._replace(loaded, path, label)
            except LoRAAdapterNotFoundError as exc:
                raise APIError(str(exc), HTTPStatus.NOT_FOUND, "lora_path") from exc
            except ValueError as exc:  # LoRAAdapterError and any other validation failure
                raise APIError(str(exc), HTTPStatus.BAD_REQUEST, "lora_path", INVALID_USER_INPUT) from exc
        logger.info("Loaded LoRA adapter %r from %r%s.", name, path, " in place" if loaded else "")
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(
        self, request: UnloadLoRAAdapterRequest, authorize: Callable[[str, APIError], None] | None = None
    ) -> str:
        """POST /v1/unload_lora_adapter: forget the name (every version; `name@version`: that one, the
        one before it becoming the newest) at once, then wait for their running requests.
        `authorize(target, missing)` raises when the caller may not unload it (`missing`: the error of
        a target that does not exist)."""
        target = self._find_unload_target(request)
        if authorize is not None:
            missing = (
                APIError(not_found_message(target), HTTPStatus.NOT_FOUND, "lora_name")
                if request.lora_name
                else APIError(
                    f"No lora adapter has lora_int_id {request.lora_int_id}.",
                    HTTPStatus.NOT_FOUND,
                    "lora_int_id",
                )
            )
            authorize(target, missing)
        name, ref = (target, None) if target in self.lora_requests else split_version(target)
        async with self.name_locks.hold(confusable_key(name)):
            if name not in self.lora_requests:
                raise APIError(not_found_message(target), HTTPStatus.NOT_FOUND, "lora_name")
            one = self.versions.find(name, ref) if ref is not None else None
            removed = self.versions.remove(name, one)
            held = self.versions.held(name)
            if held:
                self.lora_requests[name] = held[-1].request
            else:
                self.lora_requests.pop(name, None)
                if not self.is_base_model(name):
                    self._name_keys.pop(confusable_key(name), None)
            await asyncio.gather(*(self.engine.remove_lora(v.request.lora_id) for v in removed))
        logger.info("Unloaded LoRA adapter %r.", target)
        return f"Success: LoRA adapter '{target}' removed successfully."

    def _find_unload_target(self, request: UnloadLoRAAdapterRequest) -> str:
        if request.lora_name:
            return checked_name(request.lora_name, "lora_name")
        if request.lora_int_id is None:
            raise APIError(
                "Either 'lora_name' or 'lora_int_id' must be provided.",
                HTTPStatus.BAD_REQUEST,
                None,
                INVALID_USER_INPUT,
            )
        for lora_request in self.lora_requests.values():
            if lora_request.lora_id == request.lora_int_id:
                return lora_request.lora_name
        for version in self.versions.older():
            if version.request.lora_id == request.lora_int_id:
                return version.key
        raise APIError(
            f"No lora adapter has lora_int_id {request.lora_int_id}.", HTTPStatus.NOT_FOUND, "lora_int_id"
        )
