"""LoRA ops under random step mixes (hypothesis): every layout, both dtypes, the C kernel on and off
(in both dtypes), against the float64 reference; non-finite slot values never reach another slot's
tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.lora_reference import (
    IN,
    OUT,
    R,
    assert_within_bf16_ulps,
    build_mapping,
    lora_magnitude,
    make_buffers,
    naive_lora,
    run_cpu_kernel,
    tolerance,
)

from loraserve.batch.lora_layout import LoRALayout
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.lora.ops import lora_cpu, lora_torch

LAYOUTS = [None, "runs", "grouped", "padded", "padded_all"]
DTYPES = [torch.float32, torch.bfloat16]
OFFSET = 4  # the LoRA columns are y[:, OFFSET:OFFSET + OUT]: the ops must leave the rest alone
PROPERTY = settings(max_examples=30, deadline=None)  # no deadline: never depends on machine speed


@st.composite
def slot_mixes(draw: st.DrawFn, max_run: int = 45) -> tuple[list[int], int]:
    """(token slots, max_loras) of a step: segments of uneven length (single tokens, long runs), some
    without an adapter, in drawn order, sorted by slot (as the runner orders a step) or shuffled."""
    max_loras = draw(st.integers(1, 8))
    lengths = st.one_of(st.just(1), st.integers(1, 4), st.integers(1, max_run))
    segments = draw(st.lists(st.tuples(st.integers(-1, max_loras - 1), lengths), min_size=1, max_size=8))
    slots = [slot for slot, length in segments for _ in range(length)]
    order = draw(st.sampled_from(["drawn", "sorted", "shuffled"]))
    if order == "sorted":
        slots.sort()
    elif order == "shuffled":
        slots = list(draw(st.permutations(slots)))
    return slots, max_loras


def _inputs(
    num_tokens: int, num_stacked: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, IN], A [L, R, IN], B [L, OUT, R] (a transposed [L, R, OUT] buffer), y0 [T, OUT + 10]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, IN, generator=g).to(dtype)
    a = torch.randn(num_stacked, R, IN, generator=g).to(dtype)
    b = torch.randn(num_stacked, R, OUT, generator=g).to(dtype).transpose(1, 2)
    return x, a, b, torch.randn(num_tokens, OUT + 10, generator=g).to(dtype)


def _assert_layout(mapping: LoRABatchMapping, forced: str | None, slots: list[int]) -> None:
    """The forced layout was built, and a padded grid's indices are consistent: its filled cells are
    exactly the adapter tokens, empty cells read row T, and a view never covers an empty cell."""
    if forced is not None and mapping.has_lora:
        assert mapping.torch_plan.layout.value == ("padded" if forced == "padded_all" else forced)
    pad = mapping.torch_plan.padded
    if pad is None:
        return
    if forced is not None:
        assert pad.uses_all_slots == (forced == "padded_all")
    gather, cells = pad.gather_index.tolist(), pad.num_groups * pad.max_len
    filled = list(range(cells)) if pad.filled_cells is None else pad.filled_cells.tolist()
    assert pad.cell_tokens.tolist() == [gather[c] for c in filled]
    assert sorted(pad.cell_tokens.tolist()) == [i for i, s in enumerate(slots) if s >= 0]
    assert all(gather[c] == len(slots) for c in set(range(cells)) - set(filled))
    if pad.contiguous_start is not None:
        assert pad.filled_cells is None and pad.contiguous_start + cells <= len(slots)


def _assert_window(
    y: torch.Tensor, y0: torch.Tensor, delta: torch.Tensor, slots: list[int], dtype: torch.dtype,
    poisoned: int | None = None,
) -> None:
    """y == y0 + delta on the rows of adapter tokens (but those of the `poisoned` slot, which may hold
    anything), and rows of tokens without an adapter are y0 bit for bit."""
    rows = [i for i, s in enumerate(slots) if s >= 0 and s != poisoned]
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    torch.testing.assert_close(y[rows].double(), y0[rows].double() + delta[rows], **tolerance(dtype))
    assert torch.equal(y[none_rows], y0[none_rows])


def _check_torch_ops(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y0: torch.Tensor, mapping: LoRABatchMapping,
    slots: list[int], reference: tuple[torch.Tensor, torch.Tensor], poisoned: int | None = None,
) -> None:
    """shrink, expand and the fused add_lora against the reference (t, delta) of scale 0.5."""
    t_ref, delta_ref = reference
    dtype, window = x.dtype, slice(OFFSET, OFFSET + OUT)
    t = lora_torch.lora_shrink(x, a, mapping, scale=0.5)
    _assert_window(t, torch.zeros_like(t), t_ref, slots, dtype, poisoned)
    y = lora_torch.lora_expand(y0.clone(), t, b, mapping, offset=OFFSET)
    _assert_window(y[:, window], y0[:, window], delta_ref, slots, dtype, poisoned)
    y_fused = lora_torch.add_lora(y0.clone(), x, a, b, mapping, offset=OFFSET)
    _assert_window(y_fused[:, window], y0[:, window], 2 * delta_ref, slots, dtype, poisoned)  # no 0.5
    for out in (y, y_fused):
        assert torch.equal(out[:, :OFFSET], y0[:, :OFFSET]) and torch.equal(out[:, OFFSET + OUT :],
                                                                            y0[:, OFFSET + OUT :])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@PROPERTY
@given(mix=slot_mixes(), extra_slots=st.integers(0, 1), seed=st.integers(0, 2**16))
def test_torch_ops_match_naive_on_random_mixes(
    layout: str | None, dtype: torch.dtype, mix: tuple[list[int], int], extra_slots: int, seed: int
) -> None:
    slots, max_loras = mix
    mapping = build_mapping(slots, max_loras, layout)
    _assert_layout(mapping, layout, slots)
    # The stacked buffers may hold more slots than max_loras (the grid then gathers its slots).
    x, a, b, y0 = _inputs(len(slots), max_loras + extra_slots, dtype, seed)
    _check_torch_ops(x, a, b, y0, mapping, slots, naive_lora(x, a, b, slots, scale=0.5))


def _kernel_inputs(
    num_slots: int, num_tokens: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One full-rank slice, contiguous as the kernel reads it: A [L, R, IN], Bt [L, R, OUT], x, y0."""
    g = torch.Generator().manual_seed(seed)
    a, bt = torch.randn(num_slots, R, IN, generator=g), torch.randn(num_slots, R, OUT, generator=g)
    x, y0 = torch.randn(num_tokens, IN, generator=g), torch.randn(num_tokens, OUT, generator=g)
    return a.to(dtype), bt.to(dtype), x.to(dtype), y0.to(dtype)


