"""The decoder stack as one C call (models/llama_stack.py) against the Python loop over the same kernels:
bit-for-bit the same tokens and logprobs, base and LoRA steps, prefill, decode and mixed; the same
errors; and the steps it must leave to the loop."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from loraserve import LLM, SamplingParams
from loraserve.batch.attention_metadata import build_attention_metadata
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.demo.random_model import save_peft_adapter
from loraserve.layers import fused_cpu, gemm_cpu, paged_attention_cpu
from loraserve.layers.linear import pack_cpu_linears
from loraserve.lora.ops import lora_cpu
from loraserve.lora.request import LoRARequest
from loraserve.models.llama import LlamaArgs, LlamaModel
from loraserve.models.llama_stack import DecoderStack

DTYPES = [torch.float32, torch.bfloat16]


def _serves(dtype: torch.dtype) -> bool:
    """Whether every op of a Llama step is a C kernel here (the C linear kernel serves the dtype)."""
    return gemm_cpu.block_layout(dtype) != 0 and fused_cpu.kernel_available() and paged_attention_cpu.kernel_available()


@pytest.fixture
def stack_runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool | None]]:
    """One entry per step that asked the stack: True where it ran the step, False where it declined,
    None where it raised."""
    runs: list[bool | None] = []
    run = DecoderStack.run

    def counted(self: DecoderStack, *args: Any) -> Any:
        runs.append(None)
        out = run(self, *args)
        runs[-1] = out is not None
        return out

    monkeypatch.setattr(DecoderStack, "run", counted)
    yield runs


def _outputs(llm: LLM, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch, stack: bool,
             loras: list[LoRARequest | None] | None = None) -> list[Any]:
    monkeypatch.setenv("LORASERVE_CPU_DECODER_STACK", "1" if stack else "0")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    return [(o.outputs[0].token_ids, _logprobs(o.outputs[0].logprobs), _logprobs(o.prompt_logprobs[1:]))
            for o in outs]


def _logprobs(steps: list[Any]) -> list[dict[int, float]]:
    return [{token: lp.logprob for token, lp in step.items()} for step in steps]


def _prompts(count: int, seed: int, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(n),), generator=g).tolist()
            for n in torch.randint(2, max_len, (count,), generator=g)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "llama3", "llama_tied"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stack_equals_python_loop(tiny_model: Any, arch: str, dtype: torch.dtype,
                                  monkeypatch: pytest.MonkeyPatch, stack_runs: list[bool | None]) -> None:
    """Prefill chunks beside decodes (a small token budget splits the prompts), a sliding window
    shorter than the prompts (mistral), qkv biases (qwen2), scaled rope (llama3): bitwise equal."""
    if not _serves(dtype):
        pytest.skip(f"the C linear kernel does not serve {dtype} on this CPU")
    llm = LLM(tiny_model(arch), dtype=str(dtype).removeprefix("torch."), max_num_batched_tokens=48,
              max_num_seqs=8, enable_prefix_caching=False)
    prompts = _prompts(8, seed=len(arch))
    loop = _outputs(llm, prompts, monkeypatch, stack=False)
    assert stack_runs == []
    stacked = _outputs(llm, prompts, monkeypatch, stack=True)
    assert stack_runs and all(stack_runs)
    assert stacked == loop
    assert all(math.isfinite(lp) for tokens, steps, _ in stacked for step in steps for lp in step.values())


@pytest.fixture(scope="module")
def adapters(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    path, root = tiny_model("llama"), tmp_path_factory.mktemp("stack-adapters")
    targets = [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["v_proj", "down_proj"],
               ["up_proj"]]
    paths = []
    for i, modules in enumerate(targets):
        paths.append(str(root / f"a{i}"))
        save_peft_adapter(hf_model(path), paths[-1], seed=70 + i, base_name=path, r=4 + 4 * i, lora_alpha=16,
                          target_modules=modules)
    return paths


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stack_equals_python_loop_with_adapters(tiny_model: Any, adapters: list[str], dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch, stack_runs: list[bool | None]) -> None:
    """A batch mixing three adapters (different targets and ranks) and the base model, prefill chunks
    and decodes: every step runs in the stack and equals the loop's."""
    if not _serves(dtype):
        pytest.skip(f"the C linear kernel does not serve {dtype} on this CPU")
    llm = LLM(tiny_model("llama"), dtype=str(dtype).removeprefix("torch."), enable_lora=True, max_loras=4,
              max_lora_rank=16, max_num_seqs=8, enable_prefix_caching=False)
    requests = [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    prompts = _prompts(8, seed=5, max_len=60)
    loras = [requests[i % 3] if i % 4 else None for i in range(8)]
    loop = _outputs(llm, prompts, monkeypatch, stack=False, loras=loras)
    stacked = _outputs(llm, prompts, monkeypatch, stack=True, loras=loras)
    assert stacked == loop
    assert stack_runs and all(stack_runs)  # where the C linear kernel serves, the LoRA kernel takes 2048 tokens


def test_stack_leaves_steps_with_a_lora_bias_to_the_loop(tiny_model: Any, hf_model: Any, adapters: list[str],
                                                          tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                          stack_runs: list[bool | None]) -> None:
    """A LoRA bias term is the torch ops' (as in `ops.add_lora`): steps where such an adapter runs go to
    the loop, the others to the stack, and the outputs are the loop's."""
    if not _serves(torch.float32):
        pytest.skip("the C linear kernel does not serve float32 on this CPU")
    path = tiny_model("llama")
    save_peft_adapter(hf_model(path), str(tmp_path / "bias"), seed=90, base_name=path, r=4, lora_alpha=8,
                      target_modules=["q_proj", "down_proj"], lora_bias=True)
    llm = LLM(path, dtype="float32", enable_lora=True, enable_lora_bias=True, max_loras=2, max_lora_rank=16,
              max_num_seqs=4, enable_prefix_caching=False)
    prompts = _prompts(2, seed=9, max_len=12)
    for lora in (LoRARequest("plain", 1, adapters[0]), LoRARequest("bias", 2, str(tmp_path / "bias"))):
        start = len(stack_runs)
        loop = _outputs(llm, prompts, monkeypatch, stack=False, loras=[lora, lora])
        stacked = _outputs(llm, prompts, monkeypatch, stack=True, loras=[lora, lora])
        assert stacked == loop
        assert stack_runs[start:] and all(run is (lora.lora_name == "plain") for run in stack_runs[start:])


def test_stack_takes_the_lora_steps_the_lora_kernel_rule_gives_it(tiny_model: Any, adapters: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Which LoRA steps the stack runs is the LoRA kernel's own rule (`lora_cpu`), not a copy of it: with
    the kernel's segment limit cut to one token, adapter prefills go to the loop and decodes (one token
    per adapter) stay in the stack, and the outputs are the loop's."""
    if not _serves(torch.float32):
        pytest.skip("the C linear kernel does not serve float32 on this CPU")
    monkeypatch.setattr(lora_cpu, "max_segment_len", lambda dtype: 1)
    seen: list[tuple[int, bool]] = []  # (the step's longest adapter segment, whether the stack ran it)
    run = DecoderStack.run

    def recorded(self: DecoderStack, residual: Any, positions: Any, kv_caches: Any, batch: Any) -> Any:
        out = run(self, residual, positions, kv_caches, batch)
        seen.append((batch.lora.segments.max_len, out is not None))
        return out

    monkeypatch.setattr(DecoderStack, "run", recorded)
    llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              max_num_seqs=4, enable_prefix_caching=False)
    loras: list[LoRARequest | None] = [LoRARequest("a0", 1, adapters[0]), LoRARequest("a1", 2, adapters[1])]
    prompts = _prompts(2, seed=3, max_len=12)
    loop = _outputs(llm, prompts, monkeypatch, stack=False, loras=loras)
    stacked = _outputs(llm, prompts, monkeypatch, stack=True, loras=loras)
    assert stacked == loop
    assert {ran for _, ran in seen} == {True, False}
    assert all(ran == (longest <= 1) for longest, ran in seen)


