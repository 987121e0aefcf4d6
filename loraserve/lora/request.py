"""`LoRARequest`: which adapter a request uses, as the serving layer resolved it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

# The most adapters one mix may name (their ranks must also fit --max-lora-rank together).
MAX_MIX_ADAPTERS = 8

MIX_PATH_PREFIX = "mix:"  # the lora_path of a mix (`LoRARequest.mixed`)

# The largest |scale| a request may set (vLLM PR #52757's `lora_scale`: a multiplier on top of the
# adapter's own alpha / r, 1.0 its stock strength). Negative scales subtract the adapter's effect
# ("negation"); past 4 the adapter's term leaves the range its load-time checks bounded.
MAX_LORA_SCALE = 4.0

# A content version is named by a prefix of its digest (`lora.digest`, sha256 hex): at least this many
# hex digits, so that a typo does not address another version by chance.
MIN_VERSION_DIGITS = 8
VERSION_KEY_DIGITS = 12  # the digest digits in `LoRARequest.version_key` and in listed version names
_HEX = frozenset("0123456789abcdef")


def check_version(version: object, name: str = "version") -> str:
    """`version` lower-cased, or ValueError naming `name`: 8 to 64 hex digits (a digest prefix)."""
    if (
        not isinstance(version, str)
        or not MIN_VERSION_DIGITS <= len(version) <= 64
        or not set(version.lower()) <= _HEX
    ):
        raise ValueError(
            f"{name} must be a prefix of the adapter's content digest: {MIN_VERSION_DIGITS} to 64 hex "
            f"digits, got {ascii(version)[:80]}"
        )
    return version.lower()


def version_key(name: str, digest: str) -> str:
    """The version key "name@<12 digest digits>": one content version, as versions are listed and routed."""
    return f"{name}@{digest[:VERSION_KEY_DIGITS]}"


def check_lora_scale(scale: object, name: str = "lora_scale") -> float:
    """`scale` as a float, or ValueError naming `name`: a finite number within +-MAX_LORA_SCALE."""
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or abs(scale) > MAX_LORA_SCALE
    ):
        raise ValueError(
            f"{name} must be a finite number within [-{MAX_LORA_SCALE:g}, {MAX_LORA_SCALE:g}], got {scale!r}"
        )
    return float(scale)


@dataclass(frozen=True)
class LoRARequest:
    """An adapter reference carried by a request.

    The id (> 0) is the engine-wide identity used by the adapter caches; two requests are the same
    adapter when id and name agree (the path may be spelled differently). The constructor and the
    `lora_int_id` field keep vLLM's spelling, which user code passes and reads; loraserve's own code
    reads the id as `lora_id`. `lora_path` may start with `~` or be a Hugging Face repo id.
    `load_inplace` (vLLM's flag): registering it again re-reads its weights (`LLMEngine.add_lora`).
    `scale` multiplies this request's LoRA term (1.0: the adapter as trained; `check_lora_scale`'s
    bounds). It is the request's, not the adapter's: requests of one adapter at different scales share
    its slot and batch together, and their prefix-cache entries are kept apart by scale.
    `mix` makes this a mix of other adapters, (component, weight) pairs (`LoRARequest.mixed` builds
    one): served as one virtual adapter of their concatenated ranks (`lora.mix`) under this id.
    `version`, a prefix of the content digest (`check_version`), pins the request to that content:
    the engine refuses it (`LoRAAdapterVersionError`, 404) when the adapter registered under this id
    holds other content (the server sets the full digest of the version a name resolved to).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = field(compare=False)
    base_model_name: str | None = field(default=None, compare=False)
    load_inplace: bool = field(default=False, compare=False)
    scale: float = field(default=1.0, compare=False)
    mix: tuple[tuple[LoRARequest, float], ...] = field(default=(), compare=False)
    version: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or self.lora_int_id < 1
        ):
            raise ValueError(
                f"LoRA adapter {self.lora_name!r}: lora_int_id must be an integer > 0, got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str):
            raise ValueError(
                f"LoRA adapter {self.lora_name!r}: lora_path must be a string, got {type(self.lora_path).__name__}"
            )
        object.__setattr__(self, "scale", check_lora_scale(self.scale, "scale"))
        if self.mix:
            object.__setattr__(self, "mix", _checked_mix(self.mix))
        if self.version is not None:
            object.__setattr__(self, "version", check_version(self.version))

    @classmethod
    def mixed(cls, parts: Sequence[tuple[LoRARequest, float]], lora_int_id: int) -> LoRARequest:
        """The mix of `parts` (component, weight) under id `lora_int_id`, named "a=0.7,b=0.3"; its
        path names the components' ids too, so one id cannot stand for two mixes."""
        mix = _checked_mix(tuple(parts))
        name = ",".join(f"{p.lora_name}={w:g}" for p, w in mix)
        path = MIX_PATH_PREFIX + ",".join(f"{p.lora_id}:{p.lora_name}={w!r}" for p, w in mix)
        return cls(name, lora_int_id, path, mix=mix)

    @property
    def is_mix(self) -> bool:
        return bool(self.mix)

    @property
    def lora_id(self) -> int:
        return self.lora_int_id

    @property
    def version_key(self) -> str:
        """The version key ("name@<12 digest digits>") for a pinned version, else the name: what routes by version
        (the Ray router's model id, the replicas' residency reports)."""
        return version_key(self.lora_name, self.version) if self.version else self.lora_name


def _checked_mix(parts: tuple[tuple[LoRARequest, float], ...]) -> tuple[tuple[LoRARequest, float], ...]:
    """The (component, weight) pairs, or ValueError: 1 to MAX_MIX_ADAPTERS distinct plain adapters
    (by id), each weight a finite number within +-MAX_LORA_SCALE."""
    if not 1 <= len(parts) <= MAX_MIX_ADAPTERS:
        raise ValueError(f"a LoRA mix names 1 to {MAX_MIX_ADAPTERS} adapters, got {len(parts)}")
    checked: list[tuple[LoRARequest, float]] = []
    for part in parts:
        if not isinstance(part, tuple) or len(part) != 2 or not isinstance(part[0], LoRARequest):
            raise ValueError(f"a LoRA mix is (LoRARequest, weight) pairs, got {part!r}")
        adapter, weight = part
        if adapter.is_mix:
            raise ValueError(f"LoRA adapter {adapter.lora_name!r} is a mix itself; mix its adapters instead")
        checked.append(
            (replace(adapter, scale=1.0), check_lora_scale(weight, f"the weight of {adapter.lora_name!r}"))
        )
    ids = [p.lora_id for p, _ in checked]
    if len(set(ids)) != len(ids):
        raise ValueError("a LoRA mix names an adapter twice; give it one weight")
    return tuple(checked)