def _add_lora(
    kernel: bool, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, mapping: LoRABatchMapping
) -> torch.Tensor:
    """What a LoRA layer runs: the C kernel when on and it serves the step, else the torch ops."""
    buffers = make_buffers(a, bt, [0, OUT], torch.full((a.shape[0], 1), R, dtype=torch.int32))
    if kernel and lora_cpu.serves(buffers.cpu_kernel_args, mapping, x.dtype):
        return run_cpu_kernel(y, x, buffers, mapping)
    return lora_torch.add_lora(y, x, a, bt.transpose(1, 2), mapping)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel_on", "kernel_off"])
@PROPERTY
@given(mix=slot_mixes(max_run=12), seed=st.integers(0, 2**16))
def test_cpu_kernel_on_and_off_match_naive(
    layout: str | None, dtype: torch.dtype, kernel: bool, mix: tuple[list[int], int], seed: int
) -> None:
    """In bf16 both paths stay within 2 ulps of what they sum (the kernel within half of one)."""
    if kernel and not lora_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    slots, max_loras = mix
    mapping = build_mapping(slots, max_loras, layout)
    a, bt, x, y0 = _kernel_inputs(max_loras, len(slots), dtype, seed)
    _, delta = naive_lora(x, a, bt.transpose(1, 2), slots, scale=1.0)
    y = _add_lora(kernel, y0.clone(), x, a, bt, mapping)
    if dtype == torch.float32:
        _assert_window(y, y0, delta, slots, dtype)
    else:
        none_rows = [i for i, s in enumerate(slots) if s < 0]
        assert torch.equal(y[none_rows], y0[none_rows])
        magnitude = y0.double().abs() + lora_magnitude(x, a, bt.transpose(1, 2), slots)
        assert_within_bf16_ulps(y, y0.double() + delta, magnitude, ulps=2)


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@PROPERTY
@given(mix=slot_mixes(), value=st.sampled_from(NON_FINITE), seed=st.integers(0, 2**16), data=st.data())
def test_non_finite_slot_reaches_only_its_own_tokens(
    layout: str | None, dtype: torch.dtype, mix: tuple[list[int], int], value: float, seed: int,
    data: st.DataObject,
) -> None:
    slots, max_loras = mix
    poisoned = data.draw(st.integers(0, max_loras - 1), label="poisoned slot")
    mapping = build_mapping(slots, max_loras, layout)
    x, a, b, y0 = _inputs(len(slots), max_loras, dtype, seed)
    reference = naive_lora(x, a, b, slots, scale=0.5)
    a[poisoned].fill_(value)
    b[poisoned].fill_(value)
    _check_torch_ops(x, a, b, y0, mapping, slots, reference, poisoned)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel_on", "kernel_off"])
