"""The OpenAI-compatible HTTP app: FastAPI routes, auth and error handlers over an EngineClient.

`build_app(engine, options)` wires an engine (`AsyncLLMEngine`, or any `EngineClient`) into routes;
the process around it (flags, model load, socket, uvicorn) is `launcher.py`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraserve import __version__, envs
from loraserve.entrypoints.openai.metrics.metrics import ServerMetrics
from loraserve.entrypoints.openai.server.auth import APIKeyMiddleware
from loraserve.entrypoints.openai.server.frontend import (
    FrontendOptions,
    apply_to_app,
    fastapi_kwargs,
    override_chat_template,
)
from loraserve.entrypoints.openai.server.http_guard import (
    HTTPVersionMiddleware,
    RequestGuardMiddleware,
    ServerLifecycle,
)
from loraserve.entrypoints.openai.server.key_store import KeyStore
from loraserve.entrypoints.openai.server.respond import respond, take_request_id_header
from loraserve.entrypoints.openai.server.responses_routes import add_responses_routes
from loraserve.entrypoints.openai.server.vllm_routes import Handler, LoadTracker, add_vllm_routes
from loraserve.entrypoints.openai.serving.client_identity import ClientIdentityMiddleware
from loraserve.entrypoints.openai.serving.engine_client import EngineClient, ReplicaStatsSource
from loraserve.entrypoints.openai.serving.errors import (
    APIError,
    api_error_from_exception,
    error_response,
)
from loraserve.entrypoints.openai.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from loraserve.entrypoints.openai.serving.responses.serving import OpenAIServingResponses
from loraserve.entrypoints.openai.serving.responses.store import ResponseStore
from loraserve.entrypoints.openai.serving.serving_chat import OpenAIServingChat
from loraserve.entrypoints.openai.serving.serving_completion import OpenAIServingCompletion
from loraserve.entrypoints.openai.serving.serving_models import (
    BaseModelPath,
    LoRAModulePath,
    OpenAIServingModels,
)
from loraserve.entrypoints.openai.serving.serving_tokenization import OpenAIServingTokenization
from loraserve.entrypoints.openai.serving.tokenizer_pool import FairTokenizerPool
from loraserve.entrypoints.openai.serving.tool_request import ToolSettings
from loraserve.entrypoints.openai.tool_parsers.manager import ToolParserManager

logger = logging.getLogger("loraserve.server")


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """What the HTTP layer needs beyond the engine."""

    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    api_keys: list[str] = field(default_factory=list)
    api_key_file: str | None = None  # keys with scopes (serving/key_scopes.py), re-read on SIGHUP
    lora_modules: list[LoRAModulePath] = field(default_factory=list)
    allow_runtime_lora_updating: bool | None = None  # None: read the environment
    trust_request_chat_template: bool = False  # a request's own chat template runs only when True
    max_request_body_bytes: int = 4 << 20
    request_read_timeout_s: float = 30.0  # a request's head, and then its body, must arrive within this
    keep_alive_timeout_s: float = 30.0  # an idle keep-alive connection is closed after this
    shutdown_timeout_s: float = 30.0  # SIGTERM: running requests may finish within this, then fail (503)
    responses_store_max_responses: int = 1024  # stored Responses API responses: the oldest go first
    responses_store_max_bytes: int = 256 << 20
    frontend: FrontendOptions = field(default_factory=FrontendOptions)  # vLLM's FrontendArgs


def tool_settings(frontend: FrontendOptions) -> ToolSettings:
    """The tool flags, the plugin file imported and the parser looked up (KeyError: unknown name)."""
    if frontend.tool_parser_plugin:
        ToolParserManager.import_tool_parser(frontend.tool_parser_plugin)
    settings = ToolSettings(
        frontend.enable_auto_tool_choice,
        frontend.tool_call_parser,
        frontend.exclude_tools_when_tool_choice_none,
    )
    settings.parser_class()
    return settings


async def build_app(engine: EngineClient, options: ServerOptions) -> FastAPI:
    """The app for `engine`, with the --lora-modules adapters registered (LoRAAdapterError if one fails)."""
    model_config = engine.model_config
    names = options.served_model_names or [model_config.served_model_name or model_config.model]
    runtime_updating = options.allow_runtime_lora_updating
    if runtime_updating is None:
        runtime_updating = envs.allow_runtime_lora_updating()
    replica_stats = engine.replica_stats if isinstance(engine, ReplicaStatsSource) else None
    metrics = ServerMetrics(engine.stats, replica_stats, model_name=names[0])
    models = OpenAIServingModels(
        engine,
        [BaseModelPath(name, model_config.model) for name in names],
        static_lora_modules=options.lora_modules,
        allow_runtime_lora_updating=runtime_updating,
        metrics=metrics,
    )
    await models.init_static_loras()
    override_chat_template(engine.tokenizer, options.frontend)
    app = FastAPI(title="loraserve", version=__version__, **fastapi_kwargs(options.frontend))
    app.state.lifecycle = lifecycle = ServerLifecycle()
    app.state.key_store = keys = KeyStore(options.api_keys, options.api_key_file)  # a bad file stops here
    app.state.engine = engine
    app.state.models = models
    app.state.metrics = metrics
    _add_error_handlers(app)
    _add_info_routes(app, engine, models, metrics)
    frontend = options.frontend
    tokenizer_pool = FairTokenizerPool()  # a few workers, shared by both endpoints, in turn by client
    app.router.on_shutdown.append(tokenizer_pool.shutdown)
    completion = OpenAIServingCompletion(
        engine,
        models,
        metrics,
        tokenizer_pool,
        return_tokens_as_token_ids=frontend.return_tokens_as_token_ids,
        enable_prompt_tokens_details=frontend.enable_prompt_tokens_details,
    )
    chat = OpenAIServingChat(
        engine,
        models,
        metrics,
        options.trust_request_chat_template,
        tokenizer_pool,
        response_role=frontend.response_role,
        return_tokens_as_token_ids=frontend.return_tokens_as_token_ids,
        enable_prompt_tokens_details=frontend.enable_prompt_tokens_details,
        tool_settings=tool_settings(frontend),
    )
    tracker = LoadTracker(frontend.enable_server_load_tracking)
    handlers = _add_generation_routes(app, completion, chat, tracker)
    app.state.responses_store = store = ResponseStore(
        options.responses_store_max_responses, options.responses_store_max_bytes
    )
    add_responses_routes(app, OpenAIServingResponses(chat, store), tracker)
    add_vllm_routes(
        app,
        lambda: _health(engine),
        tracker,
        OpenAIServingTokenization(chat),
        handlers,
        frontend.enable_tokenizer_info_endpoint,
    )
    if runtime_updating:
        _add_lora_routes(app, models)
    # Whose turn, whose share, which adapters: the key's scope, counted under its label.
    app.add_middleware(ClientIdentityMiddleware, scope_of=keys.scope, on_request=_key_counter(metrics))
    app.add_middleware(
        RequestGuardMiddleware,
        max_body_bytes=options.max_request_body_bytes,
        read_timeout_s=options.request_read_timeout_s,
        lifecycle=lifecycle,
    )
    if keys.enabled:  # added last, so it runs first: no unauthenticated body is ever buffered
        app.add_middleware(APIKeyMiddleware, keys=keys)
    apply_to_app(app, options.frontend)  # CORS outside the key check: preflight requests carry no API key
    app.add_middleware(HTTPVersionMiddleware)  # outermost: HTTP/9.9 is no request to answer as 1.1
    return app


def _key_counter(metrics: ServerMetrics) -> Callable[[str], None]:
    def count(label: str) -> None:
        metrics.key_requests.labels(label).inc()

    return count


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        # A union field reports one error per member; the one that is not a type mismatch says most.
        errors.sort(key=lambda error: str(error.get("type", "")).endswith("_type"))
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
        where = ".".join(loc)
        message = first.get("msg", "Invalid request")
        if first.get("type"):  # pydantic's error type, which vLLM's message carries (clients match it)
            message += f" [type={first['type']}]"
        num_fields = len({tuple(e.get("loc", ())[:2]) for e in errors})
        if num_fields > 1:
            message += f" (and {num_fields - 1} more problem(s))"
        return error_response(f"{where}: {message}" if where else message, 400, where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        return api_error_from_exception(exc).response()


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_union_tag(part: object) -> bool:
    """pydantic's names for union members in an error location ("list[constrained-str]", "str")."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in _TYPE_NAMES)


