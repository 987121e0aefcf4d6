"""Per-token LoRA scales (a request's `lora_scale`) in every LoRA backend: the torch twin in every layout,
the C kernel in every code path this CPU can run, and Triton (CUDA, or its interpreter), each against
the float64 reference with each token's own scale, and the scale's other oracle: the same slot with its
B multiplied by the scale. One slot serves its adapter at several scales in one step."""

from __future__ import annotations

import importlib.util
import os
import platform

import pytest
import torch
from support.lora_reference import (
    IN,
    OUT,
    L,
    R,
    assert_within_bf16_ulps,
    build_mapping,
    lora_magnitude,
    make_buffers,
    naive_lora,
    run_cpu_kernel,
    tolerance,
)

from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.lora.ops import lora_cpu, lora_torch
from loraserve.native.build import cpu_flags
from loraserve.native.kernel_slot import KernelSlot

# Slot per token, with one slot at several scales (0.3, 1.0, -0.5, 2.0 on slot 2), base tokens between.
SLOTS = [2, 2, -1, 0, 2, 2, 5, 5, -1, 0, 2, 3]
SCALES = [0.3, 1.0, 7.0, 1.0, -0.5, 2.0, 0.0, 1.25, 3.0, 0.5, 0.3, 1.0]
# A balanced decode grid (the runner's sorted order): the padded layout's view of the activations.
GRID_SLOTS = [s for s in (0, 2, 5) for _ in range(3)]
GRID_SCALES = [0.3, 1.0, 2.0, 1.0, -1.0, 0.5, 0.25, 1.0, 1.5]
CASES = {"mixed": (SLOTS, SCALES), "grid": (GRID_SLOTS, GRID_SCALES)}


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(L, R, IN, generator=g).to(dtype)
    b = torch.randn(L, R, OUT, generator=g).to(dtype).transpose(1, 2)
    return a, b


def test_mapping_keeps_no_scales_when_all_are_one() -> None:
    assert LoRABatchMapping.build([0, 1], "cpu", max_loras=4, token_scales=[1.0, 1.0]).scales is None
    # A base token's scale is never read: it cannot make a step scaled.
    assert LoRABatchMapping.build([0, -1], "cpu", max_loras=4, token_scales=[1.0, 5.0]).scales is None
    m = LoRABatchMapping.build([2, -1, 0, 2], "cpu", max_loras=4, token_scales=[0.5, 9.0, 2.0, 1.0])
    assert m.scales is not None
    assert m.scales.by_token.flatten().tolist() == [0.5, 1.0, 2.0, 1.0]
    assert m.scales.by_segment.flatten().tolist() == [2.0, 0.5, 1.0]  # slot 0's token, then slot 2's
    assert m.cpu_kernel_args is not None and m.cpu_kernel_args[6] == m.scales.by_segment.data_ptr()
    assert LoRABatchMapping.build([2], "cpu", max_loras=4).cpu_kernel_args[6] == 0  # type: ignore[index]


@pytest.mark.parametrize("bad", [[float("nan"), 1.0], [1.0, float("inf")]])
def test_mapping_refuses_non_finite_scales(bad: list[float]) -> None:
    with pytest.raises(ValueError, match="finite"):
        LoRABatchMapping.build([0, 1], "cpu", max_loras=4, token_scales=bad)
    with pytest.raises(ValueError, match="2 token scales for 3 tokens"):
        LoRABatchMapping.build([0, 1, 1], "cpu", max_loras=4, token_scales=[1.0, 0.5])