@PROPERTY
@given(mix=slot_mixes(max_run=12), value=st.sampled_from(NON_FINITE), seed=st.integers(0, 2**16),
       data=st.data())
def test_non_finite_slot_stays_isolated_with_kernel_on_and_off(
    layout: str | None, dtype: torch.dtype, kernel: bool, mix: tuple[list[int], int], value: float, seed: int,
    data: st.DataObject,
) -> None:
    if kernel and not lora_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    slots, max_loras = mix
    poisoned = data.draw(st.integers(0, max_loras - 1), label="poisoned slot")
    mapping = build_mapping(slots, max_loras, layout)
    a, bt, x, y0 = _kernel_inputs(max_loras, len(slots), dtype, seed)
    clean = _add_lora(kernel, y0.clone(), x, a, bt, mapping)
    a[poisoned].fill_(value)
    bt[poisoned].fill_(value)
    y = _add_lora(kernel, y0.clone(), x, a, bt, mapping)
    # Every other token comes out bit for bit as without the poison.
    others = [i for i, s in enumerate(slots) if s != poisoned]
    assert torch.equal(y[others], clean[others])


@pytest.mark.parametrize(
    ("slots", "dtype"),
    [
        ([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3], torch.bfloat16),  # a decode step in bf16 (the torch ops)
        ([0] * 40 + [1] * 40 + [2] * 40 + [3] * 39, torch.float32),  # a prefill mix
    ],
    ids=["decode_bf16", "prefill_f32"],
)
def test_grid_one_cell_short_regression(slots: list[int], dtype: torch.dtype) -> None:
    """Sorted segments whose last one is a token short: the grid's one empty cell held index T right
    after token T-1 and passed for a contiguous grid; the view then reached past the activations
    ("shape '[4, 3, 128]' is invalid for input of size 1408")."""
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=4)
    pad = mapping.torch_plan.padded
    assert mapping.torch_plan.layout is LoRALayout.PADDED and pad is not None
    assert pad.contiguous_start is None and pad.filled_cells is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(slots), 128, generator=g).to(dtype)
    a, b = torch.randn(4, R, 128, generator=g).to(dtype), torch.randn(4, 64, R, generator=g).to(dtype)
    y = lora_torch.add_lora(torch.zeros(len(slots), 64, dtype=dtype), x, a, b, mapping)
    _, delta = naive_lora(x, a, b, slots, scale=1.0)
    torch.testing.assert_close(y.double(), delta, **tolerance(dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["torch_f32", "torch_bf16", "kernel_f32", "kernel_bf16"])
def test_nan_slot_leaves_other_tokens_unaffected(layout: str | None, backend: str) -> None:
    """Slot 1 filled with NaN: its grid has empty cells (which used to be added into token 0, of
    slot 0), and tokens of slot 0 and without an adapter must come out exactly as without the NaN."""
    if backend.startswith("kernel") and not lora_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    slots = [0, 0, 0, 1, -1, 2, 2]
    dtype = torch.bfloat16 if backend.endswith("bf16") else torch.float32
    mapping = build_mapping(slots, 4, layout)
    a, bt, x, y0 = _kernel_inputs(4, len(slots), dtype, seed=7)

    def run(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        if backend.startswith("kernel"):
            return run_cpu_kernel(y0.clone(), x, make_buffers(a, bt, [0, OUT], torch.full((4, 1), R, dtype=torch.int32)), mapping)
        return lora_torch.add_lora(y0.clone(), x, a, bt.transpose(1, 2), mapping)

    clean = run(a, bt)
    a[1], bt[1] = float("nan"), float("nan")
    poisoned = run(a, bt)
    others = [i for i, s in enumerate(slots) if s != 1]
    assert torch.isnan(poisoned[3]).all()
    assert torch.equal(poisoned[others], clean[others])
