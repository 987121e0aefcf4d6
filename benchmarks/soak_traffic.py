"""Soak traffic: mixed, partly hostile clients against a live server, with every request's fate counted.

Workers run at once until the deadline, each drawing its next request from a fixed mix:
- valid generations (completions and chats, streamed or not, the base model or a stable adapter): each
  must end 200 with a finish reason (a stream: no error event, then [DONE]);
- client disconnects: a stream closed after its first chunk;
- bad requests: invalid bodies and unknown names, each of which must get a 4xx, among them issue 39's
  attacks (a runaway regex, over-budget constraints, JSON nested past the bound in the body and in
  strings, NaN numbers, a runaway tool schema);
- served attacks (issue 39): requests a server must serve without failing anyone (a beam search whose
  length_penalty overflows, a request filling every batch slot), each 200 (or a 503 refusal);
- adapter churn (one worker, when a churn adapter is given): load a fresh name, use it, unload it.

Every request ends in exactly one outcome, so `issued == sum(outcomes)`: nothing is silently dropped.
`lost` lists valid requests that did not complete; `unexpected` lists bad ones not answered 4xx.
Used by `benchmarks.soak` (long runs with RSS sampling) and by the bounded soak test in the suite.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.hostile_adapters import health_watch, hostile_worker

BAD_BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", {"model": "{base}", "prompt": "x", "n": 0}),
    ("/v1/completions", {"model": "{base}", "prompt": "x", "temperature": -1}),
    ("/v1/completions", {"model": "{base}", "prompt": []}),
    ("/v1/completions", {"model": "{base}", "prompt": "x", "max_tokens": 10**9}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),
    ("/v1/completions", {"model": "{base}", "prompt": "x", "stop": ["s"] * 100}),
    ("/v1/completions", {"model": "{base}", "prompt": [[1, 2]] * 50, "n": 128}),
    ("/v1/completions", {"model": "p\ud800", "prompt": "x"}),
    ("/v1/chat/completions", {"model": "{base}", "messages": []}),
    (
        "/v1/chat/completions",
        {
            "model": "{base}",
            "messages": [{"role": "user", "content": "x"}],
            "chat_template": "{% for i in range(10**7) %}x{% endfor %}",
        },
    ),
    ("/v1/completions", "not json at all"),
    ("/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": "../../../../etc"}),
    ("/v1/load_lora_adapter", {"lora_name": "x\nINFO forged", "lora_path": "/tmp"}),
    # Issue 39: grammar compiles that must end (timeout, budget), JSON past the depth bound, NaN.
    ("/v1/completions", {"model": "{base}", "prompt": "x", "max_tokens": 4, "guided_regex": ".*" * 2000}),
    ("/v1/completions", {"model": "{base}", "prompt": "x", "guided_regex": "a" * 300_000}),
    ("/v1/completions", {"model": "{base}", "prompt": "x", "guided_json": "[" * 1000 + "]" * 1000}),
    (
        "/v1/chat/completions",
        {
            "model": "{base}",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"x": {"type": "string", "pattern": ".*" * 1000}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },  # x 300 compiled inside the soak's 1 s timeout on a Zen 4 core (a 200); x 1000 cannot on any CPU
    ),
    ("/v1/completions", '{"model": "{base}", "prompt": "x", "logit_bias": {"7": NaN}}'),
    (
        "/v1/completions",
        '{"model": "{base}", "prompt": "x", "response_format": ' + "[" * 500 + "]" * 500 + "}",
    ),
    ("/invocations", "[" * 100_000),
]
# Attacks that must be served, each a 200 (or a 503 refusal) while the rest of the traffic goes on.
SERVED_ATTACKS: list[tuple[str, Any]] = [
    (
        "/v1/completions",
        {
            "model": "{base}",
            "prompt": "x",
            "max_tokens": 4,
            "use_beam_search": True,
            "n": 2,
            "length_penalty": 1e308,
        },
    ),
    ("/v1/completions", {"model": "{base}", "prompt": "x", "max_tokens": 8, "n": 32, "temperature": 0.8}),
    ("/v1/completions", {"model": "{base}", "prompt": "x", "max_tokens": 4, "repetition_penalty": 1e308}),
]


@dataclass(slots=True)
class SoakTally:
    issued: Counter = field(default_factory=Counter)  # kind -> requests started
    outcomes: Counter = field(default_factory=Counter)  # "kind:outcome" -> count
    lost: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    health_latencies_s: list[float] = field(default_factory=list)  # benchmarks.hostile_adapters.health_watch

    def record(self, kind: str, outcome: str, detail: str | None = None) -> None:
        self.outcomes[f"{kind}:{outcome}"] += 1
        if outcome == "lost" and detail is not None:
            self.lost.append(f"{kind}: {detail}"[:300])
        if outcome == "unexpected" and detail is not None:
            self.unexpected.append(f"{kind}: {detail}"[:300])

    @property
    def num_issued(self) -> int:
        return sum(self.issued.values())

    @property
    def num_accounted(self) -> int:
        return sum(self.outcomes.values())

    def summary(self) -> dict[str, Any]:
        return {
            "issued": dict(self.issued),
            "outcomes": dict(sorted(self.outcomes.items())),
            "num_lost": len(self.lost),
            "lost": self.lost[:20],
            "num_unexpected": len(self.unexpected),
            "unexpected": self.unexpected[:20],
            **self.health_summary(),
        }

    def health_summary(self) -> dict[str, Any]:
        if not self.health_latencies_s:
            return {}
        ordered = sorted(self.health_latencies_s)
        return {
            "health_checks": len(ordered),
            "health_p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1),
            "health_max_ms": round(1000 * ordered[-1], 1),
        }


@dataclass(frozen=True, slots=True)
class SoakPlan:
    url: str
    base_model: str
    adapters: list[str]  # stable adapter names, registered for the whole run
    duration_s: float
    concurrency: int = 8
    max_tokens: int = 12
    churn_adapter_path: str | None = None  # an adapter folder to load under fresh names
    seed: int = 0
    mix: tuple[float, float, float] = (0.7, 0.15, 0.15)  # shares of valid, disconnecting and bad requests
    hostile_adapters: dict[str, str] | None = (
        None  # kind -> folder (benchmarks.hostile_adapters), each load a 400
    )
    watch_health: bool = False  # poll /health throughout, latencies in the tally


async def run_soak_traffic(plan: SoakPlan) -> SoakTally:
    tally = SoakTally()
    deadline = time.monotonic() + plan.duration_s
    limits = httpx.Limits(
        max_connections=plan.concurrency + 4, max_keepalive_connections=plan.concurrency + 4
    )
    async with httpx.AsyncClient(base_url=plan.url, timeout=180, limits=limits) as client:
        workers = [
            _worker(client, plan, tally, deadline, random.Random(plan.seed + i))
            for i in range(plan.concurrency)
        ]
        if plan.churn_adapter_path is not None:
            workers.append(_churn_worker(client, plan, tally, deadline))
        if plan.hostile_adapters:
            workers.append(hostile_worker(client, plan.hostile_adapters, tally, deadline))
        if plan.watch_health:
            workers.append(health_watch(client, tally, deadline))
        await asyncio.gather(*workers)
    return tally


async def _worker(
    client: httpx.AsyncClient, plan: SoakPlan, tally: SoakTally, deadline: float, rng: random.Random
) -> None:
    while time.monotonic() < deadline:
        roll = rng.random() * sum(plan.mix)
        if roll < plan.mix[0]:
            await _valid(client, plan, tally, rng)
        elif roll < plan.mix[0] + plan.mix[1]:
            await _disconnect(client, plan, tally, rng)
        else:
            await _bad(client, plan, tally, rng)


def _generation_body(plan: SoakPlan, rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    words = " ".join(
        rng.choice(["capital", "river", "France", "table", "query", "ship", "sea"]) for _ in range(6)
    )
    common = {"model": model, "max_tokens": plan.max_tokens, "temperature": rng.choice([0.0, 0.7])}
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": words, "n": rng.choice([1, 1, 2])}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}


async def _valid(client: httpx.AsyncClient, plan: SoakPlan, tally: SoakTally, rng: random.Random) -> None:
    model = rng.choice([plan.base_model, *plan.adapters])
    path, body = _generation_body(plan, rng, model)
    stream = rng.random() < 0.5
    kind = "valid-stream" if stream else "valid"
    tally.issued[kind] += 1
    try:
        if stream:
            outcome, detail = await _read_stream(client, path, {**body, "stream": True})
        else:
            response = await client.post(path, json=body)
            outcome, detail = _check_full(response)
    except httpx.HTTPError as exc:
        outcome, detail = "lost", f"{type(exc).__name__}: {exc}"
    tally.record(kind, outcome, f"{model} {path}: {detail}")


def _check_full(response: httpx.Response) -> tuple[str, str]:
    if response.status_code == 503:
        return "refused", response.text
    if response.status_code != 200:
        return "lost", f"{response.status_code} {response.text}"
    choices = response.json().get("choices") or []
    if not choices or any(choice.get("finish_reason") is None for choice in choices):
        return "lost", f"unfinished choices: {response.text}"
    return "ok", ""


async def _read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, str]:
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return ("refused" if response.status_code == 503 else "lost"), f"{response.status_code} {text}"
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "lost", f"stream ended without [DONE] after {len(events)} events"
    errors = [event for event in events[:-1] if '"error"' in event and "error" in json.loads(event)]
    if errors:
        return "lost", f"error event {errors[0]}"
    return "ok", ""


async def _disconnect(
    client: httpx.AsyncClient, plan: SoakPlan, tally: SoakTally, rng: random.Random
) -> None:
    model = rng.choice([plan.base_model, *plan.adapters])
    path, body = _generation_body(plan, rng, model)
    body = {**body, "stream": True, "max_tokens": plan.max_tokens * 4}
    tally.issued["disconnect"] += 1
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                tally.record("disconnect", "lost", f"{response.status_code}")
                return
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # leave mid-stream: the context manager closes the connection
        tally.record("disconnect", "ok")
    except httpx.HTTPError as exc:
        tally.record("disconnect", "lost", f"{type(exc).__name__}: {exc}")


async def _bad(client: httpx.AsyncClient, plan: SoakPlan, tally: SoakTally, rng: random.Random) -> None:
    served = rng.random() < len(SERVED_ATTACKS) / (len(SERVED_ATTACKS) + len(BAD_BODIES))
    kind = "attack-served" if served else "bad"
    path, body = rng.choice(SERVED_ATTACKS if served else BAD_BODIES)
    tally.issued[kind] += 1
    text = (body if isinstance(body, str) else json.dumps(body)).replace("{base}", plan.base_model)
    try:
        response = await client.post(
            path, content=text.encode(), headers={"content-type": "application/json"}
        )
    except httpx.HTTPError as exc:
        tally.record(kind, "unexpected", f"{path}: {type(exc).__name__}: {exc}")
        return
    expected = response.status_code in (200, 503) if served else 400 <= response.status_code < 500
    if expected:
        tally.record(kind, "ok")
    else:
        tally.record(
            kind, "unexpected", f"{path} {text[:80]} -> {response.status_code} {response.text[:200]}"
        )


async def _churn_worker(client: httpx.AsyncClient, plan: SoakPlan, tally: SoakTally, deadline: float) -> None:
    """Load a fresh name, generate with it, unload it; every step must succeed."""
    number = 0
    while time.monotonic() < deadline:
        number += 1
        name = f"churn-{number}"
        tally.issued["churn"] += 1
        try:
            loaded = await client.post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": plan.churn_adapter_path}
            )
            if loaded.status_code != 200:
                tally.record("churn", "lost", f"load {name}: {loaded.status_code} {loaded.text}")
                continue
            body = {"model": name, "prompt": "churn", "max_tokens": 4}
            outcome, detail = _check_full(await client.post("/v1/completions", json=body))
            unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            if unloaded.status_code != 200:
                outcome, detail = "lost", f"unload {name}: {unloaded.status_code} {unloaded.text}"
            tally.record("churn", outcome, detail)
        except httpx.HTTPError as exc:
            tally.record("churn", "lost", f"{name}: {type(exc).__name__}: {exc}")
