"""`DecoderStack`: a Llama-family model's decoder layers for one step in one C call on CPU.

`native/kernels/decoder_stack.c` runs, layer after layer, the very kernels the Python path
(`llama.py`) calls:
the fused RMSNorm, the C linear kernel (plus the LoRA kernel), rope, paged attention and SiLU-and-mul,
with the same arguments, in the same order, so the hidden states come out bit for bit the same. What
goes is the Python between them: ~270 wrapper and ctypes calls and ~200 allocations per step, about
2 ms of a 30-layer decode step. The Python path stays the twin, the oracle of the tests, and the path
for every step the C call does not serve (`run` returns None):
- models with per-head q/k norms (Qwen3), another activation than SiLU, softcapping, or a linear
  that the C linear kernel does not serve (e.g. fp32 and bf16 on AVX2-only CPUs: oneDNN runs those);
  a block-quantized linear (GGUF kept quantized) runs through quant_kernel.c's `quant_gemm`, each
  linear binding its own kernel, and steps of more tokens than the integer path takes
  (`quant_kernel.integer_rows`: past that, torch's tile path) stay the loop's;
- LoRA steps that the LoRA kernel does not serve (a bias term, long prefill segments, another dtype);
- LORASERVE_CPU_DECODER_STACK=0, a fused or attention kernel switched off, or no C compiler.
Which kernel serves a call is never decided here: each op family's own predicate says it, the one
its Python wrapper asks too (`gemm_cpu.serves` / `quant_kernel.stack_serves`,
`fused_cpu.norm_weight_serves` and `rotary_tables_serve`, `paged_attention_cpu.serves`,
`lora_cpu.serving`), so changing a kernel's rule
changes the stack's with it. What stays here is what the stack itself can run (its fixed op order,
one layout for every layer, no LoRA bias term).

The fixed half of the arguments (weights, caches, tables: raw pointers) is bound once; the caller
builds a new stack whenever `BoundObjects` shows one of those objects replaced, and the caches are
bound again whenever one of them moved. Module hooks on the linears and norms do not see the steps the
stack runs (set LORASERVE_CPU_DECODER_STACK=0 to observe them).
"""

from __future__ import annotations

import ctypes
import operator
import sys
from typing import Any

import torch
import torch.nn.functional as F

from loraserve.batch.attention_metadata import AttentionMetadata
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.layers import fused_cpu, gemm_cpu, paged_attention_cpu
from loraserve.layers.quant import kernel as quant_kernel
from loraserve.lora.ops import lora_cpu
from loraserve.native.build import function_address, load_library
from loraserve.native.kernel_slot import KernelSlot

# decoder_stack.c's field counts, the model fields read back here, and its error ops.
MODEL_FIELDS, LAYER_FIELDS, STEP_FIELDS = 20, 18, 21
M_HIDDEN, M_Q, M_KV, M_INTER, M_HEAD_DIM, M_POSITIONS = 8, 9, 10, 11, 14, 18
OP_GEMM, OP_ROPE, OP_ATTENTION, OP_LORA = 1, 2, 3, 4
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _load_stack() -> Any:
    lib = load_library("decoder_stack.c")
    if lib is not None:
        i64p = ctypes.POINTER(ctypes.c_int64)
        lib.decoder_stack.argtypes = [i64p, i64p, i64p, ctypes.c_float, ctypes.c_float]
        lib.decoder_stack.restype = ctypes.c_int
        lib.decoder_stack_layout.restype = ctypes.c_int
        if lib.decoder_stack_layout() != MODEL_FIELDS | LAYER_FIELDS << 8 | STEP_FIELDS << 16:
            raise RuntimeError("decoder_stack.c's argument layout differs from llama_stack.py's")
    return lib


_kernel: KernelSlot[Any] = KernelSlot(_load_stack)


def _library() -> Any:
    return _kernel.get()


