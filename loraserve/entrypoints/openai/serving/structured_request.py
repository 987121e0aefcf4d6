"""A request's structured-output fields -> `StructuredOutputsParams`, as vLLM maps them.

vLLM's `structured_outputs` object wins; else the older `guided_*` fields and `structural_tag`; then
`response_format` (json_object, json_schema, structural_tag) sets its constraint on top. Every
refusal is a 400 naming the field; a constraint that does not compile is refused by the engine,
with vLLM's texts (structured_output/xgrammar_backend.py).
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.protocol import SamplingRequest
from loraserve.structured_output.grammar_compile import check_budget
from loraserve.structured_output.params import StructuredOutputsParams

_BACKENDS = (None, "", "auto", "xgrammar")


def structured_outputs_of(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's constraint, or None for free text."""
    if request.guided_decoding_backend not in _BACKENDS:
        raise APIError(
            f"guided_decoding_backend {request.guided_decoding_backend!r} is not available: this server "
            "serves structured outputs with xgrammar.",
            HTTPStatus.BAD_REQUEST,
            "guided_decoding_backend",
        )
    values: dict[str, Any] = {}
    param = "structured_outputs"
    if request.structured_outputs is not None:
        values = dict(request.structured_outputs)
    else:
        param = "guided_json"
        for field, name in (
            ("json", "guided_json"),
            ("regex", "guided_regex"),
            ("choice", "guided_choice"),
            ("grammar", "guided_grammar"),
            ("whitespace_pattern", "guided_whitespace_pattern"),
            ("structural_tag", "structural_tag"),
        ):
            value = getattr(request, name)
            if value is not None:
                values[field], param = value, name
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        param = "response_format"
        values.update(_from_response_format(fmt))
    if not values:
        return None
    try:
        params = StructuredOutputsParams.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise APIError(str(exc), HTTPStatus.BAD_REQUEST, param) from exc
    params.param = param  # what a compile refusal (too large, too slow, invalid) names
    try:  # what can be refused before the request queues: a schema that is not JSON, or too deep, or too large
        check_budget(params.grammar_key(), param)
    except ValueError as exc:
        raise APIError(str(exc), HTTPStatus.BAD_REQUEST, param) from None
    return params


def _from_response_format(fmt: Any) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(
                "response_format of type 'json_schema' needs json_schema.schema.",
                HTTPStatus.BAD_REQUEST,
                "response_format",
            )
        return {"json": fmt.json_schema.json_schema}
    # structural_tag: vLLM's {"structures": [...], "triggers": [...]} or xgrammar's {"format": ...}
    tag = {k: v for k, v in (fmt.model_extra or {}).items()}
    tag["type"] = "structural_tag"
    if "structures" in tag:
        tag.pop("type")
    return {"structural_tag": json.dumps(tag)}