@pytest.mark.parametrize("layout", [None, "runs", "grouped", "padded", "padded_all"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_apply_each_tokens_scale(case: str, layout: str | None, dtype: torch.dtype) -> None:
    slots, scales = CASES[case]
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    a, b = _weights(dtype)
    t_ref, delta_ref = naive_lora(x, a, b, slots, scale=0.5, token_scales=scales)
    mapping = build_mapping(slots, L, layout, token_scales=scales)
    assert mapping.scales is not None
    t = lora_torch.lora_shrink(x, a, mapping, scale=0.5)
    torch.testing.assert_close(t.double(), t_ref, **tolerance(dtype))
    y0 = torch.randn(len(slots), OUT + 10, generator=torch.Generator().manual_seed(3)).to(dtype)
    y_fused = lora_torch.add_lora(y0.clone(), x, a, b, mapping, offset=4)
    torch.testing.assert_close(
        y_fused[:, 4 : 4 + OUT].double(), y0[:, 4 : 4 + OUT].double() + 2 * delta_ref, **tolerance(dtype)
    )
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(y_fused[none_rows], y0[none_rows])


def test_a_scale_equals_scaling_b() -> None:
    """The scale's second oracle: token i at scale c on slot s gives what slot s with c * B gives."""
    slots, scales = CASES["mixed"]
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    a, b = (w.double() for w in _weights(torch.float32))
    y = lora_torch.add_lora(
        torch.zeros(len(slots), OUT, dtype=torch.float64),
        x,
        a,
        b,
        build_mapping(slots, L, token_scales=scales),
    )
    for i, (slot, c) in enumerate(zip(slots, scales, strict=True)):
        one = build_mapping([slot], L)
        expected = lora_torch.add_lora(torch.zeros(1, OUT, dtype=torch.float64), x[i : i + 1], a, c * b, one)
        torch.testing.assert_close(y[i : i + 1], expected)


# name: (flags after -march=native, CPU flags the build needs), as in test_cpu_kernel_paths.py
BUILDS: dict[str, tuple[tuple[str, ...], set[str]]] = {
    "native": ((), set()),
    "avx512": (("-mno-avx512bf16",), {"avx512f", "avx512bw", "avx2", "fma"}),
    "avx2": (("-mno-avx512f",), {"avx2", "fma"}),
    "portable": (("-mno-avx",), set()),
}
# A packed layer whose widths are not multiples of the vector sizes (scalar tails).
SIZES = [37, 5, 14]


@pytest.fixture(params=list(BUILDS))
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> lora_cpu.KernelBuild:
    """The named build of lora_kernel.c swapped in for the process's own one."""
    flags, needs = BUILDS[request.param]
    if not lora_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    if request.param != "native" and (
        platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags()
    ):
        pytest.skip(f"the {request.param} build needs an x86-64 CPU with {sorted(needs)}")
    built = lora_cpu.build_kernels(flags)
    assert built is not None
    monkeypatch.setattr(lora_cpu, "_kernel", KernelSlot.holding(built))
    return built


def _sliced(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(5)
    n, offsets = len(SIZES), [0, *torch.tensor(SIZES).cumsum(0).tolist()]
    ranks = torch.randint(1, R + 1, (L, n), generator=g, dtype=torch.int32)
    ranks[:, 0] = R
    a, bt = torch.zeros(L, n * R, IN), torch.zeros(L, n * R, offsets[-1])
    for s in range(L):
        for q in range(n):
            r = int(ranks[s, q])
            a[s, q * R : q * R + r] = torch.randn(r, IN, generator=g)
            bt[s, q * R : q * R + r, offsets[q] : offsets[q + 1]] = torch.randn(r, SIZES[q], generator=g)
    return a.to(dtype), bt.to(dtype), ranks, offsets


@pytest.mark.parametrize("case", [*CASES, "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_applies_each_tokens_scale(
    kernel: lora_cpu.KernelBuild, case: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every code path (register blocks of 4 rows x 1..4 tokens, scalar tails) against the float64
    reference with t rounded as the build rounds it, after the scale; two threads take the
    segment-major order for the grid."""
    if case == "long":  # token groups and blocks that do not divide the segments
        slots = [1] * 11 + [-1] + [3] * 21
        scales = [0.5 + 0.1 * i for i in range(len(slots))]
    else:
        slots, scales = CASES[case]
    a, bt, ranks, offsets = _sliced(dtype)
    buffers = make_buffers(a, bt, offsets, ranks)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(len(slots), IN, generator=g).to(dtype)
    y0 = torch.randn(len(slots), offsets[-1], generator=g).to(dtype)
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=L, token_scales=scales)
    y = run_cpu_kernel(y0.clone(), x, buffers, mapping)
    _, delta = naive_lora(x, a, bt.transpose(1, 2), slots, 1.0, kernel.t_dtype(dtype), scales)
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(y[none_rows], y0[none_rows])
    y_torch = lora_torch.add_lora(y0.clone(), x, a, bt.transpose(1, 2), mapping)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y0.double() + delta, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y, y_torch, atol=1e-4, rtol=1e-4)
    else:
        magnitude = y0.double().abs() + lora_magnitude(x, a, bt.transpose(1, 2), slots, scales)
        assert_within_bf16_ulps(y, y0.double() + delta, magnitude, ulps=0.6)
        assert_within_bf16_ulps(y_torch, y0.double() + delta, magnitude, ulps=2)


def _triton_device() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.skipif(_triton_device() is None, reason="needs CUDA + Triton (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_applies_each_tokens_scale(case: str, dtype: torch.dtype) -> None:
    from loraserve.lora.ops import lora_triton

    device = _triton_device()
    assert device is not None
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16 dot")
    slots, scales = CASES[case]
    x = torch.randn(len(slots), IN).to(dtype)
    a, b = _weights(dtype)
    t_ref, delta_ref = naive_lora(x, a, b, slots, scale=0.5, token_scales=scales)
    mapping = LoRABatchMapping.build(slots, device, max_loras=L, token_scales=scales)
    x, a, b = x.to(device), a.to(device), b.to(device)
    t = lora_triton.lora_shrink(x, a, mapping, scale=0.5)
    torch.testing.assert_close(t.double().cpu(), t_ref, **tolerance(dtype))
    y0 = torch.randn(len(slots), OUT).to(dtype).to(device)
    y = lora_triton.add_lora(y0.clone(), x, a, b, mapping)
    torch.testing.assert_close(y.double().cpu(), y0.double().cpu() + 2 * delta_ref, **tolerance(dtype))
