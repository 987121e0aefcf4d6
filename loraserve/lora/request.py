"""`LoRARequest`: which adapter a request uses, as the serving layer resolved it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoRARequest:
    """An adapter reference carried by a request.

    The id (> 0) is the engine-wide identity used by the adapter caches; two requests are the same
    adapter when id and name agree (the path may be spelled differently). The constructor and the
    `lora_int_id` field keep vLLM's spelling, which user code passes and reads; loraserve's own code
    reads the id as `lora_id`. `lora_path` may start with `~` or be a Hugging Face repo id.
    `load_inplace` (vLLM's flag): registering it again re-reads its weights (`LLMEngine.add_lora`).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = field(compare=False)
    base_model_name: str | None = field(default=None, compare=False)
    load_inplace: bool = field(default=False, compare=False)

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

    @property
    def lora_id(self) -> int:
        return self.lora_int_id
