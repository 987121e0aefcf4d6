"""The PEFT oracle under teacher forcing: what the reference model says of tokens we generated."""

from __future__ import annotations

from typing import Any

import torch


def assert_matches_peft(
    peft_model: Any, adapter: str | None, prompt: list[int], tokens: list[int], logprobs: list[float], tol: float
) -> None:
    """Each generated token is the oracle's argmax for its prefix (near-ties within `tol` allowed), and
    its logprob is the oracle's log-softmax within `tol`. `adapter` None means the base model."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                logits = peft_model(ids).logits[0]
        else:
            peft_model.set_adapter(adapter)
            logits = peft_model(ids).logits[0]
    reference = torch.log_softmax(logits.float(), -1)
    for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        row = reference[len(prompt) - 1 + i]
        assert row[token] >= row.max() - tol, f"{adapter}: token {i} is not the oracle's argmax"
        assert abs(row[token].item() - logprob) < tol, f"{adapter}: logprob {i} differs from the oracle's"
