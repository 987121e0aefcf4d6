"""The `lora_filesystem_resolver` plugin: adapters found by name in one local directory.

`<LORASERVE_LORA_RESOLVER_CACHE_DIR>/<lora_name>/adapter_config.json` must describe a PEFT LoRA adapter
trained for the served base model. Names never escape the directory: absolute names, `..` components and
symlinks pointing outside it resolve to nothing. A name with no such folder, or a folder without an
adapter_config.json, is "not here" (None: 404); a folder whose config cannot be read, is no JSON object,
is no LoRA or names another base model is found but refused: a `LoRAAdapterError` naming the adapter and
the problem (400), so the client learns why (`LoRAAdapterBaseMismatchError` for the base model, which the
server may still accept when the name is one it serves under).
"""

from __future__ import annotations

import logging
import os

from loraserve import envs
from loraserve.errors import LoRAAdapterBaseMismatchError, LoRAAdapterError
from loraserve.lora.adapter_io import run_adapter_io
from loraserve.lora.config_fields import CONFIG_NAME, shown
from loraserve.lora.peft_helper import read_adapter_config
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry

logger = logging.getLogger(__name__)

PLUGIN_NAME = "lora_filesystem_resolver"
# The serving layer replaces this with a unique id before the adapter reaches the engine.
UNASSIGNED_LORA_INT_ID = 1


def name_parts(name: str) -> list[str] | None:
    """The `/`-separated parts of an adapter name that stays below its root (a folder, a key prefix);
    None for an empty or absolute name, a NUL, a backslash, or an empty, `.` or `..` part."""
    if not name or "\x00" in name or "\\" in name or os.path.isabs(name) or name.startswith("/"):
        return None
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return None
    return parts


def path_inside(root: str, name: str) -> str | None:
    """`root/name` with every symlink resolved, or None when it is not strictly inside `root`."""
    parts = name_parts(name)
    if parts is None:
        return None
    real_root = os.path.realpath(root)
    candidate = os.path.realpath(os.path.join(real_root, *parts))
    if candidate == real_root or os.path.commonpath([real_root, candidate]) != real_root:
        return None
    return candidate


def lora_request_from_path(lora_name: str, lora_path: str, base_model_name: str) -> LoRARequest | None:
    """A LoRARequest for the PEFT LoRA adapter at `lora_path` made for `base_model_name`; None when
    there is no adapter folder there; LoRAAdapterError (LoRAAdapterBaseMismatchError for another base
    model) when the folder holds one that cannot be served."""
    if not os.path.isdir(lora_path) or not os.path.lexists(os.path.join(lora_path, CONFIG_NAME)):
        return None
    config = read_adapter_config(lora_path, lora_name)  # bounded; a LoRAAdapterError names the problem
    if not isinstance(config, dict):
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': {CONFIG_NAME} must hold a JSON object, got {type(config).__name__}"
        )
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': only LORA adapters are supported, got {shown(peft_type)} "
            f"(field 'peft_type' in {CONFIG_NAME})"
        )
    adapter_base = config.get("base_model_name_or_path")
    if adapter_base != base_model_name:
        # A local path of another model is a server path: named as such, not echoed.
        local = isinstance(adapter_base, str) and os.path.isabs(adapter_base)
        named = "a local model path" if local else None
        raise LoRAAdapterBaseMismatchError(
            f"LoRA adapter '{lora_name}': it was trained for base model {named or shown(adapter_base)}, which is not "
            f"the model this server serves (field 'base_model_name_or_path' in {CONFIG_NAME})",
            lora_path,
            adapter_base if isinstance(adapter_base, str) else None,
        )
    return LoRARequest(
        lora_name=lora_name,
        lora_int_id=UNASSIGNED_LORA_INT_ID,
        lora_path=lora_path,
        base_model_name=base_model_name,
    )


class FilesystemResolver(LoRAResolver):
    """Resolves `lora_name` to the adapter folder `lora_cache_dir/lora_name`."""

    def __init__(self, lora_cache_dir: str) -> None:
        self.lora_cache_dir = lora_cache_dir

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        lora_path = path_inside(self.lora_cache_dir, lora_name)
        if lora_path is None:
            logger.info("Adapter name %r does not name a folder inside the resolver directory.", lora_name)
            return None
        # File system work leaves the event loop: a slow disk must not stall every other request.
        return await run_adapter_io(lora_request_from_path, lora_name, lora_path, base_model_name)


def register_filesystem_resolver() -> None:
    """Entry point: register the resolver when LORASERVE_LORA_RESOLVER_CACHE_DIR names a directory."""
    cache_dir = envs.lora_resolver_cache_dir()
    if not cache_dir:
        if PLUGIN_NAME in (envs.plugins() or []):
            logger.warning(
                "%s is enabled in LORASERVE_PLUGINS but LORASERVE_LORA_RESOLVER_CACHE_DIR is not set; "
                "the filesystem resolver is not registered.",
                PLUGIN_NAME,
            )
        return
    if not os.path.isdir(cache_dir):
        raise ValueError(
            f"{cache_dir!r} is not a directory: LORASERVE_LORA_RESOLVER_CACHE_DIR must be set to a valid "
            "directory for Filesystem Resolver plugin to function"
        )
    LoRAResolverRegistry.register_resolver("Filesystem Resolver", FilesystemResolver(cache_dir))
    logger.info("Filesystem LoRA resolver registered for %s.", cache_dir)
