"""The registry's listing: what runs natively, what on the transformers backend, where adapters apply;
the `loraserve models` command prints it and docs/models.md holds its table."""

from __future__ import annotations

import json
import os

import pytest

from loraserve.entrypoints.cli import main
from loraserve.models.registry import (
    TRANSFORMERS_LORA,
    describe,
    describe_markdown,
    get_supported_archs,
    register_model,
    resolve_architecture,
)

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "models.md")


def test_describe_lists_native_rows_then_every_other_transformers_causal_lm() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    rows = describe()
    native = [r.architecture for r in rows if r.implementation == "native"]
    backend = [r.architecture for r in rows if r.implementation == "transformers"]
    assert native == get_supported_archs() and "Phi3ForCausalLM" in native
    assert set(backend) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) - set(native)
    assert "Olmo2ForCausalLM" in backend and all(r.lora == TRANSFORMERS_LORA for r in rows[len(native) :])
    for row in rows:  # each row says how resolution actually runs it
        assert resolve_architecture([row.architecture]).is_native == (row.implementation == "native")
    assert [r.architecture for r in describe(include_transformers=False)] == native


def test_a_registered_plugin_architecture_is_listed_native(monkeypatch: pytest.MonkeyPatch) -> None:
    from loraserve.models import registry

    monkeypatch.setattr(registry, "_NATIVE_MODELS", dict(registry._NATIVE_MODELS))
    register_model("MyPluginForCausalLM", "my_plugin.model:MyModel")
    assert ("MyPluginForCausalLM", "native") in [(r.architecture, r.implementation) for r in describe(False)]


def test_docs_models_md_holds_the_generated_table() -> None:
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    assert text.endswith(describe_markdown()), "docs/models.md is stale: regenerate its table"


def test_loraserve_models_prints_the_listing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["ARCHITECTURE", "RUNS"]
    listed = [line.split()[:2] for line in lines[1:-1]]
    assert listed == [[name, "native"] for name in get_supported_archs()]
    assert main(["models", "--all", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows == [
        {
            "architecture": r.architecture,
            "implementation": r.implementation,
            "lora": r.lora,
            "images": r.images,
        }
        for r in describe()
    ]
