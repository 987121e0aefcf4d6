"""The S3 resolver's local cache folder: one folder per version of an adapter, published atomically.

`<cache_dir>/<hash of store and name>/<hash of the listing>/` holds a copy of exactly one listing
(keys, sizes, ETags): a new upload gets a new folder, so files an engine registered are never
rewritten. A copy is written into a `.partial-*` folder beside its final place, checked, given its
manifest (the listing, written last), then renamed into place: a folder at a final name is always
complete. A final folder that no longer matches its manifest (a file deleted or truncated by hand)
is set aside and replaced. Old versions and `.partial-*` folders left by a crash are not pruned.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping

from loraserve.errors import LoRAAdapterUnavailableError
from loraserve.lora.resolvers.s3_objects import StoredObject

MANIFEST_FILE = ".s3-listing.json"


def version_folder(cache_dir: str, store_key: str, listing: Mapping[str, StoredObject]) -> str:
    """Where the copy of `listing` lives; `store_key` names the store and the adapter (any string)."""
    lines = sorted(f"{o.key}\0{o.size}\0{o.etag}" for o in listing.values())
    version = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]
    return os.path.join(cache_dir, hashlib.sha256(store_key.encode()).hexdigest()[:32], version)


def is_complete(folder: str, listing: Mapping[str, StoredObject]) -> bool:
    """Whether `folder` is a published copy of `listing`: its manifest matches, every size too."""
    try:
        with open(os.path.join(folder, MANIFEST_FILE), encoding="utf-8") as f:
            if f.read() != _manifest(listing):
                return False
        return all(os.path.getsize(os.path.join(folder, name)) == o.size for name, o in listing.items())
    except OSError:
        return False


def new_partial(final: str, lora_name: str) -> str:
    """A fresh, empty `.partial-*` folder beside `final` (same file system, so the rename is atomic)."""
    parent = os.path.dirname(final)
    try:
        os.makedirs(parent, exist_ok=True)
        return tempfile.mkdtemp(prefix=".partial-", dir=parent)
    except OSError as exc:
        raise cache_error(lora_name, exc) from exc


def publish(partial: str, final: str, listing: Mapping[str, StoredObject], lora_name: str) -> None:
    """Give the verified `partial` its manifest and rename it to `final`. Another process that got
    there first wins; a broken folder found there is set aside first."""
    try:
        with open(os.path.join(partial, MANIFEST_FILE), "x", encoding="utf-8") as f:
            f.write(_manifest(listing))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(partial, final)
        except OSError:
            if is_complete(final, listing):
                return
            broken = tempfile.mkdtemp(prefix=".broken-", dir=os.path.dirname(final))
            os.rename(final, os.path.join(broken, "copy"))
            shutil.rmtree(broken, ignore_errors=True)
            os.rename(partial, final)
        _fsync_dir(os.path.dirname(final))  # the rename itself survives a crash
    except OSError as exc:
        if is_complete(final, listing):  # a concurrent publisher won the second race too
            return
        raise cache_error(lora_name, exc) from exc


def cache_error(lora_name: str, exc: OSError) -> LoRAAdapterUnavailableError:
    """The client-facing error for a cache that cannot be written: the reason, never the path."""
    return LoRAAdapterUnavailableError(
        f"LoRA adapter '{lora_name}': the local S3 adapter cache cannot be written ({exc.strerror or type(exc).__name__})"
    )


def _manifest(listing: Mapping[str, StoredObject]) -> str:
    return json.dumps({name: [o.key, o.size, o.etag] for name, o in sorted(listing.items())})


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
