"""`loraserve serve MODEL --replicas 2`: two engine replicas on Ray Serve behind one HTTP server.

One cluster per module: the test process starts a small local Ray, and the server (a child process,
as users run it) joins it through RAY_ADDRESS, so the tests can reach the replica actors. Adapters are
resolved by name from two stores at once: a shared folder (the filesystem resolver, `a00`...) and a
moto S3 bucket (the S3 resolver, `s00`..., the same weights; the AWS settings reach the server only,
after Ray started, so the replicas have them only as the launcher forwards them). The tests: a Zipf
trace from either store is answered in full, each adapter's requests stay on one replica, both
replicas serve, greedy text equals one in-process engine's; the ingress /metrics shows each replica's
residency; killing a replica mid-trace loses no request (each succeeds or gets a clear 503).
Without Ray, `--replicas 2` is a one-line error.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.harness import wait_for
from support.moto_s3 import FAKE_AWS_ENV, moto_s3_server, upload_adapter
from support.serve_process import ServeProcess

HAS_RAY = find_spec("ray") is not None and find_spec("ray.serve") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="needs the ray extra (ray[serve])")
# The module's first test also pays for its cluster: a Ray instance, two replicas and both adapter stores,
# which beside a busy neighbour take minutes (the server's wait follows its progress: serve_process.py).
pytestmark = pytest.mark.timeout(1200)
NUM_ADAPTERS = 12
MAX_MODEL_LEN = 256  # room for a long stream: the kill lands while it runs
PROMPTS = ["The quick brown fox", "SELECT name FROM", "Bonjour, comment", "numbers 0 1 2"]
SERVE_FLAGS = [
    "--replicas", "2",
    "--served-model-name", "tiny",
    "--dtype", "float32",
    "--device", "cpu",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--enable-lora",
    "--max-loras", "4",
    # Host room for both stores' adapters and the runtime-loaded ones: an eviction would send an
    # adapter's next request to whichever replica is least loaded (it is held nowhere any more), and
    # which adapter is evicted first depends on timing.
    "--max-cpu-loras", str(2 * NUM_ADAPTERS + 8),
    "--kv-cache-memory-bytes", str(16 << 20),
    "--replica-cpus", "1",
]  # fmt: skip
REPO_ROOT = str(Path(__file__).resolve().parents[3])


STORES = {"folder": "a", "s3": "s"}  # adapter name prefix of each store


def adapter_name(i: int, store: str = "folder") -> str:
    return f"{STORES[store]}{i:02d}"


@pytest.fixture(scope="module")
def cluster(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import ray
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter

    model_dir = tiny_model("llama")
    store = tmp_path_factory.mktemp("adapter-store")
    for i in range(NUM_ADAPTERS):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        save_peft_adapter(base, str(store / adapter_name(i)), 900 + i, model_dir, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj"])  # fmt: skip
    # Ray's workers (the replicas) must import this checkout of loraserve, as the test process does.
    python_path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    saved_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = python_path
    # log_to_driver off: replica logs streamed into this process would land in other tests' captured stderr
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    env = {
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "PYTHONPATH": python_path,
        "LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "true",
        "LORASERVE_LORA_RESOLVER_CACHE_DIR": str(store),
        "LORASERVE_REPLICA_STATS_TIMEOUT": "60",  # a busy test machine never drops a replica from /metrics
        "LORASERVE_LORA_RESOLVER_S3_PREFIX": "loras",
        "LORASERVE_LORA_RESOLVER_S3_CACHE_DIR": str(tmp_path_factory.mktemp("s3-cache")),
    }
    try:
        with pytest.MonkeyPatch.context() as mp:  # set after ray.init: Ray's own processes never see them
            for key, value in FAKE_AWS_ENV.items():
                mp.setenv(key, value)
            with moto_s3_server() as s3:
                bucket = s3.new_bucket()
                for i in range(NUM_ADAPTERS):
                    upload_adapter(s3, bucket, f"loras/{adapter_name(i, 's3')}", str(store / adapter_name(i)))
                env |= {"LORASERVE_LORA_RESOLVER_S3_BUCKET": bucket, "LORASERVE_LORA_RESOLVER_S3_ENDPOINT_URL": s3.endpoint_url}
                with ServeProcess([model_dir, *SERVE_FLAGS], env=env, startup_timeout_s=180) as server:
                    yield {"server": server, "model_dir": model_dir, "store": store}
                    status, output = server.stop()
                    assert status == 0, output[-3000:]
    finally:
        ray.shutdown()
        if saved_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_path


def zipf_trace(num_requests: int, seed: int, store: str = "folder") -> list[tuple[str, str]]:
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(NUM_ADAPTERS)]
    every = [adapter_name(i, store) for i in range(NUM_ADAPTERS)]
    names = rng.choices(every, weights, k=num_requests)
    names[:NUM_ADAPTERS] = every  # every adapter at least once
    return [(name, rng.choice(PROMPTS)) for name in names]


def complete(url: str, model: str, prompt: str, max_tokens: int = 6, timeout: float = 120) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def replica_of(response: httpx.Response) -> str:
    value = response.headers["x-loraserve-replica"]
    assert value and "," not in value, value  # one prompt: one replica
    return value


def oracle_texts(model_dir: str, store: Path, jobs: set[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Greedy text of each (adapter, prompt) from one in-process engine."""
    from loraserve.entrypoints.llm import LLM
    from loraserve.lora.request import LoRARequest
    from loraserve.sampling_params import SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, enable_lora=True,
              max_loras=4, max_cpu_loras=NUM_ADAPTERS, kv_cache_memory_bytes=16 << 20)  # fmt: skip
    ordered = sorted(jobs)
    ids = {adapter_name(i): i + 1 for i in range(NUM_ADAPTERS)}
    loras = [LoRARequest(name, ids[name], str(store / name)) for name, _ in ordered]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([p for _, p in ordered], params, loras, use_tqdm=False)
    return {job: out.outputs[0].text for job, out in zip(ordered, outputs)}


