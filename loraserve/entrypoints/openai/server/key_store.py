"""KeyStore: the API keys the server accepts and each one's scope, re-read from `--api-key-file` on
SIGHUP without a restart.

`--api-key` keys reach everything (`key_scopes.ADMIN`, client ids `key-<i>` as before); the key
file's keys reach what their entries say (client ids `key:<label>`). A request's Authorization header
is compared with every key in constant time (no early exit: the time taken says nothing about which
key, or how much of one, matched). A reload that fails (a missing file, a bad entry) keeps the keys
in force and logs why, naming the entry, never a key.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import replace

import yaml

from loraserve.entrypoints.openai.serving.key_scopes import ADMIN, KeyFileError, KeyScope, parse_key_file

logger = logging.getLogger("loraserve.server")

# A key file holds a few hundred keys at most; a bigger one is a mistake, read no further.
MAX_KEY_FILE_BYTES = 4 << 20


class KeyStore:
    def __init__(self, api_keys: list[str], key_file: str | None = None) -> None:
        if any(not key for key in api_keys):
            raise ValueError("api_keys must be non-empty keys.")
        self.api_keys = list(api_keys)
        self.key_file = key_file
        self._entries: tuple[tuple[bytes, KeyScope], ...] = ()
        self._load()  # at startup a bad file stops the server (KeyFileError)

    @property
    def enabled(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self._entries)

    def reload(self) -> bool:
        """Re-read the key file (SIGHUP); on failure keep the keys in force. True if it changed them."""
        if self.key_file is None:
            return False
        try:
            self._load()
        except (OSError, KeyFileError, yaml.YAMLError) as exc:
            logger.error("Reloading --api-key-file failed; the keys in force stay: %s", _reason(exc))
            return False
        logger.info("Reloaded --api-key-file: %d key(s).", len(self._entries))
        return True

    def _load(self) -> None:
        entries = [
            (f"Bearer {key}".encode(), replace(ADMIN, label=f"key-{i}", client_id=f"key-{i}"))
            for i, key in enumerate(self.api_keys)
        ]
        if self.key_file is not None:
            entries += [(f"Bearer {key}".encode(), scope) for key, scope in read_key_file(self.key_file)]
        self._entries = tuple(entries)  # one assignment: a request sees the old keys or the new ones

    def scope(self, authorization: bytes) -> KeyScope | None:
        """The scope of the key this Authorization header carries; None when it carries none we know."""
        found: KeyScope | None = None
        for expected, scope in self._entries:
            if hmac.compare_digest(authorization, expected) and found is None:
                found = scope
        return found


def read_key_file(path: str) -> list[tuple[str, KeyScope]]:
    """The (key, scope) pairs of a YAML or JSON key file; KeyFileError / OSError / YAMLError."""
    with open(path, "rb") as f:
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"the key file is larger than {MAX_KEY_FILE_BYTES} bytes")
    return parse_key_file(yaml.safe_load(data))  # YAML reads JSON too


def _reason(exc: BaseException) -> str:
    """Why a load failed, without the file's text (a YAML error quotes the line, which may hold a key)."""
    if isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        return (
            f"not valid YAML or JSON (line {mark.line + 1})" if mark is not None else "not valid YAML or JSON"
        )
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    return str(exc)
