"""Structured outputs through the OpenAI client against a live server (tiny random Llama + a PEFT
adapter): every response_format / structured_outputs / guided_* kind returns output that validates
(jsonschema, re.fullmatch, choice membership, the EBNF's language), for the base model and the
adapter, streamed and not, greedy and sampled, all in one mixed batch with unconstrained requests,
whose greedy outputs are those they give alone. Bad constraints are 400s with vLLM's texts.

A random model writes noise; under a grammar the noise must still validate. The schemas here are
bounded (string lengths, enums, item counts, integer ranges) so that every output closes within
max_tokens, and the server runs with disable_any_whitespace (vLLM's option) for the same reason.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import openai
import pytest
import torch
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "role", "age", "address", "tags", "active"],
}
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "(" num ("+" num)? ("+" num)? ")"\nnum ::= [0-9] | [0-9] [0-9]'
GRAMMAR_RE = r"\(\d{1,2}(\+\d{1,2}){0,2}\)"
# A bare integer: a tag's JSON content takes xgrammar's own whitespace rule, and an integer has no
# place for whitespace, so the random model must close the tag.
TAG_SCHEMA = {"type": "integer", "minimum": 0, "maximum": 99}
TAG_FORMAT = {
    "type": "tag",
    "begin": "<f>",
    "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
    "end": "</f>",
}
MAX_TOKENS = 160


def _json(text: str) -> Any:
    # strict=False: xgrammar's JSON string rule (vLLM's too) admits raw control characters other
    # than newline and carriage return inside strings, which strict JSON escapes.
    return json.loads(text, strict=False)


def _valid_schema(text: str) -> None:
    jsonschema.validate(_json(text), SCHEMA)


def _valid_object(text: str) -> None:
    assert isinstance(_json(text), dict)


_LITERALS = {"t": "true", "f": "false", "n": "null"}


def _close_json_prefix(text: str) -> str:
    """A JSON prefix closed into a whole document (strings, then brackets; a dangling key, colon or
    comma finished with null / dropped); only a real prefix of a JSON value closes into valid JSON."""
    stack, in_string, escaped = [], False, False
    for char in text:
        if in_string:
            escaped, in_string = (not escaped and char == "\\"), in_string and (escaped or char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]":
            assert stack and stack.pop() == char, text
    closed = text + ('"' if in_string else "")
    if not in_string:  # a literal or number cut short
        closed = re.sub(r"(?<![\w.])(t|tr|tru|f|fa|fal|fals|n|nu|nul)$", lambda m: _LITERALS[m[1][0]], closed)
        closed = re.sub(r"(?:(?<=\d)[.eE]|(?<=\d[eE])[+-]|(?<!\w)-)$", lambda m: m[0] + "0", closed)
    stripped = closed.rstrip()
    if stripped.endswith(","):
        closed = stripped[:-1]
    elif stripped.endswith(":"):
        closed = stripped + "null"
    elif stack and stack[-1] == "}" and stripped.endswith('"') and not stripped.endswith(('{"', ',"')):
        # a key without its value, e.g. {"a": 1, "b"
        tail = stripped[: stripped.rfind('"', 0, len(stripped) - 1)].rstrip()
        closed = stripped + ":null" if tail.endswith(("{", ",")) else stripped
    return closed + "".join(reversed(stack))


def _object_or_prefix(text: str, reason: str) -> None:
    """json_object bounds nothing: a random model may still be writing when max_tokens ends it."""
    if reason == "stop":
        _valid_object(text)
    else:
        assert text.startswith("{") and isinstance(_json(_close_json_prefix(text)), dict), text


def _valid_regex(text: str) -> None:
    assert re.fullmatch(REGEX, text), text


def _valid_choice(text: str) -> None:
    assert text in CHOICES, text


def _valid_grammar(text: str) -> None:
    assert re.fullmatch(GRAMMAR_RE, text), text


def _valid_tag(text: str) -> None:
    match = re.fullmatch(r"<f>(.*)</f>", text, re.DOTALL)
    assert match, text
    jsonschema.validate(_json(match[1]), TAG_SCHEMA)


# name -> (request fields, validator)
KINDS: dict[str, tuple[dict[str, Any], Any]] = {
    "response_format.json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
            }
        },
        _valid_schema,
    ),
    "response_format.json_object": ({"response_format": {"type": "json_object"}}, _object_or_prefix),
    "structured_outputs.json": ({"structured_outputs": {"json": SCHEMA}}, _valid_schema),
    "structured_outputs.regex": ({"structured_outputs": {"regex": REGEX}}, _valid_regex),
    "structured_outputs.choice": ({"structured_outputs": {"choice": CHOICES}}, _valid_choice),
    "structured_outputs.grammar": ({"structured_outputs": {"grammar": GRAMMAR}}, _valid_grammar),
    "response_format.structural_tag": (
        {"response_format": {"type": "structural_tag", "format": TAG_FORMAT}},
        _valid_tag,
    ),
    "structured_outputs.structural_tag": (
        {
            "structured_outputs": {
                "structural_tag": json.dumps({"type": "structural_tag", "format": TAG_FORMAT})
            }
        },
        _valid_tag,
    ),
    "guided_json": ({"guided_json": json.dumps(SCHEMA)}, _valid_schema),
    "guided_regex": ({"guided_regex": REGEX}, _valid_regex),
    "guided_choice": ({"guided_choice": CHOICES}, _valid_choice),
    "guided_grammar": ({"guided_grammar": GRAMMAR}, _valid_grammar),
}


@pytest.fixture(scope="module")
def server(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    adapter = str(tmp_path_factory.mktemp("so") / "sql")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_peft_adapter(base, adapter, 77, model_dir, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=256,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            kv_cache_memory_bytes=32 << 20,
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
    )
    options = ServerOptions(served_model_names=["tiny"], lora_modules=[LoRAModulePath("sql", adapter)])
    with RunningServer(engine, options) as running:
        yield running


def _client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)


async def _run(
    client: openai.AsyncOpenAI, model: str, chat: bool, stream: bool, body: dict[str, Any]
) -> tuple[str, str]:
    """(text, finish_reason) of one request."""
    fields = dict(body)
    response_format = fields.pop("response_format", None)
    common: dict[str, Any] = dict(model=model, max_tokens=MAX_TOKENS, extra_body=fields)
    temperature = fields.pop("temperature")
    seed = fields.pop("seed", None)
    if chat:
        if response_format is not None:
            common["response_format"] = response_format
        call = client.chat.completions.create(
            messages=[{"role": "user", "content": "Describe a user."}],
            temperature=temperature,
            seed=seed,
            stream=stream,
            **common,
        )
    else:
        if response_format is not None:
            fields["response_format"] = response_format
        call = client.completions.create(
            prompt="A user:", temperature=temperature, seed=seed, stream=stream, **common
        )
    result = await call
    if not stream:
        choice = result.choices[0]
        return (choice.message.content if chat else choice.text) or "", choice.finish_reason
    text, reason = "", None
    async for chunk in result:
        for choice in chunk.choices:
            text += (choice.delta.content if chat else choice.text) or ""
            reason = choice.finish_reason or reason
    return text, reason


def test_every_kind_validates_in_one_mixed_batch(server: RunningServer) -> None:
    """Each kind x {base, adapter} x {stream, not} x {greedy, sampled}, with unconstrained requests,
    all at once; the unconstrained greedy ones must match their outputs when run alone."""
    jobs: list[tuple[str, bool, bool, dict[str, Any], Any]] = []
    for i, (name, (fields, check)) in enumerate(KINDS.items()):
        for model in ("tiny", "sql"):
            for stream in (False, True):
                for sampled in (False, True):
                    body = {**fields, "temperature": 0.9 if sampled else 0.0, "seed": i if sampled else None}
                    chat = (i + stream) % 2 == 0  # both endpoints, each kind streamed and not
                    jobs.append((model, chat, stream, body, (name, check)))
    free = [
        (model, chat, False, {"temperature": 0.0, "ignore_eos": True}, None)
        for model in ("tiny", "sql")
        for chat in (False, True)
    ]

    async def main() -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
        client = _client(server)
        alone = [await _run(client, m, c, s, b) for m, c, s, b, _ in free]
        mixed = await asyncio.gather(*(_run(client, m, c, s, b) for m, c, s, b, _ in [*jobs, *free]))
        return alone, mixed[: len(jobs)], mixed[len(jobs) :]

    alone, constrained, unconstrained = asyncio.run(main())
    for (model, chat, stream, body, (name, check)), (text, reason) in zip(jobs, constrained, strict=True):
        where = f"{name} model={model} chat={chat} stream={stream} temperature={body['temperature']}"
        try:
            if check is _object_or_prefix:
                check(text, reason)
            else:
                assert reason == "stop", f"finish_reason {reason!r}"
                check(text)
        except Exception as exc:
            raise AssertionError(f"{where}: {text!r} does not validate: {exc}") from exc
    assert unconstrained == alone


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"structured_outputs": {"json": {"type": "integer", "multipleOf": 3}}},
            None,
            "The provided JSON schema contains features not supported by xgrammar.",
        ),
        ({"guided_json": "{not json"}, None, "Invalid JSON grammar specification."),
        (
            {"guided_regex": "(unclosed"},
            None,
            "Failed to transform regex into a grammar: Regex parsing error",
        ),
        (
            {"guided_grammar": "root ::= undefined_rule"},
            None,
            "Invalid grammar specification: EBNF parser error",
        ),
        ({"structural_tag": "{not json"}, None, "Invalid structural tag specification: "),
        (
            {"structured_outputs": {"json": {"type": "object"}, "regex": "a+"}},
            "structured_outputs",
            "You can only use one kind of structured outputs constraint but multiple are specified",
        ),
        ({"structured_outputs": {"colour": "red"}}, "structured_outputs", "unknown field(s): colour"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
        (
            {"guided_decoding_backend": "outlines", "guided_regex": "a"},
            "guided_decoding_backend",
            "not available",
        ),
    ],
)
def test_bad_constraints_are_400s(
    server: RunningServer, fields: dict[str, Any], param: str | None, message: str
) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        body: dict[str, Any] = {"model": "tiny", "max_tokens": 4, **fields}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = "hi"
        reply = server.http.post(path, json=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert message in error["message"], error
        if param is not None:
            assert error["param"] == param, error
    # The server goes on serving.
    ok = server.http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
