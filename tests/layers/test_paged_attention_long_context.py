"""Long-context decode through the CPU paged-attention kernel (every vector width's build) against
the float64 reference: the shapes issue 26's long-context step runs (16 sequences, ~2k tokens).

Decode of sequences whose contexts are odd lengths crossing cache blocks and the kernel's 128-key
blocks (1, 17, 129, 300, 1023), GQA groups 1, 4 and 8, head dims 64, 128 and 256 (Gemma), sliding
windows that start mid-block and logit softcaps; at 1 thread (one item per sequence and all its KV
heads) and 2 (items of one KV head, or key partitions merged in a second pass), so every way the kernel
cuts a long context into work is compared with the definition."""

from __future__ import annotations

import contextlib
import platform
import zlib
from collections.abc import Iterator

import pytest
import torch
from support.attention_reference import AttentionCase, make_inputs, reference_attention, tolerance

from loraserve.layers import paged_attention_cpu
from loraserve.native.build import cpu_flags, load_library

CONTEXTS = (1, 17, 129, 300, 1023)  # crossing cache blocks of 16 and the kernel's key blocks of 128
GROUPS = {"g1": (8, 8), "g4": (8, 2), "g8": (16, 2)}  # (num_heads, num_kv_heads)
FEATURES: dict[str, tuple[float | None, int | None]] = {  # (softcap, window)
    "plain": (None, None),
    "window": (None, 250),  # starts mid-block in the longer contexts, covers the shorter ones whole
    "softcap": (30.0, None),
    "softcap_window": (5.0, 97),
}
DTYPES = [torch.float32, torch.bfloat16]


def _decode_case(group: str, head_dim: int, dtype: torch.dtype, feature: str) -> AttentionCase:
    softcap, window = FEATURES[feature]
    heads, kv_heads = GROUPS[group]
    return AttentionCase(
        (1,) * len(CONTEXTS), CONTEXTS, heads, kv_heads, head_dim, 16, dtype, softcap, window
    )


@contextlib.contextmanager
def _threads(num_threads: int) -> Iterator[None]:
    """The kernel splits work by torch's thread count: set it for the call, whatever the machine's."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("group", list(GROUPS))
def test_long_context_decode_matches_reference(
    group: str, head_dim: int, dtype: torch.dtype, feature: str, num_threads: int
) -> None:
    if not paged_attention_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU attention kernel cannot be built")
    case = _decode_case(group, head_dim, dtype, feature)
    inputs = make_inputs(case, seed=zlib.crc32(repr((group, head_dim, feature)).encode()))
    with _threads(num_threads):
        out = paged_attention_cpu.paged_attention(
            inputs.q,
            inputs.k_cache,
            inputs.v_cache,
            inputs.block_tables,
            inputs.context_lens,
            inputs.query_starts,
            case.block_size,
            case.scale,
            case.softcap,
            case.window,
        )
    assert out.dtype == dtype and out.shape == inputs.q.shape
    torch.testing.assert_close(out.double(), reference_attention(case, inputs), **tolerance(dtype))


# The other CPU classes' builds, made here as test_paged_attention_kernels does: AVX2 and portable C.
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


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANT_ARCHES))
def test_other_vector_widths_decode_long_contexts(
    variant_kernels: dict[str, object], variant: str, dtype: torch.dtype, num_threads: int
) -> None:
    if variant not in variant_kernels:
        pytest.skip(f"this machine cannot build or run the {variant} variant")
    for group, head_dim, feature in [
        ("g1", 256, "softcap_window"),
        ("g4", 64, "window"),
        ("g8", 128, "plain"),
    ]:
        case = _decode_case(group, head_dim, dtype, feature)
        inputs = make_inputs(case, seed=zlib.crc32(repr((variant, group, head_dim)).encode()))
        with _threads(num_threads):
            out = paged_attention_cpu.run_kernel(
                variant_kernels[variant],
                inputs.q,
                inputs.k_cache,
                inputs.v_cache,
                inputs.block_tables,
                inputs.context_lens,
                inputs.query_starts,
                case.block_size,
                case.scale,
                case.softcap,
                case.window,
            )
        torch.testing.assert_close(out.double(), reference_attention(case, inputs), **tolerance(dtype))
