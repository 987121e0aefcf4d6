"""The paged attention kernels (C on CPU, Triton) against the torch twin and a float64 reference.

Block tables are shuffled and non-contiguous, unused cache slots hold NaN, contexts cross block
boundaries; decode, single prefill, chunked prefill, mixed and short multi-token query steps; GQA
groups 1, 3, 4 and 40; head dims 64, 128 and 33; sliding window and logit softcap; float32 and bf16."""

from __future__ import annotations

import importlib.util
import itertools
import os
import platform
import zlib

import pytest
import torch
from support.attention_reference import (
    AttentionCase,
    AttentionInputs,
    make_inputs,
    reference_attention,
    tolerance,
)

from loraserve.layers import paged_attention_cpu, paged_attention_torch
from loraserve.native.build import cpu_flags, load_library

MODES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {  # (query_lens, context_lens)
    "decode": ((1, 1, 1, 1, 1), (1, 16, 17, 40, 75)),
    "prefill": ((37,), (37,)),
    "chunked_prefill": ((7, 20), (30, 20)),
    "mixed": ((1, 9, 1, 33), (50, 9, 16, 40)),
    "short_queries": ((4, 2, 3), (40, 17, 70)),  # items of all, or of some, of the KV heads (4 x 9 heads)
}
GROUPS = [(4, 4), (9, 3), (8, 2), (40, 1)]  # (num_heads, num_kv_heads): groups of 1, 3, 4 and 40 (> MAX_ROWS)
FEATURES: dict[str, tuple[float | None, int | None]] = {  # (softcap, window)
    "plain": (None, None),
    "window": (None, 6),
    "softcap": (5.0, None),
    "softcap_window": (5.0, 6),
}
DTYPES = [torch.float32, torch.bfloat16]


def _case(mode: str, group: tuple[int, int], dims: tuple[int, int], dtype: torch.dtype, feature: str) -> AttentionCase:
    query_lens, context_lens = MODES[mode]
    softcap, window = FEATURES[feature]
    return AttentionCase(query_lens, context_lens, *group, *dims, dtype, softcap, window)


def _run(op: object, case: AttentionCase, inputs: AttentionInputs) -> torch.Tensor:
    return op(  # type: ignore[operator]
        inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.context_lens, inputs.query_starts,
        case.block_size, case.scale, case.softcap, case.window,
    )


def _needs_kernel() -> None:
    if not paged_attention_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU attention kernel cannot be built")


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [(64, 16), (128, 5), (33, 7)], ids=lambda d: f"D{d[0]}-bs{d[1]}")
@pytest.mark.parametrize("group", GROUPS, ids=lambda g: f"H{g[0]}-KVH{g[1]}")
@pytest.mark.parametrize("mode", list(MODES))
def test_cpu_kernel_matches_reference_and_twin(
    mode: str, group: tuple[int, int], dims: tuple[int, int], dtype: torch.dtype, feature: str
) -> None:
    _needs_kernel()
    case = _case(mode, group, dims, dtype, feature)
    inputs = make_inputs(case, seed=zlib.crc32(repr((mode, group, dims, feature)).encode()))
    expected = reference_attention(case, inputs)
    out = _run(paged_attention_cpu.paged_attention, case, inputs)
    twin = _run(paged_attention_torch.paged_attention, case, inputs)
    assert out.dtype == dtype and out.shape == inputs.q.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, **tolerance(dtype))
    torch.testing.assert_close(twin.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("mode", ["decode", "short_queries"])
def test_short_query_items_take_several_kv_heads(mode: str, num_threads: int) -> None:
    """With few threads for the sequences, a short query's item covers all its KV heads at once (the
    engine's decode on a small machine); this must match the reference whatever the machine's thread
    count, so the count is set here."""
    _needs_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for group, feature, dtype in itertools.product(GROUPS, FEATURES, DTYPES):
            case = _case(mode, group, (64, 16), dtype, feature)
            inputs = make_inputs(case, seed=zlib.crc32(repr((mode, group, feature, num_threads)).encode()))
            out = _run(paged_attention_cpu.paged_attention, case, inputs)
            torch.testing.assert_close(out.double(), reference_attention(case, inputs), **tolerance(dtype))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_contexts_split_over_threads(num_threads: int, dtype: torch.dtype) -> None:
    """A few long sequences give the threads too few items, so their keys are split into partitions
    that a second pass merges (windowed and not); the result must not depend on the split."""
    _needs_kernel()
    case = AttentionCase((1, 3), (1500, 700), 6, 2, 64, 16, dtype, None, None)
    windowed = AttentionCase((1, 3), (1500, 700), 6, 2, 64, 16, dtype, 2.5, 600)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for c in (case, windowed):
            inputs = make_inputs(c, seed=num_threads)
            out = _run(paged_attention_cpu.paged_attention, c, inputs)
            torch.testing.assert_close(out.double(), reference_attention(c, inputs), **tolerance(dtype))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [2, 5])
