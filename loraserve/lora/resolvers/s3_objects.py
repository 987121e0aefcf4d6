"""One adapter object from S3 to a local file, checked against what the store's listing promised.

A download is refused, naming the adapter and the file, when the object's length (ContentLength, then
the bytes received) differs from its listed size, when its ETag changed since the listing, when the
sha256 that S3 keeps for it (ChecksumSHA256, single-part uploads) differs from the bytes, or when a
published `SHA256SUMS` (sha256sum's output format, beside the adapter's files) lists another digest.
Never more than the listed size is written. Transport failures are `LoRAAdapterUnavailableError`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError

from loraserve.errors import LoRAAdapterError, LoRAAdapterUnavailableError

DIGEST_FILE = "SHA256SUMS"
MAX_DIGEST_FILE_BYTES = 64 << 10
_CHUNK_BYTES = 1 << 20
_SUMS_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One object of an adapter as listed: its file name in the adapter folder, key, size and ETag."""

    file_name: str
    key: str
    size: int
    etag: str


def store_error(lora_name: str, what: str, exc: BaseException) -> LoRAAdapterUnavailableError:
    """The client-facing error for a failed store call: the S3 error code or exception type only (the
    endpoint and bucket stay in the server's log)."""
    if isinstance(exc, ClientError):
        reason = str(exc.response.get("Error", {}).get("Code") or "ClientError")
    else:
        reason = type(exc).__name__
    return LoRAAdapterUnavailableError(
        f"LoRA adapter '{lora_name}': the S3 adapter store cannot be read now ({what}: {reason}); retry later"
    )


def parse_sha256sums(text: str, lora_name: str) -> dict[str, str]:
    """File name -> lowercase hex digest, from `sha256sum`'s output (`<hex>  <name>` or `<hex> *<name>`);
    blank lines are skipped, anything else is refused."""
    digests: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _SUMS_LINE.match(line.rstrip("\r"))
        if match is None:
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_name}': {DIGEST_FILE} line {number} is not '<sha256 hex>  <file name>'"
            )
        digests[match.group(2).removeprefix("./")] = match.group(1).lower()
    return digests


def download_object(client: Any, bucket: str, obj: StoredObject, dest: str, lora_name: str) -> str:
    """Write `obj` to the new file `dest` and return its sha256 (hex); see the module doc for checks."""
    try:
        response = client.get_object(Bucket=bucket, Key=obj.key, ChecksumMode="ENABLED")
    except (BotoCoreError, ClientError) as exc:
        raise store_error(lora_name, f"reading {obj.file_name}", exc) from exc
    with contextlib.closing(response["Body"]) as body:
        length = response.get("ContentLength")
        if length != obj.size:
            raise _size_error(lora_name, obj, length)
        if response.get("ETag", obj.etag) != obj.etag:
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_name}': {obj.file_name} changed in the S3 store while it was "
                "downloaded; retry"
            )
        digest, received = _copy(body, dest, obj, lora_name)
    if received != obj.size:
        raise _size_error(lora_name, obj, received)
    published = response.get("ChecksumSHA256")
    # A multipart object's checksum ("...-N") is a digest of part digests, not of the bytes.
    if published and "-" not in published and base64.b64decode(published) != digest.digest():
        raise digest_error(lora_name, obj.file_name, "the store's ChecksumSHA256")
    return digest.hexdigest()


def digest_error(lora_name: str, file_name: str, source: str) -> LoRAAdapterError:
    return LoRAAdapterError(
        f"LoRA adapter '{lora_name}': {file_name} from the S3 store does not match its sha256 in {source}"
    )


def _size_error(lora_name: str, obj: StoredObject, got: object) -> LoRAAdapterError:
    return LoRAAdapterError(
        f"LoRA adapter '{lora_name}': {obj.file_name} from the S3 store has {got} bytes, but the store "
        f"lists {obj.size}"
    )


def _copy(body: Any, dest: str, obj: StoredObject, lora_name: str) -> tuple[Any, int]:
    """Stream the body into `dest` (created, never overwritten), hashing it; stops past the listed size."""
    digest = hashlib.sha256()
    received = 0
    try:
        with open(dest, "xb") as f:
            for chunk in body.iter_chunks(_CHUNK_BYTES):
                received += len(chunk)
                if received > obj.size:
                    raise _size_error(lora_name, obj, f"more than {obj.size}")
                digest.update(chunk)
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    except FlexibleChecksumError as exc:  # botocore checked the store's CRC or SHA itself
        raise digest_error(lora_name, obj.file_name, "the store's checksum") from exc
    except (BotoCoreError, ClientError) as exc:
        raise store_error(lora_name, f"reading {obj.file_name}", exc) from exc
    return digest, received
