"""A fake engine for server tests: an `EngineClient` over a deterministic toy "model".

It offers hooks the real engine cannot: gates that hold generation or adapter loads, injected failures,
and counters of what the server asked for. Tests use it for fault injection and exact concurrency; end
to end numbers come from the real engine (test_server_e2e.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from loraserve.config import LoRAConfig, SchedulerConfig
from loraserve.engine.admission import QueueLoad, check_admission
from loraserve.engine.fair_admission import AdmissionHold, FairAdmission
from loraserve.errors import (
    EngineDeadError,
    EngineShutdownError,
    LoRAAdapterError,
    LoRAAdapterNotFoundError,
    PromptTooLongError,
)
from loraserve.lora.request import LoRARequest
from loraserve.outputs import CompletionOutput, Logprob, RequestOutput
from loraserve.sampling_params import SamplingParams

FAKE_BASE_MODEL = "fake-org/fake-base"
FIRST_ORDINARY_TOKEN = 6  # ids below are special tokens in the demo tokenizer


@dataclass
class FakeModelConfig:
    model: str
    model_path: str
    max_model_len: int
    vocab_size: int
    served_model_name: str = ""
    dtype: str = "float32"
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def toy_next_token(prompt_ids: list[int], lora_id: int, seq_index: int, step: int, vocab: int) -> int:
    """The fake model: a deterministic function of prompt, adapter, choice and position."""
    span = vocab - FIRST_ORDINARY_TOKEN
    return FIRST_ORDINARY_TOKEN + (sum(prompt_ids) * 7 + lora_id * 31 + seq_index * 17 + step * 13) % span


def write_adapter(
    path: str, base_model: str = FAKE_BASE_MODEL, rank: int = 8, peft_type: str = "LORA"
) -> str:
    """An adapter folder with adapter_config.json (and a weights file name) for the fake engine."""
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": peft_type, "base_model_name_or_path": base_model, "r": rank, "lora_alpha": 16}
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(b"fake")
    return path


@dataclass
class FakeEngine:
    tokenizer: Any
    max_model_len: int = 64
    lora_enabled: bool = True
    max_lora_rank: int = 16
    model_config: FakeModelConfig = field(init=False)
    lora_config: LoRAConfig | None = field(init=False)
    loras: dict[int, LoRARequest] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)  # lora id -> the digest of its folder's files
    add_lora_calls: list[str] = field(default_factory=list)
    running: dict[str, int] = field(default_factory=dict)  # request id -> lora id (0 = base)
    aborted: list[str] = field(default_factory=list)
    prompts_seen: list[list[int]] = field(default_factory=list)
    priorities_seen: list[int] = field(default_factory=list)
    salts_seen: list[str | None] = field(default_factory=list)
    removing: set[int] = field(default_factory=set)
    gate: asyncio.Event | None = None  # when set to an unset Event, every token waits for it
    num_free_tokens: int = 0  # ... except the first num_free_tokens of each request
    load_gate: asyncio.Event | None = None
    fail_with: BaseException | None = None  # raised by the next generate() before any output
    fail_after_tokens: int | None = None  # raise RuntimeError after this many tokens
    dead_error: BaseException | None = None
    aborted_event: threading.Event = field(default_factory=threading.Event)
    load_latencies: list[float] = field(default_factory=list)  # drained by stats(), like the real engine
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    shutdown_error: BaseException | None = None
    waiting: dict[str, int] = field(default_factory=dict)  # reported as waiting_by_adapter (adapter -> count)
    admitted_clients: list[str | None] = field(default_factory=list)  # the client id of every admit()
    eos_after: int | None = None  # each sequence "writes eos" (finish_reason "stop") after this many tokens
    _admission: FairAdmission | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.model_config = FakeModelConfig(
            FAKE_BASE_MODEL, "/nonexistent/fake", self.max_model_len, len(self.tokenizer)
        )
        self.lora_config = (
            LoRAConfig(max_loras=2, max_lora_rank=self.max_lora_rank) if self.lora_enabled else None
        )

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def is_healthy(self) -> bool:
        return self.dead_error is None

    async def start(self) -> None:
        self._changed = asyncio.Condition()

    async def shutdown(self) -> None:
        """Like the real engine: requests still running fail with EngineShutdownError."""
        self.shutdown_error = EngineShutdownError("The server is shutting down; the request did not finish.")
        if self.gate is not None:
            self.gate.set()

    def kill(self, exc: BaseException) -> None:
        """Simulate a crash in the forward pass: every running request fails."""
        self.dead_error = exc
        if self.gate is not None:
            self.gate.set()

    def expected_token_ids(
        self, prompt_ids: list[int], params: SamplingParams, lora_id: int, index: int
    ) -> list[int]:
        vocab = self.model_config.vocab_size
        assert params.max_tokens is not None
        return [toy_next_token(prompt_ids, lora_id, index, step, vocab) for step in range(params.max_tokens)]

    def _sequence(
        self, prompt_ids: list[int], params: SamplingParams, lora_id: int, index: int, step: int
    ) -> CompletionOutput:
        ids = self.expected_token_ids(prompt_ids, params, lora_id, index)[: step + 1]
        text = self.tokenizer.decode(ids)
        finish = "length" if len(ids) == params.max_tokens else None
        if (
            self.eos_after is not None
            and len(ids) == self.eos_after
            and finish is None
            and not params.ignore_eos
        ):
            finish = "stop"
        for stop in params.stop or []:
            if stop in text:
                text, finish = text[: text.index(stop)], "stop"
        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._position(token_id, params.logprobs) for token_id in ids]
        return CompletionOutput(index, text, ids, -0.5 * len(ids), logprobs, finish, None)

    def _position(self, token_id: int, num_top: int) -> dict[int, Logprob]:
        position = {token_id: Logprob(-0.5, 1, None)}
        for rank in range(2, num_top + 2):
            other = FIRST_ORDINARY_TOKEN + (token_id + rank) % (
                self.model_config.vocab_size - FIRST_ORDINARY_TOKEN
            )
            position.setdefault(other, Logprob(-0.5 - rank, rank, None))
        return position

    def _check(self, prompt: list[int], lora_request: LoRARequest | None) -> int:
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine is dead: {self.dead_error}")
        if self.fail_with is not None:
            exc, self.fail_with = self.fail_with, None
            raise exc
        if len(prompt) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens, max_model_len is {self.max_model_len}"
            )
        if any(t < 0 or t >= self.model_config.vocab_size for t in prompt):
            raise ValueError("token id out of vocabulary")
        if lora_request is None:
            return 0
        if lora_request.lora_id not in self.loras or lora_request.lora_id in self.removing:
            raise LoRAAdapterError(f"adapter {lora_request.lora_name!r} is not registered")
        return lora_request.lora_id

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        group_id: str | None = None,
        priority: int = 0,
        client_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.priorities_seen.append(priority)
        if isinstance(prompt, dict):  # {"prompt_token_ids": ids, "cache_salt": salt}
            self.salts_seen.append(prompt.get("cache_salt"))
            prompt = prompt["prompt_token_ids"]
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        lora_id = self._check(ids, lora_request)
        if request_id in self.running:
            raise ValueError(f"request id {request_id} is already running")
        self.prompts_seen.append(ids)
        self.running[request_id] = lora_id
        finished = False
        try:
            assert sampling_params.max_tokens is not None
            for step in range(sampling_params.max_tokens):
                if self.gate is not None and step >= self.num_free_tokens:
                    await self.gate.wait()
                await asyncio.sleep(0)
                if self.shutdown_error is not None:
                    raise self.shutdown_error
                if self.dead_error is not None:
                    raise EngineDeadError(f"The engine failed while running a batch: {self.dead_error}")
                if self.fail_after_tokens is not None and step >= self.fail_after_tokens:
                    raise RuntimeError("injected failure in the forward pass at 0x7f00deadbeef")
                seqs = [
                    self._sequence(ids, sampling_params, lora_id, i, step) for i in range(sampling_params.n)
                ]
                finished = all(seq.finish_reason is not None for seq in seqs)
                yield RequestOutput(
                    request_id,
                    None,
                    ids,
                    seqs,
                    finished,
                    lora_name=lora_request.lora_name if lora_request else None,
                )
                if finished:
                    return
        finally:
            self.running.pop(request_id, None)
            if not finished:
                self.aborted.append(request_id)
                self.aborted_event.set()
            async with self._changed:
                self._changed.notify_all()

    async def admit(
        self, num_seqs: int, num_prefill_tokens: int, client_id: str | None = None, limits: Any = None
    ) -> AdmissionHold:
        """The real gate (`FairAdmission`) over `scheduler_config`, as `AsyncLLMEngine.admit`."""
        if self._admission is None:
            self._admission = FairAdmission(self.scheduler_config)
        self.admitted_clients.append(client_id)
        return await self._admission.admit(num_seqs, num_prefill_tokens, client_id, limits)

    async def check_admission(self, num_seqs: int, num_prefill_tokens: int) -> None:
        """Like the real engine's, against `scheduler_config` and the requests running now."""
        check_admission(self.scheduler_config, QueueLoad(len(self.running), 0), num_seqs, num_prefill_tokens)

    async def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        self.add_lora_calls.append(lora_request.lora_name)
        if self.load_gate is not None:
            await self.load_gate.wait()
        config_file = os.path.join(lora_request.lora_path, "adapter_config.json")
        if not os.path.isdir(lora_request.lora_path):
            raise LoRAAdapterNotFoundError(f"No adapter found at {lora_request.lora_path!r}.")
        try:
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise LoRAAdapterError(
                f"Adapter {lora_request.lora_name!r}: adapter_config.json unreadable: {exc}"
            ) from exc
        if config.get("peft_type") != "LORA":
            raise LoRAAdapterError(
                f"Adapter {lora_request.lora_name!r}: peft_type {config.get('peft_type')!r} is not LORA."
            )
        if int(config.get("r", 0)) > self.max_lora_rank:
            raise LoRAAdapterError(
                f"Adapter {lora_request.lora_name!r}: rank r={config['r']} exceeds max_lora_rank={self.max_lora_rank}."
            )
        self.loras[lora_request.lora_id] = lora_request
        # The fake's content digest: the folder's files, as the real engine's covers config and weights.
        digest = hashlib.sha256()
        for entry in sorted(os.listdir(lora_request.lora_path)):
            entry_path = os.path.join(lora_request.lora_path, entry)
            if os.path.isfile(entry_path):
                with open(entry_path, "rb") as f:
                    digest.update(entry.encode() + b"\0" + f.read())
        self.digests[lora_request.lora_id] = digest.hexdigest()
        self.load_latencies.append(0.002)
        return True

    async def lora_digest(self, lora_id: int) -> str:
        if lora_id not in self.loras:
            raise LoRAAdapterNotFoundError(f"LoRA id {lora_id} is not registered.")
        return self.digests[lora_id]

    async def replace_lora(self, old_lora_id: int, lora_request: LoRARequest) -> bool:
        await self.add_lora(lora_request)
        if old_lora_id not in self.running.values():
            self.loras.pop(old_lora_id, None)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        if lora_id not in self.loras:
            return False
        self.removing.add(lora_id)
        async with self._changed:
            await self._changed.wait_for(lambda: lora_id not in self.running.values())
        del self.loras[lora_id]
        self.removing.discard(lora_id)
        return True

    async def list_loras(self) -> list[LoRARequest]:
        return list(self.loras.values())

    def stats(self) -> dict[str, Any]:
        running: dict[str, int] = {}
        for lora_id in self.running.values():
            name = self.loras[lora_id].lora_name if lora_id in self.loras else ""
            running[name] = running.get(name, 0) + 1
        stats: dict[str, Any] = {
            "num_running": len(self.running),
            "num_waiting": sum(self.waiting.values()),
            "running_by_adapter": running,
            "waiting_by_adapter": dict(self.waiting),
            "lora_num_loads": len(self.loras),
            "lora_load_seconds": self._drain_latencies(),
        }
        if self.lora_config is not None:  # like the real engine: every adapter in host memory, the
            stats["max_lora"] = self.lora_config.max_loras  # running ones in slots
            names = {lora.lora_name for lora in self.loras.values()}
            stats["lora_adapters_loaded"] = {"slot": sorted(n for n in running if n), "host": sorted(names)}
        return stats

    def _drain_latencies(self) -> list[float]:
        drained, self.load_latencies = self.load_latencies, []
        return drained


def hold_generation(server: Any, num_free_tokens: int = 0) -> None:
    """Make every token after the first `num_free_tokens` of each request wait until release_generation()."""

    def hold() -> None:
        server.engine.num_free_tokens = num_free_tokens
        server.engine.gate = asyncio.Event()

    server.call(hold)


def release_generation(server: Any) -> None:
    server.call(lambda: server.engine.gate.set())
    server.call(lambda: setattr(server.engine, "gate", None))
    server.call(lambda: setattr(server.engine, "num_free_tokens", 0))
