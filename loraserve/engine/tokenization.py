"""Tokenizer loading and prompt normalisation (text, {"prompt"}, {"prompt_token_ids"}) with validation."""

from __future__ import annotations

from typing import Any

from loraserve.config import ModelConfig
from loraserve.errors import PromptTooLongError

PromptInput = str | list[int] | dict[str, Any]


def load_tokenizer(model_config: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model_config.tokenizer or model_config.model_path, trust_remote_code=model_config.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"Could not load a tokenizer from {model_config.tokenizer or model_config.model_path!r}: {exc}"
        ) from exc


def prepare_prompt(prompt: PromptInput, tokenizer: Any, model_config: ModelConfig) -> tuple[str | None, list[int]]:
    """Return (prompt text or None, token ids), raising ValueError for anything unusable."""
    text: str | None = None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            text = prompt["prompt"]
            ids = None
        else:
            raise ValueError("A prompt dict needs a 'prompt' or a 'prompt_token_ids' key.")
    elif isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise ValueError(f"Unsupported prompt type {type(prompt).__name__}; use a str or a list of token ids.")
    if ids is None:
        if not isinstance(text, str):
            raise ValueError("'prompt' must be a string.")
        if tokenizer is None:
            raise ValueError("This engine has no tokenizer; pass prompt_token_ids.")
        ids = tokenizer.encode(text)
    ids = _validate_ids(ids, model_config)
    return text, ids


def _validate_ids(ids: Any, model_config: ModelConfig) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of integers.")
    if not ids:
        raise ValueError("The prompt is empty; at least one token is needed.")
    vocab = model_config.vocab_size
    bad = [t for t in ids if t < 0 or t >= vocab]
    if bad:
        raise ValueError(f"Token id {bad[0]} is out of vocabulary (valid ids are 0..{vocab - 1}).")
    if len(ids) >= model_config.max_model_len:
        raise PromptTooLongError(
            f"The prompt has {len(ids)} tokens, but max_model_len is {model_config.max_model_len}; "
            f"the prompt plus at least one generated token must fit."
        )
    return ids
