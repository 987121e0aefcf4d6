"""LoRA resolvers: the registry, the filesystem resolver (names never escape its folder) and the Hub
resolver (allowlisted repos only, subpath-restricted downloads) with a stand-in hub client."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil

import pytest
from support.adapter_files import unsafe_configs

from loraserve.errors import LoRAAdapterBaseMismatchError, LoRAAdapterError
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry, _LoRAResolverRegistry
from loraserve.lora.resolvers.filesystem_resolver import FilesystemResolver, register_filesystem_resolver
from loraserve.lora.resolvers.hf_hub_resolver import (
    HfHubResolver,
    register_hf_hub_resolver,
    split_adapter_name,
)

BASE = "org/base-model"


def make_adapter(path: str, base: str = BASE, peft_type: str = "LORA") -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump({"peft_type": peft_type, "base_model_name_or_path": base, "r": 4}, f)
    return path


def resolve(resolver: LoRAResolver, name: str, base: str = BASE) -> LoRARequest | None:
    return asyncio.run(resolver.resolve_lora(base, name))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch):
    for var in ("PLUGINS", "LORA_RESOLVER_CACHE_DIR", "LORA_RESOLVER_HF_REPO_LIST"):
        monkeypatch.delenv("LORASERVE_" + var, raising=False)
        monkeypatch.delenv("VLLM_" + var, raising=False)
    saved = dict(LoRAResolverRegistry.resolvers)
    LoRAResolverRegistry.resolvers.clear()
    yield
    LoRAResolverRegistry.resolvers.clear()
    LoRAResolverRegistry.resolvers.update(saved)


class Named(LoRAResolver):
    def __init__(self, tag: str) -> None:
        self.tag = tag

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        return None


def test_registry(caplog: pytest.LogCaptureFixture) -> None:
    registry = _LoRAResolverRegistry()
    first, second, third = Named("1"), Named("2"), Named("3")
    registry.register_resolver("a", first)
    registry.register_resolver("b", second)
    assert registry.get_supported_resolvers() == ["a", "b"]
    with caplog.at_level(logging.WARNING):
        registry.register_resolver("a", third)
    assert "already registered" in caplog.text
    assert registry.get_resolver("a") is third and registry.get_supported_resolvers() == ["a", "b"]
    with pytest.raises(KeyError, match="'missing' not found"):
        registry.get_resolver("missing")
    with pytest.raises(TypeError):
        registry.register_resolver("c", object())  # type: ignore[arg-type]


def test_filesystem_resolver_accepts_matching_lora(tmp_path) -> None:
    path = make_adapter(str(tmp_path / "sql"))
    make_adapter(str(tmp_path / "team" / "nested"))
    resolver = FilesystemResolver(str(tmp_path))
    found = resolve(resolver, "sql")
    assert found is not None and found.lora_name == "sql"
    assert os.path.realpath(found.lora_path) == os.path.realpath(path) and found.base_model_name == BASE
    assert resolve(resolver, "team/nested") is not None
    assert resolve(resolver, "missing") is None  # no such folder: not here (404)
    (tmp_path / "empty").mkdir()
    assert resolve(resolver, "empty") is None  # a folder without adapter_config.json: no adapter here


def test_filesystem_resolver_refuses_an_adapter_for_another_base(tmp_path) -> None:
    """Found, but trained for another model: said (400), with the base it names, never skipped silently."""
    path = make_adapter(str(tmp_path / "sql"))
    with pytest.raises(LoRAAdapterBaseMismatchError, match="trained for base model 'org/base-model'") as info:
        resolve(FilesystemResolver(str(tmp_path)), "sql", base="other/base")
    assert "base_model_name_or_path" in str(info.value) and "'sql'" in str(info.value)
    assert info.value.adapter_base == BASE
    assert os.path.realpath(info.value.lora_path) == os.path.realpath(path)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ('{"peft_type": "PREFIX_TUNING", "base_model_name_or_path": "org/base-model"}', "'PREFIX_TUNING'"),
        ("not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object, got list"),
        ('{"base_model_name_or_path": "org/base-model"}', "got None .field 'peft_type'"),
        ("[" * 70 + "]" * 70, "nests 70 levels deep"),
    ],
)
def test_filesystem_resolver_refuses_bad_configs_saying_why(tmp_path, config: str, reason: str) -> None:
    """A folder that exists with a config that does not read or is no LoRA: a refusal naming the
    adapter and the problem (the client's 400), not "no such adapter"."""
    os.makedirs(tmp_path / "bad")
    (tmp_path / "bad" / "adapter_config.json").write_text(config)
    with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'bad': .*{reason}") as info:
        resolve(FilesystemResolver(str(tmp_path)), "bad")
    assert not isinstance(info.value, LoRAAdapterBaseMismatchError)


def test_filesystem_resolver_refuses_unsafe_config_files_unread(tmp_path) -> None:
    resolver = FilesystemResolver(str(tmp_path))
    for name, (_, why) in unsafe_configs(tmp_path).items():
        with pytest.raises(LoRAAdapterError, match=f"LoRA adapter '{name}': .*{why}"):
            resolve(resolver, name)


def test_filesystem_resolver_names_stay_inside(tmp_path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    outside = make_adapter(str(tmp_path / "outside"))
    make_adapter(str(root / "inside"))
    os.symlink(outside, root / "escape")
    os.symlink(root / "inside", root / "alias")  # a link that stays inside is fine
    resolver = FilesystemResolver(str(root))
    for name in (
        "../outside",
        "/" + outside.lstrip("/"),
        outside,
        "inside/../../outside",
        "escape",
        "..",
        ".",
        "",
        "inside/..",
        "./inside",
        "inside\\..\\..\\outside",
        "inside\x00",
    ):
        assert resolve(resolver, name) is None, name
    assert resolve(resolver, "alias") is not None
    assert resolve(resolver, "inside") is not None


def test_register_filesystem_resolver(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    register_filesystem_resolver()  # unset: nothing registered, no error
    assert LoRAResolverRegistry.get_supported_resolvers() == []
    monkeypatch.setenv("LORASERVE_PLUGINS", "lora_filesystem_resolver")
    with caplog.at_level(logging.WARNING):
        register_filesystem_resolver()
    assert "LORASERVE_LORA_RESOLVER_CACHE_DIR is not set" in caplog.text
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path / "missing"))
    with pytest.raises(
        ValueError,
        match="LORASERVE_LORA_RESOLVER_CACHE_DIR must be set to a valid directory for "
        "Filesystem Resolver plugin to function",
    ):
        register_filesystem_resolver()
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))
    register_filesystem_resolver()
    assert isinstance(LoRAResolverRegistry.get_resolver("Filesystem Resolver"), FilesystemResolver)