@pytest.mark.ray
@needs_ray
@pytest.mark.parametrize("store", list(STORES))
def test_zipf_trace_keeps_adapters_on_their_replica(cluster: dict[str, Any], store: str) -> None:
    url = cluster["server"].url
    trace = zipf_trace(120, seed=7, store=store)
    with ThreadPoolExecutor(4) as pool:  # below the spread depth (8): affinity alone decides
        responses = list(pool.map(lambda job: complete(url, *job), trace))
    assert [r.status_code for r in responses] == [200] * len(trace), [r.text for r in responses if r.status_code != 200]
    by_adapter: dict[str, Counter[str]] = defaultdict(Counter)
    for (name, _prompt), response in zip(trace, responses):
        by_adapter[name][replica_of(response)] += 1
    for name, counts in by_adapter.items():
        main_share = counts.most_common(1)[0][1] / sum(counts.values())
        assert main_share >= 0.8, f"{name}: {dict(counts)}"
    assert len({replica for counts in by_adapter.values() for replica in counts}) == 2
    folder_of = {adapter_name(i, store): adapter_name(i) for i in range(NUM_ADAPTERS)}  # the same weights
    texts = {(folder_of[name], prompt): r.json()["choices"][0]["text"] for (name, prompt), r in zip(trace, responses)}
    assert texts == oracle_texts(cluster["model_dir"], cluster["store"], set(texts))


