"""Hostile and broken adapters on the real engine (tiny Llama, one slot, one host-cache entry): each is a
4xx for that adapter alone, naming it, without server paths or advice to load files unsafely.

Covered: a 2 GB sparse weights file, a catastrophic `target_modules` / `layers_pattern` regex, a path
component too long for the file system, an evicted adapter whose folder was deleted (404) or whose
files changed (409, until unloaded and loaded again, which serves the new weights with no stale KV),
and broken adapters found by a resolver in a server directory (a config that does not read, no LoRA or
another base model: a 400 saying why; an adapter naming the served name instead of the model path loads).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.lora.resolver import LoRAResolverRegistry
from loraserve.lora.resolvers.filesystem_resolver import FilesystemResolver

PROMPT = list(range(20, 60))  # 40 tokens: whole KV blocks that the prefix cache keeps
CATASTROPHIC = "(?:.|.)*(?:.|.)*[0-9]{5}"  # years of backtracking on a module name without a budget


class _Exploit:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("touch /tmp/loraserve_pwned",))


@pytest.fixture(scope="module")
def faults(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    root = tmp_path_factory.mktemp("faults")
    for seed, name in enumerate(("v1", "v2")):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        save_peft_adapter(base, str(root / name), 700 + seed, model_dir, r=8, lora_alpha=16,
                          target_modules=["q_proj", "v_proj"])
    _write_resolver_adapters(root, model_dir)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=model_dir, dtype="float32", device="cpu", max_model_len=96, enable_lora=True,
                   max_loras=1, max_cpu_loras=1, max_lora_rank=16, kv_cache_memory_bytes=16 << 20)
    )
    saved = dict(LoRAResolverRegistry.resolvers)
    LoRAResolverRegistry.resolvers.clear()
    LoRAResolverRegistry.register_resolver("Filesystem Resolver", FilesystemResolver(str(root / "resolver")))
    options = ServerOptions(served_model_names=["tiny"], allow_runtime_lora_updating=True)
    try:
        with RunningServer(engine, options) as server:
            yield server, root
    finally:
        LoRAResolverRegistry.resolvers.clear()
        LoRAResolverRegistry.resolvers.update(saved)


def _write_resolver_adapters(root: Path, model_dir: str) -> None:
    """Broken adapters in the resolver's (server) directory, each made for the served model."""
    resolver = root / "resolver"
    for name in ("pickled", "no-weights", "garbage"):
        shutil.copytree(root / "v1", resolver / name)
        for weights in (resolver / name).glob("adapter_model.*"):
            weights.unlink()
    torch.save({"x": _Exploit()}, resolver / "pickled" / "adapter_model.bin")
    (resolver / "garbage" / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 64) + b"\xff" * 64)
    bases = {"other-base": "org/other-base", "other-local-base": "/models/other", "by-name": "tiny"}
    for name, base in bases.items():
        shutil.copytree(root / "v1", resolver / name)
        config = resolver / name / "adapter_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": base}))
    for name, text in (("deep", "[" * 80 + "]" * 80), ("not-lora", '{"peft_type": "IA3"}')):
        (resolver / name).mkdir()
        (resolver / name / "adapter_config.json").write_text(text)
    assert json.loads((resolver / "pickled" / "adapter_config.json").read_text())["base_model_name_or_path"] == model_dir


