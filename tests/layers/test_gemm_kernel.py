"""The CPU linear kernel (gemm_kernel.c) against a float64 reference and its twin (F.linear), on every
build this machine can run: tiles that do not divide the rows, column blocks that do not divide the
outputs, odd input widths, a bias, strided rows; and the builds that must serve nothing."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.lora_reference import assert_within_bf16_ulps

from loraserve.layers import gemm_cpu
from loraserve.layers.linear import Linear, pack_cpu_linears
from loraserve.native.build import cpu_flags

# name: (flags after -march=native, CPU flags the build needs, dtypes it must serve)
BUILDS: dict[str, tuple[tuple[str, ...], set[str], set[torch.dtype]]] = {
    "avx512_bf16": ((), {"avx512f", "avx512bw", "avx512_bf16"}, {torch.float32, torch.bfloat16}),
    "avx512": (("-mno-avx512bf16",), {"avx512f", "avx512bw"}, {torch.float32}),
    "avx2": (("-mno-avx512f",), {"avx2", "fma"}, set()),
    "portable": (("-mno-avx",), set(), set()),
}
# (rows, in, out): 8-row tiles with tails, 48-column blocks with tails, odd widths, more rows than
# one work item's 128-row chunk, and one row of one column.
SHAPES = [(1, 1, 1), (7, 33, 50), (8, 64, 48), (9, 576, 97), (33, 31, 200), (130, 96, 145), (300, 17, 49)]


def _install(flags: tuple[str, ...], needs: set[str]) -> Any:
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
        pytest.skip(f"this build needs an x86-64 CPU with {sorted(needs)}")
    lib = gemm_cpu.build_kernel(flags)
    if lib is None:
        pytest.skip("no C compiler: the kernel is not built here")
    return lib


@pytest.fixture(params=list(BUILDS))
def build(request: pytest.FixtureRequest) -> Iterator[tuple[str, set[torch.dtype]]]:
    """Swaps the named build in for the process's own one, and the process's back afterwards."""
    flags, needs, dtypes = BUILDS[request.param]
    own = gemm_cpu.kernel_library()
    gemm_cpu.use_library(_install(flags, needs))
    yield request.param, dtypes
    gemm_cpu.use_library(own)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of the (rounded) inputs, and the magnitude sum |x||w| that bounds rounding."""
    ref = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    if bias is not None:
        ref, magnitude = ref + bias.double(), magnitude + bias.double().abs()
    return ref, magnitude


def _inputs(rows: int, cols_in: int, cols_out: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols_in, generator=g).to(dtype)
    weight = torch.randn(cols_out, cols_in, generator=g).to(dtype)
    bias = torch.randn(cols_out, generator=g).to(dtype)
    return x, weight, bias


def _kernel_dtype() -> torch.dtype:
    """bf16 where this CPU's build serves it, else float32 (tests that need one served dtype)."""
    return torch.bfloat16 if gemm_cpu.block_layout(torch.bfloat16) else torch.float32


def _packed_or_skip(weight: torch.Tensor) -> gemm_cpu.PackedWeight:
    packed = gemm_cpu.pack(weight)
    if packed is None:
        pytest.skip(f"the kernel does not serve {weight.dtype} on this CPU")
    return packed


