"""loraserve: one base LLM, hundreds of LoRA adapters, shared batches, OpenAI-compatible serving."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "LoRARequest",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy so that `import loraserve` (e.g. by the CLI's --help) does not import torch and transformers.
    if name == "LLM":
        from loraserve.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from loraserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from loraserve.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "LoRARequest":
        from loraserve.lora.request import LoRARequest

        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from loraserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'loraserve' has no attribute {name!r}")
