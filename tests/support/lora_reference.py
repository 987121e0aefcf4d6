"""The LoRA ops' shared test scaffolding: shapes, forced mappings, slot buffers and the float64 reference."""

from __future__ import annotations

import torch

from loraserve.batch.lora_layout import LoRALayout
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.lora.ops import LoRABuffers, lora_cpu

L, R, IN, OUT = 6, 8, 40, 56


def build_mapping(
    slots: list[int], max_loras: int | None = None, layout: str | None = None, device: str = "cpu",
    token_scales: list[float] | None = None,
) -> LoRABatchMapping:
    """The step's mapping, its layout forced by name ("padded_all": the grid over all max_loras slots)."""
    if layout is None:
        return LoRABatchMapping.build(slots, device, max_loras=max_loras, token_scales=token_scales)
    all_slots = layout == "padded_all"
    forced = LoRALayout.PADDED if all_slots else LoRALayout(layout)
    return LoRABatchMapping.build(slots, device, max_loras=max_loras, layout=forced, all_slots=all_slots,
                                  token_scales=token_scales)


def make_buffers(
    a: torch.Tensor, bt: torch.Tensor, offsets: list[int], ranks: torch.Tensor, max_rank: int = R
) -> LoRABuffers:
    """Slot buffers over given weights, every slot marked as holding an adapter."""
    buffers = LoRABuffers(lora_a=a, lora_b_t=bt, bias=None, slice_offsets=torch.tensor(offsets),
                          ranks=ranks, max_rank=max_rank)
    buffers.active_mask = (1 << a.shape[0]) - 1
    return buffers


def run_cpu_kernel(y: torch.Tensor, x: torch.Tensor, buffers: LoRABuffers, mapping: LoRABatchMapping) -> torch.Tensor:
    """The C kernel alone; ValueError when it cannot serve these tensors or this step."""
    if not lora_cpu.serves(buffers.cpu_kernel_args, mapping, x.dtype):
        raise ValueError("the CPU LoRA kernel serves float32 / bfloat16 CPU tensors with short segments only")
    return lora_cpu.run(x, y, buffers.cpu_kernel_args, mapping)


def naive_lora(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int], scale: float,
    t_dtype: torch.dtype = torch.float64, token_scales: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token float64 reference: t[i] = scale * c_i * A[s] x[i] (c_i = token_scales[i], 1 without);
    delta[i] = B[s] t[i], with t rounded to `t_dtype` (to nearest even) in between where the code under
    test rounds it (`KernelBuild.t_dtype`)."""
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for i, s in enumerate(slots):
        if s >= 0:
            c = 1.0 if token_scales is None else token_scales[i]
            t[i] = (scale * c * (a[s].double() @ x[i].double())).to(t_dtype).double()
            delta[i] = b[s].double() @ t[i]
    return t, delta


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.5, "rtol": 0.05}


def lora_magnitude(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int], token_scales: list[float] | None = None
) -> torch.Tensor:
    """Per element of delta = B[s] A[s] x: sum_k |t_k B[s][:, k]| with t = c_i A[s] x exact (float64), the
    size of what a bf16 LoRA sum rounds (t, its products with B, delta). [T, out]."""
    mag = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for i, s in enumerate(slots):
        if s >= 0:
            c = 1.0 if token_scales is None else abs(token_scales[i])
            mag[i] = c * (b[s].double().abs() @ (a[s].double() @ x[i].double()).abs())
    return mag


def assert_within_bf16_ulps(y: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, ulps: float) -> None:
    """|y - expected| <= ulps bf16 units in the last place of `magnitude`, elementwise. bf16 keeps 8
    significant bits, so one ulp of v is at most 2^-7 |v|; rounding to nearest errs by half that."""
    bound = ulps * 2.0**-7 * magnitude
    error = (y.double() - expected).abs()
    worst = int(torch.argmax(error - bound))
    assert bool((error <= bound).all()), (
        f"error {error.flatten()[worst].item():.4g} > {ulps} bf16 ulps ({bound.flatten()[worst].item():.4g}) "
        f"at flat index {worst}")
