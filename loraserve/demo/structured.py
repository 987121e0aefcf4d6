"""The demo's second batch: a JSON object matching a schema and a forced tool call, base and adapter.

The same grammars the server uses: `response_format: json_schema` becomes a `json` constraint, and
`tool_choice: "required"` becomes vLLM's array-of-calls schema (`required_schema`), so even the 135M
model writes valid output (compact: no whitespace between JSON tokens, so none is spent on it). Each question runs as one batch of the base model and the `sql` adapter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from loraserve.entrypoints.llm import LLM
from loraserve.entrypoints.openai.serving.protocol import ChatCompletionToolsParam
from loraserve.entrypoints.openai.serving.tool_request import required_schema, template_tools
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams
from loraserve.structured_output.params import StructuredOutputsParams

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "required": ["city", "unit"],
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}
JSON_QUESTION = "Which city is the capital of France? Answer in JSON."
TOOL_QUESTION = "What is the weather in Paris?"


def run_structured(llm: LLM, adapter: LoRARequest | None, max_tokens: int) -> list[str]:
    """Lines to print: each model's JSON answer and its forced call, from one batch."""
    tools = [ChatCompletionToolsParam.model_validate(WEATHER_TOOL)]
    as_json = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=CITY_SCHEMA, disable_any_whitespace=True),
    )
    as_call = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(
            json=required_schema(tools, max_calls=1), disable_any_whitespace=True
        ),
    )
    models: Sequence[LoRARequest | None] = [None, adapter]
    json_out = llm.chat([[_user(JSON_QUESTION)]] * 2, as_json, lora_request=list(models), use_tqdm=False)
    call_out = llm.chat(
        [[_user(TOOL_QUESTION)]] * 2,
        as_call,
        lora_request=list(models),
        use_tqdm=False,
        tools=template_tools(tools),
    )
    lines = [f"\nQ: {JSON_QUESTION} (response_format: json_schema {{city, country}})"]
    lines += [
        f"  [{_label(m)}] {out.outputs[0].text.strip()}" for m, out in zip(models, json_out, strict=True)
    ]
    lines.append(f'\nQ: {TOOL_QUESTION} (tools: [get_weather], tool_choice: "required")')
    for model, out in zip(models, call_out, strict=True):
        lines.append(f"  [{_label(model)}] {_call_text(out.outputs[0].text)}")
    return lines


def _call_text(text: str) -> str:
    """The forced call as the server returns it: the name, and the arguments as a JSON string."""
    try:
        call = json.loads(text)[0]
    except (ValueError, IndexError, KeyError, TypeError):  # cut by max_tokens: show what was written
        return f"(incomplete) {text.strip()}"
    return f"{call['name']}({json.dumps(call['parameters'])})"


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _label(lora: LoRARequest | None) -> str:
    return "base" if lora is None else lora.lora_name