def _kernel_addresses() -> list[int] | None:
    """gemm_linear_prefetch (0 without the dense kernel: `_layer_serves` then takes quantized linears
    only), rms_norm, silu_and_mul, rotary_inplace, paged_attention, then lora_fused and
    lora_weight_ranges (0 when the LoRA kernel is missing: LoRA steps then take the Python path); None
    if one of the others is."""
    gemm, fused = gemm_cpu.kernel_library(), fused_cpu.kernel_library()
    attention = paged_attention_cpu.kernel_function()
    if fused is None or attention is None:
        return None
    lora = lora_cpu.fused_function()
    ranges = lora_cpu.weight_ranges_function()
    return [0 if gemm is None else function_address(gemm.gemm_linear_prefetch)] + [
        function_address(fn) for fn in (fused.rms_norm, fused.silu_and_mul, fused.rotary_inplace, attention)] + [
        0 if lora is None else function_address(lora), 0 if ranges is None else function_address(ranges)]


class BoundObjects:
    """Where each object a stack binds sits, to tell cheaply at every step whether one was replaced:
    the kernel builds, the rope tables, and per layer its modules, linears, their packed weights and
    biases, and the norm weights. LoRA wrapping, repacking, swapping a kernel build or assigning a new
    parameter changes one; the caller then builds the stack again. Entries are (dict, key, object),
    a parent's before its children's, read straight from the modules' dicts (~20 us a step, warm)."""

    def __init__(self, layer_list: Any, rotary: Any) -> None:
        self.libraries = _libraries()
        entries: list[tuple[dict[str, Any], str, object]] = [
            (rotary._buffers, "cos_table", rotary._buffers.get("cos_table")),
            (rotary._buffers, "sin_table", rotary._buffers.get("sin_table"))]
        for key, layer in layer_list._modules.items():
            attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
            entries += [(layer_list._modules, key, layer), (layer._modules, "self_attn", attn),
                        (layer._modules, "mlp", mlp)]
            for modules, name in ((attn._modules, "qkv_proj"), (attn._modules, "o_proj"),
                                  (mlp._modules, "gate_up_proj"), (mlp._modules, "down_proj")):
                linear = modules[name]
                entries += [(modules, name, linear), (linear.__dict__, "kernel_weight", linear.kernel_weight),
                            (linear.__dict__, "quant_parts", linear.quant_parts),
                            (linear._parameters, "bias", linear._parameters.get("bias"))]
            for name in ("input_layernorm", "post_attention_layernorm"):
                norm = layer._modules[name]
                entries += [(layer._modules, name, norm), (norm._parameters, "weight", norm._parameters["weight"])]
        # Kept as three columns, which `unchanged` walks with builtins alone (no Python frame per entry).
        self._dicts = [d for d, _, _ in entries]
        self._keys = [key for _, key, _ in entries]
        self._objects = [obj for _, _, obj in entries]

    def unchanged(self) -> bool:
        return all(map(operator.is_, _libraries(), self.libraries)) and all(
            map(operator.is_, map(dict.get, self._dicts, self._keys), self._objects))


def _libraries() -> tuple[Any, Any, Any, Any]:
    return (gemm_cpu.kernel_library(), fused_cpu.kernel_library(), lora_cpu.fused_function(),
            quant_kernel.kernel_library())


