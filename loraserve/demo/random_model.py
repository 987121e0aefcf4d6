"""The embedded demo: a small random Llama, a real BPE tokenizer and a few PEFT adapters, built offline.

`build_demo()` writes them once into the cache folder (fixed seeds, so every machine builds the same
files) and returns their paths; the CLI (`loraserve demo`, `loraserve serve` without a model), the
README commands, the tests and the benchmarks all use these builders.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from loraserve import envs
from loraserve.model_loader.staging import publish, stage

DEMO_VERSION = "v1"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
_CORPUS = """
Low-rank adapters let one base model serve many customers, tasks and languages at once.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step.
SELECT name, count(*) FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY 2 DESC;
def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)
Bonjour, comment allez-vous ? Très bien, merci. Héllo wörld, grüße aus München.
你好，世界。今天天气很好。 こんにちは世界 🙂 🚀 numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000
The server batches requests for different adapters together, so mixing them costs little.
"""


@dataclass(frozen=True)
class DemoPaths:
    root: str
    model_dir: str
    adapters: dict[str, str] = field(default_factory=dict)


def build_tokenizer(out_dir: str, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer on the embedded corpus and save it (with a chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def save_random_model(out_dir: str, config: Any, seed: int = 0, dtype: Any = None) -> Any:
    """Instantiate `config` with random weights (fixed seed) and save it with save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out_dir)
    return model


# The tests' and quick benchmarks' tiny shape: 2 layers, GQA 4:2, every op at a size that runs in ms.
TINY_SHAPE: dict[str, int] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def llama_config(vocab_size: int, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    values: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def save_peft_adapter(base_model: Any, out_dir: str, seed: int, base_name: str, **lora_kwargs: Any) -> None:
    """Build a PEFT LoRA adapter on `base_model` with non-zero random A and B and save it."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(base_model, LoraConfig(**lora_kwargs), adapter_name="default")
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    peft_model.peft_config["default"].base_model_name_or_path = base_name
    peft_model.save_pretrained(out_dir)
    peft_model.unload()


DEMO_ADAPTERS: dict[str, dict[str, Any]] = {
    "sql-lora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "french-lora": dict(
        r=16,
        lora_alpha=16,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp-lora": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
}


def build_demo(root: str | None = None) -> DemoPaths:
    """Build (once) and return the demo model and adapters under `root` (default: the cache folder)."""
    root = root or os.path.join(envs.cache_root(), f"demo-{DEMO_VERSION}")
    model_dir = os.path.join(root, "model")
    paths = DemoPaths(root, model_dir, {name: os.path.join(root, "adapters", name) for name in DEMO_ADAPTERS})
    if os.path.exists(os.path.join(root, "COMPLETE")):
        return paths
    staging = stage(os.path.dirname(root) or ".", ".demo-")
    try:
        _build_demo_into(staging, model_dir)
        publish(staging, root, "COMPLETE")
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    return paths


def _build_demo_into(staging: str, final_model_dir: str) -> None:
    model_dir = os.path.join(staging, "model")
    tokenizer = build_tokenizer(model_dir)
    model = save_random_model(model_dir, llama_config(len(tokenizer)), seed=0)
    for i, (name, kwargs) in enumerate(DEMO_ADAPTERS.items()):
        save_peft_adapter(model, os.path.join(staging, "adapters", name), 100 + i, final_model_dir, **kwargs)
    with open(os.path.join(staging, "COMPLETE"), "w", encoding="utf-8") as f:
        json.dump({"version": DEMO_VERSION}, f)
