"""LoRA shrink/expand ops and the batch mapping on fixed step mixes, against a naive per-token reference.

Random mixes (hypothesis), every layout and non-finite slots are in test_lora_layout_properties.py."""

from __future__ import annotations

import importlib.util
import os

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

from loraserve.batch.lora_layout import LoRALayout
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.lora import ops
from loraserve.lora.ops import LoRABuffers, lora_cpu, lora_torch
from loraserve.native.kernel_slot import KernelSlot


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


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(L, R, IN, generator=g).to(dtype)
    # B stored [L, R, out] and passed as its [L, out, R] transpose, as LinearWithLoRA does.
    b = torch.randn(L, R, OUT, generator=g).to(dtype).transpose(1, 2)
    return a, b


@pytest.mark.parametrize("layout", [None, "runs", "grouped", "padded"])
@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_ops_match_naive(mix: str, layout: str | None, dtype: torch.dtype) -> None:
    slots = MIXES[mix]
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(2)).to(dtype)
    a, b = _weights(dtype)
    t_ref, delta_ref = naive_lora(x, a, b, slots, scale=0.5)
    for max_loras in (L, None):
        mapping = build_mapping(slots, max_loras, layout)
        t = lora_torch.lora_shrink(x, a, mapping, scale=0.5)
        torch.testing.assert_close(t.double(), t_ref, **tolerance(dtype))
        y0 = torch.randn(len(slots), OUT + 10, generator=torch.Generator().manual_seed(3)).to(dtype)
        y = lora_torch.lora_expand(y0.clone(), t, b, mapping, offset=4)
        torch.testing.assert_close(
            y[:, 4 : 4 + OUT].double(), y0[:, 4 : 4 + OUT].double() + delta_ref, **tolerance(dtype)
        )
        assert torch.equal(y[:, :4], y0[:, :4]) and torch.equal(y[:, 4 + OUT :], y0[:, 4 + OUT :])
        y_fused = lora_torch.add_lora(y0.clone(), x, a, b, mapping, offset=4)
        fused_ref = y0[:, 4 : 4 + OUT].double() + 2 * delta_ref  # add_lora has no scale (0.5 above)
        torch.testing.assert_close(y_fused[:, 4 : 4 + OUT].double(), fused_ref, **tolerance(dtype))
        # Rows without an adapter are left bit-for-bit alone.
        none_rows = [i for i, s in enumerate(slots) if s < 0]
        assert torch.equal(y_fused[none_rows], y0[none_rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["1", "0"])
def test_contiguous_weights_and_dispatch_match(kernel: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ops.add_lora` (the C kernel when on and built, else the torch ops) against shrink then expand."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", kernel)
    kernel_calls = []
    run = lora_cpu.run
    monkeypatch.setattr(lora_cpu, "run", lambda *args: kernel_calls.append(1) or run(*args))
    slots = MIXES["zipf"]
    x = torch.randn(len(slots), IN).to(dtype)
    a, b = _weights(dtype)
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=L)
    y1 = torch.zeros(len(slots), OUT, dtype=dtype)
    buffers = make_buffers(a, b.transpose(1, 2).contiguous(), [0, OUT], torch.full((L, 1), R, dtype=torch.int32))
    ops.add_lora(y1, x, buffers, mapping)
    assert len(kernel_calls) == (kernel == "1" and lora_cpu.kernel_available())
    y2 = ops.lora_expand(
        torch.zeros(len(slots), OUT, dtype=dtype), ops.lora_shrink(x, a.contiguous(), mapping), b.contiguous(), mapping
    )
    if dtype == torch.float32:
        torch.testing.assert_close(y1, y2, atol=1e-5, rtol=1e-5)
    else:  # each within ~1 ulp of the exact sum, so within 3 of each other
        assert_within_bf16_ulps(y1, y2.double(), lora_magnitude(x, a, b, slots), ulps=3)


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
    from loraserve.lora.ops import lora_triton

    device = _triton_device()
    assert device is not None
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16 dot")
    slots = MIXES[mix]
    x = torch.randn(len(slots), IN).to(dtype)
    a, b = _weights(dtype)
    t_ref, delta_ref = naive_lora(x, a, b, slots, scale=0.5)
    mapping = LoRABatchMapping.build(slots, device, max_loras=L)
    x, a, b = x.to(device), a.to(device), b.to(device)
    tol = tolerance(torch.float32 if dtype == torch.float32 else torch.bfloat16)
    t = lora_triton.lora_shrink(x, a, mapping, scale=0.5)
    torch.testing.assert_close(t.double().cpu(), t_ref, **tol)
    y0 = torch.randn(len(slots), OUT + 10).to(dtype).to(device)
    y = lora_triton.lora_expand(y0.clone(), t, b, mapping, offset=4)
    torch.testing.assert_close(
        y[:, 4 : 4 + OUT].double().cpu(), y0[:, 4 : 4 + OUT].double().cpu() + delta_ref, **tol
    )
    assert torch.equal(y[:, :4], y0[:, :4])
    y_fused = lora_triton.add_lora(y0.clone(), x, a, b, mapping, offset=4)
    fused_ref = y0[:, 4 : 4 + OUT].double().cpu() + 2 * delta_ref
    torch.testing.assert_close(y_fused[:, 4 : 4 + OUT].double().cpu(), fused_ref, **tol)


def _sliced_weights(
    sizes: list[int], ranks: torch.Tensor, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
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
    return a.to(dtype), bt.to(dtype)


# Slice layouts: plain, qkv-like (uneven), gate_up-like, and widths that are not multiples of the
# kernel's vector and chunk sizes (scalar tails).
SLICES = {"plain": [56], "qkv": [40, 8, 8], "gate_up": [300, 300], "odd": [37, 5]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", list(SLICES.values()), ids=list(SLICES))
@pytest.mark.parametrize("mix", list(MIXES))
def test_cpu_kernel_matches_naive(mix: str, sizes: list[int], dtype: torch.dtype) -> None:
    """Against the float64 reference of the same (bf16-rounded) inputs and the torch twin. In bf16 the
    kernel rounds each output once, to nearest (half an ulp of the magnitude it sums, plus float32
    noise), from t as its build rounds it (the reference rounds t alike), and the twin rounds t, the
    product and the sum (at most 1.5 ulps)."""
    if not lora_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    slots = MIXES[mix]
    g = torch.Generator().manual_seed(4)
    ranks = torch.randint(0, R + 1, (L, len(sizes)), generator=g, dtype=torch.int32)
    ranks[:, 0] = R  # full rank somewhere, and rank 0 (slice untouched) somewhere else
    ranks[1, -1] = 0
    a, bt = _sliced_weights(sizes, ranks, seed=5, dtype=dtype)
    buffers = make_buffers(a, bt, [0, *torch.tensor(sizes).cumsum(0).tolist()], ranks)
    # x is a column window of a wider tensor: rows have a stride larger than IN.
    x = torch.randn(len(slots), IN + 7, generator=g)[:, 3 : 3 + IN].to(dtype)
    y0 = torch.randn(len(slots), sum(sizes), generator=g).to(dtype)
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=L)
    y = run_cpu_kernel(y0.clone(), x, buffers, mapping)
    build = lora_cpu.kernel_build()
    assert build is not None
    _, delta = naive_lora(x, a, bt.transpose(1, 2), slots, scale=1.0, t_dtype=build.t_dtype(dtype))
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(y[none_rows], y0[none_rows])
    # The torch twin gives the same answer from the same block-diagonal buffers.
    y_torch = lora_torch.add_lora(y0.clone(), x.contiguous(), a, bt.transpose(1, 2), mapping)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y0.double() + delta, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y, y_torch, atol=1e-4, rtol=1e-4)
    else:
        magnitude = y0.double().abs() + lora_magnitude(x, a, bt.transpose(1, 2), slots)
        assert_within_bf16_ulps(y, y0.double() + delta, magnitude, ulps=0.6)
        assert_within_bf16_ulps(y_torch, y0.double() + delta, magnitude, ulps=2)


def test_cpu_kernel_refuses_what_it_cannot_serve() -> None:
    ranks = torch.full((L, 1), R, dtype=torch.int32)
    a, bt = _sliced_weights([56], ranks, seed=0)
    buffers = make_buffers(a, bt, [0, 56], ranks)
    mapping = LoRABatchMapping.build([0, 1], "cpu", max_loras=L)
    x, y = torch.randn(2, IN), torch.zeros(2, 56)
    args = buffers.cpu_kernel_args
    for other in (torch.float64, torch.float16, torch.bfloat16):  # activations of another dtype than the buffers'
        assert not lora_cpu.serves(args, mapping, other)
    assert lora_cpu.serves(args, mapping, torch.float32) == lora_cpu.kernel_available()
    assert not lora_cpu.serves(None, mapping, torch.float32)  # buffers the kernel cannot read
    assert not lora_cpu.serves(args, LoRABatchMapping.build([0, L], "cpu"), torch.float32)  # a slot past the layer's
    far = LoRABatchMapping.build([0, L], "cpu")
    for step in (mapping, far):  # the batched form (the decoder stack's) answers as `serves` does, layer by layer
        layers = [args, None, make_buffers(a.bfloat16(), bt.bfloat16(), [0, 56], ranks).cpu_kernel_args]
        assert lora_cpu.serving(layers, step, torch.float32) == [lora_cpu.serves(x, step, torch.float32) for x in layers]
    for dtype in (torch.float32, torch.bfloat16):
        max_len = lora_cpu.max_segment_len(dtype)
        if max_len == 0:
            continue
        typed = make_buffers(a.to(dtype), bt.to(dtype), [0, 56], ranks).cpu_kernel_args
        long_segment = LoRABatchMapping.build([0] * (max_len + 1), "cpu", max_loras=L)
        assert not lora_cpu.serves(typed, long_segment, dtype)
        assert lora_cpu.serves(typed, LoRABatchMapping.build([0] * max_len, "cpu", max_loras=L), dtype)
    offsets = torch.tensor([0, 56])
    assert make_buffers(a.double(), bt.double(), [0, 56], ranks).cpu_kernel_args is None
    assert make_buffers(a.half(), bt.half(), [0, 56], ranks).cpu_kernel_args is None
    assert make_buffers(a.bfloat16(), bt, [0, 56], ranks).cpu_kernel_args is None  # one dtype for both
    assert lora_cpu.layer_args(a.transpose(1, 2), bt, offsets, ranks, R) is None  # not contiguous
    with pytest.raises(ValueError, match="do not cut"):
        lora_cpu.layer_args(a, bt, torch.tensor([0, 4096]), ranks, R)
    if lora_cpu.kernel_available():
        with pytest.raises(ValueError, match="do not fit"):
            run_cpu_kernel(torch.zeros(3, 56), torch.randn(3, IN), buffers, mapping)
        with pytest.raises(ValueError, match="not of the LoRA buffers' dtype"):  # run's own checks
            lora_cpu.run(x.bfloat16(), y.bfloat16(), args, mapping)
        far = LoRABatchMapping.build([0, 100_000], "cpu")  # no max_loras: the mapping cannot check
        with pytest.raises(ValueError, match="out of range"):
            lora_cpu.run(x, y, args, far)
        with pytest.raises(ValueError, match="2-D CPU rows"):
            lora_cpu.run(x, y.t().contiguous().t(), args, mapping)
        # Ranks past max_rank are clamped by the kernel, never read past the buffers.
        wild = make_buffers(a, bt, [0, 56], torch.full((L, 1), 10**6, dtype=torch.int32))
        expected = run_cpu_kernel(torch.zeros(2, 56), x, buffers, mapping)
        torch.testing.assert_close(run_cpu_kernel(torch.zeros(2, 56), x, wild, mapping), expected)


def test_cpu_kernel_off_or_unbuildable_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: object,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", "0")
    assert not lora_cpu.kernel_available()
    monkeypatch.delenv("LORASERVE_CPU_LORA_KERNEL")
    # A compiler that fails: the kernel is reported unavailable (with the reason), nothing raises.
    monkeypatch.setattr(lora_cpu, "_kernel", KernelSlot(lora_cpu._build_and_log, lora_cpu.envs.cpu_lora_kernel))
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert not lora_cpu.kernel_available() and not lora_cpu.write_kernel_available()
    assert "C kernel lora_kernel.c unavailable" in caplog.text


# Property tests: random steps against the naive reference. Each layout the builder can pick is
# forced in turn ("padded_all" is the grid over all max_loras slots), plus the builder's own choice.


def test_cpu_kernel_names_the_weights_each_call_reads() -> None:
    """lora_weight_ranges (what the decoder stack has the base product fetch ahead of the LoRA kernel)
    lists, per segment in order and per slice, A's rows and Bt's block of the slot (its rank's rows,
    its slice's columns), says when the kernel splits segments among threads, and declines past its
    room for runs."""
    import ctypes

    ranges = lora_cpu.weight_ranges_function()
    if ranges is None:
        pytest.skip("the C kernel is not built here")
    buffers = LoRABuffers.allocate(4, 8, 64, [0, 32, 48], torch.bfloat16, torch.device("cpu"), False)
    buffers.ranks.copy_(torch.tensor([[8, 8], [8, 8], [3, 0], [8, 5]], dtype=torch.int32))
    layer = buffers.cpu_kernel_args
    assert layer is not None
    out = (ctypes.c_int64 * (2 + 4 * 16))()

    def listed(slots: list[int], num_threads: int, room: int = 16) -> tuple[int, int, list[tuple[int, ...]]]:
        mapping = LoRABatchMapping.build(slots, "cpu", max_loras=4)
        assert mapping.cpu_kernel_args is not None
        total = ranges(ctypes.addressof(layer.c_layer), ctypes.addressof(mapping.cpu_kernel_args), out, room,
                       num_threads)
        return total, out[1], [tuple(out[2 + 4 * i : 6 + 4 * i]) for i in range(out[0])]

    def runs(slot: int) -> list[tuple[int, ...]]:
        found = []
        for q, (lo, hi) in enumerate([(0, 32), (32, 48)]):
            rank = int(buffers.ranks[slot, q])
            a, bt = buffers.lora_a[slot, q * 8], buffers.lora_b_t[slot, q * 8, lo:]
            found += [(a.data_ptr(), rank * 64 * 2, 1, 0), (bt.data_ptr(), (hi - lo) * 2, rank, 48 * 2)]
        return found

    total, split, found = listed([2, -1, 0, 2, 3], num_threads=2)
    assert found == runs(0) + runs(2) + runs(3) and split == 0
    assert total == sum(size * rows for _, size, rows, _ in found)
    assert listed([0, 1, 2, 3], num_threads=2)[1] == 4  # one-token segments on 2 threads: 4 runs each
    assert listed([0, 1, 2, 3], num_threads=1)[1] == 0
    assert listed([0] * 9 + [1, 2, 3], num_threads=2)[1] == 0  # a segment longer than a token group
    assert listed([-1, -1], num_threads=1) == (0, 0, [])
    assert listed([0, 1, 2], num_threads=1, room=11)[0] == -1 and out[0] == 0


def test_lora_buffers_take_given_storage_of_their_shapes_only() -> None:
    """A model's layers take their slot buffers from one allocation (huge pages): the storage is used
    as is, and storage of another shape or dtype is refused."""
    offsets = [0, 32, 48]
    a, b = (torch.zeros(shape) for shape in LoRABuffers.shapes(4, 8, 64, offsets))
    buffers = LoRABuffers.allocate(4, 8, 64, offsets, torch.float32, torch.device("cpu"), False, storage=[a, b])
    assert buffers.lora_a.data_ptr() == a.data_ptr() and buffers.lora_b_t.data_ptr() == b.data_ptr()
    with pytest.raises(ValueError, match="wrong shape or dtype"):
        LoRABuffers.allocate(4, 8, 64, offsets, torch.float32, torch.device("cpu"), False, storage=[b, a])
    with pytest.raises(ValueError, match="wrong shape or dtype"):
        LoRABuffers.allocate(4, 8, 64, offsets, torch.float32, torch.device("cpu"), False,
                             storage=[a.bfloat16(), b.bfloat16()])
