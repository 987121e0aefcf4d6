"""Adapter loading: PEFT checkpoints on native Llama / GPT-2 against PEFT's own forward pass, and refusals."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch

from loraserve.batch.attention_metadata import build_attention_metadata
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.config import LoRAConfig
from loraserve.errors import LoRAAdapterError
from loraserve.lora.adapter_read import ReadLimits, read_adapter
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.manager import LoRAManager
from loraserve.lora.request import LoRARequest
from loraserve.lora.targets import LoRATargets
from loraserve.lora.weights import LoRALayerWeights, PackedLoRALayerWeights

ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _hf_gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2
    )
    return GPT2LMHeadModel(cfg).eval()


def _save_adapter(base: Any, folder: Path, seed: int, **lora_kwargs: Any) -> Any:
    """A PEFT adapter with random (non-zero) A and B saved to `folder`; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora_kwargs)).eval()
    g = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_" in name:
            param.data.copy_(torch.randn(param.shape, generator=g) * 0.3)
    peft_model.save_pretrained(folder)
    return peft_model


def _native(hf_model: Any) -> Any:
    from loraserve.models.gpt2 import GPT2LMHeadModel
    from loraserve.models.llama import LlamaForCausalLM

    cls = GPT2LMHeadModel if hf_model.config.model_type == "gpt2" else LlamaForCausalLM
    model = cls(hf_model.config, torch.float32)
    model.load_weights(hf_model.state_dict().items())
    return model.eval()


def _run_native(
    model: Any, seqs: list[list[int]], seq_slots: list[int], max_loras: int
) -> list[torch.Tensor]:
    """Prefill `seqs` in one batch, sequence i on LoRA slot seq_slots[i]; logits per sequence."""
    spec, block_size = model.kv_cache_spec(), 16
    tables, next_block = [], 0
    for seq in seqs:
        n = math.ceil(len(seq) / block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    shape = (next_block * block_size, spec.num_kv_heads, spec.head_dim)
    caches = [KVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    lens = [len(s) for s in seqs]
    attn = build_attention_metadata(lens, lens, tables, block_size, torch.device("cpu"), spec.sliding_window)
    slots = [slot for slot, n in zip(seq_slots, lens, strict=True) for _ in range(n)]
    batch = ForwardBatch(attn=attn, lora=LoRABatchMapping.build(slots, "cpu", max_loras=max_loras))
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.tensor([p for n in lens for p in range(n)])
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, caches, batch))
    return list(logits.split(lens))


def _reference(model: Any, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0].float()


