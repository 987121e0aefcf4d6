"""GGUF models: served like HF folders, equal to transformers on the same file, cached by content.

Tiny GGUF files written with the `gguf` package stand in for real ones (tests/support/gguf_files.py;
gguf_from_hf.py writes HF models as GGUF); tests/models/test_real_model.py runs the real SmolLM2 file.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from support.gguf_files import byte_vocab_size, write_tiny_family_gguf, write_tiny_llama_gguf
from support.gguf_from_hf import write_moe_gguf_from_hf, write_phi3_gguf_from_hf
from support.parity import hf_greedy, random_prompts
from support.tiny_moe import moe_config
from support.tiny_phi3 import ORIGINAL, phi3_config

from loraserve import LLM, SamplingParams
from loraserve.model_loader.gguf import GGUFError, find_gguf_file, gguf_folder

PROMPT = "the cat in the hat"


@pytest.fixture()
def cache_root(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    root = str(tmp_path / "cache")
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", root)
    return root


def transformers_greedy(path: str, num_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(path), os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(folder, gguf_file=name)(PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False, min_new_tokens=num_tokens
        )
    return out[0, len(ids) :].tolist()


def our_greedy(llm: LLM, num_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_gguf_file_and_folder_serve_what_transformers_computes(tmp_path: Any, cache_root: str) -> None:
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"), raw_types={"blk.0.ffn_up.weight": "Q8_0"})
    want = transformers_greedy(path, 8)
    llm = LLM(path, dtype="float32")
    assert our_greedy(llm, 8) == want
    assert llm.get_tokenizer().chat_template is not None  # the template comes from the metadata
    assert llm.engine.config.model.served_model_name == path
    folder_llm = LLM(str(tmp_path), dtype="float32")  # a folder holding one .gguf
    assert our_greedy(folder_llm, 8) == want


@pytest.mark.parametrize(
    ("arch", "model_type", "native"),
    [
        ("phi3", "phi3", "Phi3ForCausalLM"),
        ("gemma2", "gemma2", "Gemma2ForCausalLM"),
        ("gemma3", "gemma3_text", "Gemma3ForCausalLM"),
    ],
)
def test_other_family_files_serve_natively_what_transformers_computes(
    tmp_path: Any, cache_root: str, arch: str, model_type: str, native: str
) -> None:
    """Phi-3 (fused qkv and gate/up in the file), Gemma-2 and Gemma-3 GGUF files: converted through the
    same cache into the family's HF folder, served by the native class, greedy tokens equal to
    transformers' on the same file (fed token by token: no EOS rule, as the request ignores EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_family_gguf(str(tmp_path / f"{arch}.gguf"), arch)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf", dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf")(PROMPT)["input_ids"]
    want = hf_greedy(model.eval(), ids, 8)
    assert len(set(want)) > 2  # the tiny model does not just repeat a token
    llm = LLM(path, dtype="float32")
    assert type(llm.engine.model).__name__ == native
    assert our_greedy(llm, 8) == want
    folder = gguf_folder(path, torch.float32)  # the cached conversion, found again
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_type"] == model_type


