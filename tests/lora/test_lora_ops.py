"""LoRA shrink/expand ops and the batch mapping, against a naive per-token reference.

Fixed mixes first, then property tests (hypothesis) over random mixes, every layout, both dtypes,
the C kernel on and off, and slots filled with NaN or inf that must reach no other token."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.lora import ops
from loraserve.lora.layout import LoRALayout
from loraserve.lora.mapping import LoRABatchMapping
from loraserve.lora.ops import LoRABuffers, cpu_ops, torch_ops

L, R, IN, OUT = 6, 8, 40, 56


def _build(
    slots: list[int], max_loras: int | None = None, layout: str | None = None, device: str = "cpu"
) -> LoRABatchMapping:
    """The step's mapping, its layout forced by name ("padded_all": the grid over all max_loras slots)."""
    if layout is None:
        return LoRABatchMapping.build(slots, device, max_loras=max_loras)
    all_slots = layout == "padded_all"
    forced = LoRALayout.PADDED if all_slots else LoRALayout(layout)
    return LoRABatchMapping.build(slots, device, max_loras=max_loras, layout=forced, all_slots=all_slots)


def _buffers(a: torch.Tensor, bt: torch.Tensor, offsets: list[int], ranks: torch.Tensor) -> LoRABuffers:
    """Slot buffers over given weights, every slot marked as holding an adapter."""
    buffers = LoRABuffers(lora_a=a, lora_b_t=bt, bias=None, slice_offsets=torch.tensor(offsets),
                          ranks=ranks, max_rank=R)
    buffers.active_mask = (1 << a.shape[0]) - 1
    return buffers


def _fused(y: torch.Tensor, x: torch.Tensor, buffers: LoRABuffers, mapping: LoRABatchMapping) -> torch.Tensor:
    """The C kernel alone; ValueError when it cannot serve these tensors or this step."""
    if buffers.cpu_kernel_args is None or not cpu_ops.applies(x, y, mapping):
        raise ValueError("the CPU LoRA kernel serves float32 CPU tensors with short segments only")
    return cpu_ops.run(x, y, buffers.cpu_kernel_args, mapping)


