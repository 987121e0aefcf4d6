"""General plugins: entry-point discovery, the LORASERVE_PLUGINS allowlist, failure isolation, once per
process; and the resolver chain (filesystem, Hub, third-party plugin) behind a running server.

tests/support/plugin_pkg is installed the way pip would leave it: its package on sys.path plus a .dist-info
folder holding the entry points from its pyproject.toml, which importlib.metadata discovers.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path

import pytest
from support.fake_engine import FAKE_BASE_MODEL, FakeEngine, write_adapter
from support.harness import RunningServer
from test_resolvers import StandInHub, make_adapter

from loraserve import plugins
from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.lora.resolver import LoRAResolverRegistry

PLUGIN_PKG = Path(__file__).parent.parent / "support" / "plugin_pkg"
PLUGIN_ENV = (
    "PLUGINS",
    "LORA_RESOLVER_CACHE_DIR",
    "LORA_RESOLVER_HF_REPO_LIST",
    "LORA_RESOLVER_S3_BUCKET",
    "TEST_PLUGIN_DIR",
    "ALLOW_RUNTIME_LORA_UPDATING",
)


def _entry_points_txt(pyproject: Path) -> str:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {value}" for name, value in entries.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def test_plugin(tmp_path_factory: pytest.TempPathFactory):
    """Install tests/support/plugin_pkg for this module; yields its imported module."""
    site = tmp_path_factory.mktemp("site")
    dist_info = site / "loraserve_test_plugin-0.1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: loraserve-test-plugin\nVersion: 0.1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(_entry_points_txt(PLUGIN_PKG / "pyproject.toml"))
    sys.path[:0] = [str(PLUGIN_PKG), str(site)]
    importlib.invalidate_caches()
    module = importlib.import_module("loraserve_test_plugin")
    yield module
    for path in (str(PLUGIN_PKG), str(site)):
        sys.path.remove(path)
    sys.modules.pop("loraserve_test_plugin", None)
    importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def fresh_state(monkeypatch: pytest.MonkeyPatch):
    """Each test is a new process as far as plugins go: nothing loaded, nothing registered."""
    for var in PLUGIN_ENV:
        monkeypatch.delenv("LORASERVE_" + var, raising=False)
        monkeypatch.delenv("VLLM_" + var, raising=False)
    monkeypatch.setattr(plugins, "_loaded_plugins", set())
    saved = dict(LoRAResolverRegistry.resolvers)
    LoRAResolverRegistry.resolvers.clear()
    yield
    LoRAResolverRegistry.resolvers.clear()
    LoRAResolverRegistry.resolvers.update(saved)


def test_builtin_entry_points_declared() -> None:
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group=plugins.GENERAL_PLUGINS_GROUP)}
    assert names["lora_filesystem_resolver"].endswith("filesystem_resolver:register_filesystem_resolver")
    assert names["lora_hf_hub_resolver"].endswith("hf_hub_resolver:register_hf_hub_resolver")


def test_all_plugins_when_unset(test_plugin, caplog: pytest.LogCaptureFixture) -> None:
    test_plugin.registrations.clear()
    with caplog.at_level(logging.ERROR):
        called = plugins.load_general_plugins()
    assert "lora_test_resolver" in called and "lora_broken_plugin" not in called
    assert sorted(test_plugin.registrations) == ["lora_broken_plugin", "lora_test_resolver"]
    assert "broken on purpose" in caplog.text and "lora_missing_module" in caplog.text
    assert LoRAResolverRegistry.get_supported_resolvers() == [test_plugin.RESOLVER_NAME]
    # Once per process: a second call runs nothing again.
    assert plugins.load_general_plugins() == []
    assert len(test_plugin.registrations) == 2


def test_empty_allowlist_loads_nothing(test_plugin, monkeypatch: pytest.MonkeyPatch) -> None:
    test_plugin.registrations.clear()
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert plugins.load_general_plugins() == []
    assert test_plugin.registrations == []


def test_allowlist(test_plugin, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    test_plugin.registrations.clear()
    monkeypatch.setenv("LORASERVE_PLUGINS", "lora_test_resolver, not_installed")
    with caplog.at_level(logging.WARNING):
        assert plugins.load_general_plugins() == ["lora_test_resolver"]
    assert test_plugin.registrations == ["lora_test_resolver"]
    assert "'not_installed'" in caplog.text


def test_resolver_chain_behind_server(test_plugin, tokenizer_dir: str, tmp_path, monkeypatch) -> None:
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    write_adapter(str(cache / "fs-adapter"))
    write_adapter(str(cache / "too-big"), rank=64)
    write_adapter(str(tmp_path / "plugin" / "x"))
    make_adapter(str(tmp_path / "remote" / "sql"), base=FAKE_BASE_MODEL)
    monkeypatch.setenv(
        "LORASERVE_PLUGINS", "lora_filesystem_resolver,lora_hf_hub_resolver,lora_test_resolver"
    )
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_CACHE_DIR", str(cache))
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_HF_REPO_LIST", "org/loras")
    monkeypatch.setenv("LORASERVE_TEST_PLUGIN_DIR", str(tmp_path / "plugin"))
    monkeypatch.setenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert plugins.load_general_plugins() == [
        "lora_filesystem_resolver",
        "lora_hf_hub_resolver",
        "lora_test_resolver",
    ]
    assert LoRAResolverRegistry.get_supported_resolvers() == [
        "Filesystem Resolver",
        "Hugging Face Hub Resolver",
        test_plugin.RESOLVER_NAME,
    ]
    hub = StandInHub({"org/loras": str(tmp_path / "remote")}, str(tmp_path / "snapshots"))
    LoRAResolverRegistry.get_resolver("Hugging Face Hub Resolver").hub_client = hub
    engine = FakeEngine(AutoTokenizer.from_pretrained(tokenizer_dir))
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:
        test_plugin.lookups.clear()
        for name in ("fs-adapter", "org/loras/sql", "plugin-x"):
            response = server.http.post(
                "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2}
            )
            assert response.status_code == 200, (name, response.text)
            assert response.json()["model"] == name
        # Tried in allowlist order: the plugin was asked only for the name the built-ins lacked.
        assert test_plugin.lookups == ["plugin-x"]
        assert hub.downloads == [("org/loras", ["sql/*"])]
        missing = server.http.post("/v1/completions", json={"model": "nothing", "prompt": "hi"})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The lora adapter 'nothing' cannot be found."
        assert test_plugin.lookups[-1] == "nothing"
        too_big = server.http.post("/v1/completions", json={"model": "too-big", "prompt": "hi"})
        assert too_big.status_code == 400 and "max_lora_rank" in too_big.json()["error"]["message"]
        for name in ("../cache/fs-adapter", "/etc", "fs-adapter/../fs-adapter/../../cache"):
            assert (
                server.http.post("/v1/completions", json={"model": name, "prompt": "hi"}).status_code == 404
            )
        ids = {card["id"]: card for card in server.http.get("/v1/models").json()["data"]}
        assert {"fs-adapter", "org/loras/sql", "plugin-x"} <= set(ids) and "too-big" not in ids
        lora_ids = [r.lora_int_id for r in server.app.state.models.lora_requests.values()]
        assert len(set(lora_ids)) == len(lora_ids)