def test_a_decode_row_gets_the_same_bits_in_any_step(num_threads: int) -> None:
    """A sequence's decode row alone (few items: its keys split over the threads) and in a step of many
    sequences (items enough) sums its keys in the same pieces: the output is the same bits (a speculative
    verification's rows and a growing batch leave a greedy output unchanged at any thread count)."""
    _needs_kernel()
    case = AttentionCase((1,) * 9, (700, 1500, 30, 300, 64, 900, 16, 200, 1), 9, 3, 64, 16, torch.bfloat16)
    inputs = make_inputs(case, seed=7)
    alone = AttentionInputs(
        inputs.q[:1], inputs.k_cache, inputs.v_cache, inputs.tables[:1], inputs.block_tables[:1],
        inputs.context_lens[:1], inputs.query_starts[:2],
    )  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = _run(paged_attention_cpu.paged_attention, case, inputs)
        one = _run(paged_attention_cpu.paged_attention, AttentionCase((1,), (700,), 9, 3, 64, 16, torch.bfloat16), alone)
        assert torch.equal(one[0], batch[0])
    finally:
        torch.set_num_threads(before)


LANE_CASES = [  # (query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, softcap, window)
    ((50, 20, 2), (300, 20, 9), 9, 3, 64, 16, None, None),  # chunks of 16 queries over 3 blocks of keys
    ((70, 9), (70, 40), 4, 4, 33, 5, 5.0, 40),  # group 1: chunks of 48 queries (> MAX_ROWS), odd head dim
    ((13, 30), (200, 30), 16, 2, 128, 32, None, 70),  # group 8: chunks of 6 queries, a window across blocks
    ((20,), (150,), 8, 2, 256, 1, 2.5, None),  # the widest head dim, blocks of one slot
    ((20,), (1200,), 8, 2, 64, 16, None, None),  # at 2 threads, too few items: key partitions merged
]


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_chunks_over_several_key_blocks(num_threads: int, dtype: torch.dtype) -> None:
    """Prefill chunks (bf16: the rows-in-lanes path) whose keys span several blocks of the online
    softmax, split into partitions at 2 threads, with causal edges inside the key groups and tiles,
    GQA groups 1 to 8, odd and wide head dims, windows and softcaps."""
    _needs_kernel()
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for i, (query_lens, context_lens, heads, kv_heads, dim, block, softcap, window) in enumerate(LANE_CASES):
            case = AttentionCase(query_lens, context_lens, heads, kv_heads, dim, block, dtype, softcap, window)
            inputs = make_inputs(case, seed=100 + i)
            out = _run(paged_attention_cpu.paged_attention, case, inputs)
            torch.testing.assert_close(out.double(), reference_attention(case, inputs), **tolerance(dtype))
    finally:
        torch.set_num_threads(before)


def test_q_rows_may_be_strided_views() -> None:
    """q as the engine hands it over: a [T, H, D] view into a wider fused qkv row."""
    _needs_kernel()
    case = _case("mixed", (8, 2), (64, 16), torch.float32, "plain")
    inputs = make_inputs(case, seed=3)
    qkv = torch.cat([inputs.q.flatten(1), torch.randn(inputs.q.shape[0], 2 * 2 * 64)], dim=1)
    q_view = qkv[:, : 8 * 64].view(-1, 8, 64)
    assert not q_view.is_contiguous() and paged_attention_cpu.serves(q_view, inputs.k_cache, inputs.v_cache)
    out = paged_attention_cpu.paged_attention(
        q_view, inputs.k_cache, inputs.v_cache, inputs.block_tables, inputs.context_lens, inputs.query_starts,
        case.block_size, case.scale,
    )
    torch.testing.assert_close(out.double(), reference_attention(case, inputs), **tolerance(torch.float32))


def test_metadata_pointing_outside_the_cache_is_refused() -> None:
    _needs_kernel()
    case = _case("mixed", (4, 4), (64, 16), torch.float32, "plain")
    inputs = make_inputs(case, seed=4)
    num_blocks = inputs.k_cache.shape[0] // case.block_size
    bad_tables = inputs.block_tables.clone()
    bad_tables[2, 0] = num_blocks
    bad_lens = inputs.context_lens.clone()
    bad_lens[1] = 5  # shorter than its 9 queries
    bad_starts = inputs.query_starts.clone()
    bad_starts[-1] += 1  # one token more than q holds
    for tables, lens, starts in [
        (bad_tables, inputs.context_lens, inputs.query_starts),
        (inputs.block_tables, bad_lens, inputs.query_starts),
        (inputs.block_tables, inputs.context_lens, bad_starts),
    ]:
        with pytest.raises(ValueError, match="outside the KV cache"):
            paged_attention_cpu.paged_attention(
                inputs.q, inputs.k_cache, inputs.v_cache, tables, lens, starts, case.block_size, case.scale
            )
    with pytest.raises(ValueError, match="int32"):
        paged_attention_cpu.paged_attention(
            inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_tables.long(), inputs.context_lens,
            inputs.query_starts, case.block_size, case.scale,
        )