def _add_info_routes(
    app: FastAPI, engine: EngineClient, models: OpenAIServingModels, metrics: ServerMetrics
) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health() -> Response:
        return await _health(engine)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await metrics.render_async(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(models.list_models().model_dump())

    @app.get("/lora-adapters")  # llama.cpp's list: a request's `lora` entries name adapters by `id`
    async def lora_adapters() -> JSONResponse:
        return JSONResponse(models.lora_adapter_list())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        for card in models.list_models().data:
            if card.id == model_id:
                return JSONResponse(card.model_dump())
        raise APIError(f"The model `{model_id}` does not exist.", 404, "model")


async def _health(engine: EngineClient) -> Response:
    if engine.is_healthy():
        return Response(status_code=200)
    reason = engine.dead_error or "the engine loop is not running"
    return error_response(f"The engine is dead: {reason}", 500)


def _add_generation_routes(
    app: FastAPI, completion: OpenAIServingCompletion, chat: OpenAIServingChat, tracker: LoadTracker
) -> list[tuple[type[BaseModel], Handler]]:
    """The generation routes; returns their handlers in /invocations' order (chat first, as vLLM)."""

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw_request: Request) -> Response:
        take_request_id_header(body, raw_request)
        return await respond(raw_request, lambda: completion.create_completion(body), tracker)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request) -> Response:
        take_request_id_header(body, raw_request)
        return await respond(raw_request, lambda: chat.create_chat_completion(body), tracker)

    return [(ChatCompletionRequest, create_chat_completion), (CompletionRequest, create_completion)]


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        return await _plain(models.load_lora_adapter(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return await _plain(models.unload_lora_adapter(body))


async def _plain(result: Awaitable[str]) -> Response:
    """A route's text, or its error as a response (the global handler would log a shutdown's 503 as a
    traceback: Starlette re-raises what reaches its `Exception` handler)."""
    try:
        return PlainTextResponse(await result)
    except Exception as exc:
        return api_error_from_exception(exc).response()
