"""`S3AdapterStore`: adapters fetched by name from an S3-compatible bucket into a local cache folder.

`get(name)` lists `<prefix>/<name>/` once per process (one request, non-recursive: `team` never
sees `team/sub`'s files), then uses a complete copy of that exact listing from the cache folder
(`s3_cache.py`), or downloads one, every file checked (`s3_objects.py`) before it is published.
Only adapter_config.json, the first weights file the loader would read, and SHA256SUMS are fetched.

Concurrent first requests for one name share one lookup (single flight). A name the store does not
hold, or holds broken (too large, a failed check), is remembered for `negative_ttl_s`, at most
`MAX_NEGATIVE_ENTRIES` names; a store that cannot be reached is not remembered.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from loraserve.errors import LoRAAdapterError, LoRAAdapterUnavailableError
from loraserve.lora.checkpoint import WEIGHT_FILES
from loraserve.lora.peft_helper import CONFIG_NAME, MAX_CONFIG_BYTES
from loraserve.lora.resolvers.filesystem_resolver import name_parts
from loraserve.lora.resolvers.s3_cache import cache_error, is_complete, new_partial, publish, version_folder
from loraserve.lora.resolvers.s3_config import S3StoreConfig
from loraserve.lora.resolvers.s3_objects import (
    DIGEST_FILE,
    MAX_DIGEST_FILE_BYTES,
    StoredObject,
    digest_error,
    download_object,
    parse_sha256sums,
    store_error,
)

logger = logging.getLogger(__name__)

MAX_NEGATIVE_ENTRIES = 4096  # names are client input: the memory of misses is bounded
_MAX_KEY_BYTES = 1024  # S3's limit on a key
_LONGEST_FILE = max(len(name) for name in (CONFIG_NAME, DIGEST_FILE, *WEIGHT_FILES))


def make_client(config: S3StoreConfig) -> Any:
    """A boto3 S3 client with the config's timeouts and botocore's standard retries (thread safe)."""
    import boto3
    from botocore.config import Config

    client_config = Config(
        connect_timeout=config.connect_timeout_s,
        read_timeout=config.read_timeout_s,
        retries={"mode": "standard", "max_attempts": config.max_attempts},
    )
    session = boto3.session.Session()
    return session.client(
        "s3", endpoint_url=config.endpoint_url, region_name=config.region, config=client_config
    )


@dataclass(slots=True)
class _Flight:
    """One lookup in progress; later callers for the same name wait for its result."""

    result: concurrent.futures.Future[str | None] = field(default_factory=concurrent.futures.Future)
    num_waiting: int = 0


class S3AdapterStore:
    """Adapter name -> local folder holding a verified copy of `<prefix>/<name>/` (see module doc)."""

    def __init__(
        self, config: S3StoreConfig, client: Any | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.client = client if client is not None else make_client(config)
        self._clock = clock
        self._lock = threading.Lock()
        self._ready: dict[str, str] = {}  # name -> verified local folder, for this process
        self._misses: OrderedDict[str, tuple[float, LoRAAdapterError | None]] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self.num_listings = 0  # list requests sent (one per lookup that reached the store)
        self.num_downloads = 0  # adapters downloaded (each a set of objects)

    def get(self, lora_name: str) -> str | None:
        """The local folder of `lora_name`, None when the store does not hold it (or the name would
        leave the prefix). LoRAAdapterError when it is there but too large or fails a check;
        LoRAAdapterUnavailableError when the store or the cache folder cannot be used."""
        if self.key_prefix(lora_name) is None:
            return None
        with self._lock:
            is_known, folder = self._recall(lora_name)
            if is_known:
                return folder
            flight = self._flights.get(lora_name)
            is_owner = flight is None
            if flight is None:
                flight = self._flights[lora_name] = _Flight()
            else:
                flight.num_waiting += 1
        if not is_owner:
            return flight.result.result()  # the owner's answer, or its exception
        try:
            folder = self._lookup(lora_name)
        except BaseException as exc:
            flight.result.set_exception(exc)
            raise
        else:
            flight.result.set_result(folder)
            return folder
        finally:
            with self._lock:
                del self._flights[lora_name]

    def num_waiting(self, lora_name: str) -> int:
        """Callers waiting for the lookup of `lora_name` in progress (not counting the one doing it)."""
        with self._lock:
            flight = self._flights.get(lora_name)
            return flight.num_waiting if flight is not None else 0

    def key_prefix(self, lora_name: str) -> str | None:
        """`<prefix><name>/`, or None for a name that could leave the prefix or make a key too long."""
        parts = name_parts(lora_name)
        if parts is None:
            return None
        prefix = f"{self.config.prefix}{'/'.join(parts)}/"
        return prefix if len(prefix.encode()) + _LONGEST_FILE <= _MAX_KEY_BYTES else None

    def list_adapter(self, lora_name: str) -> dict[str, StoredObject] | None:
        """The objects to fetch by file name: the config, the first weights file present and
        SHA256SUMS if published; None when the store has no `<name>/adapter_config.json`."""
        prefix = self.key_prefix(lora_name)
        if prefix is None:
            return None
        with self._lock:
            self.num_listings += 1
        wanted = {CONFIG_NAME, DIGEST_FILE, *WEIGHT_FILES}
        found: dict[str, StoredObject] = {}
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.config.bucket, Prefix=prefix, Delimiter="/"
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    name = item["Key"][len(prefix) :]
                    if name in wanted:
                        found[name] = StoredObject(name, item["Key"], int(item["Size"]), item["ETag"])
        except (BotoCoreError, ClientError) as exc:
            logger.warning(
                "Listing %s%s for adapter %r failed: %s", self.config.location, prefix, lora_name, exc
            )
            raise store_error(lora_name, "listing", exc) from exc
        if CONFIG_NAME not in found:
            return None
        weights = next((name for name in WEIGHT_FILES if name in found), None)
        if weights is None:
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_name}': the S3 store has its {CONFIG_NAME} but no weights file "
                f"({', '.join(WEIGHT_FILES)})"
            )
        listing = {name: obj for name, obj in found.items() if name in (CONFIG_NAME, weights, DIGEST_FILE)}
        self._check_sizes(lora_name, listing)
        return listing

    def fetch(self, lora_name: str, listing: dict[str, StoredObject]) -> str:
        """A verified local copy of `listing`: the cached one if complete, else a new download."""
        where = "\0".join((self.config.endpoint_url or "", self.config.bucket, self.config.prefix, lora_name))
        final = version_folder(self.config.cache_dir, where, listing)
        if is_complete(final, listing):
            return final
        partial = new_partial(final, lora_name)
        try:
            self._download(lora_name, listing, partial)
            publish(partial, final, listing, lora_name)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return final

    # ---- internals --------------------------------------------------------------------------------
    def _recall(self, lora_name: str) -> tuple[bool, str | None]:
        """Under the lock: (True, folder) for a name found earlier whose folder is still there,
        (True, None) for a remembered miss (raising its error, if it was a refusal); (False, None)
        when the store must be asked."""
        folder = self._ready.get(lora_name)
        if folder is not None and os.path.isdir(folder):
            return True, folder
        miss = self._misses.get(lora_name)
        if miss is None:
            return False, None
        expires, error = miss
        if self._clock() >= expires:
            del self._misses[lora_name]
            return False, None
        if error is not None:  # a fresh exception: re-raising one object would grow its traceback
            raise type(error)(str(error))
        return True, None

    def _lookup(self, lora_name: str) -> str | None:
        try:
            listing = self.list_adapter(lora_name)
            if listing is None:
                logger.info("Adapter %r is not in %s.", lora_name, self.config.location)
                self._remember_miss(lora_name, None)
                return None
            folder = self.fetch(lora_name, listing)
        except LoRAAdapterUnavailableError:
            raise  # the store may be back at the next request: nothing remembered
        except LoRAAdapterError as exc:
            logger.warning("Adapter %r in %s refused: %s", lora_name, self.config.location, exc)
            self._remember_miss(lora_name, exc)
            raise
        with self._lock:
            self._ready[lora_name] = folder
        return folder

    def _remember_miss(self, lora_name: str, error: LoRAAdapterError | None) -> None:
        if self.config.negative_ttl_s <= 0:
            return
        with self._lock:
            self._misses[lora_name] = (self._clock() + self.config.negative_ttl_s, error)
            self._misses.move_to_end(lora_name)
            while len(self._misses) > MAX_NEGATIVE_ENTRIES:
                self._misses.popitem(last=False)

    def _check_sizes(self, lora_name: str, listing: dict[str, StoredObject]) -> None:
        limits = {CONFIG_NAME: MAX_CONFIG_BYTES, DIGEST_FILE: MAX_DIGEST_FILE_BYTES}
        for name, obj in listing.items():
            if name in limits and obj.size > limits[name]:
                raise LoRAAdapterError(
                    f"LoRA adapter '{lora_name}': {name} in the S3 store is larger than {limits[name]} bytes"
                )
        total = sum(obj.size for obj in listing.values())
        if total > self.config.max_adapter_bytes:
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_name}': its files in the S3 store hold {total} bytes, more than the "
                f"limit of {self.config.max_adapter_bytes} (LORASERVE_LORA_RESOLVER_S3_MAX_ADAPTER_BYTES)"
            )

    def _download(self, lora_name: str, listing: dict[str, StoredObject], folder: str) -> None:
        """Every object into `folder`, SHA256SUMS first so that each file is checked against it."""
        with self._lock:
            self.num_downloads += 1
        logger.info("Downloading adapter %r from %s.", lora_name, self.config.location)
        sums: dict[str, str] | None = None
        for name in sorted(listing, key=lambda name: name != DIGEST_FILE):
            dest = os.path.join(folder, name)
            try:
                digest = download_object(self.client, self.config.bucket, listing[name], dest, lora_name)
                if name == DIGEST_FILE:
                    with open(dest, encoding="utf-8", errors="replace") as f:
                        sums = parse_sha256sums(f.read(), lora_name)
            except OSError as exc:
                raise cache_error(lora_name, exc) from exc
            if sums is not None and name != DIGEST_FILE:
                if name not in sums:
                    raise LoRAAdapterError(f"LoRA adapter '{lora_name}': {DIGEST_FILE} does not list {name}")
                if sums[name] != digest:
                    raise digest_error(lora_name, name, DIGEST_FILE)
