"""Engine options that vLLM users pass: skip_tokenizer_init, max_logprobs, generation_config (and its
override), tokenizer_mode, load_format and download_dir, through `LLM` / `EngineArgs`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
from support.tiny_gemma2 import save_tiny_gemma2

from loraserve import LLM, SamplingParams
from loraserve.engine.arg_utils import EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma2_without_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """A tiny random Gemma-2 (softcapped attention, alternating window) saved without any tokenizer file."""
    path = str(tmp_path_factory.mktemp("gemma2"))
    hf = save_tiny_gemma2(path, 0)
    return path, hf


def test_skip_tokenizer_init_serves_token_ids(gemma2_without_tokenizer: tuple[str, Any]) -> None:
    path, hf = gemma2_without_tokenizer
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    prompt = [5, 17, 42, 99, 7, 8, 9, 10]  # longer than the window: both kinds of layer matter
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0]
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)[
        0, len(prompt) :
    ].tolist()
    assert list(out.token_ids) == expected and out.text == ""
    with pytest.raises(ValueError, match="skip_tokenizer_init.*token ids"):
        llm.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([prompt], SamplingParams(stop=["x"]), use_tqdm=False)


def test_max_logprobs(tiny_model: Any) -> None:
    llm = LLM(tiny_model("llama"), dtype="float32", max_logprobs=30)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=25), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and all(len(position) >= 25 for position in out.logprobs)
    with pytest.raises(
        ValueError, match="Requested sample logprobs of 31, which is greater than max allowed: 30"
    ):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=31), use_tqdm=False)
    default = LLM(tiny_model("llama"), dtype="float32")
    with pytest.raises(
        ValueError, match="Requested prompt logprobs of 21, which is greater than max allowed: 20"
    ):
        default.generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=21), use_tqdm=False)


def test_generation_config_gives_the_defaults(tiny_model: Any, tmp_path: Path) -> None:
    path = shutil.copytree(tiny_model("llama"), tmp_path / "model")
    (path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "do_sample": True, "bos_token_id": 1}
        )
    )
    auto = LLM(str(path), dtype="float32")
    assert auto.engine.model_config.sampling_defaults == {"temperature": 0.0, "top_k": 5, "max_tokens": 3}
    first, second = (auto.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert len(first.token_ids) == 3 and first.token_ids == second.token_ids  # greedy, as configured
    none = EngineArgs(model=str(path), dtype="float32", generation_config="vllm").create_engine_config()
    assert none.model.sampling_defaults == {}
    overridden = EngineArgs(
        model=str(path),
        dtype="float32",
        override_generation_config={"temperature": 0.5, "repetition_penalty": 1.1},
    ).create_engine_config()
    assert overridden.model.sampling_defaults == {
        "temperature": 0.5,
        "top_k": 5,
        "max_tokens": 3,
        "repetition_penalty": 1.1,
    }
    with pytest.raises(ValueError, match="'beams' is not a sampling default"):
        EngineArgs(model=str(path), override_generation_config={"beams": 2}).create_engine_config()
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        EngineArgs(model=str(path), generation_config=str(tmp_path)).create_engine_config()


def test_tokenizer_and_load_formats(tiny_model: Any, tmp_path: Path) -> None:
    path = tiny_model("llama")
    slow = EngineArgs(model=path, tokenizer_mode="slow").create_engine_config()
    assert slow.model.tokenizer_mode == "slow"
    with pytest.raises(ValueError, match="tokenizer_mode 'mistral' is not supported"):
        EngineArgs(model=path, tokenizer_mode="mistral").create_engine_config()
    with pytest.raises(ValueError, match="load_format 'tensorizer' is not supported"):
        EngineArgs(model=path, load_format="tensorizer").create_engine_config()
    with pytest.raises(ValueError, match="load_format 'gguf' needs a .gguf model"):
        EngineArgs(model=path, load_format="gguf").create_engine_config()
    with pytest.raises(ValueError, match=r"No weights found .*load_format='pt'"):
        LLM(path, load_format="pt")
    no_weights = shutil.copytree(
        path, tmp_path / "no-weights", ignore=shutil.ignore_patterns("*.safetensors")
    )
    dummy = LLM(str(no_weights), dtype="float32", load_format="dummy")
    assert len(dummy.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 5


def test_download_dir_holds_the_hub_cache(tiny_model: Any, tmp_path: Path) -> None:
    """A repo id is looked up in --download-dir's cache (HF_HUB_OFFLINE: the suite never downloads)."""
    commit = "0" * 40
    repo = tmp_path / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny_model("llama"), repo / "snapshots" / commit)
    config = EngineArgs(model="org/tiny", dtype="float32", download_dir=str(tmp_path)).create_engine_config()
    assert config.model.model_path == str(repo / "snapshots" / commit)
    assert str(tmp_path) != huggingface_hub.constants.HF_HUB_CACHE
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        EngineArgs(model="org/tiny", dtype="float32").create_engine_config()


def test_options_are_declared_once_on_their_config() -> None:
    """EngineArgs takes LoRAConfig's (and the other configs') option fields as they are declared there:
    the same defaults, and the same checks with the same texts, run when EngineArgs is built."""
    from loraserve.config import CacheConfig, LoRAConfig, SchedulerConfig
    from loraserve.options import declared_options

    args = EngineArgs(model="m")
    for config in (CacheConfig(), SchedulerConfig(), LoRAConfig()):
        shared = [f.name for f, _ in declared_options(config)]
        assert shared and all(getattr(args, name) == getattr(config, name) for name in shared)
    text = r"max_cpu_loras \(2\) must be >= max_loras \(4\)\."
    with pytest.raises(ValueError, match=text):
        LoRAConfig(max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match=text):
        EngineArgs(model="m", max_loras=4, max_cpu_loras=2)  # before any model is read
    with pytest.raises(ValueError, match="max_lora_rank must be >= 1, got 0."):
        EngineArgs(model="m", max_lora_rank=0)
    with pytest.raises(
        ValueError, match=r"max_logprobs must be >= 0 \(or -1: the vocabulary size\), got -2\."
    ):
        EngineArgs(model="m", max_logprobs=-2)


def test_llm_takes_exactly_the_engine_fields(tiny_model: Any) -> None:
    llm = LLM(
        tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3, block_size=8
    )
    lora = llm.engine.config.lora
    assert lora is not None and (lora.max_loras, lora.cpu_capacity) == (2, 3)
    assert llm.engine.config.cache.block_size == 8
    with pytest.raises(TypeError, match="max_lora"):
        LLM(tiny_model("llama"), max_lora=2)  # a misspelt option is refused, not ignored