def _zipf_slots(num_tokens: int, num_slots: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    probs = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.3
    return torch.multinomial(probs, num_tokens, replacement=True, generator=g).tolist()


MIXES: dict[str, list[int]] = {
    "one_adapter": [3] * 20,
    "all_different": [5, 0, 4, 1, 3, 2],
    "zipf": _zipf_slots(40, L, seed=1),
    "some_without": [-1, 2, 2, -1, 0, -1, 5, 2, -1, 0, 0],
    "all_without": [-1] * 7,
    "contiguous_runs": [1] * 5 + [4] * 3 + [-1] * 2 + [1] * 4,
    "single_token": [2],
    # Sorted by slot with equal segments (what the runner produces for a balanced decode batch):
    # the padded grid is a view of the activations, after some base tokens; also over all slots.
    "slot_grid": [-1, -1] + [s for s in (0, 2, 5) for _ in range(3)],
    "slot_grid_all": [s for s in range(L) for _ in range(2)],
}


def _naive(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token float64 reference: t[i] = scale * A[s] x[i]; delta[i] = B[s] t[i]."""
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    delta = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float64)
    for i, s in enumerate(slots):
        if s >= 0:
            t[i] = scale * (a[s].double() @ x[i].double())
            delta[i] = b[s].double() @ t[i]
    return t, delta


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(L, R, IN, generator=g).to(dtype)
    # B stored [L, R, out] and passed as its [L, out, R] transpose, as LinearWithLoRA does.
    b = torch.randn(L, R, OUT, generator=g).to(dtype).transpose(1, 2)
    return a, b


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.5, "rtol": 0.05}


@pytest.mark.parametrize("layout", [None, "runs", "grouped", "padded"])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_match_naive(mix: str, layout: str | None, dtype: torch.dtype) -> None:
    slots = MIXES[mix]
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    a, b = _weights(dtype)
    t_ref, delta_ref = _naive(x, a, b, slots, scale=0.5)
    for max_loras in (L, None):
        mapping = _build(slots, max_loras, layout)
        t = torch_ops.lora_shrink(x, a, mapping, scale=0.5)
        torch.testing.assert_close(t.double(), t_ref, **_tol(dtype))
        y0 = torch.randn(len(slots), OUT + 10, generator=torch.Generator().manual_seed(3)).to(dtype)
        y = torch_ops.lora_expand(y0.clone(), t, b, mapping, offset=4)
        torch.testing.assert_close(
            y[:, 4 : 4 + OUT].double(), y0[:, 4 : 4 + OUT].double() + delta_ref, **_tol(dtype)
        )
        assert torch.equal(y[:, :4], y0[:, :4]) and torch.equal(y[:, 4 + OUT :], y0[:, 4 + OUT :])
        y_fused = torch_ops.add_lora(y0.clone(), x, a, b, mapping, offset=4)
        fused_ref = y0[:, 4 : 4 + OUT].double() + 2 * delta_ref  # add_lora has no scale (0.5 above)
        torch.testing.assert_close(y_fused[:, 4 : 4 + OUT].double(), fused_ref, **_tol(dtype))
        # Rows without an adapter are left bit-for-bit alone.
        none_rows = [i for i, s in enumerate(slots) if s < 0]
        assert torch.equal(y_fused[none_rows], y0[none_rows])


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_contiguous_weights_and_dispatch_match(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ops.add_lora` (whichever backend it picks) against shrink then expand on contiguous weights."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", kernel)
    slots = MIXES["zipf"]
    x = torch.randn(len(slots), IN)
    a, b = _weights(torch.float32)
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=L)
    y1 = torch.zeros(len(slots), OUT)
    ops.add_lora(y1, x, _buffers(a, b.transpose(1, 2), [0, OUT], torch.full((L, 1), R, dtype=torch.int32)), mapping)
    y2 = ops.lora_expand(
        torch.zeros(len(slots), OUT), ops.lora_shrink(x, a.contiguous(), mapping), b.contiguous(), mapping
    )
    torch.testing.assert_close(y1, y2, atol=1e-5, rtol=1e-5)


def test_mapping_indices() -> None:
    slots = [2, -1, 0, 2, 2, -1, 0]
    m = LoRABatchMapping.build(slots, "cpu", max_loras=4)
    assert m.active_slots == (0, 2) and m.num_tokens == 7 and m.num_active_tokens == 5
    seg = m.segments
    assert seg.token_ids.tolist() == [2, 6, 0, 3, 4] and seg.slots.tolist() == [0, 2]
    assert seg.starts.tolist() == [0, 2] and seg.lens.tolist() == [2, 3] and seg.max_len == 3
    assert m.token_slots.tolist() == slots and m.has_lora and m.active_mask == 0b101
    assert not LoRABatchMapping.build([-1, -1], "cpu").has_lora
    assert not LoRABatchMapping.build([], "cpu").has_lora
    assert LoRABatchMapping.build(torch.tensor(slots), "cpu").segments.token_ids.tolist() == [2, 6, 0, 3, 4]


def test_layout_choice() -> None:
    # One adapter for the whole batch: plain matmuls on views, no gather.
    assert LoRABatchMapping.build([3] * 32, "cpu", max_loras=16).torch_plan.layout is LoRALayout.RUNS
    # Many adapters with two tokens each (a decode step): one bmm over all slots, no weight gather.
    plan = LoRABatchMapping.build([i % 16 for i in range(32)], "cpu", max_loras=16).torch_plan
    assert plan.layout is LoRALayout.PADDED and plan.padded is not None and plan.padded.uses_all_slots
    with pytest.raises(ValueError, match="all slots"):
        LoRABatchMapping.build([0, 1], "cpu", layout=LoRALayout.PADDED, all_slots=True)  # no max_loras


@pytest.mark.parametrize("bad", [[-2], [0, 7], [1.5]])
def test_mapping_rejects_bad_slots(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="token slot"):
        LoRABatchMapping.build(bad, "cpu", max_loras=4)


def _triton_device() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.skipif(_triton_device() is None, reason="needs CUDA + Triton (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_torch(mix: str, dtype: torch.dtype) -> None:
    from loraserve.lora.ops import triton_ops

    device = _triton_device()
    assert device is not None
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16 dot")
    slots = MIXES[mix]
    x = torch.randn(len(slots), IN).to(dtype)
    a, b = _weights(dtype)
    t_ref, delta_ref = _naive(x, a, b, slots, scale=0.5)
    mapping = LoRABatchMapping.build(slots, device, max_loras=L)
    x, a, b = x.to(device), a.to(device), b.to(device)
    tol = _tol(torch.float32 if dtype == torch.float32 else torch.bfloat16)
    t = triton_ops.lora_shrink(x, a, mapping, scale=0.5)
    torch.testing.assert_close(t.double().cpu(), t_ref, **tol)
    y0 = torch.randn(len(slots), OUT + 10).to(dtype).to(device)
    y = triton_ops.lora_expand(y0.clone(), t, b, mapping, offset=4)
    torch.testing.assert_close(
        y[:, 4 : 4 + OUT].double().cpu(), y0[:, 4 : 4 + OUT].double().cpu() + delta_ref, **tol
    )
    assert torch.equal(y[:, :4], y0[:, :4])
    y_fused = triton_ops.add_lora(y0.clone(), x, a, b, mapping, offset=4)
    fused_ref = y0[:, 4 : 4 + OUT].double().cpu() + 2 * delta_ref
    torch.testing.assert_close(y_fused[:, 4 : 4 + OUT].double().cpu(), fused_ref, **tol)


def _sliced_weights(sizes: list[int], ranks: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-diagonal A [L, n*R, IN] and Bt [L, n*R, out] as LinearWithLoRA stores them: slice q of
    slot s uses rows [q*R, q*R + ranks[s, q]) and its own output columns; everything else is zero."""
    g = torch.Generator().manual_seed(seed)
    n, out = len(sizes), sum(sizes)
    a, bt = torch.zeros(L, n * R, IN), torch.zeros(L, n * R, out)
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    for s in range(L):
        for q in range(n):
            r = int(ranks[s, q])
            a[s, q * R : q * R + r] = torch.randn(r, IN, generator=g)
            bt[s, q * R : q * R + r, offsets[q] : offsets[q + 1]] = torch.randn(r, sizes[q], generator=g)
    return a, bt


# Slice layouts: plain, qkv-like (uneven), gate_up-like, and widths that are not multiples of the
# kernel's vector and chunk sizes (scalar tails).
SLICES = {"plain": [56], "qkv": [40, 8, 8], "gate_up": [300, 300], "odd": [37, 5]}


@pytest.mark.parametrize("sizes", list(SLICES.values()), ids=list(SLICES))
@pytest.mark.parametrize("mix", list(MIXES))
def test_cpu_kernel_matches_naive(mix: str, sizes: list[int]) -> None:
    if not cpu_ops.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    slots = MIXES[mix]
    g = torch.Generator().manual_seed(4)
    ranks = torch.randint(0, R + 1, (L, len(sizes)), generator=g, dtype=torch.int32)
    ranks[:, 0] = R  # full rank somewhere, and rank 0 (slice untouched) somewhere else
    ranks[1, -1] = 0
    a, bt = _sliced_weights(sizes, ranks, seed=5)
    buffers = _buffers(a, bt, [0, *torch.tensor(sizes).cumsum(0).tolist()], ranks)
    # x is a column window of a wider tensor: rows have a stride larger than IN.
    x = torch.randn(len(slots), IN + 7, generator=g)[:, 3 : 3 + IN]
    y0 = torch.randn(len(slots), sum(sizes), generator=g)
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=L)
    y = _fused(y0.clone(), x, buffers, mapping)
    _, delta = _naive(x, a, bt.transpose(1, 2), slots, scale=1.0)
    torch.testing.assert_close(y.double(), y0.double() + delta, atol=1e-4, rtol=1e-4)
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(y[none_rows], y0[none_rows])
    # The torch twin gives the same answer from the same block-diagonal buffers.
    y_torch = torch_ops.add_lora(y0.clone(), x.contiguous(), a, bt.transpose(1, 2), mapping)
    torch.testing.assert_close(y, y_torch, atol=1e-4, rtol=1e-4)


def test_cpu_kernel_refuses_what_it_cannot_serve() -> None:
    ranks = torch.full((L, 1), R, dtype=torch.int32)
    a, bt = _sliced_weights([56], ranks, seed=0)
    buffers = _buffers(a, bt, [0, 56], ranks)
    mapping = LoRABatchMapping.build([0, 1], "cpu", max_loras=L)
    x, y = torch.randn(2, IN), torch.zeros(2, 56)
    assert not cpu_ops.applies(x.double(), y, mapping) and not cpu_ops.applies(x, y.double(), mapping)
    long_segment = LoRABatchMapping.build([0] * (cpu_ops.MAX_SEGMENT_LEN + 1), "cpu", max_loras=L)
    assert not cpu_ops.applies(torch.zeros(33, IN), torch.zeros(33, 56), long_segment)
    offsets = torch.tensor([0, 56])
    assert _buffers(a.double(), bt.double(), [0, 56], ranks).cpu_kernel_args is None
    assert cpu_ops.layer_args(a.transpose(1, 2), bt, offsets, ranks, R) is None  # not contiguous
    with pytest.raises(ValueError, match="do not cut"):
        cpu_ops.layer_args(a, bt, torch.tensor([0, 4096]), ranks, R)
    if cpu_ops.kernel_available():
        with pytest.raises(ValueError, match="do not fit"):
            _fused(torch.zeros(3, 56), torch.randn(3, IN), buffers, mapping)
        far = LoRABatchMapping.build([0, 100_000], "cpu")  # no max_loras: the mapping cannot check
        with pytest.raises(ValueError, match="out of range"):
            _fused(y, x, buffers, far)
        # Ranks past max_rank are clamped by the kernel, never read past the buffers.
        wild = _buffers(a, bt, [0, 56], torch.full((L, 1), 10**6, dtype=torch.int32))
        expected = _fused(torch.zeros(2, 56), x, buffers, mapping)
        torch.testing.assert_close(_fused(torch.zeros(2, 56), x, wild, mapping), expected)


def test_cpu_kernel_off_or_unbuildable_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: object,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", "0")
    assert not cpu_ops.kernel_available()
    monkeypatch.delenv("LORASERVE_CPU_LORA_KERNEL")
    # A compiler that fails: the kernel is reported unavailable (with the reason), nothing raises.
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    monkeypatch.setattr(cpu_ops, "_kernel", None)
    monkeypatch.setattr(cpu_ops, "_write_kernel", None)
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert not cpu_ops.kernel_available() and not cpu_ops.write_kernel_available()
    assert "CPU LoRA kernel unavailable" in caplog.text


# Property tests: random steps against the naive reference. Each layout the builder can pick is
# forced in turn ("padded_all" is the grid over all max_loras slots), plus the builder's own choice.
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
    torch.testing.assert_close(y[rows].double(), y0[rows].double() + delta[rows], **_tol(dtype))
    assert torch.equal(y[none_rows], y0[none_rows])


def _check_torch_ops(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, y0: torch.Tensor, mapping: LoRABatchMapping,
    slots: list[int], reference: tuple[torch.Tensor, torch.Tensor], poisoned: int | None = None,
) -> None:
    """shrink, expand and the fused add_lora against the reference (t, delta) of scale 0.5."""
    t_ref, delta_ref = reference
    dtype, window = x.dtype, slice(OFFSET, OFFSET + OUT)
    t = torch_ops.lora_shrink(x, a, mapping, scale=0.5)
    _assert_window(t, torch.zeros_like(t), t_ref, slots, dtype, poisoned)
    y = torch_ops.lora_expand(y0.clone(), t, b, mapping, offset=OFFSET)
    _assert_window(y[:, window], y0[:, window], delta_ref, slots, dtype, poisoned)
    y_fused = torch_ops.add_lora(y0.clone(), x, a, b, mapping, offset=OFFSET)
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
    mapping = _build(slots, max_loras, layout)
    _assert_layout(mapping, layout, slots)
    # The stacked buffers may hold more slots than max_loras (the grid then gathers its slots).
    x, a, b, y0 = _inputs(len(slots), max_loras + extra_slots, dtype, seed)
    _check_torch_ops(x, a, b, y0, mapping, slots, _naive(x, a, b, slots, scale=0.5))


def _kernel_weights(num_slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One full-rank slice: A [L, R, IN] and Bt [L, R, OUT], contiguous float32 as the kernel reads."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, R, IN, generator=g), torch.randn(num_slots, R, OUT, generator=g)


def _add_lora_f32(
    kernel: bool, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, mapping: LoRABatchMapping
) -> torch.Tensor:
    """What a LoRA layer runs: the C kernel when on and it serves the step, else the torch ops."""
    if kernel and cpu_ops.applies(x, y, mapping):
        return _fused(y, x, _buffers(a, bt, [0, OUT], torch.full((a.shape[0], 1), R, dtype=torch.int32)), mapping)
    return torch_ops.add_lora(y, x, a, bt.transpose(1, 2), mapping)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel_on", "kernel_off"])
@PROPERTY
@given(mix=slot_mixes(max_run=12), seed=st.integers(0, 2**16))
def test_cpu_kernel_on_and_off_match_naive(
    layout: str | None, kernel: bool, mix: tuple[list[int], int], seed: int
) -> None:
    if kernel and not cpu_ops.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    slots, max_loras = mix
    mapping = _build(slots, max_loras, layout)
    a, bt = _kernel_weights(max_loras, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, y0 = torch.randn(len(slots), IN, generator=g), torch.randn(len(slots), OUT, generator=g)
    _, delta = _naive(x, a, bt.transpose(1, 2), slots, scale=1.0)
    y = _add_lora_f32(kernel, y0.clone(), x, a, bt, mapping)
    _assert_window(y, y0, delta, slots, torch.float32)


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
    mapping = _build(slots, max_loras, layout)
    x, a, b, y0 = _inputs(len(slots), max_loras, dtype, seed)
    reference = _naive(x, a, b, slots, scale=0.5)
    a[poisoned].fill_(value)
    b[poisoned].fill_(value)
    _check_torch_ops(x, a, b, y0, mapping, slots, reference, poisoned)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel_on", "kernel_off"])
@PROPERTY
@given(mix=slot_mixes(max_run=12), value=st.sampled_from(NON_FINITE), seed=st.integers(0, 2**16),
       data=st.data())
def test_non_finite_slot_stays_isolated_with_kernel_on_and_off(
    layout: str | None, kernel: bool, mix: tuple[list[int], int], value: float, seed: int,
    data: st.DataObject,
) -> None:
    if kernel and not cpu_ops.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    slots, max_loras = mix
    poisoned = data.draw(st.integers(0, max_loras - 1), label="poisoned slot")
    mapping = _build(slots, max_loras, layout)
    a, bt = _kernel_weights(max_loras, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x, y0 = torch.randn(len(slots), IN, generator=g), torch.randn(len(slots), OUT, generator=g)
    _, delta = _naive(x, a, bt.transpose(1, 2), slots, scale=1.0)
    a[poisoned].fill_(value)
    bt[poisoned].fill_(value)
    y = _add_lora_f32(kernel, y0.clone(), x, a, bt, mapping)
    _assert_window(y, y0, delta, slots, torch.float32, poisoned)


@pytest.mark.parametrize(
    ("slots", "dtype"),
    [
        ([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3], torch.bfloat16),  # a decode step in bf16 (no C kernel)
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
    y = torch_ops.add_lora(torch.zeros(len(slots), 64, dtype=dtype), x, a, b, mapping)
    _, delta = _naive(x, a, b, slots, scale=1.0)
    torch.testing.assert_close(y.double(), delta, **_tol(dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", ["torch_f32", "torch_bf16", "kernel"])
def test_nan_slot_leaves_other_tokens_unaffected(layout: str | None, backend: str) -> None:
    """Slot 1 filled with NaN: its grid has empty cells (which used to be added into token 0, of
    slot 0), and tokens of slot 0 and without an adapter must come out exactly as without the NaN."""
    if backend == "kernel" and not cpu_ops.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    slots = [0, 0, 0, 1, -1, 2, 2]
    dtype = torch.bfloat16 if backend == "torch_bf16" else torch.float32
    mapping = _build(slots, 4, layout)
    a, bt = _kernel_weights(4, seed=7)
    a, bt = a.to(dtype), bt.to(dtype)
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(8)).to(dtype)
    y0 = torch.randn(len(slots), OUT, generator=torch.Generator().manual_seed(9)).to(dtype)

    def run(a: torch.Tensor, bt: torch.Tensor) -> torch.Tensor:
        if backend == "kernel":
            return _fused(y0.clone(), x, _buffers(a, bt, [0, OUT], torch.full((4, 1), R, dtype=torch.int32)), mapping)
        return torch_ops.add_lora(y0.clone(), x, a, bt.transpose(1, 2), mapping)

    clean = run(a, bt)
    a[1], bt[1] = float("nan"), float("nan")
    poisoned = run(a, bt)
    others = [i for i, s in enumerate(slots) if s != 1]
    assert torch.isnan(poisoned[3]).all()
    assert torch.equal(poisoned[others], clean[others])
