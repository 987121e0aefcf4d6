"""VLLM_ALLOW_LONG_MAX_MODEL_LEN: a max_model_len beyond the config's is refused with the hint, or
served with the variable set, rope tables extended so positions past the config's length run."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loraserve.entrypoints.llm import LLM
from loraserve.layers.rotary import RotaryEmbedding
from loraserve.sampling_params import SamplingParams

CONFIG_LEN = 256  # conftest TINY's max_position_embeddings


def test_longer_than_the_config_is_refused_with_the_variable_named(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("LORASERVE_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1") as err:
        LLM(tiny_model("llama"), dtype="float32", max_model_len=2 * CONFIG_LEN)
    assert f"User-specified max_model_len ({2 * CONFIG_LEN}) is greater than the derived" in str(err.value)


def test_the_variable_serves_positions_past_the_config(
    tiny_model: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    path = tiny_model("llama")
    llm = LLM(path, dtype="float32", max_model_len=2 * CONFIG_LEN, enable_prefix_caching=False)
    assert llm.engine.model_config.max_model_len == 2 * CONFIG_LEN
    prompt = [7 + (i * 5) % 200 for i in range(CONFIG_LEN + 40)]  # past the config's last position
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
    # The first positions' rope values are those of a model built for the config's length.
    long_rope = next(m for m in llm.engine.model.modules() if isinstance(m, RotaryEmbedding))
    assert long_rope.cos_table.shape[0] == 2 * CONFIG_LEN
    short = LLM(path, dtype="float32", enable_prefix_caching=False)
    short_rope = next(m for m in short.engine.model.modules() if isinstance(m, RotaryEmbedding))
    assert short_rope.cos_table.shape[0] == CONFIG_LEN
    assert long_rope.cos_table[:CONFIG_LEN].equal(short_rope.cos_table)
    (short_out,) = short.generate([prompt[:100]], params, use_tqdm=False)
    (long_out,) = llm.generate([prompt[:100]], params, use_tqdm=False)
    assert long_out.outputs[0].token_ids == short_out.outputs[0].token_ids
