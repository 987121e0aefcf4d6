"""`LoRARequest`: which adapter a request uses, as the serving layer resolved it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The largest |scale| a request may set (vLLM PR #52757's `lora_scale`: a multiplier on top of the
# adapter's own alpha / r, 1.0 its stock strength). Negative scales subtract the adapter's effect
# ("negation"); past 4 the adapter's term leaves the range its load-time checks bounded.
MAX_LORA_SCALE = 4.0


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
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = field(compare=False)
    base_model_name: str | None = field(default=None, compare=False)
    load_inplace: bool = field(default=False, compare=False)
    scale: float = field(default=1.0, compare=False)

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

    @property
    def lora_id(self) -> int:
        return self.lora_int_id
