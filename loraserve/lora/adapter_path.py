"""Where an adapter's files are: a `lora_path` as users write it turned into a local folder.

As vLLM does: `~` is expanded; a path that exists locally (or is written as one: absolute, `./`,
`../`) is a local folder; anything else shaped like a Hugging Face repo id, `org/repo` or
`org/repo/sub/folder`, is downloaded with huggingface_hub (only the adapter's config and weight
files, and only under the subfolder), from the local cache alone when HF_HUB_OFFLINE is set.
`AdapterLocations` resolves each registered adapter once, so that reloading an evicted adapter
never asks the Hub again (and never finds a newer revision than the one its digest was taken of).
"""

from __future__ import annotations

import os
import re
import threading

from loraserve import envs
from loraserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from loraserve.lora.request import LoRARequest

# One path segment of a Hub repo id or subfolder (huggingface_hub's own rule is stricter still).
_SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# The files an adapter needs; a repo can hold much more (training checkpoints, logs).
_ADAPTER_FILES = ("adapter_config.json", "adapter_model*")


def expand_adapter_path(lora_path: str) -> str:
    """`lora_path` with `~` expanded (what every local use of an adapter path starts from)."""
    return os.path.expanduser(lora_path)


def hub_repo_parts(lora_path: str) -> tuple[str, str] | None:
    """(repo id, subfolder) when `lora_path` is not local and reads as `org/repo[/sub/folder]`; else None.

    A segment such as `..` or `.` makes it no repo id at all, so it can never climb out of the
    downloaded snapshot."""
    expanded = expand_adapter_path(lora_path)
    if os.path.exists(expanded) or lora_path.startswith(("/", "~", "./", "../", "\\")):
        return None
    parts = lora_path.split("/")
    if len(parts) < 2 or not all(_SEGMENT.match(part) and part not in (".", "..") for part in parts):
        return None
    return "/".join(parts[:2]), "/".join(parts[2:])


def resolve_adapter_path(lora_path: str, lora_name: str) -> str:
    """The local folder of an adapter: `~` expanded, or a Hub repo id downloaded (see module doc)."""
    parts = hub_repo_parts(lora_path)
    if parts is None:
        return expand_adapter_path(lora_path)
    repo_id, subfolder = parts
    return _download(repo_id, subfolder, lora_path, lora_name)


def _download(repo_id: str, subfolder: str, lora_path: str, lora_name: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = envs.hf_hub_offline()
    patterns = [f"{subfolder}/{name}" if subfolder else name for name in _ADAPTER_FILES]
    where = f"LoRA adapter '{lora_name}': {lora_path!r} is not a local folder"
    try:
        root = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline)
    except HFValidationError as exc:
        raise LoRAAdapterNotFoundError(f"No adapter found. {where} nor a Hugging Face repo id ({exc}).") from exc
    except LocalEntryNotFoundError as exc:
        if offline:
            raise LoRAAdapterNotFoundError(
                f"No adapter found. {where}, and Hugging Face repo {repo_id!r} is not in the local cache "
                "(HF_HUB_OFFLINE is set, so nothing is downloaded)."
            ) from exc
        raise LoRAAdapterError(f"{where}, and downloading Hugging Face repo {repo_id!r} failed: {exc}") from exc
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 404):  # the Hub answers 401 for a repo that does not exist (or is gated)
            raise LoRAAdapterNotFoundError(
                f"No adapter found. {where}, and the Hugging Face Hub has no repo {repo_id!r} it can read."
            ) from exc
        raise LoRAAdapterError(f"{where}, and downloading Hugging Face repo {repo_id!r} failed: {exc}") from exc
    folder = os.path.join(str(root), *subfolder.split("/")) if subfolder else str(root)
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        raise LoRAAdapterNotFoundError(
            f"No adapter found. {where}, and Hugging Face repo {repo_id!r} has no adapter_config.json"
            + (f" under {subfolder!r}." if subfolder else " at its root.")
        )
    return folder


class AdapterLocations:
    """lora_id -> local folder, resolved once per registered adapter (thread-safe)."""

    def __init__(self) -> None:
        self._folders: dict[int, str] = {}
        self._lock = threading.Lock()

    def local_path(self, lora_request: LoRARequest) -> str:
        with self._lock:
            known = self._folders.get(lora_request.lora_id)
        if known is not None:
            return known
        folder = resolve_adapter_path(lora_request.lora_path, lora_request.lora_name)
        with self._lock:
            return self._folders.setdefault(lora_request.lora_id, folder)

    def known_folder(self, lora_request: LoRARequest) -> str | None:
        """The local folder without downloading: the resolved one, or the expanded path when it is not a
        Hub repo id; None for a repo not downloaded yet (there are no files to fingerprint)."""
        with self._lock:
            known = self._folders.get(lora_request.lora_id)
        if known is not None:
            return known
        if hub_repo_parts(lora_request.lora_path) is not None:
            return None
        return expand_adapter_path(lora_request.lora_path)

    def forget(self, lora_id: int) -> None:
        """The adapter is gone (or failed to load): the next registration of its id resolves again."""
        with self._lock:
            self._folders.pop(lora_id, None)