class DecoderStack:
    """The fixed arguments of decoder_stack.c for one model; `build` returns None where it cannot serve
    it. Valid while `BoundObjects` of its layers says unchanged: the caller builds a new one otherwise."""

    def __init__(self, layers: list[Any], model_args: ctypes.Array[ctypes.c_int64], has_lora_kernel: bool,
                 eps: float, scale: float, dtype: torch.dtype) -> None:
        self.layers = layers
        self.linears = [_linears(layer) for layer in layers]
        self.model_args = model_args
        self.has_lora_kernel = has_lora_kernel
        self.eps, self.scale, self.dtype = eps, scale, dtype
        self._caches_key: tuple[int, ...] = ()
        self._layer_args: ctypes.Array[ctypes.c_int64] | None = None
        # Each linear's (kernel address, argument array), the arrays held here: the stack's copies of
        # their addresses stay valid.
        self._gemm = [[_gemm_binding(linear, dtype) for linear in group] for group in self.linears]
        # Quantized linears serve only the integer path's rows (more rows: torch's tile path, the loop's).
        self.max_rows = min(
            (quant_kernel.integer_rows(part, dtype) for group in self.linears for linear in group
             for part in linear.quant_parts or () if part is not None),
            default=sys.maxsize,
        )

    @classmethod
    def build(cls, layers: list[Any], rotary: Any) -> DecoderStack | None:
        """For `layers` (LlamaDecoderLayer) sharing `rotary`; None when some op is not a C kernel here."""
        if not layers or not fused_cpu.kernel_available() or _library() is None:
            return None
        attn0, mlp0, norm0 = layers[0].self_attn, layers[0].mlp, layers[0].input_layernorm
        dtype = attn0.qkv_proj.weight.dtype
        if dtype not in _DTYPE_CODES or not all(_layer_serves(layer, layers[0], rotary, dtype) for layer in layers) \
                or not _tables_serve(rotary, attn0.head_dim):
            return None
        kernels = _kernel_addresses()
        if kernels is None:
            return None
        sizes = [len(layers), attn0.qkv_proj.in_features, attn0.split_sizes[0], attn0.split_sizes[1], mlp0.size,
                 attn0.num_heads, attn0.num_kv_heads, attn0.head_dim, _DTYPE_CODES[dtype]]
        tables = [rotary.cos_table.data_ptr(), rotary.sin_table.data_ptr(), rotary.cos_table.shape[0]]
        model_args = (ctypes.c_int64 * MODEL_FIELDS)(*kernels, *sizes, *tables, 0)  # M_EXT: none
        return cls(layers, model_args, kernels[5] != 0, norm0.eps, attn0.attn.scale, dtype)

    def _bind_caches(self, kv_caches: list[KVCache]) -> ctypes.Array[ctypes.c_int64] | None:
        """Every layer's fixed fields with these caches, bound again whenever a cache tensor moved; None
        when the layers' caches differ in layout (the loop then serves the step)."""
        key = tuple(id(cache.scales) for cache in kv_caches) + tuple(
            t.data_ptr() for cache in kv_caches for t in (cache.k, cache.v))
        if self._layer_args is not None and key == self._caches_key:
            return self._layer_args
        # One layout for every layer (the stack binds one set of sizes): the first layer's, which
        # `_attention_serves` asked the attention kernel about (each layer's own scales: `_caches_serve`).
        layout = _cache_layout(kv_caches[0])
        if any(_cache_layout(cache) != layout for cache in kv_caches):
            return None
        values: list[int] = []
        for layer, gemm, cache in zip(self.layers, self._gemm, kv_caches):  # the cache's format last (L_KV_FORMAT)
            format = paged_attention_cpu.kernel_format(cache.dtype, cache.scales)
            values += self._fields(layer, gemm, cache.k, cache.v) + [ctypes.addressof(format)]
        self._layer_args = (ctypes.c_int64 * (LAYER_FIELDS * len(self.layers)))(*values)
        self._caches_key = key
        return self._layer_args

    def _fields(
        self, layer: Any, gemm: list[tuple[int, Any]], k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> list[int]:
        """One layer's fixed fields (a subclass binds other norm weights)."""
        return _layer_fields(layer, gemm, k_cache, v_cache)

    def run(self, residual: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
            batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoder layers over the embeddings `residual` [T, hidden] (which becomes the residual
        stream, updated in place): returns (last layer's output, residual), as the Python loop does; None
        when this step needs the Python path."""
        meta, num_tokens = batch.attn, residual.shape[0]
        if num_tokens > self.max_rows:
            return None
        if residual.dtype != self.dtype or not residual.is_cpu or not residual.is_contiguous() or num_tokens == 0 \
                or positions.dtype != torch.int64 or not positions.is_contiguous() or positions.shape != (num_tokens,):
            return None
        lora_layers = None
        if batch.lora is not None:
            lora_layers = self._lora_layers(batch.lora, num_tokens)
            if lora_layers is None:
                return None
        buffers = self._buffers(num_tokens)
        if len(kv_caches) != len(self.layers) or not self._attention_serves(buffers[2], kv_caches[0], meta):
            return None
        layer_args = self._bind_caches(kv_caches)
        if layer_args is None:
            return None
        k_cache = kv_caches[0].k
        return self._call(residual, positions, layer_args, meta, lora_layers, batch.lora, k_cache, buffers)

    def _buffers(self, num_tokens: int) -> list[torch.Tensor]:
        """The step's work buffers x, h, qkv, a, g, s, laid out as the loop's tensors of the same names."""
        m = self.model_args
        q, kv, inter, hidden = m[M_Q], m[M_KV], m[M_INTER], m[M_HIDDEN]
        return [torch.empty(num_tokens, width, dtype=self.dtype)
                for width in (hidden, hidden, q + 2 * kv, q, 2 * inter, inter)]

    def _attention_serves(self, qkv: torch.Tensor, kv_cache: KVCache,
                          meta: AttentionMetadata) -> bool:
        """Whether the attention kernel takes the first layer's call, asked as the loop's `PagedAttention`
        asks it (q, k, v: views of the packed qkv rows); the kernel's switch is read every step, as the
        loop reads it. Raises what the loop's first layer raises for metadata that does not fit."""
        attn0 = self.layers[0].self_attn
        q, k, v = qkv.split(attn0.split_sizes, dim=-1)
        q_heads = q.view(qkv.shape[0], attn0.num_heads, attn0.head_dim)
        k_cache, v_cache, scales = kv_cache.k, kv_cache.v, kv_cache.scales
        if not paged_attention_cpu.serves(q_heads, k_cache, v_cache, (k, v, meta.slot_mapping), scales):
            return False
        index = (meta.block_tables, meta.context_lens, meta.query_starts)
        paged_attention_cpu.check_inputs(q_heads, k_cache, v_cache, index, meta.block_size, scales)
        return True

    def _call(self, residual: torch.Tensor, positions: torch.Tensor, layer_args: ctypes.Array[ctypes.c_int64],
              meta: AttentionMetadata, lora_layers: ctypes.Array[ctypes.c_int64] | None, lora: LoRABatchMapping | None,
              k_cache: torch.Tensor, new: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = residual.shape[0]
        m = self.model_args
        step = (ctypes.c_int64 * STEP_FIELDS)(
            num_tokens, torch.get_num_threads(), positions.data_ptr(), meta.block_tables.data_ptr(),
            meta.block_tables.shape[1], meta.context_lens.data_ptr(), meta.query_starts.data_ptr(),
            meta.context_lens.shape[0], k_cache.shape[0] // meta.block_size, meta.block_size,
            meta.sliding_window or 0, meta.slot_mapping.data_ptr(),
            0 if lora is None or lora.cpu_kernel_args is None else ctypes.addressof(lora.cpu_kernel_args),
            0 if lora_layers is None else ctypes.addressof(lora_layers),
            residual.data_ptr(), *(t.data_ptr() for t in new))
        status = _library().decoder_stack(m, layer_args, step, self.eps, self.scale)
        if status != 0:
            _raise_for(status, self.dtype, k_cache, meta.block_size, num_tokens, m[M_POSITIONS], m[M_HEAD_DIM])
        return new[0], residual

    def _lora_layers(self, mapping: LoRABatchMapping, num_tokens: int) -> ctypes.Array[ctypes.c_int64] | None:
        """The LoRA kernel's layer arguments of each linear (0: no term this step) where
        `lora_cpu.serving` says the kernel runs the term, the rule `ops.add_lora` asks too; None when
        some layer's term needs another path (or has a bias term or a DoRA scale, which the stack does
        not apply)."""
        if mapping.num_tokens != num_tokens:
            return None
        terms: list[Any] = []  # each linear's kernel args; None: no LoRA term this step
        for group in self.linears:
            for linear in group:
                buffers = getattr(linear, "lora_buffers", None)
                if buffers is None or not (buffers.active_mask | buffers.bias_mask) & mapping.active_mask:
                    terms.append(None)
                    continue
                args = buffers.cpu_kernel_args
                # A bias term and DoRA's output scale are the loop's (`ops.add_lora`, `ops.apply_dora`).
                if not self.has_lora_kernel or (buffers.bias_mask | buffers.dora_mask) & mapping.active_mask \
                        or args is None \
                        or (args.in_features, args.out_features) != (linear.in_features, linear.out_features):
                    return None
                terms.append(args)
        if not all(lora_cpu.serving([args for args in terms if args is not None], mapping, self.dtype)):
            return None
        return (ctypes.c_int64 * len(terms))(*[0 if args is None else ctypes.addressof(args.c_layer) for args in terms])


def _linears(layer: Any) -> tuple[Any, Any, Any, Any]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _layer_serves(layer: Any, first: Any, rotary: Any, dtype: torch.dtype) -> bool:
    """The layer's ops are the stack's, with `first`'s sizes, eps and scale (one set for the model)."""
    attn, mlp, ref = layer.self_attn, layer.mlp, first.self_attn
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (attn.q_norm is None and attn.k_norm is None and mlp.act is F.silu and attn.attn.softcap is None
            and attn.rotary is rotary and attn.attn.scale == ref.attn.scale and mlp.size == first.mlp.size
            and (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (ref.num_heads, ref.num_kv_heads, ref.head_dim)
            and attn.split_sizes == [attn.num_heads * attn.head_dim] + [attn.num_kv_heads * attn.head_dim] * 2
            and all(_linear_serves(lin, dtype)  # the bias is bound raw: of the dtype, contiguous
                    and (lin.bias is None or (lin.bias.dtype == dtype and lin.bias.is_contiguous()))
                    for lin in _linears(layer))
            and all(fused_cpu.norm_weight_serves(n.weight, dtype, attn.qkv_proj.in_features)
                    and n.eps == first.input_layernorm.eps for n in norms))


def _cache_layout(cache: KVCache) -> list[tuple[Any, ...] | None]:
    """What the attention kernel's checks of a cache depend on: its K, V (and block scales') layouts."""
    tensors = (cache.k, cache.v, cache.scales.k_blocks, cache.scales.v_blocks)
    return [(t.shape, t.stride(), t.dtype, t.device) if t is not None else None for t in tensors]


def _tables_serve(rotary: Any, head_dim: int) -> bool:
    return rotary.head_dim == head_dim and fused_cpu.rotary_tables_serve(rotary.cos_table, rotary.sin_table, head_dim)


def _linear_serves(linear: Any, dtype: torch.dtype) -> bool:
    """The rule `Linear.base_forward` follows: quantized slices, else the dense C kernel's weight."""
    if linear.quant_parts is not None:
        return quant_kernel.stack_serves(linear.quant_parts, dtype, linear.in_features)
    return gemm_cpu.serves(linear.kernel_weight, dtype) and gemm_cpu.kernel_library() is not None


def _gemm_binding(linear: Any, dtype: torch.dtype) -> tuple[int, Any]:
    """(kernel address, argument array) of a linear `_linear_serves` accepted."""
    if linear.quant_parts is not None:
        return quant_kernel.stack_binding(linear.quant_parts, dtype)
    return function_address(gemm_cpu.kernel_library().gemm_linear_prefetch), gemm_cpu.call_args(linear.kernel_weight)


def _layer_fields(layer: Any, gemm: list[tuple[int, Any]], k_cache: torch.Tensor, v_cache: torch.Tensor) -> list[int]:
    attn, mlp = layer.self_attn, layer.mlp
    fields = [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
    for linear, (_, args) in zip((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj), gemm):
        fields += [ctypes.addressof(args), 0 if linear.bias is None else linear.bias.data_ptr()]
    return fields + [k_cache.data_ptr(), v_cache.data_ptr(), int(attn.attn.use_sliding_window)] + [
        address for address, _ in gemm]


def _raise_for(code: int, dtype: torch.dtype, k_cache: torch.Tensor, block_size: int, num_tokens: int,
               num_positions: int, head_dim: int) -> None:
    """The error the op's own wrapper raises for its status (decoder_stack.c's code: layer, op, status)."""
    op, status = code >> 4 & 0xF, code & 0xF
    if op == OP_GEMM:
        raise RuntimeError(f"the CPU linear kernel refused {dtype} (status {status})")
    if op == OP_ROPE:
        if status == 1:
            raise IndexError(f"a position is outside the rotary tables ({num_positions} positions)")
        raise ValueError(f"the rotary kernel refused head_dim={head_dim} (status {status})")
    if op == OP_ATTENTION:
        paged_attention_cpu.raise_for_status(status, k_cache, block_size, num_tokens)
    if op == OP_LORA:
        raise MemoryError("CPU LoRA kernel could not allocate its scratch buffer")
    raise RuntimeError(f"the decoder stack failed in layer {code >> 8} (op {op}, status {status})")