def test_llama_adapters_match_peft(tmp_path: Path) -> None:
    """Three PEFT adapters (q+v only; all modules with rank/alpha patterns; rsLoRA up_proj on one layer)
    served two slots at a time next to base-model tokens, against PEFT's forward pass."""
    hf = _hf_llama()
    peft_models = {
        1: _save_adapter(hf, tmp_path / "qv", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        2: _save_adapter(
            hf,
            tmp_path / "all",
            2,
            r=8,
            lora_alpha=16,
            target_modules=ALL_LLAMA,
            rank_pattern={"layers.1.mlp.down_proj": 2},
            alpha_pattern={"o_proj": 3},
        ),  # fmt: skip
        3: _save_adapter(
            hf,
            tmp_path / "up",
            3,
            r=4,
            lora_alpha=6,
            use_rslora=True,
            target_modules=["up_proj"],
            layers_to_transform=[1],
        ),  # fmt: skip
    }
    native = _native(hf)
    manager = LoRAManager(
        native, LoRAConfig(max_loras=2, max_cpu_loras=3, max_lora_rank=8), torch.float32, "cpu"
    )
    paths = {1: "qv", 2: "all", 3: "up"}
    for i, folder in paths.items():
        manager.load(LoRARequest(folder, i, str(tmp_path / folder)))
    # Loads upload into free slots at once (off the engine's step); with none free, they wait for a step.
    assert manager.slot_of(1) is not None and manager.slot_of(2) is not None and manager.slot_of(3) is None
    assert manager.stats()["lora_num_slot_evictions"] == 0
    qv = manager.get_adapter(1)
    assert qv is not None
    packed = qv.loras["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(packed, PackedLoRALayerWeights) and packed.slices[1] is None  # no k_proj LoRA
    assert "model.layers.0.mlp.gate_up_proj" not in qv.loras
    up = manager.get_adapter(3)
    assert up is not None and list(up.loras) == ["model.layers.1.mlp.gate_up_proj"]
    up_slices = up.loras["model.layers.1.mlp.gate_up_proj"]
    assert isinstance(up_slices, PackedLoRALayerWeights) and up_slices.slices[0] is None
    seqs = [[5, 9, 3, 7, 11, 2], [4, 4, 8, 1], [6, 2, 9, 17, 3, 3, 8]]
    for step_ids in ([1, None, 2], [3, 1, None], [2, 3, 3]):
        active = {i for i in step_ids if i is not None}
        slots = manager.activate(active)
        outputs = _run_native(native, seqs, [slots[i] if i else -1 for i in step_ids], max_loras=2)
        for seq, lora_id, got in zip(seqs, step_ids, outputs, strict=True):
            expected = _reference(peft_models[lora_id] if lora_id else hf, seq)
            torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_gpt2_fan_in_fan_out_and_biases(tmp_path: Path) -> None:
    """GPT-2 Conv1D adapters (fan_in_fan_out=True), one with lora_B bias, one retraining base biases."""
    hf = _hf_gpt2()
    targets = ["c_attn", "c_proj", "c_fc"]
    with_lora_bias = _save_adapter(hf, tmp_path / "lb", 4, r=4, target_modules=targets, fan_in_fan_out=True,
                                   lora_bias=True)  # fmt: skip
    from peft import LoraConfig, get_peft_model

    retrained = get_peft_model(copy.deepcopy(hf), LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True,
                                                             bias="lora_only")).eval()  # fmt: skip
    g = torch.Generator().manual_seed(5)
    for name, param in retrained.named_parameters():
        if "lora_" in name or name.endswith("c_attn.base_layer.bias"):
            param.data.add_(torch.randn(param.shape, generator=g) * 0.3)  # as if training moved them
    retrained.save_pretrained(tmp_path / "bias")
    native = _native(hf)
    config = LoRAConfig(max_loras=2, max_lora_rank=4, enable_lora_bias=True)
    manager = LoRAManager(native, config, torch.float32, "cpu")
    manager.load(LoRARequest("lb", 1, str(tmp_path / "lb")))
    manager.load(LoRARequest("bias", 2, str(tmp_path / "bias")))
    slots = manager.activate({1, 2})
    seqs = [[3, 8, 1, 9], [7, 7, 2], [10, 4, 4, 6, 1]]
    outputs = _run_native(native, seqs, [slots[1], -1, slots[2]], max_loras=2)
    for seq, oracle, got in zip(seqs, [with_lora_bias, hf, retrained], outputs, strict=True):
        torch.testing.assert_close(got, _reference(oracle, seq), atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def llama_and_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    hf = _hf_llama()
    folder = tmp_path_factory.mktemp("adapter") / "qv"
    _save_adapter(hf, folder, 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return hf, _native(hf), folder


def _load(folder: Path, model: Any, name: str = "a", enable_bias: bool = False) -> LoRAModel:
    limits = ReadLimits(max_lora_rank=16, enable_lora_bias=enable_bias, dtype=torch.float32)
    return read_adapter(folder, LoRARequest(name, 1, str(folder)), LoRATargets.from_model(model), limits)


def _copy_adapter(
    src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None, **config: Any
) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        tensors = safetensors.torch.load_file(str(src / "adapter_model.safetensors"))
    safetensors.torch.save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_weights_and_identity(llama_and_adapter: tuple[Any, Any, Path], tmp_path: Path) -> None:
    _, native, folder = llama_and_adapter
    model = _load(folder, native)
    tensors = safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))
    q = model.loras["model.layers.1.self_attn.qkv_proj"]
    assert isinstance(q, PackedLoRALayerWeights) and isinstance(q.slices[0], LoRALayerWeights)
    a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    # alpha / r = 2 stays beside B until a slot folds it in (LinearWithLoRA.set_lora).
    assert q.slices[0].scaling == 2.0
    torch.testing.assert_close(q.slices[0].lora_b @ q.slices[0].lora_a, b @ a)
    assert model.rank == 4 and model.identity.name == "a"
    assert _load(folder, native).identity == model.identity
    changed = {k: (v + 1 if k.endswith("lora_B.weight") else v) for k, v in tensors.items()}
    assert (
        _load(_copy_adapter(folder, tmp_path / "new", changed), native).identity.digest
        != model.identity.digest
    )
    # adapter_model.bin is read when there is no safetensors file.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    torch.save(tensors, bin_dir / "adapter_model.bin")
    assert _load(bin_dir, native).identity.digest == model.identity.digest
    # With both, the safetensors file wins: the .bin beside it (other weights, even a pickle) is unread.
    both = _copy_adapter(folder, tmp_path / "both", tensors)
    torch.save({"x": _Exploit()}, both / "adapter_model.bin")
    assert _load(both, native).identity.digest == model.identity.digest
    assert not Path("/tmp/loraserve_pwned").exists()


class _Exploit:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch /tmp/loraserve_pwned",))


def test_pickle_that_runs_code_is_refused(llama_and_adapter: tuple[Any, Any, Path], tmp_path: Path) -> None:
    _, native, folder = llama_and_adapter
    bad = tmp_path / "evil"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    torch.save({"x": _Exploit()}, bad / "adapter_model.bin")
    with pytest.raises(
        LoRAAdapterError, match="'a': adapter_model.bin holds objects that safe loading refuses"
    ) as info:
        _load(bad, native)
    assert not Path("/tmp/loraserve_pwned").exists() and "0x" not in str(info.value)
    assert "weights_only" not in str(info.value)  # torch's advice to load it unsafely never reaches a client


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no_weights", "no weights file"),
        # The vocab modules take adapters (tests/lora/test_vocab_lora.py), checked like the others.
        ("lm_head", r"lm_head lora_B has shape \(100, 4\), expected \(128, 4\)"),
        # vLLM's closing sentence for an adapter made for another model, which its tests match.
        (
            "unknown_module",
            r"cannot apply LoRA to: \['c_attn'\].*Please verify that the loaded LoRA module is correct",
        ),
        ("embedding", r"model\.embed_tokens has no lora_B weight"),
        ("modules_to_save_weights", "it saves lm_head, which modules_to_save does not name"),
        (
            "other_model",
            r"does not match this model .* lora_A has shape \(4, 64\), expected \(4, 32\)\. "
            "Please verify that the loaded LoRA module is correct",
        ),
        ("rank_mismatch", r"lora_A has shape \(4, 32\), expected \(8, 32\)"),
        ("missing_b", "has no lora_B weight"),
        ("nan", "non-finite"),
        ("inf_in_bin", "non-finite"),  # a .bin file: checked tensor by tensor, not in one pass
        ("overflow_once_scaled", r"lora_B has non-finite .* overflow the LoRA dtype once scaled by 1e\+41"),
        # Issue 22's repros: each tensor fits once scaled, the LoRA term they form does not.
        ("alpha_1e38", r"model\.layers\.0\.self_attn\.q_proj has weights whose LoRA term \(scale 2\.5e\+37"),
        ("weight_3e38", r"model\.layers\.0\.self_attn\.q_proj has weights whose LoRA term \(scale 2 x"),
        ("bias_without_flag", "Adapter bias cannot be used without bias_enabled"),
        ("empty", "has no LoRA weights"),
    ],
)
def test_bad_adapters(
    llama_and_adapter: tuple[Any, Any, Path], tmp_path: Path, case: str, message: str
) -> None:
    _, native, folder = llama_and_adapter
    tensors = _tensors(folder)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    config: dict[str, Any] = {}
    if case == "lm_head":
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(4, 32)
        tensors["base_model.model.lm_head.lora_B.weight"] = torch.randn(100, 4)
    elif case == "unknown_module":
        tensors["base_model.model.model.layers.0.attn.c_attn.lora_A.weight"] = torch.randn(4, 32)
    elif case == "embedding":
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(4, 128)
    elif case == "modules_to_save_weights":
        tensors["base_model.model.lm_head.weight"] = torch.randn(128, 32)
    elif case == "other_model":
        tensors[q_a] = torch.randn(4, 64)
    elif case == "rank_mismatch":
        config["r"] = 8
    elif case == "missing_b":
        del tensors[q_a.replace("lora_A", "lora_B")]
    elif case == "nan":
        tensors[q_a] = tensors[q_a].clone()
        tensors[q_a][0, 0] = float("nan")
    elif case == "inf_in_bin":
        tensors[q_a] = tensors[q_a].clone()
        tensors[q_a][0, 1] = float("inf")
    elif case == "overflow_once_scaled":
        config["lora_alpha"] = 4e41  # scaling alpha / r = 1e41: finite B values overflow float32 in a slot
    elif case == "alpha_1e38":
        config["lora_alpha"] = 1e38  # r = 4: scaling 2.5e37, B's values times it still fit float32
    elif case == "weight_3e38":
        tensors[q_a] = tensors[q_a].clone()
        tensors[q_a][0, 0] = 3e38  # finite in float32 and bfloat16
    elif case == "bias_without_flag":
        tensors[q_a.replace("lora_A.weight", "lora_B.bias")] = torch.randn(32)
    elif case == "empty":
        tensors = {}
    target = _copy_adapter(folder, tmp_path / case, tensors, **config)
    if case in ("no_weights", "inf_in_bin"):
        (target / "adapter_model.safetensors").unlink()
    if case == "inf_in_bin":
        torch.save(tensors, target / "adapter_model.bin")
    with pytest.raises(LoRAAdapterError, match=message) as info:
        _load(target, native, name="bad")
    assert "'bad'" in str(info.value)


