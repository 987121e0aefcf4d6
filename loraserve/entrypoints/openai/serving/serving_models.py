"""OpenAIServingModels: which names the server answers to, and how an adapter name becomes loaded.

A request's `model` is a served base-model name or an adapter name. Loaded adapters are looked up
directly; unknown names go to the registered LoRA resolvers (only when runtime LoRA updating is on),
one name at a time under a per-name lock so concurrent first requests load an adapter once.

Every adapter name (a request's `model`, the load and unload routes, --lora-modules) is checked and
then NFKC-normalised (`names.canonical_name`) before it is looked up, locked, resolved or registered,
so look-alike spellings of one name are that name. A new name whose skeleton (`names.confusable_key`)
equals that of a registered adapter or a served base name is refused (400) before anything loads; the
per-name locks are keyed by skeleton, so two such names never register side by side.

Each adapter name holds content versions (`adapter_versions`): the plain name is the newest,
`name@<digest prefix>` or `name@<label>` one held version; load_inplace publishes a new version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from http import HTTPStatus

from loraserve import envs
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
from loraserve.entrypoints.openai.serving.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from loraserve.errors import (
    LoRAAdapterBaseMismatchError,
    LoRAAdapterError,
    LoRAAdapterNotFoundError,
    LoRAAdapterUnavailableError,
)
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry

logger = logging.getLogger(__name__)

MAX_MIXES = 1024  # distinct mixes whose ids the server remembers


@dataclass(frozen=True, slots=True)
class BaseModelPath:
    name: str  # the name clients use
    model_path: str  # what the user gave to --model


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def not_found_message(lora_name: str) -> str:
    return f"The lora adapter '{lora_name}' cannot be found."


class OpenAIServingModels:
    """Served base-model names plus the adapters registered in the engine, and the resolver chain."""

    def __init__(
        self,
        engine: EngineClient,
        base_model_paths: list[BaseModelPath],
        static_lora_modules: list[LoRAModulePath] | None = None,
        allow_runtime_lora_updating: bool | None = None,
        lora_resolvers: list[LoRAResolver] | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        if not base_model_paths:
            raise ValueError("base_model_paths must name at least one served model.")
        self.engine = engine
        self.base_model_paths = list(base_model_paths)
        self.static_lora_modules = list(static_lora_modules or [])
        if allow_runtime_lora_updating is None:
            allow_runtime_lora_updating = envs.allow_runtime_lora_updating()
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        if lora_resolvers is None:
            names = LoRAResolverRegistry.get_supported_resolvers()
            lora_resolvers = [LoRAResolverRegistry.get_resolver(name) for name in names]
        # Resolvers are never consulted unless runtime updating is on, so keep none at all otherwise.
        self.lora_resolvers = list(lora_resolvers) if allow_runtime_lora_updating else []
        self.lora_requests: dict[str, LoRARequest] = {}  # name -> its newest version
        self.versions = AdapterVersions()  # name -> the versions held, the newest last
        # confusable_key -> the registered adapter or base name it belongs to
        self._name_keys: dict[str, str] = {
            confusable_key(path.name): path.name for path in self.base_model_paths
        }
        self._lora_ids = itertools.count(1)
        # Mixes served so far, by their components and weights (LoRARequest.mixed's path): the same
        # mix keeps its id, hence its slot and host-cache entry. The newest MAX_MIXES are kept.
        self._mixes: OrderedDict[str, LoRARequest] = OrderedDict()
        self._retiring: set[asyncio.Task[bool]] = set()  # removals of forgotten mixes, until done
        self.name_locks = NamedLocks()  # confusable_key(name) -> lock held while it is resolved or loaded
        self.metrics = metrics

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora_config is not None

    @property
    def served_model_name(self) -> str:
        return self.base_model_paths[0].name

    @property
    def base_model_name(self) -> str:
        """The name resolvers match adapters against: the model as the user named it (model_config.model)."""
        return self.engine.model_config.model

    def is_base_model(self, name: str | None) -> bool:
        if name is None or any(path.name == name for path in self.base_model_paths):
            return True
        canonical = canonical_name(name)
        return any(canonical_name(path.name) == canonical for path in self.base_model_paths)

    async def init_static_loras(self) -> None:
        """Register the --lora-modules adapters; raises LoRAAdapterError naming the first bad one."""
        for module in self.static_lora_modules:
            name = canonical_name(module.name)
            problem = self._confusable(name)
            if problem is not None:
                raise LoRAAdapterError(f"--lora-modules: {problem}")
            await self._add_lora(name, module.path, module.base_model_name)
            logger.info("Registered LoRA adapter %r from %s.", name, module.path)

    async def resolve_model(self, name: str | None) -> LoRARequest | None:
        """The LoRARequest for `name`, None for the base model; APIError 404/400 otherwise."""
        if self.is_base_model(name):
            return None
        assert name is not None
        name = checked_name(name, "model")  # before it is logged, counted or handed to a resolver
        if name in self.lora_requests:
            return self.lora_requests[name]
        plain, ref = split_version(name)
        if ref is not None:  # name@version: that name (loaded or resolved), then one of its versions
            if self.is_base_model(plain):
                raise APIError(f"The model `{name}` does not exist.", HTTPStatus.NOT_FOUND, param="model")
            newest = await self.resolve_model(plain)
            assert newest is not None
            return self.versions.find(newest.lora_name, ref).request
        if not self.lora_enabled or not self.allow_runtime_lora_updating or not self.lora_resolvers:
            raise APIError(f"The model `{name}` does not exist.", HTTPStatus.NOT_FOUND, param="model")
        async with self.name_locks.hold(confusable_key(name)):
            # Another request may have resolved the name while this one waited for the lock.
            if name in self.lora_requests:
                return self.lora_requests[name]
            self._refuse_confusable(name, "model")
            return await self._resolve_unlocked(name)

    def _confusable(self, name: str) -> str | None:
        """Why `name` may not be registered beside the names already served, or None."""
        other = self._name_keys.get(confusable_key(name))
        if other is None or other == name:
            return None
        kind = "served base model" if self.is_base_model(other) else "loaded adapter"
        return (
            f"the adapter name {ascii(name)} looks like the {kind} {ascii(other)} (the same after NFKC "
            "normalisation and mapping Cyrillic and Greek look-alike letters to Latin); choose a distinct name."
        )

    def _refuse_confusable(self, name: str, param: str) -> None:
        problem = self._confusable(name)
        if problem is not None:
            raise APIError(
                problem[0].upper() + problem[1:], HTTPStatus.BAD_REQUEST, param, INVALID_USER_INPUT
            )

    async def _resolve_unlocked(self, name: str) -> LoRARequest:
        load_error: ValueError | None = None
        for resolver in self.lora_resolvers:
            try:
                found = await resolver.resolve_lora(self.base_model_name, name)
            except LoRAAdapterNotFoundError:
                continue
            except LoRAAdapterBaseMismatchError as exc:
                if not self._serves_base(exc.adapter_base):  # another model's adapter: a 400 saying so
                    logger.warning("LoRA resolver %s refused %r: %s", type(resolver).__name__, name, exc)
                    load_error = load_error or exc
                    continue
                # Resolvers match the model path; the adapter names a served name instead (the demo's do).
                found = LoRARequest(name, 1, exc.lora_path, exc.adapter_base)  # id: `_add_lora` assigns one
            except LoRAAdapterError as exc:  # found but refused, or its store unreachable: said, not hidden
                logger.warning(
                    "LoRA resolver %s could not provide %r: %s", type(resolver).__name__, name, exc
                )
                load_error = load_error or exc
                continue
            except Exception:
                # A broken plugin must not turn every unknown name into a 500; the next resolver tries.
                logger.exception("LoRA resolver %s failed on %r.", type(resolver).__name__, name)
                continue
            if found is None:
                continue
            try:
                return await self._add_lora(name, found.lora_path, found.base_model_name)
            except ValueError as exc:  # LoRAAdapterError, or another validation failure
                logger.warning(
                    "Adapter %r found by %s failed to load: %s", name, type(resolver).__name__, exc
                )
                load_error = load_error or exc
        if isinstance(load_error, LoRAAdapterUnavailableError):
            raise APIError(
                str(load_error), HTTPStatus.SERVICE_UNAVAILABLE, "model", headers={"Retry-After": "1"}
            )
        if load_error is not None:
            raise APIError(
                f"The lora adapter '{name}' was found but failed to load: {load_error}",
                HTTPStatus.BAD_REQUEST,
                param="model",
            )
        raise APIError(not_found_message(name), HTTPStatus.NOT_FOUND, param="model")

    def mix_request(self, parts: list[tuple[LoRARequest, float]]) -> LoRARequest:
        """The mix of these (adapter, weight) pairs, under the id it had before or a fresh one."""
        key = LoRARequest.mixed(parts, 1).lora_path
        mix = self._mixes.pop(key, None) or LoRARequest.mixed(parts, next(self._lora_ids))
        self._mixes[key] = mix
        while len(self._mixes) > MAX_MIXES:
            _, old = self._mixes.popitem(last=False)
            # The engine forgets it too (once its requests finish): else every distinct weight a client
            # sends would stay registered. The same mix asked again later gets a new id.
            self._retire(old)
        return mix

    def _retired(self, task: asyncio.Task[bool]) -> None:
        self._retiring.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("Removing a retired LoRA adapter or mix failed: %s", task.exception())

    def _serves_base(self, adapter_base: str | None) -> bool:
        """Whether an adapter's base_model_name_or_path is a name or model path this server serves."""
        if adapter_base is None:
            return False
        paths = {self.base_model_name, *(path.model_path for path in self.base_model_paths)}
        return adapter_base in paths or self.is_base_model(adapter_base)

    async def _add_lora(
        self, name: str, path: str, base_model_name: str | None, label: str | None = None
    ) -> LoRARequest:
        """Register one adapter in the engine under a fresh id as the first version of `name`; nothing
        is kept if the engine refuses it."""
        lora_request = LoRARequest(
            lora_name=name,
            lora_int_id=next(self._lora_ids),
            lora_path=path,
            base_model_name=base_model_name or self.base_model_name,
        )
        start = time.perf_counter()
        await self.engine.add_lora(lora_request)
        if self.metrics is not None:
            self.metrics.lora_add_seconds.observe(time.perf_counter() - start)
        lora_request = await self._publish(lora_request, label)
        self._name_keys[confusable_key(name)] = name
        return lora_request

    async def _publish(self, lora_request: LoRARequest, label: str | None) -> LoRARequest:
        """Make the registered `lora_request` its name's newest version, pinned to its digest (every
        request the name resolves to then runs on that content or fails); the oldest held version
        beyond `KEEP_VERSIONS` is retired. The same content as a held version is that version."""
        name = lora_request.lora_name
        try:
            digest = await self.engine.lora_digest(lora_request.lora_id)
        except BaseException:
            self._retire(lora_request)  # registered but never published: the engine forgets it too
            raise
        same = next((v for v in self.versions.held(name) if v.digest == digest), None)
        if same is not None:  # nothing new: keep the held registration (and its id, slot, cache)
            self._retire(lora_request)
            self.versions.remove(name, same)
            lora_request, label = same.request, label or same.label
        lora_request = replace(lora_request, version=digest)
        for old in self.versions.publish(AdapterVersion(lora_request, digest, label)):
            self._retire(old.request)  # removed once the requests running on it end
        self.lora_requests[name] = lora_request
        return lora_request

    def _retire(self, lora_request: LoRARequest) -> None:
        """Remove an adapter from the engine in the background (its running requests finish first)."""
        task = asyncio.get_running_loop().create_task(self.engine.remove_lora(lora_request.lora_id))
        self._retiring.add(task)
        task.add_done_callback(self._retired)

    def held_versions(self, name: str) -> list[AdapterVersion]:
        """The versions of adapter `name` that can be addressed now, oldest first."""
        return self.versions.held(canonical_name(name))

    async def _replace_lora(self, loaded: LoRARequest, path: str, label: str | None) -> LoRARequest:
        """load_inplace: a new version of the name under a new id, so that requests running on the old
        weights finish on them; the name points at the new version once the engine serves it, and the
        previous one stays addressable as name@digest (`adapter_versions` says how long)."""
        lora_request = LoRARequest(
            lora_name=loaded.lora_name,
            lora_int_id=next(self._lora_ids),
            lora_path=path,
            base_model_name=loaded.base_model_name,
        )
        start = time.perf_counter()
        await self.engine.add_lora(lora_request)  # the held versions stay registered beside it
        if self.metrics is not None:
            self.metrics.lora_add_seconds.observe(time.perf_counter() - start)
        return await self._publish(lora_request, label)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """POST /v1/load_lora_adapter: validate, then register (or, with load_inplace, replace the
        weights of the adapter loaded under that name); APIError with the status otherwise."""
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
        if not self.lora_enabled:
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
        async with self.name_locks.hold(confusable_key(name)):
            loaded = self.lora_requests.get(name)
            if loaded is not None and not request.load_inplace:
                raise APIError(
                    f"The lora adapter '{name}' has already been loaded.",
                    HTTPStatus.BAD_REQUEST,
                    "lora_name",
                    INVALID_USER_INPUT,
                )
            self._refuse_confusable(name, "lora_name")
            self.versions.check_label_free(name, label)
            try:
                if loaded is None:
                    await self._add_lora(name, path, None, label)
                else:
                    await self._replace_lora(loaded, path, label)
            except LoRAAdapterNotFoundError as exc:
                raise APIError(str(exc), HTTPStatus.NOT_FOUND, "lora_path") from exc
            except ValueError as exc:  # LoRAAdapterError and any other validation failure
                raise APIError(str(exc), HTTPStatus.BAD_REQUEST, "lora_path", INVALID_USER_INPUT) from exc
        logger.info("Loaded LoRA adapter %r from %r%s.", name, path, " in place" if loaded else "")
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """POST /v1/unload_lora_adapter: forget the name (every version; `name@version`: that one, the
        one before it becoming the newest) at once, then wait for their running requests."""
        target = self._find_unload_target(request)
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

    def listed_adapters(self) -> list[tuple[str, AdapterVersion | None, LoRARequest]]:
        """(listed name, version, request): each name's newest version under the name, in load
        order, then the older versions still held as name@<12 digest digits>. A request's `lora`
        entries index this list; old indices stay valid when a name gets a new version."""
        newest = [(name, self._newest(name), lora) for name, lora in self.lora_requests.items()]
        return newest + [(v.key, v, v.request) for v in self.versions.older()]

    def _newest(self, name: str) -> AdapterVersion | None:
        held = self.versions.held(name)
        return held[-1] if held else None

    def lora_adapter_list(self) -> list[dict[str, object]]:
        """GET /lora-adapters (llama.cpp's server): each adapter's `id` (its index in /v1/models'
        adapters, what a request's `lora` entries name), name, scale (1.0: scales are per request)
        and content digest."""
        return [
            {"id": i, "name": name, "scale": 1.0, "digest": version.digest if version else None}
            for i, (name, version, _) in enumerate(self.listed_adapters())
        ]

    def list_models(self) -> ModelList:
        """GET /v1/models: every served base name, then every adapter's newest version under its
        name, then the older versions held (`listed_adapters`), each with its digest and label."""
        max_model_len = self.engine.model_config.max_model_len
        cards = [
            ModelCard(id=path.name, root=path.model_path, max_model_len=max_model_len)
            for path in self.base_model_paths
        ]
        for name, version, lora in self.listed_adapters():
            base = lora.base_model_name
            parent = base if base and self.is_base_model(base) else self.served_model_name
            digest, label = (version.digest, version.label) if version else (None, None)
            cards.append(ModelCard(id=name, root=lora.lora_path, parent=parent, digest=digest, version=label))
        return ModelList(data=cards)
