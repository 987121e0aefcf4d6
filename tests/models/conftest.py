"""Fixtures that model test modules share: the tiny random MoE models (tests/support/tiny_moe.py) of
test_moe.py and test_moe_adapters.py.

`moe_models` is module-scoped: each module builds its own (a fraction of a second, from a fixed seed),
so no module sees models that another module's adapters were written on (PEFT wraps the model in place).
"""

from __future__ import annotations

from typing import Any

import pytest
from support.tiny_moe import MOE_ARCHS, save_tiny_moe
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: str) -> dict[str, tuple[str, Any]]:
    """arch -> (folder, the float32 HF model) for every MoE family."""
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    models = {}
    for arch in MOE_ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        models[arch] = (path, save_tiny_moe(path, arch, tokenizer_dir, vocab_size))
    return models