@pytest.mark.parametrize("case", ["alpha_1e38", "weight_3e38", "fine"])
def test_overflowing_lora_terms_are_refused_in_bfloat16(
    llama_and_adapter: tuple[Any, Any, Path], tmp_path: Path, case: str
) -> None:
    """The serving dtype here ("auto" is bf16): the same two repros are refused, the adapter itself loads."""
    _, native, folder = llama_and_adapter
    tensors = _tensors(folder)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    config: dict[str, Any] = {"lora_alpha": 1e38} if case == "alpha_1e38" else {}
    if case == "weight_3e38":
        tensors[q_a] = tensors[q_a].clone()
        tensors[q_a][1, 3] = -3e38
    target = _copy_adapter(folder, tmp_path / case, tensors, **config)
    limits = ReadLimits(max_lora_rank=16, enable_lora_bias=False, dtype=torch.bfloat16)

    def load() -> LoRAModel:
        request = LoRARequest("big", 1, str(target))
        return read_adapter(target, request, LoRATargets.from_model(native), limits)

    if case == "fine":
        assert load().loras
        return
    with pytest.raises(
        LoRAAdapterError, match=r"'big': model\.layers\.0\.self_attn\.q_proj has weights whose LoRA term"
    ):
        load()


def test_adapter_name_in_keys(llama_and_adapter: tuple[Any, Any, Path], tmp_path: Path) -> None:
    """State dicts saved with the adapter name (`lora_A.default.weight`) load the same."""
    _, native, folder = llama_and_adapter
    tensors = {k.replace(".weight", ".default.weight"): v for k, v in _tensors(folder).items()}
    named = _load(_copy_adapter(folder, tmp_path / "named", tensors), native)
    plain = _load(folder, native)
    for key, weights in plain.loras.items():
        other = named.loras[key]
        assert isinstance(weights, PackedLoRALayerWeights) and isinstance(other, PackedLoRALayerWeights)
        for s1, s2 in zip(weights.slices, other.slices, strict=True):
            assert (s1 is None and s2 is None) or (
                s1 is not None and s2 is not None and torch.equal(s1.lora_b, s2.lora_b)
            )
    mixed = {**tensors, **{k.replace(".default.", ".other."): v.clone() for k, v in tensors.items()}}
    with pytest.raises(LoRAAdapterError, match="several adapters"):
        _load(_copy_adapter(folder, tmp_path / "mixed", mixed), native)
