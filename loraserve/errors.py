"""Exception types that cross module boundaries; the server maps them to HTTP statuses."""

from __future__ import annotations


class LoRAAdapterError(ValueError):
    """An adapter is invalid or cannot be loaded (HTTP 400). The message names the adapter and field."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """An adapter's path or name does not exist (HTTP 404)."""


class LoRAAdapterGoneError(LoRAAdapterNotFoundError):
    """A registered adapter must be read again but its folder is gone from disk (HTTP 404)."""


class LoRAAdapterVersionError(LoRAAdapterNotFoundError):
    """A request names a content version (a digest prefix) that the adapter it names does not hold
    (HTTP 404): it is never served other weights instead."""


class LoRAAdapterBaseMismatchError(LoRAAdapterError):
    """A resolver found an adapter, but its adapter_config.json names another base model than the one
    it was asked for (HTTP 400, unless the server also answers to that name: `adapter_base` is the
    config's base_model_name_or_path, `lora_path` the folder found)."""

    def __init__(self, message: str, lora_path: str, adapter_base: str | None) -> None:
        super().__init__(message)
        self.lora_path = lora_path
        self.adapter_base = adapter_base


class LoRAAdapterUnavailableError(LoRAAdapterError):
    """The store that holds an adapter cannot be read right now (HTTP 503 with Retry-After): the same
    request may succeed later. The message names the adapter and the reason, never the store's address."""


class LoRAAdapterChangedError(LoRAAdapterError):
    """A registered adapter must be read again but its files no longer hold the content it was
    registered with (HTTP 409): new weights never run under the old identity."""


class PromptTooLongError(ValueError):
    """A prompt does not fit in max_model_len (HTTP 400)."""


class EngineDeadError(RuntimeError):
    """The engine loop crashed; every running request failed and /health reports it (HTTP 500)."""


class EngineShutdownError(EngineDeadError):
    """The engine was shut down (server shutdown) before the request finished (HTTP 503)."""


class EngineOverloadedError(RuntimeError):
    """The engine's queue is full right now (HTTP 503 with Retry-After); the same request may fit later."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLargeError(ValueError):
    """A request needs more queue room than the server ever grants (HTTP 400); retrying cannot help."""


class ReplicaUnavailableError(EngineOverloadedError):
    """The replica running a request died or could not be reached (HTTP 503 with Retry-After); the
    cluster starts a replacement, so the same request may succeed when sent again."""
