"""Adapter paths as vLLM users write them: `~/...` and Hugging Face repo ids (`org/repo[/sub]`).

The Hub is never reached: repo ids resolve from a local cache laid out as huggingface_hub writes it
(HF_HUB_OFFLINE is set for the whole suite), and the online call is checked with a recording stand-in.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest

from loraserve import LLM, SamplingParams
from loraserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from loraserve.lora.adapter_path import hub_repo_parts, resolve_adapter_path
from loraserve.lora.request import LoRARequest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def adapter(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    from loraserve.demo.random_model import save_peft_adapter

    path = str(tmp_path_factory.mktemp("adapter") / "sql")
    save_peft_adapter(hf_model(tiny_model("llama")), path, 11, tiny_model("llama"), r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])
    return path


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> LLM:
    return LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=4, max_lora_rank=8)


def fake_hub_cache(root: Path, repo_id: str, files: dict[str, str]) -> Path:
    """A huggingface_hub cache holding one snapshot of `repo_id` (files: path in repo -> source file)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    for name, source in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, snapshot / name)
    return snapshot


def adapter_files(adapter: str, prefix: str = "") -> dict[str, str]:
    return {prefix + name: os.path.join(adapter, name) for name in os.listdir(adapter)}


def tokens(llm: LLM, lora: LoRARequest | None) -> list[int]:
    return llm.generate([PROMPT], PARAMS, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids


def test_tilde_is_expanded(llm: LLM, adapter: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(adapter, tmp_path / "adapters" / "sql")
    expected = tokens(llm, LoRARequest("plain", 1, adapter))
    assert tokens(llm, LoRARequest("home", 2, "~/adapters/sql")) == expected
    assert expected != tokens(llm, None)


def test_a_repo_id_loads_from_the_hub_cache(
    llm: LLM, adapter: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = fake_hub_cache(tmp_path, "org/sql-lora", adapter_files(adapter))
    fake_hub_cache(tmp_path, "org/many", adapter_files(adapter, "adapters/sql/"))
    assert resolve_adapter_path("org/sql-lora", "x") == str(snapshot)
    expected = tokens(llm, LoRARequest("plain", 3, adapter))
    assert tokens(llm, LoRARequest("hub", 4, "org/sql-lora")) == expected
    assert tokens(llm, LoRARequest("hub-sub", 5, "org/many/adapters/sql")) == expected
    # Not in the cache and HF_HUB_OFFLINE set: a clear not-found, nothing downloaded.
    with pytest.raises(LoRAAdapterNotFoundError, match="not in the local cache .*HF_HUB_OFFLINE"):
        tokens(llm, LoRARequest("absent", 6, "org/absent"))
    with pytest.raises(LoRAAdapterNotFoundError, match="has no adapter_config.json under 'elsewhere'"):
        tokens(llm, LoRARequest("wrong-sub", 7, "org/many/elsewhere"))


def test_online_download_fetches_only_the_adapter_files(
    adapter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append((repo_id, kwargs))
        return os.path.dirname(adapter)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert resolve_adapter_path("org/repo/sql", "x") == adapter
    assert calls == [
        ("org/repo", {"allow_patterns": ["sql/adapter_config.json", "sql/adapter_model*"], "local_files_only": False})
    ]


@pytest.mark.parametrize(
    "path, parts",
    [
        ("org/repo", ("org/repo", "")),
        ("org/repo/a/b", ("org/repo", "a/b")),
        ("org/../etc", None),  # never a repo id: it could climb out of the snapshot
        ("org/repo/../../x", None),
        ("org//repo", None),
        ("./org/repo", None),
        ("/abs/path", None),
        ("~/adapters/sql", None),
        ("single", None),
    ],
)
def test_which_paths_are_repo_ids(path: str, parts: tuple[str, str] | None) -> None:
    assert hub_repo_parts(path) == parts


def test_a_path_that_is_neither_is_not_found(llm: LLM) -> None:
    with pytest.raises(LoRAAdapterError, match="No adapter found"):
        tokens(llm, LoRARequest("dots", 8, "org/../etc"))