def test_kernel_does_not_serve_what_it_cannot_read() -> None:
    _needs_kernel()
    inputs = make_inputs(_case("decode", (4, 4), (64, 16), torch.float32, "plain"), seed=5)
    q, k, v = inputs.q, inputs.k_cache, inputs.v_cache
    assert paged_attention_cpu.serves(q, k, v)
    assert not paged_attention_cpu.serves(q.half(), k.half(), v.half())
    assert paged_attention_cpu.serves(q.bfloat16(), k, v)  # the cache's format is its own (kv_cache.py)
    assert not paged_attention_cpu.serves(q, k.half(), v.half())
    assert not paged_attention_cpu.serves(q, k, v.bfloat16())
    assert not paged_attention_cpu.serves(q.transpose(0, 1).contiguous().transpose(0, 1), k, v)
    rows, slots = torch.zeros(q.shape[0], k.shape[1] * k.shape[2]), torch.zeros(q.shape[0], dtype=torch.long)
    assert paged_attention_cpu.serves(q, k, v, (rows, rows, slots))  # write_and_attend's new rows
    assert not paged_attention_cpu.serves(q, k, v, (rows, rows, slots.int()))
    assert not paged_attention_cpu.serves(q, k, v, (rows[:, 1:], rows, slots))
    assert not paged_attention_cpu.serves(q, k, v, (rows.t().contiguous().t(), rows, slots))
    assert not paged_attention_cpu.serves(q, k, v, (rows.bfloat16(), rows, slots))  # new rows in q's dtype


# The other CPU classes' code paths, built here: AVX2 (8 lanes) and portable C (x86-64 has no AVX).
VARIANT_ARCHES = {"avx2": "haswell", "portable": "x86-64"}


@pytest.fixture(scope="module")
def variant_kernels() -> dict[str, object]:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the variant builds are x86 -march values")
    kernels = {}
    for name, arch in VARIANT_ARCHES.items():
        if name == "avx2" and not {"avx2", "fma"} <= cpu_flags():
            continue
        lib = load_library("paged_attention.c", arch=arch)
        if lib is None:
            pytest.skip("no C compiler")
        kernels[name] = paged_attention_cpu.bind(lib)
    return kernels


@pytest.mark.parametrize("variant", ["avx2", "portable"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(MODES))
def test_other_vector_widths_match_reference(
    variant_kernels: dict[str, object], variant: str, mode: str, dtype: torch.dtype
) -> None:
    if variant not in variant_kernels:
        pytest.skip(f"this machine cannot build or run the {variant} variant")
    for group, dims, feature in [((9, 3), (64, 16), "softcap_window"), ((8, 2), (33, 5), "plain")]:
        case = _case(mode, group, dims, dtype, feature)
        inputs = make_inputs(case, seed=6)
        out = paged_attention_cpu.run_kernel(
            variant_kernels[variant], inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_tables,
            inputs.context_lens, inputs.query_starts, case.block_size, case.scale, case.softcap, case.window,
        )
        torch.testing.assert_close(out.double(), reference_attention(case, inputs), **tolerance(dtype))


def _triton_device() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.skipif(_triton_device() is None, reason="needs CUDA + Triton (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", list(MODES))
def test_triton_matches_reference(mode: str, dtype: torch.dtype, feature: str) -> None:
    from loraserve.layers import paged_attention_triton

    device = _triton_device()
    assert device is not None
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16")
    # The interpreter runs each program in Python, so the fewest KV heads that keep every path: a padded
    # group of 3 over two KV heads, head dim 33 (masked) with blocks of 5 in a group of 4, and a group of
    # 1 over two heads at head dim 128.
    for group, dims in [((6, 2), (64, 16)), ((4, 1), (33, 5)), ((2, 2), (128, 16))]:
        case = _case(mode, group, dims, dtype, feature)
        inputs = make_inputs(case, seed=7)
        expected = reference_attention(case, inputs)
        q, k_cache, v_cache, tables, lens, starts = (
            t.to(device) for t in (inputs.q, inputs.k_cache, inputs.v_cache, inputs.block_tables,
                                   inputs.context_lens, inputs.query_starts)
        )
        out = paged_attention_triton.paged_attention(
            q, k_cache, v_cache, tables, lens, starts, case.block_size, case.scale, case.softcap, case.window,
            max_query_len=max(case.query_lens),
        )
        assert out.dtype == dtype and out.shape == inputs.q.shape
        tol = tolerance(torch.float32 if dtype == torch.float32 else torch.bfloat16)
        torch.testing.assert_close(out.double().cpu(), expected, **tol)