def _variant(root: Path, name: str, source: str = "v1", **config: Any) -> str:
    """A copy of adapter `source` under a new folder, with `config` fields overridden."""
    folder = root / "variants" / name
    shutil.copytree(root / source, folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return str(folder)


def load(server: RunningServer, name: str, path: str) -> httpx.Response:
    return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def complete(server: RunningServer, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1,
            "ignore_eos": True, "return_tokens_as_token_ids": True}
    return server.http.post("/v1/completions", json=body)


def assert_error(response: httpx.Response, status: int, *phrases: str, root: Path) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for phrase in phrases:
        assert phrase in message, message
    assert str(root) not in response.text and "/tmp" not in response.text, message
    return message


def test_sparse_2gb_weights_file_is_a_400_without_reading_it(faults) -> None:
    server, root = faults
    folder = Path(_variant(root, "sparse"))
    path = folder / "adapter_model.safetensors"
    header = json.dumps({"w": {"dtype": "U8", "shape": [2 << 30], "data_offsets": [0, 2 << 30]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    os.truncate(path, 8 + len(header) + (2 << 30))
    for _ in range(2):  # and again: the same 400
        assert_error(load(server, "sparse", str(folder)), 400, "LoRA adapter 'sparse'",
                     "more than any LoRA adapter for this model and max_lora_rank can hold", root=root)
    assert complete(server, "tiny").status_code == 200


@pytest.mark.parametrize(
    ("field", "config"),
    [
        ("target_modules", {"target_modules": CATASTROPHIC}),
        ("layers_pattern", {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0],
                            "layers_pattern": CATASTROPHIC}),
        ("rank_pattern", {"rank_pattern": {CATASTROPHIC: 4}}),
    ],
)
def test_catastrophic_regex_is_a_400_naming_the_adapter(faults, field: str, config: dict) -> None:
    server, root = faults
    name = f"regex-{field}"
    assert_error(load(server, name, _variant(root, name, **config)), 400, f"LoRA adapter '{name}'",
                 f"the pattern in field '{field}'", "took too long", root=root)
    assert server.http.get("/health").status_code == 200


def test_path_component_too_long_is_a_400_without_the_path(faults) -> None:
    server, root = faults
    assert_error(load(server, "long", str(root / ("a" * 300))), 400, "LoRA adapter 'long'",
                 "File name too long", root=root)


def test_evicted_adapter_whose_folder_was_deleted_is_a_404_for_it_alone(faults) -> None:
    server, root = faults
    folder = _variant(root, "doomed")
    assert load(server, "doomed", folder).status_code == 200
    assert complete(server, "doomed").status_code == 200
    assert load(server, "bystander", _variant(root, "bystander", "v2")).status_code == 200  # evicts "doomed"
    shutil.rmtree(folder)
    for _ in range(2):
        assert_error(complete(server, "doomed"), 404, "LoRA adapter 'doomed'", "files are gone", root=root)
        assert complete(server, "bystander").status_code == 200 and complete(server, "tiny").status_code == 200
    assert server.http.get("/health").status_code == 200


def _logprobs(response: httpx.Response) -> tuple[list[str], list[float]]:
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def test_adapter_changed_on_disk_is_a_409_until_reloaded_and_then_serves_fresh_kv(faults) -> None:
    server, root = faults
    folder = _variant(root, "mutable")
    assert load(server, "mutable", folder).status_code == 200
    old = _logprobs(complete(server, "mutable"))  # its KV blocks are now in the prefix cache
    assert load(server, "evictor", _variant(root, "evictor", "v2")).status_code == 200  # evicts "mutable"
    for weights in Path(folder).glob("adapter_model.*"):
        shutil.copy(root / "v2" / weights.name, weights)
    for _ in range(2):
        assert_error(complete(server, "mutable"), 409, "LoRA adapter 'mutable' changed on disk", root=root)
        assert complete(server, "evictor").status_code == 200
    # Unloading and loading it again serves the new content under a new identity (prefix-cache salt):
    # exactly what a fresh load of the new content computes, not the old adapter's cached KV.
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "mutable"}).status_code == 200
    assert load(server, "mutable", folder).status_code == 200
    new = _logprobs(complete(server, "mutable"))
    assert load(server, "fresh", _variant(root, "fresh", "v2")).status_code == 200
    fresh = _logprobs(complete(server, "fresh"))
    assert new[0] == fresh[0] and new[1] == pytest.approx(fresh[1], abs=1e-4)
    assert new[1] != pytest.approx(old[1], abs=1e-4)


@pytest.mark.parametrize(
    ("name", "phrase"),
    [
        ("pickled", "adapter_model.bin holds objects that safe loading refuses"),
        ("no-weights", "no weights file"),
        ("garbage", "cannot load adapter_model.safetensors safely"),
    ],
)
def test_resolved_broken_adapters_show_no_server_paths(faults, name: str, phrase: str) -> None:
    server, root = faults
    for _ in range(2):  # the second time from the failed-load memory: the same answer
        message = assert_error(complete(server, name), 400, f"'{name}'", phrase, root=root)
        assert "weights_only" not in message and "False" not in message
    assert not Path("/tmp/loraserve_pwned").exists()
    by_path = load(server, f"{name}-by-path", str(root / "resolver" / name))
    assert "weights_only" not in assert_error(by_path, 400, phrase, root=root)
    assert_error(load(server, "missing", str(root / "nowhere")), 404, "No adapter found for LoRA adapter 'missing'", root=root)


@pytest.mark.parametrize(
    ("name", "phrases"),
    [
        ("other-base", ("trained for base model 'org/other-base'", "base_model_name_or_path")),
        ("other-local-base", ("trained for base model a local model path", "base_model_name_or_path")),
        ("deep", ("adapter_config.json nests 80 levels deep",)),
        ("not-lora", ("only LORA adapters are supported, got 'IA3'", "field 'peft_type'")),
    ],
)
def test_resolved_adapter_with_a_bad_config_is_a_400_saying_why(faults, name: str, phrases: tuple) -> None:
    """The resolver found the folder: the client learns what is wrong with it, not "no such adapter"."""
    server, root = faults
    found = f"The lora adapter '{name}' was found but failed to load"
    message = assert_error(complete(server, name), 400, found, *phrases, root=root)
    assert "/models/other" not in message
    assert_error(complete(server, "no-such-folder"), 404, "'no-such-folder' cannot be found", root=root)


def test_resolved_adapter_may_name_the_served_name_as_its_base(faults) -> None:
    """base_model_name_or_path "tiny" (the served name) while the server serves a folder: it loads."""
    server, _ = faults
    response = complete(server, "by-name")
    assert response.status_code == 200, response.text
    models = server.http.get("/v1/models").json()["data"]
    card = next(m for m in models if m["id"] == "by-name")
    assert card["parent"] == "tiny"
