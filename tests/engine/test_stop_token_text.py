"""A stop token's own text is never output (vLLM's rule), also with skip_special_tokens=False, unless
include_stop_str_in_output asks for it: the tool call parsers read the text as the model wrote it,
and "</s>" after a call would make it malformed."""

from __future__ import annotations

from typing import Any

from loraserve.entrypoints.llm import LLM
from loraserve.sampling_params import SamplingParams


def test_the_eos_and_stop_ids_leave_no_text(tiny_model: Any) -> None:
    llm = LLM(tiny_model("llama"), dtype="float32", max_model_len=64)
    eos = llm.engine.tokenizer.eos_token
    # The grammar allows only the stop token once "no" is written, so each ends on a stop token.
    cases = [
        (dict(skip_special_tokens=False), "no"),
        (dict(skip_special_tokens=True), "no"),
        (dict(skip_special_tokens=False, include_stop_str_in_output=True), "no" + eos),
    ]
    for fields, text in cases:
        params = SamplingParams(
            max_tokens=8, temperature=0.0, structured_outputs={"choice": ["no"]}, **fields
        )
        (out,) = llm.generate(["tell me"], params, use_tqdm=False)
        seq = out.outputs[0]
        assert seq.finish_reason == "stop" and seq.token_ids[-1] == llm.engine.tokenizer.eos_token_id
        assert seq.text == text, (fields, seq.text)
    # A stop token id the request names is cut the same way (the token stays in token_ids).
    free_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (free,) = llm.generate(["tell me"], free_params, use_tqdm=False)
    ids = free.outputs[0].token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # its first appearance
    params = SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[ids[k]], skip_special_tokens=False
    )
    (cut,) = llm.generate(["tell me"], params, use_tqdm=False)
    assert cut.outputs[0].token_ids == ids[: k + 1] and cut.outputs[0].stop_reason == ids[k]
    assert cut.outputs[0].text == llm.engine.tokenizer.decode(ids[:k], skip_special_tokens=False)
