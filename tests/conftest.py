"""Shared, session-scoped fixtures: one tokenizer, tiny random models of each architecture (fp32), and
SmolLM2's transformers oracle and float32 LLM for the real-model modules."""

from __future__ import annotations

import gc
import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from loraserve.demo.random_model import TINY_SHAPE

pytest_plugins = ["support.fake_server_fixtures", "support.parallel"]

# The suite is hermetic: nothing may reach the Hugging Face Hub (PEFT, for one, looks base models up).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite runs the C linear kernel wherever it serves the dtype, also on AMX CPUs, whose bf16 default is
# oneDNN (gemm_cpu.prefers_onednn; tests/layers/test_linear_packing.py tests that choice itself).
os.environ.setdefault("LORASERVE_CPU_GEMM_KERNEL", "1")
# Without CUDA, Triton's kernels run under its interpreter (tests/support/triton_lora.py, the Triton
# op tests): `@triton.jit` reads the variable when a kernel is defined, and PEFT imports Triton, so it
# is set here, before any test module loads.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _rss_mb() -> int:
    """This process's resident memory in MiB (0 where /proc is missing: nothing is freed early there)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """An engine (1 GiB of KV cache by default) dropped by a test sits in reference cycles that
    Python's collector, counting objects rather than bytes, reaches late, and in-process servers
    stayed reachable from FastAPI's caches: a whole run grew past 20 GB. Once a test is over (its
    fixtures released), free them if it grew the process by 256 MB."""
    before = _rss_mb()
    yield
    if _rss_mb() - before > 256:
        # FastAPI memoises facts about endpoint functions in module-level LRU caches keyed by the
        # functions themselves; our endpoints close over the engine, so every in-process server
        # would live on in them.
        from fastapi.dependencies import models

        for value in vars(models).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()
        gc.collect()


@pytest.fixture(params=["kernel", "onednn"])
def linear_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """CPU linear layers through the C linear kernel (where this CPU's build serves the dtype), then
    through oneDNN's packed linear, the kernel unloaded for the test: engines built inside the test
    pack for whichever is in place."""
    from loraserve.layers import gemm_cpu

    own = gemm_cpu.kernel_library()
    if request.param == "onednn":
        gemm_cpu.use_library(None)
    yield request.param
    gemm_cpu.use_library(own)


TINY = TINY_SHAPE


def _tiny_config(arch: str, vocab_size: int) -> Any:
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(vocab_size=vocab_size, **TINY)
    if arch == "llama3":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(vocab_size=vocab_size, rope_scaling=rope, **TINY)
    if arch == "llama_tied":
        return tf.LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=True, **TINY)
    if arch == "mistral":
        return tf.MistralConfig(vocab_size=vocab_size, sliding_window=8, **TINY)
    if arch == "qwen2":
        return tf.Qwen2Config(vocab_size=vocab_size, **TINY)
    if arch == "qwen3":
        return tf.Qwen3Config(vocab_size=vocab_size, head_dim=32, **TINY)
    if arch == "gpt2":
        return tf.GPT2Config(
            vocab_size=vocab_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=256,
            bos_token_id=1,
            eos_token_id=2,
        )
    if arch == "gpt_neox":  # no native implementation: served by the transformers backend
        return tf.GPTNeoXConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
        )
    raise ValueError(arch)


@pytest.fixture(scope="session")
def smollm_cache_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One LORASERVE_CACHE_ROOT for the SmolLM2 test modules: each converts the GGUF once per (dtype,
    quantized) key and the others reuse it (a conversion is tens of seconds)."""
    return str(tmp_path_factory.mktemp("smollm-cache"))


@pytest.fixture(scope="session")
def smollm2_oracle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """transformers and PEFT on SmolLM2's GGUF file (support/smollm2.py), loaded once for the modules
    that check the real model against it (dequantizing the file in Python takes tens of seconds)."""
    from support.smollm2 import load_oracle

    return load_oracle(str(tmp_path_factory.mktemp("smollm2-adapters")))


@pytest.fixture(scope="session")
def smollm2_llm(smollm_cache_root: str) -> Any:
    """One float32 LLM on SmolLM2's GGUF file with slots for both of support/smollm2.py's adapters, for
    the modules that only generate with it (an engine per module loaded the same folder again)."""
    from support.smollm2 import ADAPTERS, GGUF_PATH

    from loraserve import LLM

    assert GGUF_PATH is not None
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LORASERVE_CACHE_ROOT", smollm_cache_root)
        # These modules hold the model to transformers' tokens: float32 activations at two int8 levels
        # (test_real_model_quantized.py checks the default, one level, against the dense model).
        patch.setenv("LORASERVE_CPU_QUANT_ACT_LEVELS", "2")
        # 128 MiB of KV cache (about 2,900 float32 tokens) holds every batch these modules run.
        return LLM(
            GGUF_PATH,
            dtype="float32",
            enable_lora=True,
            max_loras=len(ADAPTERS),
            max_lora_rank=8,
            max_model_len=2048,
            kv_cache_memory_bytes=128 << 20,
        )


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from loraserve.demo.random_model import build_tokenizer

    path = str(tmp_path_factory.mktemp("tokenizer"))
    build_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> Callable[[str], str]:
    """tiny_model("llama") -> folder with config.json, weights and tokenizer (built once per session)."""
    from transformers import AutoTokenizer

    from loraserve.demo.random_model import save_random_model

    built: dict[str, str] = {}
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))

    def make(arch: str) -> str:
        if arch not in built:
            path = str(tmp_path_factory.mktemp(f"model-{arch}"))
            save_random_model(path, _tiny_config(arch, vocab_size), seed=1234)
            for name in os.listdir(tokenizer_dir):
                shutil.copy(os.path.join(tokenizer_dir, name), path)
            built[arch] = path
        return built[arch]

    return make


@pytest.fixture(scope="session")
def hf_model() -> Callable[[str], Any]:
    """Load (and cache) the transformers reference model for a folder, in float32."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, Any] = {}

    def load(path: str) -> Any:
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return load