def _model(tiny_model: Any, arch: str, dtype: torch.dtype, qk_norm: bool = False,
           qkv_bias: bool | None = None) -> LlamaModel:
    """The decoder of a tiny model with random weights (biases too), packed for the CPU kernels as the
    loader does."""
    config = AutoConfig.from_pretrained(tiny_model(arch))
    model = LlamaModel(LlamaArgs.from_config(config, qkv_bias=qkv_bias, qk_norm=qk_norm), config, dtype)
    g = torch.Generator().manual_seed(0)
    for param in model.parameters():
        param.data.copy_(torch.randn(param.shape, generator=g) * 0.2)
    pack_cpu_linears(model)
    return model


def _caches(model: LlamaModel, dtype: torch.dtype, num_blocks: int = 4) -> list[KVCache]:
    attn = model.layers[0].self_attn
    shape = (num_blocks * 16, attn.num_kv_heads, attn.head_dim)
    return [KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in model.layers]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stack_equals_python_loop_with_biases(tiny_model: Any, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
                                              stack_runs: list[bool | None]) -> None:
    """Random (nonzero) qkv biases, a two-sequence prefill, then a decode step: the same hidden states.
    (The tiny checkpoints' biases are zeros, so the engine test above cannot see them.)"""
    if not _serves(dtype):
        pytest.skip(f"the C linear kernel does not serve {dtype} on this CPU")
    model = _model(tiny_model, "qwen2", dtype, qkv_bias=True)
    steps = [([5, 9, 11, 3, 8], [0, 1, 2, 0, 1], build_attention_metadata([3, 2], [3, 2], [[0], [1]], 16, "cpu")),
             ([4, 6], [3, 2], build_attention_metadata([1, 1], [4, 3], [[0], [1]], 16, "cpu"))]
    hidden = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LORASERVE_CPU_DECODER_STACK", flag)
        caches = _caches(model, dtype)
        with torch.inference_mode():
            hidden[flag] = [model(torch.tensor(ids), torch.tensor(pos), caches, ForwardBatch(attn=meta, lora=None))
                            for ids, pos, meta in steps]
    assert stack_runs == [True, True]
    for loop, stacked in zip(hidden["0"], hidden["1"]):
        assert torch.equal(loop, stacked)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_stack_builds_only_for_the_ops_it_has(tiny_model: Any, qk_norm: bool) -> None:
    """Qwen3's per-head q/k norms are not in the C stack: `build` declines, the loop serves that model."""
    if not _serves(torch.float32):
        pytest.skip("the C linear kernel does not serve float32 on this CPU")
    model = _model(tiny_model, "qwen3", torch.float32, qk_norm=qk_norm)
    assert (DecoderStack.build(list(model.layers), model.rotary) is None) == qk_norm


