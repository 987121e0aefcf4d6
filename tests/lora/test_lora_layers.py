"""LinearWithLoRA against the dense computation W + scaling * B @ A, several slots in one batch."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from support.lora_reference import assert_within_bf16_ulps
from torch import nn

from loraserve.batch.attention_metadata import build_attention_metadata
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.lora_layout import LoRALayout
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.config import LoRAConfig
from loraserve.layers.linear import Linear
from loraserve.lora.layers import LinearWithLoRA, wrap_model_for_lora
from loraserve.lora.ops import lora_cpu, lora_torch
from loraserve.lora.targets import LoRATargets, lora_target_modules
from loraserve.lora.weights import LoRALayerWeights, PackedLoRALayerWeights

IN, MAX_LORAS, MAX_RANK = 24, 4, 8


def _linear(output_sizes: list[int], bias: bool = True, seed: int = 0, dtype: torch.dtype = torch.float32) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(IN, output_sizes, bias=bias, dtype=dtype)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=g))
    return layer


def _lora(
    name: str, out: int, rank: int, seed: int, bias: bool = False, dtype: torch.dtype = torch.float32
) -> LoRALayerWeights:
    g = torch.Generator().manual_seed(seed)
    return LoRALayerWeights(
        name,
        rank,
        torch.randn(rank, IN, generator=g).to(dtype),
        torch.randn(out, rank, generator=g).to(dtype),
        scaling=0.5 + seed,
        bias=torch.randn(out, generator=g) if bias else None,
    )


def _dense_delta(lora: LoRALayerWeights | PackedLoRALayerWeights, sizes: list[int]) -> torch.Tensor:
    """[out, in] float64 delta weight the adapter adds to the layer (zero for slices it leaves alone)."""
    if isinstance(lora, LoRALayerWeights):
        return lora.scaling * lora.lora_b.double() @ lora.lora_a.double()
    parts = [
        torch.zeros(size, IN, dtype=torch.float64) if s is None else s.scaling * s.lora_b.double() @ s.lora_a.double()
        for s, size in zip(lora.slices, sizes, strict=True)
    ]
    return torch.cat(parts)


def _batch(slots: list[int], layout: LoRALayout | None = None) -> ForwardBatch:
    """One step of len(slots) single-token sequences (attention is not used by a lone layer)."""
    n = len(slots)
    attn = build_attention_metadata([1] * n, [1] * n, [[i] for i in range(n)], 1, torch.device("cpu"), None)
    return ForwardBatch(attn, LoRABatchMapping.build(slots, "cpu", max_loras=MAX_LORAS, layout=layout))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["kernel", "runs", "grouped", "padded"])
def test_packed_layer_matches_dense(layout: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compute path: the fused CPU kernel, and each layout of the torch ops (kernel off), in
    float32 and in bfloat16 (the layer, its slot buffers and the adapters' weights)."""
    if layout == "kernel" and not lora_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    calls = {"kernel": 0, "torch": 0}
    run, add = lora_cpu.run, lora_torch.add_lora

    def count(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(*args: object) -> torch.Tensor:
            calls[name] += 1
            return fn(*args)
        return wrapper

    monkeypatch.setattr(lora_cpu, "run", count("kernel", run))
    monkeypatch.setattr(lora_torch, "add_lora", count("torch", add))
    if layout != "kernel":
        monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", "0")
    sizes = [16, 8, 8]  # q, k, v
    base = _linear(sizes, dtype=dtype)
    layer = LinearWithLoRA(base, MAX_LORAS, MAX_RANK)
    adapters = {  # q and v only; all three; the packed module as a whole
        0: PackedLoRALayerWeights("qkv", [_lora("q", 16, 4, 1, dtype=dtype), None, _lora("v", 8, 2, 2, dtype=dtype)]),
        2: PackedLoRALayerWeights("qkv", [_lora(n, size, r, seed, dtype=dtype)
                                          for n, size, r, seed in [("q", 16, 8, 3), ("k", 8, 3, 4), ("v", 8, 5, 5)]]),
        3: _lora("qkv", 32, 6, 6, dtype=dtype),
    }
    for slot, weights in adapters.items():
        layer.set_lora(slot, weights)
    slots = [2, -1, 0, 3, 0, 2, 2, -1, 3]
    x = torch.randn(len(slots), IN).to(dtype)
    forced = None if layout == "kernel" else LoRALayout(layout)
    y = layer(x, _batch(slots, forced))
    assert calls == ({"kernel": 1, "torch": 0} if layout == "kernel" else {"kernel": 0, "torch": 1})
    for i, slot in enumerate(slots):
        delta = _dense_delta(adapters[slot], sizes) if slot >= 0 else torch.zeros(32, IN, dtype=torch.float64)
        expected = (base.weight.double() + delta) @ x[i].double() + base.bias.double()
        if dtype == torch.float32:
            torch.testing.assert_close(y[i].double(), expected, atol=1e-4, rtol=1e-4)
        else:  # the base output, the scaled B and the sum each rounded once (0.75 ulps at most)
            magnitude = (base.weight.double().abs() + delta.abs()) @ x[i].double().abs() + base.bias.double().abs()
            assert_within_bf16_ulps(y[i], expected, magnitude, ulps=2)


def test_slot_reuse_bias_and_reset() -> None:
    base = _linear([20])
    layer = LinearWithLoRA(base, MAX_LORAS, MAX_RANK, bias_enabled=True)
    first, second = _lora("m", 20, 8, 1, bias=True), _lora("m", 20, 3, 2, bias=False)
    layer.set_lora(1, first)
    layer.set_lora(1, second)  # a smaller adapter in the same slot leaves nothing of the first behind
    x = torch.randn(3, IN)
    y = layer(x, _batch([1, -1, 1]))
    expected = x @ (base.weight + _dense_delta(second, [20]).float()).t() + base.bias
    torch.testing.assert_close(y[[0, 2]], expected[[0, 2]], atol=1e-4, rtol=1e-4)
    layer.set_lora(2, first)
    y = layer(x, _batch([2, 1, -1]))
    torch.testing.assert_close(
        y[0], (base.weight + _dense_delta(first, [20]).float()) @ x[0] + base.bias + first.bias
    )
    torch.testing.assert_close(y[2], base.weight @ x[2] + base.bias)
    layer.reset_lora(2)
    torch.testing.assert_close(layer(x, _batch([2, 2, 2])), base(x))


def test_bias_needs_enable_lora_bias() -> None:
    layer = LinearWithLoRA(_linear([20]), MAX_LORAS, MAX_RANK, bias_enabled=False)
    with pytest.raises(ValueError, match="enable-lora-bias"):
        layer.set_lora(0, _lora("m", 20, 4, 1, bias=True))


def test_rejects_weights_that_do_not_fit() -> None:
    layer = LinearWithLoRA(_linear([20]), MAX_LORAS, MAX_RANK)
    with pytest.raises(ValueError, match="does not fit"):
        layer.set_lora(0, _lora("m", 21, 4, 1))
    with pytest.raises(ValueError, match="does not fit"):
        layer.set_lora(0, LoRALayerWeights("m", 9, torch.zeros(9, IN), torch.zeros(20, 9), 1.0))
    with pytest.raises(ValueError, match="out of range"):
        layer.set_lora(MAX_LORAS, _lora("m", 20, 4, 1))


def test_no_adapter_tokens_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _linear([20])
    layer = LinearWithLoRA(base, MAX_LORAS, MAX_RANK)
    layer.set_lora(0, _lora("m", 20, 4, 1))

    def fail(*args: object) -> None:
        raise AssertionError("LoRA op called for a batch that needs none")

    monkeypatch.setattr(lora_torch, "add_lora", fail)
    monkeypatch.setattr(lora_cpu, "run", fail)
    x = torch.randn(4, IN)
    for batch in (
        None,
        ForwardBatch(_batch([-1] * 4).attn, lora=None),
        _batch([-1] * 4),
        _batch([1, 1, -1, 1]),
    ):  # slot 1 is empty
        assert torch.equal(layer(x, batch), base(x))


def test_lora_dtype_differs_from_model_dtype() -> None:
    base = _linear([20])
    layer = LinearWithLoRA(base, MAX_LORAS, MAX_RANK, dtype=torch.float64)
    lora = _lora("m", 20, 4, 1)
    layer.set_lora(0, lora)
    x = torch.randn(2, IN)
    y = layer(x, _batch([0, -1]))
    assert y.dtype == torch.float32 and layer.lora_a_stacked.dtype == torch.float64
    torch.testing.assert_close(
        y[0], (base.weight + _dense_delta(lora, [20]).float()) @ x[0] + base.bias, atol=1e-4, rtol=1e-4
    )


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = _linear([16, 8, 8])
        self.o_proj = _linear([IN], bias=False)


class _TinyModel(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.lm_head = _linear([50], bias=False)


def test_wrap_model_in_place() -> None:
    model = _TinyModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    targets = LoRATargets.from_model(model)
    assert sorted(targets.modules) == [f"layers.{i}.{m}" for i in range(2) for m in ("o_proj", "qkv_proj")]
    assert targets.sub_modules["layers.1.k_proj"] == ("layers.1.qkv_proj", 1)
    assert targets.supported_leaf_names() == ["k_proj", "o_proj", "q_proj", "qkv_proj", "v_proj"]
    wrapped = wrap_model_for_lora(model, LoRAConfig(max_loras=2, max_lora_rank=4))
    assert set(wrapped) == set(targets.modules) and isinstance(model.layers[0].qkv_proj, LinearWithLoRA)
    assert not isinstance(model.lm_head, LinearWithLoRA)
    # Same parameter names and values; the slot buffers stay out of the state dict.
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert wrap_model_for_lora(model, LoRAConfig(max_loras=2, max_lora_rank=4)) == wrapped
    assert set(lora_target_modules(model)) == set(targets.modules)
    assert wrapped["layers.0.qkv_proj"].lora_a_stacked.shape == (2, 3 * 4, IN)
    assert wrapped["layers.0.qkv_proj"].lora_b_stacked.shape == (2, 32, 3 * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_slot_rewrite_leaves_no_trace(cpu_kernel: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing a smaller adapter over a bigger one gives the same buffers as writing it into a fresh
    layer (rows past the new ranks zeroed, off-diagonal blocks untouched); a reset gives zeros."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    sizes = [16, 8, 8]
    big = PackedLoRALayerWeights("qkv", [_lora(n, size, 8, seed, dtype=dtype)
                                         for n, size, seed in [("q", 16, 1), ("k", 8, 2), ("v", 8, 3)]])
    small = PackedLoRALayerWeights("qkv", [_lora("q", 16, 3, 4, dtype=dtype), None, _lora("v", 8, 5, 5, dtype=dtype)])
    whole = _lora("qkv", 32, 2, 6, dtype=dtype)  # the packed layer targeted as a whole
    used, fresh = (LinearWithLoRA(_linear(sizes, dtype=dtype), MAX_LORAS, MAX_RANK) for _ in range(2))
    for later in (small, whole):
        used.set_lora(1, big)
        used.set_lora(1, later)
        fresh.reset_lora(1)
        fresh.set_lora(1, later)
        assert torch.equal(used.lora_a_stacked, fresh.lora_a_stacked)
        assert torch.equal(used.lora_b_stacked, fresh.lora_b_stacked)
        assert torch.equal(used.lora_buffers.ranks, fresh.lora_buffers.ranks)
        assert used.lora_buffers.active_mask == fresh.lora_buffers.active_mask == 1 << 1
    used.reset_lora(1)
    buffers = used.lora_buffers
    assert not buffers.lora_a.any() and not buffers.lora_b.any() and not buffers.ranks.any()
    assert buffers.active_mask == buffers.bias_mask == 0
