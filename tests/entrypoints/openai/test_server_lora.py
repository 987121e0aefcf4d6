"""Runtime adapter management over HTTP (fake engine): load/unload routes and statuses, resolvers only
when enabled, one load for many concurrent first requests, bad loads failing alone, unload waiting."""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest
from support.fake_engine import FakeEngine, write_adapter
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry
from loraserve.lora.resolvers.filesystem_resolver import FilesystemResolver


class CountingResolver(LoRAResolver):
    """Resolves from a FilesystemResolver and counts every question it is asked."""

    def __init__(self, root: str) -> None:
        self.inner = FilesystemResolver(root)
        self.asked: list[str] = []

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        self.asked.append(lora_name)
        return await self.inner.resolve_lora(base_model_name, lora_name)


@pytest.fixture()
def adapters(tmp_path) -> str:
    for name in ("a", "b", "c", "shared"):
        write_adapter(str(tmp_path / name))
    write_adapter(str(tmp_path / "rank64"), rank=64)
    write_adapter(str(tmp_path / "prefix"), peft_type="PREFIX_TUNING")
    os.makedirs(tmp_path / "empty")
    return str(tmp_path)


@pytest.fixture()
def resolver(adapters: str):
    counting = CountingResolver(adapters)
    saved = dict(LoRAResolverRegistry.resolvers)
    LoRAResolverRegistry.resolvers.clear()
    LoRAResolverRegistry.register_resolver("counting", counting)
    yield counting
    LoRAResolverRegistry.resolvers.clear()
    LoRAResolverRegistry.resolvers.update(saved)


def complete(server: RunningServer, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 3, **extra}
    return server.http.post("/v1/completions", json=body, timeout=30)


def load(server: RunningServer, name: str, path: str) -> httpx.Response:
    return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def model_ids(server: RunningServer) -> set[str]:
    return {card["id"] for card in server.http.get("/v1/models").json()["data"]}


def test_runtime_updating_off(tokenizer, adapters: str, resolver: CountingResolver, monkeypatch) -> None:
    monkeypatch.delenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    with RunningServer(FakeEngine(tokenizer), ServerOptions(served_model_names=["base"])) as server:
        load = {"lora_name": "a", "lora_path": os.path.join(adapters, "a")}
        assert server.http.post("/v1/load_lora_adapter", json=load).status_code == 404
        assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
        response = complete(server, "a")
        assert response.status_code == 404 and "does not exist" in response.json()["error"]["message"]
    assert resolver.asked == []


