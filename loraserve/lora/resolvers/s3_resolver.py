"""The `lora_s3_resolver` plugin: adapters found by name in an S3-compatible bucket (AWS, MinIO, R2).

Adapter `N` is `s3://<LORASERVE_LORA_RESOLVER_S3_BUCKET>/<..._PREFIX>/N/` (`s3_config.py` has every
variable). It is downloaded once per process into a local cache, verified, and then resolved like the
filesystem resolver's folders: a PEFT LoRA adapter whose `base_model_name_or_path` is the served model.
Registered when the bucket variable is set (and LORASERVE_PLUGINS allows it); like every resolver it is
asked only when runtime LoRA updating is on. Needs boto3 (`pip install loraserve[s3]`), imported only
when a bucket is configured.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING

from loraserve import envs
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry
from loraserve.lora.resolvers.filesystem_resolver import lora_request_from_path
from loraserve.lora.resolvers.s3_config import S3StoreConfig

if TYPE_CHECKING:
    from loraserve.lora.resolvers.s3_store import S3AdapterStore

logger = logging.getLogger(__name__)

PLUGIN_NAME = "lora_s3_resolver"
RESOLVER_NAME = "S3 Resolver"
# Downloads wait on the network: their own threads, so a slow store never starves the default executor.
MAX_DOWNLOAD_THREADS = 8


class S3Resolver(LoRAResolver):
    """Resolves `lora_name` to a verified local copy of `<prefix>/<lora_name>/` from `store`.

    None when the store does not hold the name; LoRAAdapterError when it holds it but too large,
    failing a check, no LoRA adapter or made for another base model (HTTP 400), and
    LoRAAdapterUnavailableError when the store cannot be read (HTTP 503)."""

    def __init__(self, store: S3AdapterStore) -> None:
        self.store = store
        self._executor = concurrent.futures.ThreadPoolExecutor(
            MAX_DOWNLOAD_THREADS, thread_name_prefix="s3-resolver"
        )

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        loop = asyncio.get_running_loop()
        folder = await loop.run_in_executor(self._executor, self.store.get, lora_name)
        if folder is None:
            return None
        return await loop.run_in_executor(
            self._executor, lora_request_from_path, lora_name, folder, base_model_name
        )


def register_s3_resolver() -> None:
    """Entry point: register the resolver when LORASERVE_LORA_RESOLVER_S3_BUCKET is set."""
    config = S3StoreConfig.from_env()
    if config is None:
        if PLUGIN_NAME in (envs.plugins() or []):
            logger.warning(
                "%s is enabled in LORASERVE_PLUGINS but LORASERVE_LORA_RESOLVER_S3_BUCKET is not set; "
                "the S3 resolver is not registered.",
                PLUGIN_NAME,
            )
        return
    try:
        from loraserve.lora.resolvers.s3_store import S3AdapterStore
    except ImportError as exc:
        raise ValueError(
            f"the S3 LoRA resolver needs boto3 ({exc}); install it with `pip install loraserve[s3]`"
        ) from exc
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, S3Resolver(S3AdapterStore(config)))
    logger.info(
        "S3 LoRA resolver registered for %s (cache %s); consulted only with runtime LoRA updating on.",
        config.location,
        config.cache_dir,
    )
