"""What one API key may reach: its adapters (names or glob patterns), the base model or not, loading
under a name prefix, per-key limits. Read from `--api-key-file` (YAML or JSON); `--api-key` keys
reach everything (`ADMIN`), as they always have.

    keys:
      - key: sk-acme-7f3a...          # the secret; compared in constant time, never logged or exported
        label: acme                   # names the key in metrics and logs ([A-Za-z0-9._-], unique)
        adapters: ["acme-*"]          # adapter names or fnmatch patterns (NFKC-normalised, as names)
        base_model: true              # may use the served base model (default: false)
        load:                         # may load/unload adapters (runtime updating on) ...
          prefix: "acme-"             # ... whose names start with this
          paths: ["/srv/adapters/acme"]   # ... from folders inside these (none: by name only, resolvers)
        limits: {max_requests_in_flight: 8, max_queued_tokens: 20000}
      - key: sk-admin-...
        label: admin
        admin: true                   # every adapter, the base model, any load (as --api-key)

A scope never discloses another key's adapters: the serving layer answers a name outside it exactly
as it answers a name that does not exist (404), and lists only what the key may use.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Any

from loraserve.engine.fair_admission import ClientLimits
from loraserve.entrypoints.openai.serving.names import canonical_name

_LABEL = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_KEY_FIELDS = {"key", "label", "adapters", "base_model", "load", "limits", "admin"}
_LOAD_FIELDS = {"prefix", "paths"}
_LIMIT_FIELDS = {"max_requests_in_flight", "max_queued_tokens"}


class KeyFileError(ValueError):
    """The key file is not valid; the message names the entry and field (never a key)."""


@dataclass(frozen=True, slots=True)
class KeyScope:
    label: str
    admin: bool = False
    adapters: tuple[str, ...] = ()  # canonical names and patterns
    base_model: bool = False
    load_prefix: str | None = None  # None: may not load or unload
    load_paths: tuple[str, ...] = ()  # real paths of folders adapters may be loaded from
    limits: ClientLimits | None = None
    client_id: str = field(default="", compare=False)  # whose share and turn: "key:<label>"

    def may_use(self, name: str) -> bool:
        """Whether this key may use adapter `name` (its plain name, no version)."""
        if self.admin:
            return True
        canonical = canonical_name(name)
        return any(fnmatch.fnmatchcase(canonical, pattern) for pattern in self.adapters)

    def may_load(self, name: str) -> bool:
        """Whether this key may load or unload adapter `name`: under its prefix and in its scope."""
        if self.admin:
            return True
        prefix = self.load_prefix
        return prefix is not None and canonical_name(name).startswith(prefix) and self.may_use(name)

    def may_load_path(self, path: str) -> bool:
        """Whether this key may load an adapter from folder `path` (resolved, links followed)."""
        if self.admin:
            return True
        real = os.path.realpath(path)
        return any(os.path.commonpath([real, root]) == root for root in self.load_paths)


ADMIN = KeyScope(label="admin", admin=True, base_model=True)


def parse_key_file(data: Any) -> list[tuple[str, KeyScope]]:
    """(key, scope) pairs of a parsed key file (`{"keys": [...]}`); KeyFileError saying what is wrong."""
    if not isinstance(data, dict) or set(data) != {"keys"} or not isinstance(data["keys"], list):
        raise KeyFileError('the key file must be an object with one field, "keys": a list of keys')
    entries: list[tuple[str, KeyScope]] = []
    for i, entry in enumerate(data["keys"]):
        entries.append(_entry(entry, f"keys[{i}]"))
    keys = [key for key, _ in entries]
    labels = [scope.label for _, scope in entries]
    for what, values in (("key", keys), ("label", labels)):
        repeated = {v for v in values if values.count(v) > 1}
        if repeated:
            shown = sorted(repeated) if what == "label" else f"{len(repeated)} of them"
            raise KeyFileError(f"each {what} must be unique; repeated: {shown}")
    return entries


def _entry(entry: Any, where: str) -> tuple[str, KeyScope]:
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where} must be an object")
    unknown = sorted(set(entry) - _KEY_FIELDS)
    if unknown:
        raise KeyFileError(f"{where} has unknown field(s): {', '.join(map(str, unknown))}")
    key = entry.get("key")
    if not isinstance(key, str) or not key or any(c.isspace() for c in key) or not key.isprintable():
        raise KeyFileError(f"{where}.key must be a non-empty string without whitespace")
    label = entry.get("label")
    if not isinstance(label, str) or not _LABEL.match(label):
        raise KeyFileError(f"{where}.label must be 1-64 of [A-Za-z0-9._-]")
    admin = _bool(entry, "admin", where)
    adapters = entry.get("adapters", [])
    if not isinstance(adapters, list) or not all(isinstance(a, str) and a for a in adapters):
        raise KeyFileError(f"{where}.adapters must be a list of adapter names or patterns")
    prefix, paths = _load(entry.get("load"), where)
    return key, KeyScope(
        label=label,
        admin=admin,
        adapters=tuple(canonical_name(a) for a in adapters),
        base_model=admin or _bool(entry, "base_model", where),
        load_prefix="" if admin else prefix,
        load_paths=paths,
        limits=_limits(entry.get("limits"), where),
        client_id=f"key:{label}",
    )


def _bool(entry: dict[str, Any], name: str, where: str) -> bool:
    value = entry.get(name, False)
    if not isinstance(value, bool):
        raise KeyFileError(f"{where}.{name} must be true or false")
    return value


def _load(value: Any, where: str) -> tuple[str | None, tuple[str, ...]]:
    if value is None:
        return None, ()
    if not isinstance(value, dict) or set(value) - _LOAD_FIELDS or not isinstance(value.get("prefix"), str):
        raise KeyFileError(f'{where}.load must be an object with "prefix" (a string) and optional "paths"')
    paths = value.get("paths", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) and os.path.isabs(p) for p in paths):
        raise KeyFileError(f"{where}.load.paths must be a list of absolute folder paths")
    return canonical_name(value["prefix"]) if value["prefix"] else "", tuple(
        os.path.realpath(p) for p in paths
    )


def _limits(value: Any, where: str) -> ClientLimits | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - _LIMIT_FIELDS:
        raise KeyFileError(f"{where}.limits may hold {sorted(_LIMIT_FIELDS)}")
    numbers = {}
    for name in _LIMIT_FIELDS:
        number = value.get(name)
        if number is not None and (isinstance(number, bool) or not isinstance(number, int) or number < 1):
            raise KeyFileError(f"{where}.limits.{name} must be a positive integer")
        numbers[name] = number
    return ClientLimits(numbers["max_requests_in_flight"], numbers["max_queued_tokens"])
