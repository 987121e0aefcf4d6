"""Transformers backend: HF models with no native implementation run on loraserve's paged KV cache.

Each model is saved with save_pretrained, resolved and loaded through `create_model_config` +
`get_model`, then driven like the engine does (two sequences in one flat batch, a chunked prefill,
then decodes, scattered KV blocks). Every step's logits are compared with the HF model's own forward
over the whole sequence so far, with the CPU attention kernel and with the torch attention path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from loraserve.batch.attention_metadata import build_attention_metadata
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.model_loader.config import create_model_config
from loraserve.model_loader.loader import get_model
from loraserve.models.transformers_fallback import TransformersForCausalLM, kv_cache_spec_from_config

VOCAB = 300
BLOCK_SIZE = 4
TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=VOCAB,
    bos_token_id=0,
    eos_token_id=0,
)


def _configs() -> dict[str, Any]:
    return {
        "gpt_neox": transformers.GPTNeoXConfig(intermediate_size=64, rotary_pct=0.5, **TINY),
        "opt": transformers.OPTConfig(ffn_dim=64, word_embed_proj_dim=32, pad_token_id=1, **TINY),
        "phi_gqa": transformers.PhiConfig(intermediate_size=64, num_key_value_heads=2, **TINY),
        # Native architectures forced through the backend, to cover windowed attention on every layer
        # (Mistral) and on some layers only (Qwen2 layer_types: layer 0 full, layer 1 windowed).
        "mistral_window": transformers.MistralConfig(
            intermediate_size=64, num_key_value_heads=2, sliding_window=4, **TINY
        ),
        "qwen2_mixed_window": transformers.Qwen2Config(
            intermediate_size=64,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            **TINY,
        ),
        # Gemma-2 (native, forced through the backend): attention logit softcapping on every layer, a window on every other one, final logit
        # softcapping; large initial weights and small caps, so that both caps change the result.
        "gemma2_softcap": transformers.Gemma2Config(
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=8,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=8,
            initializer_range=0.5,
            **TINY,
        ),
    }


def _save(tmp_path: Path, name: str) -> tuple[str, Any]:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_configs()[name], dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    return str(tmp_path), hf


def _step(
    model: Any,
    kv_caches: list[Any],
    seqs: list[list[int]],
    done: list[int],
    tables: list[list[int]],
    sliding_window: int | None,
) -> torch.Tensor:
    """Run the new tokens seqs[i][done[i]:] of every sequence in one flat batch; logits of each last token."""
    query_lens = [len(seq) - start for seq, start in zip(seqs, done, strict=True)]
    input_ids = torch.tensor([t for seq, start in zip(seqs, done, strict=True) for t in seq[start:]])
    positions = torch.tensor(
        [p for seq, start in zip(seqs, done, strict=True) for p in range(start, len(seq))]
    )
    meta = build_attention_metadata(
        query_lens,
        [len(s) for s in seqs],
        tables,
        BLOCK_SIZE,
        torch.device("cpu"),
        sliding_window=sliding_window,
    )
    hidden = model(input_ids, positions, kv_caches, ForwardBatch(attn=meta))
    assert hidden.shape == (len(input_ids), 32)
    last_rows = torch.cumsum(torch.tensor(query_lens), 0) - 1
    return model.compute_logits(hidden[last_rows])


@pytest.mark.parametrize("attention_kernel", ["1", "0"], ids=["cpu_kernel", "torch_attention"])
@pytest.mark.parametrize("name", list(_configs()))
def test_prefill_and_decode_match_hf_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, attention_kernel: str
) -> None:
    monkeypatch.setenv("LORASERVE_CPU_ATTENTION_KERNEL", attention_kernel)
    path, hf = _save(tmp_path, name)
    model_impl = "transformers" if "window" in name or "gemma" in name else "auto"  # Gemma-2 is native too
    model_config = create_model_config(path, dtype="float32", device="cpu", model_impl=model_impl)
    model = get_model(model_config, "cpu")
    assert isinstance(model, TransformersForCausalLM) and not model.is_native
    assert model.packed_modules_mapping == {}
    spec = model.kv_cache_spec()
    num_slots = 12 * BLOCK_SIZE
    kv_caches = [
        KVCache(
            torch.zeros(num_slots, spec.num_kv_heads, spec.head_dim),
            torch.zeros(num_slots, spec.num_kv_heads, spec.head_dim),
        )
        for _ in range(spec.num_layers)
    ]
    generator = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(2, VOCAB, (9,), generator=generator).tolist(),
        torch.randint(2, VOCAB, (6,), generator=generator).tolist(),
    ]
    tables = [[7, 2, 10, 4], [1, 9, 3, 0]]  # scattered blocks, enough for 16 tokens each
    # Sequence 0's prompt arrives in two chunks (chunked prefill) while sequence 1 prefills, then decodes.
    seqs, done = [prompts[0][:5], list(prompts[1])], [0, 0]
    with torch.inference_mode():
        for step in range(5):
            logits = _step(model, kv_caches, seqs, done, tables, spec.sliding_window)
            assert logits.dtype == torch.float32 and logits.shape == (2, VOCAB)
            for i, seq in enumerate(seqs):
                expected = hf(input_ids=torch.tensor([seq])).logits[0, -1]
                torch.testing.assert_close(logits[i], expected, rtol=1e-4, atol=1e-4)
                done[i] = len(seq)
                if i == 0 and step == 0:
                    seq.extend(prompts[0][5:])
                else:
                    seq.append(int(expected.argmax()))


def test_kv_cache_spec_comes_from_the_config() -> None:
    configs = _configs()
    assert kv_cache_spec_from_config(configs["mistral_window"]).sliding_window == 4
    assert kv_cache_spec_from_config(configs["qwen2_mixed_window"]).sliding_window == 4
    assert kv_cache_spec_from_config(configs["opt"]).sliding_window is None
    assert kv_cache_spec_from_config(configs["gemma2_softcap"]).sliding_window == 4
    phi = kv_cache_spec_from_config(configs["phi_gqa"])
    assert (phi.num_layers, phi.num_kv_heads, phi.head_dim) == (2, 2, 8)
    linear = transformers.PretrainedConfig(layer_types=["full_attention", "linear_attention"], **TINY)
    with pytest.raises(ValueError, match="linear_attention"):
        kv_cache_spec_from_config(linear)


def test_model_without_attention_backend_support_is_refused() -> None:
    config = transformers.BloomConfig(
        hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB, architectures=["BloomForCausalLM"]
    )
    with pytest.raises(ValueError, match="_supports_attention_backend=False"):
        TransformersForCausalLM(config, torch.float32)


def test_lora_mapping_without_wrapped_layers_runs_the_base_model_and_config_is_not_mutated() -> None:
    from loraserve.batch.lora_mapping import LoRABatchMapping

    config = _configs()["opt"]
    config.architectures = ["OPTForCausalLM"]
    model = TransformersForCausalLM(config, torch.float32).eval()  # no dropout
    assert getattr(config, "_attn_implementation", None) != "loraserve_paged"
    spec = model.kv_cache_spec()
    shape = (8, spec.num_kv_heads, spec.head_dim)
    kv_caches = [KVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    meta = build_attention_metadata([2], [2], [[0]], BLOCK_SIZE, torch.device("cpu"))
    ids, positions = torch.tensor([3, 4]), torch.tensor([0, 1])
    with torch.inference_mode():
        base = model(ids, positions, kv_caches, ForwardBatch(attn=meta))
        # Layers LoRA never wrapped ignore the mapping; the binding is cleared after the step.
        mapping = LoRABatchMapping.build([0, 0], "cpu")
        mapped = model(ids, positions, kv_caches, ForwardBatch(attn=meta, lora=mapping))
    torch.testing.assert_close(mapped, base, rtol=0, atol=0)
    assert model.step_binding.batch is None
    # Module names are the HF model's own (PEFT's), not nested under the wrapper.
    assert "model.decoder.layers.0.self_attn.q_proj" in dict(model.named_modules())
