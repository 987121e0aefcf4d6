"""`loraserve serve MODEL --enable-auto-tool-choice --tool-call-parser NAME --tool-parser-plugin FILE`,
run as the command line runs it: the plugin file registers its parser with vLLM's decorator, and
tool_choice "auto" reads every output through it, whole and streamed, for the base model and an
adapter. vLLM's hermes line (a built-in parser) starts too.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from support.live_serve import live_serve
from support.serve_process import free_port

PLUGIN = '''
import json

from loraserve.entrypoints.openai.tool_parsers import ParsedOutput, PartialToolCall, ToolParser, ToolParserManager


@ToolParserManager.register_module(["echo_all"])
class EchoAll(ToolParser):
    """Every output is one call: echo(text=<the output>), its arguments sent once the output ends."""

    def parse(self, text, final):
        arguments = json.dumps({"text": text}) if final else ""
        return ParsedOutput("", (PartialToolCall("echo", arguments, final),))
'''
TOOLS = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def files(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from loraserve.demo.random_model import save_peft_adapter

    root = tmp_path_factory.mktemp("tool-plugin")
    (root / "echo_parser.py").write_text(PLUGIN)
    model = tiny_model("llama")
    save_peft_adapter(
        hf_model(model), str(root / "sql"), 41, model, r=8, lora_alpha=16, target_modules=["q_proj"]
    )
    return {"model": model, "plugin": str(root / "echo_parser.py"), "adapter": str(root / "sql")}


def test_a_plugin_parser_serves_auto_tool_choice(
    files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraserve.entrypoints.openai.tool_parsers import ToolParserManager

    # The server runs in this process: the plugin's parser goes into a copy of the registry, restored after.
    monkeypatch.setattr(ToolParserManager, "tool_parsers", dict(ToolParserManager.tool_parsers))
    port = free_port()
    argv = [files["model"], "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
            "--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={files['adapter']}",
            "--enable-auto-tool-choice", "--tool-call-parser", "echo_all", "--tool-parser-plugin", files["plugin"]]  # fmt: skip
    with live_serve(argv, monkeypatch):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        for model in ("llama", "sql"):
            body: dict[str, Any] = dict(
                model=files["model"] if model == "llama" else model,
                messages=[{"role": "user", "content": "hi"}],
                tools=TOOLS,
                max_tokens=6,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            whole = client.chat.completions.create(**body).choices[0]
            plain = client.chat.completions.create(**{**body, "tools": None}).choices[0]  # no tools: text
            assert whole.message.content is None and plain.message.content
            (call,) = whole.message.tool_calls or []
            assert call.function.name == "echo" and json.loads(call.function.arguments) == {
                "text": plain.message.content
            }
            # A call cut by max_tokens keeps finish_reason "length".
            assert whole.finish_reason == "length"
            pieces = [
                c.choices[0].delta for c in client.chat.completions.create(**body, stream=True) if c.choices
            ]
            calls = [tc for d in pieces for tc in d.tool_calls or []]
            assert calls[0].function.name == "echo" and calls[0].function.arguments == ""
            assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments


def test_vllms_hermes_line_starts(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    argv = [tiny_model("llama"), "--port", str(port), "--max-model-len", "256", "--enable-auto-tool-choice",
            "--tool-call-parser", "hermes"]  # fmt: skip
    with live_serve(argv, monkeypatch):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model=tiny_model("llama"), messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=3
        )
        assert reply.choices[0].message.tool_calls == [] and reply.choices[0].message.content is not None