def _check(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    ref, magnitude = _reference(x, weight, bias)
    if y.dtype == torch.bfloat16:  # float32 sums, one rounding: half an ulp plus the sums' own error
        assert_within_bf16_ulps(y, ref, magnitude, ulps=1.0)
    else:
        assert bool(((y.double() - ref).abs() <= 1e-6 * magnitude + 1e-30).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
def test_every_build_matches_reference_or_declines(build: tuple[str, set[torch.dtype]], dtype: torch.dtype,
                                                   with_bias: bool) -> None:
    name, served = build
    for i, (rows, cols_in, cols_out) in enumerate(SHAPES):
        x, weight, bias = _inputs(rows, cols_in, cols_out, dtype, seed=i)
        packed = gemm_cpu.pack(weight)
        if dtype not in served:
            assert packed is None, f"the {name} build must leave {dtype} to oneDNN"
            return
        assert packed is not None
        y = gemm_cpu.linear(x, packed, bias if with_bias else None)
        assert y.shape == (rows, cols_out) and y.dtype == dtype
        _check(y, x, weight, bias if with_bias else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_strided_rows_leading_dims_and_twin_agree(dtype: torch.dtype) -> None:
    x_wide, weight, bias = _inputs(12, 80, 70, dtype, seed=7)
    packed = gemm_cpu.pack(weight)
    if packed is None:
        pytest.skip(f"the kernel does not serve {dtype} on this CPU")
    x = x_wide[:, 5:69]  # rows 80 apart, 64 features
    packed = gemm_cpu.pack(weight[:, 5:69].contiguous())
    assert packed is not None
    y = gemm_cpu.linear(x, packed, bias)
    _check(y, x, weight[:, 5:69], bias)
    twin = gemm_cpu.linear_twin(x, weight[:, 5:69], bias)
    tol = dict(rtol=2**-7, atol=2**-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, twin, **tol)
    y3 = gemm_cpu.linear(x.reshape(3, 4, 64), packed, bias)  # leading dims other than tokens stay
    assert y3.shape == (3, 4, 70) and torch.equal(y3.reshape(12, 70), y)


def test_prefetch_chain_links_in_order_and_changes_nothing() -> None:
    """Each weight names the next one to prefetch (a ring, of other shapes) and outputs are unchanged.
    (A prefetch neither faults nor changes a value, so a wrong address shows only in speed.)"""
    dtype = _kernel_dtype()
    shapes = [(96, 50), (50, 200), (200, 96)]
    weights = [_inputs(1, i, o, dtype, seed=s)[1] for s, (i, o) in enumerate(shapes)]
    packed = [gemm_cpu.pack(w) for w in weights]
    if any(p is None for p in packed):
        pytest.skip("the kernel does not serve this CPU")
    x = _inputs(40, 200, 1, dtype, seed=9)[0]
    alone = [gemm_cpu.linear(x[:, : w.shape[1]], p, None) for w, p in zip(weights, packed)]  # type: ignore[arg-type]
    gemm_cpu.chain_prefetch(packed)  # type: ignore[arg-type]
    assert packed[2].prefetch_next is packed[0]  # type: ignore[union-attr]
    chained = [gemm_cpu.linear(x[:, : w.shape[1]], p, None) for w, p in zip(weights, packed)]  # type: ignore[arg-type]
    for a, b in zip(alone, chained):
        assert torch.equal(a, b)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    foreign = gemm_cpu.pack(weights[0].to(other))
    if foreign is not None:  # a weight of another dtype (another layout) is never a prefetch target
        gemm_cpu.chain_prefetch([packed[0], foreign])  # type: ignore[list-item]
        assert packed[0].prefetch_next is None and foreign.prefetch_next is None  # type: ignore[union-attr]


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("split", [0, 2])
def test_side_prefetch_changes_nothing(num_threads: int, split: int) -> None:
    """gemm_linear_prefetch fetching other memory (runs of rows of odd sizes and strides, empty runs,
    split among threads or not, within and beyond its share of the weight's bytes) gives
    gemm_linear_packed's output bit for bit."""
    import ctypes

    x, weight, bias = _inputs(40, 576, 200, _kernel_dtype(), seed=12)
    packed = _packed_or_skip(weight)
    lib = gemm_cpu.kernel_library()
    side_memory = torch.zeros(1 << 20, dtype=torch.uint8)
    base = side_memory.data_ptr()
    for runs in ([(7, 130, 1, 0), (300, 64, 5, 1000), (9000, 0, 3, 64), (20000, 100, 0, 0)],  # empty runs too
                 [(i * 9000 + 3, 500, 16, 560) for i in range(8)],
                 [(0, 1 << 19, 1, 0), (1 << 19, 1 << 18, 2, 1 << 18)]):  # over the share: not fetched
        flat = [v for address, *rest in runs for v in (base + address, *rest)]
        side = (ctypes.c_int64 * (2 + len(flat)))(len(runs), split, *flat)
        y = torch.empty(40, 200, dtype=x.dtype)
        status = lib.gemm_linear_prefetch(gemm_cpu.call_args(packed), x.data_ptr(), x.stride(0), bias.data_ptr(),
                                          y.data_ptr(), 40, num_threads, side)
        assert status == 0 and torch.equal(y, gemm_cpu.linear(x, packed, bias))


@pytest.mark.parametrize("num_threads", [3, 7])
def test_more_threads_than_column_blocks(num_threads: int) -> None:
    """Few column blocks and many threads: rows are split finer so no thread idles, same results."""
    x, weight, bias = _inputs(40, 64, 50, _kernel_dtype(), seed=11)
    packed = _packed_or_skip(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        y = gemm_cpu.linear(x, packed, bias)
    finally:
        torch.set_num_threads(before)
    _check(y, x, weight, bias)


def test_bad_inputs_are_refused() -> None:
    dtype = _kernel_dtype()
    packed = _packed_or_skip(torch.ones(8, 16, dtype=dtype))
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(TypeError, match="packed weight"):
        gemm_cpu.linear(torch.ones(2, 16, dtype=other), packed, None)
    with pytest.raises(ValueError, match="16"):
        gemm_cpu.linear(torch.ones(2, 15, dtype=dtype), packed, None)
    with pytest.raises(ValueError, match="bias"):  # a short bias would be read past its end
        gemm_cpu.linear(torch.ones(2, 16, dtype=dtype), packed, torch.ones(1, dtype=dtype))


def test_bias_of_another_dtype_is_converted_and_kept_alive() -> None:
    x, weight, bias = _inputs(9, 64, 151936, _kernel_dtype(), seed=3)  # a bias the allocator unmaps when freed
    packed = _packed_or_skip(weight)
    other = torch.float64  # converted to x's dtype for the call: the copy must outlive the kernel's read
    y = gemm_cpu.linear(x, packed, bias.to(other))
    _check(y, x, weight, bias)


def test_a_packed_weight_without_the_kernel_fails_clearly() -> None:
    dtype = _kernel_dtype()
    packed = _packed_or_skip(torch.ones(8, 16, dtype=dtype))
    own = gemm_cpu.kernel_library()
    gemm_cpu.use_library(None)
    try:
        with pytest.raises(RuntimeError, match="not loaded"):
            gemm_cpu.linear(torch.ones(2, 16, dtype=dtype), packed, None)
    finally:
        gemm_cpu.use_library(own)


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders a `dtype` weight on this CPU (bf16 without AVX-512: it refuses)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_layers_pack_for_the_kernel_and_release_dense_weights(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Linear(64, [40, 24], bias=True, dtype=dtype), Linear(64, 30, dtype=dtype)])
    for layer in layers:
        layer.weight.data.normal_()
    layers[0].bias.data.normal_()  # type: ignore[union-attr]
    dense = [layer.weight.detach().clone() for layer in layers]
    served = gemm_cpu.block_layout(dtype) > 0
    assert pack_cpu_linears(layers) == (2 if served or _onednn_packs(dtype) else 0)
    if not served:
        pytest.skip(f"the kernel does not serve {dtype} on this CPU")
    x = torch.randn(5, 64).to(dtype)
    for layer, weight in zip(layers, dense):
        assert layer.kernel_weight is not None and layer.packed_weight is None
        assert layer.weight.numel() == 0
        _check(layer(x), x, weight, layer.bias)


def test_switched_off_kernel_leaves_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    own = gemm_cpu.kernel_library()
    gemm_cpu.use_library(None)  # what LORASERVE_CPU_GEMM_KERNEL=0 or no compiler leaves
    try:
        layer = Linear(32, 16, dtype=torch.float32)
        layer.weight.data.normal_()
        weight = layer.weight.detach().clone()
        assert gemm_cpu.pack(weight) is None
        pack_cpu_linears(layer)
        assert layer.kernel_weight is None
        x = torch.randn(3, 32)
        torch.testing.assert_close(layer(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    finally:
        gemm_cpu.use_library(own)
