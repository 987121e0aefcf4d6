"""The `lora_hf_hub_resolver` plugin: adapters downloaded from allowlisted Hugging Face Hub repositories.

An adapter name is `<org>/<repo>` (adapter at the repository root) or `<org>/<repo>/<subpath>`; the
repository must be in LORASERVE_LORA_RESOLVER_HF_REPO_LIST. Only a subpath that holds adapter_config.json
is downloaded, and only that subpath. Enabled only when named explicitly in LORASERVE_PLUGINS, because it
lets any client trigger downloads.
"""

from __future__ import annotations

import logging
import posixpath
from typing import Any

from loraserve import envs
from loraserve.lora.adapter_io import run_adapter_io
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry
from loraserve.lora.resolvers.filesystem_resolver import lora_request_from_path, path_inside

logger = logging.getLogger(__name__)

PLUGIN_NAME = "lora_hf_hub_resolver"


def split_adapter_name(lora_name: str, repo_list: list[str]) -> tuple[str, str] | None:
    """(repo, subpath) for a name under an allowlisted repo; None for other or unsafe names."""
    if not lora_name or "\\" in lora_name or "\x00" in lora_name or lora_name.startswith("/"):
        return None
    if any(part in ("", ".", "..") for part in lora_name.split("/")):
        return None
    # The longest match wins, so "org/repo-a" never captures a name meant for "org/repo-a/sub" wrongly.
    for repo in sorted(repo_list, key=len, reverse=True):
        if lora_name == repo:
            return repo, ""
        if lora_name.startswith(repo + "/"):
            return repo, lora_name[len(repo) + 1 :]
    return None


class HfHubResolver(LoRAResolver):
    """Downloads `<org>/<repo>[/<subpath>]` adapters with `hub_client` (default: huggingface_hub.HfApi)."""

    def __init__(self, repo_list: list[str], hub_client: Any | None = None) -> None:
        logger.warning(
            "The Hugging Face Hub LoRA resolver lets any client download adapters from %s onto this "
            "server. This is not a safe setting for production deployments.",
            repo_list,
        )
        self.repo_list = list(repo_list)
        if hub_client is None:
            from huggingface_hub import HfApi

            hub_client = HfApi()
        self.hub_client = hub_client

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        split = split_adapter_name(lora_name, self.repo_list)
        if split is None:
            return None
        repo_id, subpath = split
        try:
            local_root = await run_adapter_io(self._download_if_adapter, repo_id, subpath)
        except Exception as exc:  # a hub failure means "not found here" and must never fail the request
            logger.warning("Hub lookup of adapter %r in %s failed: %s", lora_name, repo_id, exc)
            return None
        if local_root is None:
            return None
        lora_path = path_inside(local_root, subpath) if subpath else local_root
        if lora_path is None:
            return None
        return await run_adapter_io(lora_request_from_path, lora_name, lora_path, base_model_name)

    def _download_if_adapter(self, repo_id: str, subpath: str) -> str | None:
        config_file = posixpath.join(subpath, "adapter_config.json") if subpath else "adapter_config.json"
        if config_file not in set(self.hub_client.list_repo_files(repo_id)):
            logger.info("Repository %s has no %s; not an adapter.", repo_id, config_file)
            return None
        allow_patterns = [f"{subpath}/*"] if subpath else None
        return str(self.hub_client.snapshot_download(repo_id=repo_id, allow_patterns=allow_patterns))


def register_hf_hub_resolver() -> None:
    """Entry point: register only when LORASERVE_PLUGINS names this plugin and a repo list is set."""
    repo_list = envs.lora_resolver_hf_repo_list()
    allowlist = envs.plugins()
    if allowlist is None or PLUGIN_NAME not in allowlist:
        if repo_list:
            logger.warning(
                "LORASERVE_LORA_RESOLVER_HF_REPO_LIST is set but %s is not named in LORASERVE_PLUGINS; "
                "the Hugging Face Hub resolver downloads remote files and must be enabled explicitly.",
                PLUGIN_NAME,
            )
        return
    if not repo_list:
        logger.warning(
            "%s is enabled in LORASERVE_PLUGINS but LORASERVE_LORA_RESOLVER_HF_REPO_LIST is empty; "
            "the Hugging Face Hub resolver is not registered.",
            PLUGIN_NAME,
        )
        return
    LoRAResolverRegistry.register_resolver("Hugging Face Hub Resolver", HfHubResolver(repo_list))