@pytest.mark.parametrize("case", ["a block past the cache", "a position past the rope tables"])
def test_stack_raises_what_the_loop_raises(tiny_model: Any, case: str, monkeypatch: pytest.MonkeyPatch,
                                           stack_runs: list[bool | None]) -> None:
    if not _serves(torch.float32):
        pytest.skip("the C linear kernel does not serve float32 on this CPU")
    model = _model(tiny_model, "llama", torch.float32)
    caches = _caches(model, torch.float32)
    block, position = (9, 3) if case == "a block past the cache" else (0, 300)
    meta = build_attention_metadata([1], [4], [[block]], 16, "cpu")
    errors = []
    for flag in ("0", "1"):
        monkeypatch.setenv("LORASERVE_CPU_DECODER_STACK", flag)
        with torch.inference_mode(), pytest.raises((ValueError, IndexError)) as caught:
            model(torch.tensor([7]), torch.tensor([position]), caches, ForwardBatch(attn=meta, lora=None))
        errors.append((type(caught.value), str(caught.value)))
    assert stack_runs == [None]  # the loop's error first, then the same from the stack's one attempt
    assert errors[0] == errors[1]


def _step(model: LlamaModel, caches: list[KVCache]) -> torch.Tensor:
    meta = build_attention_metadata([3, 2], [3, 2], [[0], [1]], 16, "cpu")
    with torch.inference_mode():
        return model(torch.tensor([5, 9, 11, 3, 8]), torch.tensor([0, 1, 2, 0, 1]), caches,
                     ForwardBatch(attn=meta, lora=None))