@pytest.mark.ray
@needs_ray
def test_streams_and_errors_carry_the_replica_header(cluster: dict[str, Any]) -> None:
    url = cluster["server"].url
    home = replica_of(complete(url, adapter_name(3), PROMPTS[0]))
    body = {"model": adapter_name(3), "prompt": PROMPTS[1], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
        assert stream.status_code == 200
        assert stream.headers["x-loraserve-replica"] == home
        assert [line for line in stream.iter_lines() if line][-1] == "data: [DONE]"
    bad = httpx.post(f"{url}/v1/completions", json={"model": adapter_name(3), "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert bad.headers["x-loraserve-replica"] == "ingress"
    missing = httpx.post(f"{url}/v1/completions", json={"model": "no-such-adapter", "prompt": "x"})
    assert missing.status_code == 404 and missing.headers["x-loraserve-replica"] == "ingress"


@pytest.mark.ray
@needs_ray
def test_runtime_load_reload_and_unload_reach_the_replicas(cluster: dict[str, Any]) -> None:
    url, store = cluster["server"].url, cluster["store"]
    load = {"lora_name": "extra", "lora_path": str(store / adapter_name(5))}
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60)
    assert loaded.status_code == 200, loaded.text
    home = loaded.headers["x-loraserve-replica"]  # validated where its requests will run
    assert replica_of(complete(url, "extra", PROMPTS[0])) == home
    reload = {**load, "lora_path": str(store / adapter_name(6)), "load_inplace": True}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=reload, timeout=60).status_code == 200
    same_as_six = complete(url, adapter_name(6), PROMPTS[0]).json()["choices"][0]["text"]
    assert complete(url, "extra", PROMPTS[0]).json()["choices"][0]["text"] == same_as_six
    assert "extra" in {s["lora_name"] for s in metric_samples(url, "loraserve:lora_adapter_loaded")}
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "extra"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert complete(url, "extra", PROMPTS[0]).status_code == 404
    # Removed from every replica (each one is reached), so no replica holds it any more.
    assert "extra" not in {s["lora_name"] for s in metric_samples(url, "loraserve:lora_adapter_loaded")}


@pytest.mark.ray
@needs_ray
def test_versions_of_one_name_route_by_digest(cluster: dict[str, Any]) -> None:
    url, store = cluster["server"].url, cluster["store"]
    first = {"lora_name": "vpol", "lora_path": str(store / adapter_name(7)), "version": "v1"}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=first, timeout=60).status_code == 200
    v1_home = replica_of(complete(url, "vpol", PROMPTS[0]))
    second = {**first, "lora_path": str(store / adapter_name(8)), "version": "v2", "load_inplace": True}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=second, timeout=60).status_code == 200
    cards = {card["id"]: card for card in httpx.get(f"{url}/v1/models", timeout=60).json()["data"]}
    old = next(card for name, card in cards.items() if name.startswith("vpol@"))
    listed = {entry["name"]: entry["digest"] for entry in httpx.get(f"{url}/lora-adapters", timeout=60).json()}
    assert listed["vpol"] == cards["vpol"]["digest"] != old["digest"] == listed[old["id"]]
    jobs = [(model, prompt) for model in ("vpol", "vpol@v1", old["id"]) for prompt in PROMPTS]
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda job: complete(url, *job), jobs))
    assert [r.status_code for r in responses] == [200] * len(jobs), [r.text for r in responses]
    oracle = oracle_texts(cluster["model_dir"], store, {(adapter_name(i), p) for i in (7, 8) for p in PROMPTS})
    folder = {"vpol": adapter_name(8), "vpol@v1": adapter_name(7), old["id"]: adapter_name(7)}
    for (model, prompt), response in zip(jobs, responses):  # each version's own weights, on any replica
        assert response.json()["choices"][0]["text"] == oracle[(folder[model], prompt)], (model, prompt)
    v1_replicas = {replica_of(r) for (model, _), r in zip(jobs, responses) if model != "vpol"}
    assert v1_replicas == {v1_home}  # the old version stays with the replica that holds it
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "vpol"}, timeout=60).status_code == 200
    assert complete(url, "vpol@v1", PROMPTS[0]).status_code == 404


def metric_samples(url: str, name: str) -> list[dict[str, str]]:
    """The labels of every sample of family `name` on the ingress's /metrics (value 1 or not)."""
    text = httpx.get(f"{url}/metrics", timeout=120).text
    return [{**s.labels, "value": str(s.value)} for f in text_string_to_metric_families(text) if f.name == name
            for s in f.samples if not s.name.endswith("_created")]  # fmt: skip


@pytest.mark.ray
@needs_ray
def test_ingress_metrics_show_each_replicas_residency(cluster: dict[str, Any]) -> None:
    url = cluster["server"].url
    names = [adapter_name(i) for i in range(4)]  # max_loras: each stays in a slot of its replica
    homes = {name: replica_of(complete(url, name, PROMPTS[0])) for name in names}
    loaded = metric_samples(url, "loraserve:lora_adapter_loaded")
    assert loaded == metric_samples(url, "vllm:lora_adapter_loaded")  # vLLM's twin, the same samples
    slots = {(s["lora_name"], s["replica"]) for s in loaded if s["level"] == "slot"}
    assert {(name, home) for name, home in homes.items()} <= slots
    info = {s["replica"]: s for s in metric_samples(url, "loraserve:lora_requests_info")}
    assert len(info) == 2 and set(homes.values()) <= set(info), info  # both replicas, by the header's ids
    assert all(s["max_lora"] == "4" for s in info.values())
    running = {s["replica"] for s in metric_samples(url, "loraserve:num_requests_running")}
    assert running == set(info)
    loads = {s["replica"]: float(s["value"]) for s in metric_samples(url, "loraserve:lora_loads")
             if s["outcome"] == "success"}  # fmt: skip
    assert set(loads) == set(info) and all(loads[home] >= 1 for home in homes.values())
    assert [float(s["value"]) for s in metric_samples(url, "loraserve:num_replicas")] == [2.0]