def test_load_and_unload_routes(tokenizer, adapters: str, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    engine = FakeEngine(tokenizer)
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:

        def load(name: str, path: str) -> httpx.Response:
            return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

        ok = load("a", os.path.join(adapters, "a"))
        assert ok.status_code == 200 and "added successfully" in ok.text
        assert "a" in model_ids(server) and complete(server, "a").status_code == 200
        cases = [
            (load("a", os.path.join(adapters, "b")), 400, "already been loaded"),
            (load("", os.path.join(adapters, "b")), 400, "must be provided"),
            (load("b", "  "), 400, "must be provided"),
            (load("base", os.path.join(adapters, "b")), 400, "base model"),
            (load("m", os.path.join(adapters, "missing")), 404, "No adapter found"),
            (load("r", os.path.join(adapters, "rank64")), 400, "max_lora_rank"),
            (load("p", os.path.join(adapters, "prefix")), 400, "PREFIX_TUNING"),
            (load("e", os.path.join(adapters, "empty")), 400, "adapter_config.json"),
            (server.http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path"),
        ]
        for response, status, text in cases:
            assert response.status_code == status, response.text
            assert text in response.json()["error"]["message"]
            # vLLM's error.type for refused loads, which clients match; 404 stays NotFoundError.
            expected_type = "NotFoundError" if status == 404 else "InvalidUserInput"
            assert response.json()["error"]["type"] == expected_type, response.text
        assert model_ids(server) == {"base", "a"}
        assert [r.lora_name for r in engine.loras.values()] == ["a"]

        assert load("b", os.path.join(adapters, "b")).status_code == 200
        b_id = server.app.state.models.lora_requests["b"].lora_int_id
        unload = server.http.post("/v1/unload_lora_adapter", json={"lora_int_id": b_id})
        assert unload.status_code == 200 and "removed successfully" in unload.text
        unload = server.http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert unload.status_code == 200
        assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
        missing = server.http.post("/v1/unload_lora_adapter", json={})
        assert missing.status_code == 400 and missing.json()["error"]["type"] == "InvalidUserInput"
        assert model_ids(server) == {"base"} and engine.loras == {}
        assert complete(server, "a").status_code == 404
        # A name can be loaded again after unloading, under a new id.
        assert load("a", os.path.join(adapters, "a")).status_code == 200
        assert server.app.state.models.lora_requests["a"].lora_int_id not in (b_id,)


def test_resolvers_and_concurrent_first_requests(tokenizer, adapters: str, resolver, monkeypatch) -> None:
    monkeypatch.setenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    engine = FakeEngine(tokenizer)
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:
        server.call(lambda: setattr(engine, "load_gate", asyncio.Event()))
        locks = server.app.state.models.name_locks

        def num_waiters() -> int:
            return locks.num_users("shared")

        async def first_requests() -> list[httpx.Response]:
            body = {"model": "shared", "prompt": "hello", "max_tokens": 3}
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                pending = [asyncio.ensure_future(http.post("/v1/completions", json=body)) for _ in range(20)]
                # All 20 are inside the resolver path (one loading, 19 queued on the name's lock) before
                # the load is allowed to finish.
                await asyncio.to_thread(wait_for, lambda: num_waiters() == 20, 10.0, "20 waiters")
                await asyncio.to_thread(server.call, lambda: engine.load_gate.set())
                return await asyncio.gather(*pending)

        results = asyncio.run(first_requests())
        assert [r.status_code for r in results] == [200] * 20
        assert engine.add_lora_calls == ["shared"] and resolver.asked == ["shared"]
        assert len({r.json()["choices"][0]["text"] for r in results}) == 1
        assert len(locks) == 0  # no lock left behind

        missing = complete(server, "nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
        broken = complete(server, "rank64")
        assert broken.status_code == 400 and "max_lora_rank" in broken.json()["error"]["message"]
        assert "rank64" not in model_ids(server) and len(locks) == 0
        assert complete(server, "../a").status_code == 404
        # Loaded names skip the resolvers.
        asked = len(resolver.asked)
        assert complete(server, "shared").status_code == 200 and len(resolver.asked) == asked


def test_bad_loads_under_good_traffic(tokenizer, adapters: str, monkeypatch) -> None:
    monkeypatch.setenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine = FakeEngine(tokenizer)
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:
        assert load(server, "a", os.path.join(adapters, "a")).status_code == 200
        bad_bodies = [
            {
                "lora_name": f"bad{i}",
                "lora_path": os.path.join(adapters, ["rank64", "prefix", "empty", "missing"][i % 4]),
            }
            for i in range(46)
        ] + [{"lora_name": "a", "lora_path": os.path.join(adapters, "b")}, {"lora_name": ""}, [1], "x"]

        async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                good = [
                    http.post("/v1/completions", json={"model": m, "prompt": "hi", "max_tokens": 4})
                    for m in ["a", "base"] * 30
                ]
                bad = [http.post("/v1/load_lora_adapter", json=body) for body in bad_bodies]
                results = await asyncio.gather(*good, *bad)
                return results[: len(good)], results[len(good) :]

        good, bad = asyncio.run(run())
        assert len(bad) == 50
        assert [r.status_code for r in good] == [200] * len(good)
        assert all(r.status_code in (400, 404) for r in bad), [r.status_code for r in bad]
        assert model_ids(server) == {"base", "a"}
        ok = load(server, "c", os.path.join(adapters, "c"))
        assert ok.status_code == 200 and complete(server, "c").status_code == 200


def test_unload_waits_for_running_requests(tokenizer, adapters: str, monkeypatch) -> None:
    monkeypatch.setenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", "true")
    engine = FakeEngine(tokenizer)
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:
        assert load(server, "a", os.path.join(adapters, "a")).status_code == 200
        server.call(lambda: setattr(engine, "gate", asyncio.Event()))
        results: dict[str, httpx.Response] = {}
        runners = [
            threading.Thread(
                target=lambda i=i: results.__setitem__(
                    f"r{i}", complete(server, "a", max_tokens=5, stream=i == 1)
                )
            )
            for i in range(2)
        ]
        for runner in runners:
            runner.start()
        wait_for(lambda: len(engine.running) == 2, what="two requests running on the adapter")
        unloader = threading.Thread(
            target=lambda: results.__setitem__(
                "unload",
                server.http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=30),
            )
        )
        unloader.start()
        wait_for(lambda: engine.removing, what="the engine to start removing the adapter")
        assert "unload" not in results and len(engine.running) == 2
        assert complete(server, "a").status_code == 404  # new requests no longer reach it
        server.call(lambda: engine.gate.set())
        for thread in (*runners, unloader):
            thread.join(30)
        assert results["unload"].status_code == 200
        assert (
            results["r0"].status_code == 200
            and results["r0"].json()["choices"][0]["finish_reason"] == "length"
        )
        assert results["r1"].status_code == 200 and results["r1"].text.rstrip().endswith("data: [DONE]")
        assert '"finish_reason":"length"' in results["r1"].text
        assert engine.loras == {} and engine.aborted == []