def _both_paths(model: LlamaModel, caches: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The step's outcome (hidden states, or the error) on the loop, then with the stack allowed."""
    outcomes = []
    for flag in ("0", "1"):
        monkeypatch.setenv("LORASERVE_CPU_DECODER_STACK", flag)
        try:
            outcomes.append(_step(model, caches() if callable(caches) else caches))
        except (RuntimeError, ValueError) as e:
            outcomes.append((type(e), str(e)))
    return outcomes


@pytest.mark.parametrize("case", ["KV heads of another model", "caches that are views", "one cache too many"])
def test_stack_leaves_caches_it_cannot_take_to_the_loop(tiny_model: Any, case: str, monkeypatch: pytest.MonkeyPatch,
                                                        stack_runs: list[bool | None]) -> None:
    """The kernel would read and write such caches out of bounds; the loop raises or copes, the stack
    declines and the outcome is the loop's."""
    if not _serves(torch.float32):
        pytest.skip("the C linear kernel does not serve float32 on this CPU")
    model = _model(tiny_model, "llama", torch.float32)
    attn = model.layers[0].self_attn

    def caches() -> list[KVCache]:
        if case == "KV heads of another model":
            return [KVCache(torch.zeros(64, 1, attn.head_dim), torch.zeros(64, 1, attn.head_dim)) for _ in model.layers]
        if case == "caches that are views":
            both = [torch.zeros(64, 2, attn.num_kv_heads, attn.head_dim) for _ in model.layers]
            return [KVCache(kv[:, 0], kv[:, 1]) for kv in both]
        return _caches(model, torch.float32) * 2

    loop, stacked = _both_paths(model, caches, monkeypatch)
    assert stack_runs == [False]
    assert (torch.equal(loop, stacked) if isinstance(loop, torch.Tensor) else loop == stacked)


def test_stack_follows_the_attention_switch(tiny_model: Any, monkeypatch: pytest.MonkeyPatch,
                                            stack_runs: list[bool | None]) -> None:
    """LORASERVE_CPU_ATTENTION_KERNEL=0 sends the loop to the torch attention at once: the stack, built
    at an earlier step, steps aside for those steps."""
    if not _serves(torch.float32):
        pytest.skip("the C linear kernel does not serve float32 on this CPU")
    model = _model(tiny_model, "llama", torch.float32)
    monkeypatch.setenv("LORASERVE_CPU_DECODER_STACK", "1")
    _step(model, _caches(model, torch.float32))
    monkeypatch.setenv("LORASERVE_CPU_ATTENTION_KERNEL", "0")
    _step(model, _caches(model, torch.float32))
    assert stack_runs == [True, False]


@pytest.mark.parametrize("change", ["a cache tensor", "a norm weight", "a linear"])
def test_stack_follows_replaced_tensors_and_modules(tiny_model: Any, change: str, monkeypatch: pytest.MonkeyPatch,
                                                    stack_runs: list[bool | None]) -> None:
    """After a step, replace what the stack bound by address (in the same cache list, the same model):
    the next step computes with the new one, as the loop does."""
    if not _serves(torch.float32):
        pytest.skip("the C linear kernel does not serve float32 on this CPU")
    model = _model(tiny_model, "llama", torch.float32)
    caches = _caches(model, torch.float32)
    monkeypatch.setenv("LORASERVE_CPU_DECODER_STACK", "1")
    _step(model, caches)
    layer = model.layers[1]
    if change == "a cache tensor":
        caches[1] = KVCache(torch.zeros_like(caches[1].k), torch.zeros_like(caches[1].v))
    elif change == "a norm weight":
        layer.post_attention_layernorm.weight = torch.nn.Parameter(torch.full_like(layer.input_layernorm.weight, 0.5),
                                                                   requires_grad=False)
    else:
        layer.mlp.down_proj = _model(tiny_model, "llama", torch.float32).layers[0].mlp.down_proj
    written, rows = caches[1].k, [0, 1, 2, 16, 17]  # the step's slots: blocks 0 and 1
    stacked = _step(model, caches)
    stacked_rows = written[rows].clone()
    written.zero_()
    monkeypatch.setenv("LORASERVE_CPU_DECODER_STACK", "0")
    loop = _step(model, caches)
    assert stack_runs == [True, True]
    assert torch.equal(stacked, loop) and torch.equal(stacked_rows, written[rows]) and written[rows].abs().sum() > 0


# Every linear of a 2-layer Llama in one of the six block formats (the packed qkv and gate_up mix them).
QUANT_TYPES = {
    "blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q5_K", "blk.0.attn_v.weight": "Q6_K",
    "blk.0.attn_output.weight": "Q8_0", "blk.0.ffn_gate.weight": "Q4_0", "blk.0.ffn_up.weight": "Q4_1",
    "blk.0.ffn_down.weight": "Q6_K", "blk.1.attn_q.weight": "Q8_0", "blk.1.attn_k.weight": "Q8_0",
    "blk.1.attn_v.weight": "Q4_0", "blk.1.attn_output.weight": "Q4_1", "blk.1.ffn_gate.weight": "Q5_K",
    "blk.1.ffn_up.weight": "Q4_K", "blk.1.ffn_down.weight": "Q4_K", "output.weight": "Q6_K",
}


@pytest.mark.parametrize(("dtype", "levels"), [(dtype, 1) for dtype in DTYPES] + [(torch.float32, 2)], ids=str)
def test_stack_equals_python_loop_on_quantized_linears(tmp_path: Any, dtype: torch.dtype, levels: int,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       stack_runs: list[bool | None]) -> None:
    """A GGUF whose linears stay block-quantized: the stack runs them through quant_gemm, bitwise equal
    to the loop's quantized linears, on the steps the integer path takes: all of them at one activation
    level (the panels serve prefill), at most DECODE_ROWS tokens at two (a longer prefill is torch's
    tile path, which the stack leaves to the loop)."""
    from support.gguf_files import write_tiny_llama_gguf

    from loraserve.layers.quant import kernel as quant_kernel

    if quant_kernel.kernel_library() is None or not fused_cpu.kernel_available() \
            or not paged_attention_cpu.kernel_available():
        pytest.skip("the quantized, fused or attention kernel is not built here")
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.delenv("LORASERVE_GGUF_DEQUANTIZE", raising=False)
    monkeypatch.setenv("LORASERVE_CPU_QUANT_ACT_LEVELS", str(levels))
    path = write_tiny_llama_gguf(str(tmp_path / "q.gguf"), raw_types=QUANT_TYPES, hidden=256, ffn=512)
    llm = LLM(path, dtype=str(dtype).removeprefix("torch."), max_num_seqs=8, enable_prefix_caching=False)
    model = llm.engine.model.model
    assert all(lin.quant_parts is not None for layer in model.layers for lin in
               (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    g = torch.Generator().manual_seed(3)
    lengths = [2, 3, 5, quant_kernel.DECODE_ROWS + 9, 30]  # one prompt alone exceeds DECODE_ROWS
    prompts = [torch.randint(3, 260, (n,), generator=g).tolist() for n in lengths]
    loop = _outputs(llm, prompts, monkeypatch, stack=False)
    assert stack_runs == []
    stacked = _outputs(llm, prompts, monkeypatch, stack=True)
    if levels == 1 and quant_kernel.kernel_path() != "portable":
        assert stack_runs and all(stack_runs)  # every step, the long prefill too
    else:
        assert True in stack_runs and False in stack_runs  # decode steps ran, the long prefill did not
    assert stacked == loop
    assert all(math.isfinite(lp) for tokens, steps, _ in stacked for step in steps for lp in step.values())


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "fp8", "int8"])
def test_stack_equals_python_loop_over_a_quantized_kv_cache(tmp_path: Any, kv_cache_dtype: str,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            stack_runs: list[bool | None]) -> None:
    """The stack hands each layer's cache format (its scales) to the attention kernel, which writes and
    reads the cache as the loop's layers do: bitwise equal, over a float32 model of quantized linears
    (which the stack serves on every CPU class)."""
    from support.gguf_files import write_tiny_llama_gguf

    from loraserve.layers.quant import kernel as quant_kernel

    if quant_kernel.kernel_library() is None or not fused_cpu.kernel_available() \
            or not paged_attention_cpu.kernel_available():
        pytest.skip("the quantized, fused or attention kernel is not built here")
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.delenv("LORASERVE_GGUF_DEQUANTIZE", raising=False)
    path = write_tiny_llama_gguf(str(tmp_path / "q.gguf"), raw_types=QUANT_TYPES, hidden=256, ffn=512)
    llm = LLM(path, dtype="float32", max_num_seqs=8, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    assert llm.engine.runner.kv_caches[0].k.element_size() < 4
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 260, (n,), generator=g).tolist() for n in (2, 5, 17, 30)]
    loop = _outputs(llm, prompts, monkeypatch, stack=False)
    assert stack_runs == []
    stacked = _outputs(llm, prompts, monkeypatch, stack=True)
    assert True in stack_runs  # the decode steps (a long prefill is the loop's)
    assert stacked == loop
