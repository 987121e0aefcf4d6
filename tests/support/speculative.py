"""The speculative-decoding tests' helpers: prompts the n-gram lookup finds its way in, running an
engine with its bookkeeping checked, and the engine's spec_decode counters."""

from __future__ import annotations

from typing import Any

import torch

from loraserve import LLM


def repetitive(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Prompts that repeat a random phrase: the n-gram lookup finds it, the random model partly follows."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        unit = torch.randint(10, 500, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        prompts.append({"prompt_token_ids": unit * 3 + unit[:2]})
    return prompts


def counters(llm: LLM) -> dict[str, int]:
    """The engine's spec_decode counters summed over adapters."""
    total = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for counts in llm.engine.stats().get("spec_decode", {}).values():
        for key in total:
            total[key] += counts[key]
    return total


def run(llm: LLM, prompts: list[Any], params: Any, loras: Any = None) -> tuple[list[Any], dict[str, int]]:
    """Outputs and the counters this call added; the engine's bookkeeping is sound and every KV
    block is free (or a prefix-cache block) once the requests are done."""
    before = counters(llm)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    after = counters(llm)
    engine = llm.engine
    assert engine.check_consistency() is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return outs, {key: after[key] - before[key] for key in after}


def tokens(outs: list[Any]) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def both_ways(counts: dict[str, int]) -> None:
    """Proposals were verified, and some were accepted and some rejected."""
    assert counts["num_drafts"] > 0
    assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]
