"""Versions of one adapter name: which content a `name`, `name@<digest prefix>` or `name@<label>` means.

A version is one content digest (`lora.digest`, the prefix-cache salt) registered under a name, with
an optional label the load request gave ("version": "v3"). A plain name means the newest published
version; `name@<8+ hex digits>` the held version whose digest starts with them (unambiguous), and
`name@<label>` the one of that label. Retention: the newest version and the one before it stay
addressable (`KEEP_VERSIONS`); publishing another retires the oldest, which the engine removes once
the requests running on it finish (they end on its weights). So a rollout that reloads one name every
step holds at most two versions of it, plus those still draining.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from http import HTTPStatus

from loraserve.entrypoints.openai.serving.errors import INVALID_USER_INPUT, APIError
from loraserve.lora.request import MIN_VERSION_DIGITS, LoRARequest, version_key

KEEP_VERSIONS = 2  # the newest and the previous one: requests admitted on it may still be resent
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_HEX = re.compile(r"^[0-9a-fA-F]+$")


@dataclass(frozen=True, slots=True)
class AdapterVersion:
    """One content version of a name: the request that serves it (`version` = the full digest)."""

    request: LoRARequest
    digest: str
    label: str | None = None

    @property
    def key(self) -> str:
        """The version key ("name@<12 digest digits>"): how an older version is listed in /v1/models."""
        return version_key(self.request.lora_name, self.digest)


def split_version(model: str) -> tuple[str, str | None]:
    """Split "name@ref" into (name, ref); a name without "@" (or ending in it) is (name, None)."""
    name, at, ref = model.rpartition("@")
    if not at or not name or not ref:
        return model, None
    return name, ref


def check_label(label: str | None) -> str | None:
    """A load request's version label, or APIError 400: 1-64 of [A-Za-z0-9._-], not 8+ hex digits
    (that reads as a digest prefix)."""
    if label is None:
        return None
    if not _LABEL.match(label) or (len(label) >= MIN_VERSION_DIGITS and _HEX.match(label)):
        raise APIError(
            "'version' is a label of 1 to 64 letters, digits, '.', '_' or '-' (not starting with a "
            f"punctuation mark, and not {MIN_VERSION_DIGITS} or more hex digits, which read as a digest).",
            HTTPStatus.BAD_REQUEST,
            "version",
            INVALID_USER_INPUT,
        )
    return label


def unknown_version(name: str, ref: str, held: list[AdapterVersion]) -> APIError:
    """vLLM's unknown-model text for `name@ref`, naming the versions the name does hold."""
    listed = ", ".join(v.digest[:12] + (f" ({v.label})" if v.label else "") for v in reversed(held))
    return APIError(
        f"The model `{name}@{ref}` does not exist: the lora adapter '{name}' has no version "
        f"{ascii(ref)[:80]} (it holds {listed or 'none'}; a version is a label or at least "
        f"{MIN_VERSION_DIGITS} hex digits of a digest).",
        HTTPStatus.NOT_FOUND,
        "model",
    )


@dataclass(slots=True)
class AdapterVersions:
    """name -> its held versions, oldest first (the last is the newest, what the plain name means)."""

    by_name: dict[str, list[AdapterVersion]] = field(default_factory=dict)

    def publish(self, version: AdapterVersion) -> list[AdapterVersion]:
        """Make `version` the newest of its name; the versions it retires (beyond KEEP_VERSIONS)."""
        held = self.by_name.setdefault(version.request.lora_name, [])
        held.append(version)
        retired = held[:-KEEP_VERSIONS]
        del held[:-KEEP_VERSIONS]
        return retired

    def check_label_free(self, name: str, label: str | None) -> None:
        if label is not None and any(v.label == label for v in self.by_name.get(name, [])):
            raise APIError(
                f"The lora adapter '{name}' already has a version labelled '{label}'.",
                HTTPStatus.BAD_REQUEST,
                "version",
                INVALID_USER_INPUT,
            )

    def held(self, name: str) -> list[AdapterVersion]:
        return list(self.by_name.get(name, []))

    def find(self, name: str, ref: str) -> AdapterVersion:
        """The held version `ref` names (a label, else a digest prefix); APIError 404 when none, 400
        when the prefix fits several."""
        held = self.by_name.get(name, [])
        for version in held:
            if version.label == ref:
                return version
        if len(ref) >= MIN_VERSION_DIGITS and _HEX.match(ref):
            matches = [v for v in held if v.digest.startswith(ref.lower())]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise APIError(
                    f"The version '{ref}' of lora adapter '{name}' is ambiguous: give more digits.",
                    HTTPStatus.BAD_REQUEST,
                    "model",
                )
        raise unknown_version(name, ref, held)

    def remove(self, name: str, version: AdapterVersion | None = None) -> list[AdapterVersion]:
        """Forget one version of `name` (the one before it becomes the newest), or all; those removed."""
        held = self.by_name.get(name, [])
        removed = [v for v in held if version is None or v == version]
        kept = [v for v in held if v not in removed]
        if kept:
            self.by_name[name] = kept
        else:
            self.by_name.pop(name, None)
        return removed

    def older(self) -> list[AdapterVersion]:
        """Every held version that is not its name's newest, by name then age."""
        return [v for held in self.by_name.values() for v in held[:-1]]