def _outcome(response: httpx.Response) -> str:
    """"ok", or "503" for a clear OpenAI-style unavailable error; anything else fails the test."""
    if response.status_code == 200:
        assert response.json()["choices"][0]["text"] is not None
        return "ok"
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and "replica" in error["message"], error
    assert response.headers.get("retry-after"), response.headers
    return "503"


@pytest.mark.ray
@needs_ray
def test_killing_a_replica_loses_no_request(cluster: dict[str, Any]) -> None:
    import ray
    from ray import serve

    url = cluster["server"].url
    homes = {adapter_name(i): replica_of(complete(url, adapter_name(i), PROMPTS[0])) for i in range(NUM_ADAPTERS)}
    victim = homes[adapter_name(0)]
    long_tokens = MAX_MODEL_LEN - 16
    trace = zipf_trace(24, seed=11)
    body = {"model": adapter_name(0), "prompt": PROMPTS[2], "max_tokens": long_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with ThreadPoolExecutor(6) as pool, httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
        assert stream.headers["x-loraserve-replica"] == victim
        lines = stream.iter_lines()
        assert next(line for line in lines if line).startswith("data: {")  # running on the victim now
        pending = [pool.submit(complete, url, name, prompt, long_tokens) for name, prompt in trace]
        ray.kill(ray.get_actor(f"SERVE_REPLICA::loraserve#engine#{victim}", namespace="serve"), no_restart=True)
        rest = [line for line in lines if line]
        outcomes = Counter(_outcome(future.result(timeout=180)) for future in pending)
    assert rest[-1] == "data: [DONE]" and '"code":503' in rest[-2].replace(" ", ""), rest[-2:]
    assert sum(outcomes.values()) == len(trace), outcomes

    def replaced() -> bool:
        time.sleep(0.5)  # a poll interval: each status is a call to the Serve controller
        deployment = serve.status().applications["loraserve"].deployments["engine"]
        return deployment.status == "HEALTHY" and deployment.replica_states.get("RUNNING") == 2

    wait_for(replaced, 120, "Ray to replace the killed replica")
    after = [complete(url, adapter_name(i), PROMPTS[3]) for i in range(NUM_ADAPTERS)]
    assert all(_outcome(r) == "ok" for r in after)
    assert victim not in {replica_of(r) for r in after}


@needs_ray
def test_replicas_get_the_aws_settings_and_nothing_else() -> None:
    from loraserve.entrypoints.ray.launcher import replica_env_vars

    aws = {
        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t",
        "AWS_DEFAULT_REGION": "eu-west-1", "AWS_REGION": "eu-west-1", "AWS_PROFILE": "adapters",
        "AWS_CONFIG_FILE": "/etc/aws/config", "AWS_SHARED_CREDENTIALS_FILE": "/etc/aws/credentials",
        "AWS_CA_BUNDLE": "/etc/ssl/ca.pem", "AWS_ENDPOINT_URL": "http://minio:9000",
        "AWS_ENDPOINT_URL_S3": "http://minio:9000",
    }  # fmt: skip
    ours = {"LORASERVE_LORA_RESOLVER_S3_BUCKET": "b", "VLLM_PLUGINS": "", "HF_TOKEN": "h", "TRANSFORMERS_OFFLINE": "1"}
    others = {"HOME": "/root", "PATH": "/bin", "AWS_LAMBDA_FUNCTION_NAME": "f", "SECRET": "x"}
    assert replica_env_vars({**aws, **ours, **others}) == {**aws, **ours}


def test_replicas_without_ray_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from loraserve.entrypoints import cli

    for name in [m for m in sys.modules if m == "ray" or m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    assert cli.main(["serve", "some/model", "--replicas", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("loraserve serve: error: --replicas 2"), err
    assert "pip install 'loraserve[ray]'" in err


def test_the_one_engine_launcher_module_refuses_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    from loraserve.entrypoints.openai.cli import launcher

    assert launcher.main(["some/model", "--replicas", "3"]) == 2
    assert "--replicas runs through `loraserve serve`" in capsys.readouterr().err
