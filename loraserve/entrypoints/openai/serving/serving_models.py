"""OpenAIServingModels: which names the server answers to, and how an adapter name becomes loaded.

A request's `model` is a served base-model name or an adapter name. Loaded adapters are looked up
directly; unknown names go to the registered LoRA resolvers (only when runtime LoRA updating is on),
one name at a time under a per-name lock so concurrent first requests load an adapter once.

Every adapter name (a request's `model`, the load and unload routes, --lora-modules) is checked and
then NFKC-normalised (`names.canonical_name`) before it is looked up, locked, resolved or registered,
so look-alike spellings of one name are that name. A new name whose skeleton (`names.confusable_key`)
equals that of a registered adapter or a served base name is refused (400) before anything loads; the
per-name locks are keyed by skeleton, so two such names never register side by side.

Tenancy: every lookup, listing, load and unload is seen through the request's API key scope
(`client_identity.current_client().scope`, `key_scopes.KeyScope`): a name outside it is answered
exactly as a name that does not exist (404: its existence is not disclosed) before anything resolves
it, and listings hold only what the key may use.

Each adapter name holds content versions (`adapter_versions`): the plain name is the newest,
`name@<digest prefix>` or `name@<label>` one held version. Registering, versioning, load_inplace and
unloading belong to the `AdapterLoader` this class holds (`adapter_loading`); this module resolves
names (resolvers, `name@version`, mixes) and lists what is served.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from http import HTTPStatus

from loraserve import envs
from loraserve.entrypoints.openai.metrics.metrics import ServerMetrics
from loraserve.entrypoints.openai.serving.adapter_loading import AdapterLoader, not_found_message
from loraserve.entrypoints.openai.serving.adapter_versions import (
    AdapterVersion,
    AdapterVersions,
    split_version,
)
from loraserve.entrypoints.openai.serving.client_identity import current_client
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.name_locks import NamedLocks
from loraserve.entrypoints.openai.serving.names import canonical_name, checked_name, confusable_key
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

__all__ = ["BaseModelPath", "LoRAModulePath", "OpenAIServingModels", "not_found_message"]

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
        # The registered adapters, their versions and engine ids, and every change to them.
        self.loader = AdapterLoader(
            engine, self.is_base_model, [p.name for p in self.base_model_paths], metrics
        )
        # Mixes served so far, by their components and weights (LoRARequest.mixed's path): the same
        # mix keeps its id, hence its slot and host-cache entry. The newest MAX_MIXES are kept.
        self._mixes: OrderedDict[str, LoRARequest] = OrderedDict()
        self.metrics = metrics

    @property
    def lora_requests(self) -> dict[str, LoRARequest]:
        """Adapter name -> its newest version (the loader's; changed only through it)."""
        return self.loader.lora_requests

    @property
    def versions(self) -> AdapterVersions:
        """Adapter name -> the versions held, the newest last."""
        return self.loader.versions

    @property
    def name_locks(self) -> NamedLocks:
        """confusable_key(name) -> lock held while that name is resolved or loaded."""
        return self.loader.name_locks

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
            problem = self.loader.confusable(name)
            if problem is not None:
                raise LoRAAdapterError(f"--lora-modules: {problem}")
            await self.loader.add(name, module.path, module.base_model_name)
            logger.info("Registered LoRA adapter %r from %s.", name, module.path)

    def missing(self, name: str) -> APIError:
        """The error of a name that does not exist, which a name outside the key's scope gets too."""
        if self.lora_enabled and self.allow_runtime_lora_updating and self.lora_resolvers:
            return APIError(not_found_message(name), HTTPStatus.NOT_FOUND, param="model")
        return APIError(f"The model `{name}` does not exist.", HTTPStatus.NOT_FOUND, param="model")

    async def resolve_model(self, name: str | None) -> LoRARequest | None:
        """The LoRARequest for `name`, None for the base model; APIError 404/400 otherwise (404 for a
        name outside the request's key scope, as for a name that does not exist)."""
        scope = current_client().scope
        if self.is_base_model(name):
            if not scope.base_model:
                shown = name or self.served_model_name
                raise APIError(f"The model `{shown}` does not exist.", HTTPStatus.NOT_FOUND, param="model")
            return None
        assert name is not None
        name = checked_name(name, "model")  # before it is logged, counted or handed to a resolver
        plain = name if name in self.lora_requests else split_version(name)[0]
        if not scope.may_use(plain):  # before any lookup or resolver: nothing about the name leaks
            raise self.missing(plain)
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
            self.loader.refuse_confusable(name, "model")
            return await self._resolve_unlocked(name)

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
                found = LoRARequest(name, 1, exc.lora_path, exc.adapter_base)  # id: `loader.add` gives one
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
                return await self.loader.add(name, found.lora_path, found.base_model_name)
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
        mix = self._mixes.pop(key, None) or LoRARequest.mixed(parts, self.loader.next_id())
        self._mixes[key] = mix
        while len(self._mixes) > MAX_MIXES:
            _, old = self._mixes.popitem(last=False)
            # The engine forgets it too (once its requests finish): else every distinct weight a client
            # sends would stay registered. The same mix asked again later gets a new id.
            self.loader.retire(old)
        return mix

    def _serves_base(self, adapter_base: str | None) -> bool:
        """Whether an adapter's base_model_name_or_path is a name or model path this server serves."""
        if adapter_base is None:
            return False
        paths = {self.base_model_name, *(path.model_path for path in self.base_model_paths)}
        return adapter_base in paths or self.is_base_model(adapter_base)

    def held_versions(self, name: str) -> list[AdapterVersion]:
        """The versions of adapter `name` that can be addressed now, oldest first."""
        return self.loader.held_versions(name)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """POST /v1/load_lora_adapter (`AdapterLoader.load`), for a key allowed to load that name from
        that folder (403 otherwise: the refusal depends on the key, never on what is loaded)."""
        scope = current_client().scope
        if not scope.admin:
            name = checked_name((request.lora_name or "").strip() or "-", "lora_name")
            if not scope.may_load(name):
                raise APIError(_load_refusal(scope.load_prefix), HTTPStatus.FORBIDDEN, "lora_name")
            if not scope.may_load_path((request.lora_path or "").strip() or "/"):
                raise APIError(
                    "This API key may not load adapters from that folder.", HTTPStatus.FORBIDDEN, "lora_path"
                )
        return await self.loader.load(request)

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """POST /v1/unload_lora_adapter (`AdapterLoader.unload`), within the key's scope: a name it may
        not use is missing (404), one it may use but not unload a 403."""
        scope = current_client().scope

        def authorize(target: str, missing: APIError) -> None:
            plain = target if target in self.lora_requests else split_version(target)[0]
            if not scope.may_use(plain):
                raise missing
            if not scope.may_load(plain):
                raise APIError(_load_refusal(scope.load_prefix), HTTPStatus.FORBIDDEN, "lora_name")

        return await self.loader.unload(request, None if scope.admin else authorize)

    def listed_adapters(self) -> list[tuple[str, AdapterVersion | None, LoRARequest]]:
        """(listed name, version, request): each name's newest version under the name, in load
        order, then the older versions still held as name@<12 digest digits>. A request's `lora`
        entries index this list; old indices stay valid when a name gets a new version."""
        scope = current_client().scope
        newest = [
            (name, self._newest(name), lora)
            for name, lora in self.lora_requests.items()
            if scope.may_use(name)
        ]
        older = [(v.key, v, v.request) for v in self.versions.older() if scope.may_use(v.request.lora_name)]
        return newest + older

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
        shown = self.base_model_paths if current_client().scope.base_model else []
        cards = [ModelCard(id=path.name, root=path.model_path, max_model_len=max_model_len) for path in shown]
        for name, version, lora in self.listed_adapters():
            base = lora.base_model_name
            parent = base if base and self.is_base_model(base) else self.served_model_name
            digest, label = (version.digest, version.label) if version else (None, None)
            cards.append(ModelCard(id=name, root=lora.lora_path, parent=parent, digest=digest, version=label))
        return ModelList(data=cards)


def _load_refusal(prefix: str | None) -> str:
    if prefix is None:
        return "This API key may not load or unload adapters."
    return f"This API key may load and unload only adapters whose names start with {ascii(prefix)}, within its scope."
