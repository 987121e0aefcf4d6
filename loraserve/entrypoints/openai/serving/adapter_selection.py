"""Which adapter, at which scale, or which mix of adapters a completion or chat request asks for.

Four spellings, one result (a `LoRARequest`, or None for the base model):
- `model`: an adapter's name (or `name@version`, one held content version), as before; or "name=weight,..." for clients that can only set `model`
  ("pirate=0.3": one adapter at scale 0.3; "french=0.7,pirate=0.3": a mix). A name that is itself a
  loaded adapter's always means that adapter.
- `lora_scale` (vLLM PR #52757's name): the scale of the adapter (or mix) that `model` selects.
- `adapters`: [{"name": "french", "weight": 0.7}, ...] with `model` the base model: a mix (one entry:
  that adapter at that scale).
- `lora` (llama.cpp's server): [{"id": 0, "scale": 0.5}, ...], `id` the adapter's index in this
  server's adapter list (the adapters of GET /v1/models after the base model, in that order, also
  GET /lora-adapters); entries of scale 0 are dropped (llama.cpp's default for an adapter left out),
  one left is that adapter at its scale, several a mix with the scales as weights.
A scale or weight must be finite and within +-MAX_LORA_SCALE; a mix names at most MAX_MIX_ADAPTERS
distinct adapters whose ranks fit --max-lora-rank together (checked when the engine builds it). Each
refusal is a 400 naming the field.
"""

from __future__ import annotations

import re
from dataclasses import replace
from http import HTTPStatus

from loraserve.entrypoints.openai.serving.errors import INVALID_USER_INPUT, APIError
from loraserve.entrypoints.openai.serving.protocol import SamplingRequest
from loraserve.entrypoints.openai.serving.serving_models import OpenAIServingModels
from loraserve.lora.request import MAX_MIX_ADAPTERS, LoRARequest, check_lora_scale

_WEIGHTED = re.compile(r"^(?P<name>[^=,]+)=(?P<weight>[^=,]+)$")


def _bad(message: str, param: str) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param, INVALID_USER_INPUT)


def _weight(value: object, param: str, label: str | None = None) -> float:
    try:
        return check_lora_scale(value, label or param)
    except ValueError as exc:
        raise _bad(str(exc), param) from None


async def select_adapter(request: SamplingRequest, models: OpenAIServingModels) -> LoRARequest | None:
    """The request's adapter (scaled) or mix, None for the base model; APIError 400/404 otherwise."""
    parts = await _parts(request, models)
    if parts is None:
        lora_request = await models.resolve_model(request.model)
    elif not parts:
        lora_request = None
    elif len(parts) == 1:  # one adapter at a weight is that adapter at that scale (its own slot)
        lora_request = replace(parts[0][0], scale=parts[0][1])
    else:
        lora_request = models.mix_request(parts)
    if request.lora_scale is None:
        return lora_request
    scale = _weight(request.lora_scale, "lora_scale")
    if lora_request is None:
        if scale == 1.0:
            return None
        raise _bad("lora_scale scales a LoRA adapter, but the request selects the base model.", "lora_scale")
    return replace(lora_request, scale=lora_request.scale * scale) if scale != 1.0 else lora_request


async def _parts(
    request: SamplingRequest, models: OpenAIServingModels
) -> list[tuple[LoRARequest, float]] | None:
    """(adapter, weight) pairs the request names through `adapters`, `lora` or a weighted `model`;
    None when it names one adapter (or the base) by `model` alone."""
    given = [field for field in ("adapters", "lora") if getattr(request, field) is not None]
    if len(given) > 1:
        raise _bad("Set one of 'adapters' and 'lora', not both.", given[1])
    if given and not models.is_base_model(request.model):
        raise _bad(f"'{given[0]}' selects the adapters; set 'model' to the base model.", "model")
    if request.adapters is not None:
        named = [
            (
                entry.name,
                _weight(entry.weight, "adapters", f"the weight of {ascii(entry.name[:80])} in 'adapters'"),
            )
            for entry in request.adapters
        ]
        if not named:
            raise _bad("'adapters' names no adapter.", "adapters")
        return await _resolve(named, models, "adapters")
    if request.lora is not None:
        listed = [lora for _, _, lora in models.listed_adapters()]
        chosen: list[tuple[LoRARequest, float]] = []
        for entry in request.lora:
            if not 0 <= entry.id < len(listed):
                raise _bad(
                    f"No LoRA adapter has id {entry.id}: this server lists {len(listed)} "
                    "(ids are indices into GET /lora-adapters).",
                    "lora",
                )
            scale = _weight(entry.scale, "lora", f"the scale of LoRA id {entry.id}")
            if scale != 0.0:
                chosen.append((listed[entry.id], scale))
        return _distinct(chosen, "lora")
    model = request.model
    if model is None or "=" not in model or model in models.lora_requests:
        return None
    named = []
    for piece in model.split(","):
        match = _WEIGHTED.match(piece.strip())
        if match is None:
            raise _bad(
                f"'model' {ascii(model[:80])} is neither a served name nor 'name=weight,...'.", "model"
            )
        try:
            weight = float(match["weight"])
        except ValueError:
            raise _bad(
                f"the weight of {ascii(match['name'][:80])} in 'model' is not a number.", "model"
            ) from None
        name = match["name"].strip()
        named.append((name, _weight(weight, "model", f"the weight of {ascii(name[:80])} in 'model'")))
    return await _resolve(named, models, "model")


async def _resolve(
    named: list[tuple[str, float]], models: OpenAIServingModels, param: str
) -> list[tuple[LoRARequest, float]]:
    if len(named) > MAX_MIX_ADAPTERS:
        raise _bad(
            f"A LoRA mix names at most {MAX_MIX_ADAPTERS} adapters; '{param}' names {len(named)}.", param
        )
    resolved = []
    for name, weight in named:
        if models.is_base_model(name):
            raise _bad(f"'{param}' names the base model {ascii(name)}; name adapters only.", param)
        lora_request = await models.resolve_model(name)
        assert lora_request is not None
        resolved.append((lora_request, weight))
    return _distinct(resolved, param)


def _distinct(parts: list[tuple[LoRARequest, float]], param: str) -> list[tuple[LoRARequest, float]]:
    if len(parts) > MAX_MIX_ADAPTERS:
        raise _bad(
            f"A LoRA mix names at most {MAX_MIX_ADAPTERS} adapters; '{param}' names {len(parts)}.", param
        )
    ids = [p.lora_id for p, _ in parts]
    if len(set(ids)) != len(ids):
        raise _bad(f"'{param}' names an adapter twice; give each adapter one weight.", param)
    return parts