def test_phi3_file_with_longrope_serves_what_the_hf_model_computes(tmp_path: Any, cache_root: str) -> None:
    """A Phi-3.5-style file (LongRoPE factors as tensors, the original length in the metadata, which
    transformers' reader leaves out): converted with its LongRoPE, the greedy tokens equal the HF
    model's it was written from, on a prompt within the original length and one past it."""
    from transformers import AutoModelForCausalLM

    config = phi3_config("phi3.5", byte_vocab_size())
    config.sliding_window = None  # GGUF files carry no Phi-3 window
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    path = write_phi3_gguf_from_hf(str(tmp_path / "phi35.gguf"), hf)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    rotary = llm.engine.model.model.rotary
    assert rotary.long and rotary.original == ORIGINAL
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts((12, 30), byte_vocab_size(), seed=3)
    for prompt, out in zip(
        prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize(
    ("arch", "native"), [("qwen2_moe", "Qwen2MoeForCausalLM"), ("qwen3_moe", "Qwen3MoeForCausalLM")]
)
def test_moe_file_serves_natively_what_the_hf_model_computes(
    tmp_path: Any, cache_root: str, arch: str, native: str
) -> None:
    """A Qwen2-MoE (shared expert and its gate, a dense layer) / Qwen3-MoE (head_dim != hidden / heads,
    q/k norms) GGUF file with stacked `ffn_*_exps` experts: converted through the same cache, served by
    the native class, greedy tokens equal to the HF model's it was written from and to its folder's."""
    from transformers import AutoModelForCausalLM

    config = moe_config(arch, byte_vocab_size())
    config.mlp_only_layers = []  # llama.cpp's qwen2moe has no dense layers
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # decisive routers, as trained ones are (see tests/support/tiny_moe.py)
        for name, param in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(4.0)
    path = write_moe_gguf_from_hf(str(tmp_path / f"{arch}.gguf"), hf)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64)
    assert type(llm.engine.model).__name__ == native
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = random_prompts((5, 17), byte_vocab_size(), seed=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        want = hf_greedy(hf, prompt, 6)
        assert len(set(want)) > 1  # the tiny model does not just repeat a token
        assert list(out.outputs[0].token_ids) == want
    folder = gguf_folder(path, torch.float32)  # the cached conversion, as an HF folder transformers loads
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf_greedy(converted, prompts[1], 6) == hf_greedy(hf, prompts[1], 6)


def test_conversion_is_cached_by_content(tmp_path: Any, cache_root: str) -> None:
    first = write_tiny_llama_gguf(str(tmp_path / "a.gguf"), seed=0)
    folder = gguf_folder(first, torch.float32)
    marker = os.path.join(folder, "COMPLETE.json")
    written = os.stat(marker).st_mtime_ns
    copy = str(tmp_path / "copy.gguf")
    shutil.copy(first, copy)
    assert gguf_folder(copy, torch.float32) == folder  # same bytes elsewhere: no new conversion
    assert os.stat(marker).st_mtime_ns == written
    assert gguf_folder(first, torch.bfloat16) != folder  # another serving dtype is another entry
    before = our_greedy(LLM(first, dtype="float32"), 6)
    write_tiny_llama_gguf(first, seed=1)  # the same path, new weights
    assert gguf_folder(first, torch.float32) != folder
    assert our_greedy(LLM(first, dtype="float32"), 6) == transformers_greedy(first, 6) != before


def test_tokenizer_and_hf_config_path_flags_override_the_metadata(
    tmp_path: Any, cache_root: str, tokenizer_dir: str
) -> None:
    from transformers import AutoTokenizer

    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.tokenization import load_tokenizer
    from loraserve.entrypoints.cli import make_parser
    from loraserve.entrypoints.openai.cli.cli_args import check_serve_args

    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    with open(os.path.join(gguf_folder(path, torch.float32), "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["max_position_embeddings"] = 64
    (config_dir / "config.json").write_text(json.dumps(config))
    parser, serve_parser = make_parser()
    flags = [
        "serve",
        path,
        "--dtype",
        "float32",
        "--tokenizer",
        tokenizer_dir,
        "--hf-config-path",
        str(config_dir),
    ]
    args = check_serve_args(serve_parser, parser.parse_args(flags))
    model_config = EngineArgs.from_cli_args(args).create_engine_config().model
    assert model_config.max_model_len == 64
    tokenizer = load_tokenizer(model_config)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab()


def test_hf_config_path_is_refused_for_hf_folders(tiny_model: Any) -> None:
    with pytest.raises(ValueError, match="applies to GGUF models"):
        LLM(tiny_model("llama"), hf_config_path=tiny_model("llama"))


def test_unloadable_files_are_refused_by_name(tmp_path: Any, cache_root: str) -> None:
    arch = write_tiny_llama_gguf(str(tmp_path / "arch.gguf"), arch="mamba3000")
    with pytest.raises(GGUFError, match="architecture 'mamba3000'"):
        LLM(arch)
    # MoE families transformers' reader does not convert: OLMoE, and Mixtral (llama with experts).
    olmoe = write_tiny_llama_gguf(str(tmp_path / "olmoe.gguf"), arch="olmoe")
    with pytest.raises(GGUFError, match="olmoe.gguf has architecture 'olmoe', which cannot be converted"):
        LLM(olmoe)
    mixtral = write_tiny_llama_gguf(str(tmp_path / "mixtral.gguf"), expert_count=8)
    with pytest.raises(GGUFError, match="mixtral.gguf has architecture 'llama' with experts"):
        LLM(mixtral)
    quant = write_tiny_llama_gguf(str(tmp_path / "quant.gguf"), raw_types={"blk.1.ffn_down.weight": "Q8_K"})
    with pytest.raises(GGUFError, match="'blk.1.ffn_down.weight' uses quantization type Q8_K"):
        LLM(quant)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="junk.gguf is not a readable GGUF file"):
        LLM(str(junk))
    assert not os.path.isdir(os.path.join(cache_root, "gguf")) or not [
        name for name in os.listdir(os.path.join(cache_root, "gguf")) if not name.startswith(".")
    ]


def test_a_folder_with_two_gguf_files_must_name_one(tmp_path: Any) -> None:
    write_tiny_llama_gguf(str(tmp_path / "a.gguf"))
    write_tiny_llama_gguf(str(tmp_path / "b.gguf"))
    with pytest.raises(GGUFError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        find_gguf_file(str(tmp_path))
    assert find_gguf_file(str(tmp_path / "b.gguf")) == str(tmp_path / "b.gguf")


def test_a_missing_hf_config_path_is_named(tmp_path: Any, cache_root: str) -> None:
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    with pytest.raises(GGUFError, match="is neither a config.json file nor a folder holding one"):
        LLM(path, hf_config_path=str(tmp_path / "nowhere"))
