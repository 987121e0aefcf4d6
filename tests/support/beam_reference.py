"""transformers' beam search as the oracle: `generate(num_beams=W, num_return_sequences=W)`."""

from __future__ import annotations

from typing import Any

import torch


def hf_beams(
    model: Any,
    prompt: list[int],
    width: int,
    num_new: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    eos_ids: list[int] | None = None,
) -> list[tuple[list[int], float]]:
    """(generated ids up to and including their eos, sequences_score) of each returned beam, best first."""
    eos = eos_ids if eos_ids is not None else [model.generation_config.eos_token_id]
    eos = [e for e in eos if e is not None]  # a model without eos: beams end at max_new_tokens
    out = model.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=num_new,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=eos or None,
    )
    beams = []
    for i in range(width):
        ids = out.sequences[i, len(prompt) :].tolist()
        ends = [ids.index(e) for e in eos if e in ids]
        beams.append((ids[: min(ends) + 1] if ends else ids, out.sequences_scores[i].item()))
    return beams