class StandInHub:
    """The two huggingface_hub calls the resolver makes, served from a local folder per repo."""

    def __init__(self, repos: dict[str, str], snapshots: str) -> None:
        self.repos = repos
        self.snapshots = snapshots
        self.downloads: list[tuple[str, list[str] | None]] = []

    def list_repo_files(self, repo_id: str) -> list[str]:
        if repo_id not in self.repos:
            raise FileNotFoundError(f"Repository Not Found for url: https://huggingface.co/{repo_id}")
        root = self.repos[repo_id]
        return sorted(
            os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/")
            for d, _, fs in os.walk(root)
            for f in fs
        )

    def snapshot_download(self, repo_id: str, allow_patterns: list[str] | None = None) -> str:
        import fnmatch

        self.downloads.append((repo_id, allow_patterns))
        target = os.path.join(self.snapshots, repo_id.replace("/", "--"))
        for rel in self.list_repo_files(repo_id):
            if allow_patterns is None or any(fnmatch.fnmatch(rel, p) for p in allow_patterns):
                os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
                shutil.copy(os.path.join(self.repos[repo_id], rel), os.path.join(target, rel))
        return target


def test_hf_hub_resolver(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    repo = tmp_path / "remote"
    make_adapter(str(repo / "adapters" / "sql"))
    make_adapter(str(repo / "adapters" / "chat"))
    (repo / "adapters" / "notes").mkdir()
    (repo / "adapters" / "notes" / "README.md").write_text("not an adapter")
    root_repo = make_adapter(str(tmp_path / "root-remote"))
    hub = StandInHub(
        {"org/loras": str(repo), "org/root": root_repo, "org/absent": str(tmp_path)}, str(tmp_path / "snap")
    )
    with caplog.at_level(logging.WARNING):
        resolver = HfHubResolver(["org/loras", "org/root", "org/absent"], hub_client=hub)
    assert "not a safe setting" in caplog.text

    found = resolve(resolver, "org/loras/adapters/sql")
    assert found is not None and found.lora_name == "org/loras/adapters/sql"
    assert hub.downloads == [("org/loras", ["adapters/sql/*"])]
    snapshot = os.path.join(str(tmp_path / "snap"), "org--loras")
    assert os.listdir(os.path.join(snapshot, "adapters")) == ["sql"]  # only that subpath came down
    assert resolve(resolver, "org/root") is not None and hub.downloads[-1] == ("org/root", None)

    num_downloads = len(hub.downloads)
    for name in (
        "org/loras/adapters/notes",
        "org/loras/adapters/missing",
        "org/other/x",
        "org/loras/../root",
        "org/loras/adapters/../adapters/sql",
        "/org/loras",
        "org/loras//adapters/sql",
        "org/lorasx/a",
    ):
        assert resolve(resolver, name) is None, name
    with pytest.raises(LoRAAdapterBaseMismatchError):  # found, for another base: said, not skipped
        resolve(resolver, "org/loras/adapters/chat", base="another/base")
    assert len(hub.downloads) == num_downloads + 1  # only the base-mismatch lookup downloaded


def test_split_adapter_name_prefers_longest_repo() -> None:
    repos = ["org/a", "org/a-b"]
    assert split_adapter_name("org/a-b/x", repos) == ("org/a-b", "x")
    assert split_adapter_name("org/a/x/y", repos) == ("org/a", "x/y")
    assert split_adapter_name("org/a", repos) == ("org/a", "")
    assert split_adapter_name("org/ab", repos) is None


def test_register_hf_hub_resolver(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_HF_REPO_LIST", "org/loras, org/more")
    with caplog.at_level(logging.WARNING):
        register_hf_hub_resolver()  # PLUGINS unset: "all plugins" is not an explicit opt-in
    assert LoRAResolverRegistry.get_supported_resolvers() == []
    assert "must be enabled explicitly" in caplog.text
    monkeypatch.setenv("LORASERVE_PLUGINS", "lora_filesystem_resolver")
    register_hf_hub_resolver()
    assert LoRAResolverRegistry.get_supported_resolvers() == []
    monkeypatch.setenv("LORASERVE_PLUGINS", "lora_filesystem_resolver,lora_hf_hub_resolver")
    register_hf_hub_resolver()
    resolver = LoRAResolverRegistry.get_resolver("Hugging Face Hub Resolver")
    assert isinstance(resolver, HfHubResolver) and resolver.repo_list == ["org/loras", "org/more"]
