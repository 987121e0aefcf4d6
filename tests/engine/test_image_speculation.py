"""Speculative decoding beside images (tiny random Qwen2-VL and Gemma-3, float32): while text requests
decode with proposals, image prompts prefill in the same steps after them, and every output equals the
engine's without speculation (tokens, logprobs). A speculating sequence's proposals are rows, and
attention entries, of their own: the image embeddings, Gemma-3's both-ways spans and Qwen2-VL's M-RoPE
positions of the rows after them must count them. The text requests propose in every decode step
(fixed proposals stand in for the n-gram lookup, which on a random model finds matches only now and
then; most are rejected, which the verification must handle as well), and each step's layout is
recorded to show that an image chunk ran after proposal rows."""

from __future__ import annotations

from typing import Any

import pytest
from support.speculative import tokens
from support.tiny_vlm import PLACEHOLDER, random_image, save_tiny_vlm

from loraserve import LLM, SamplingParams

ALWAYS = {"method": "ngram", "num_speculative_tokens": 3, "draft_policy": "always"}
OPTIONS = dict(dtype="float32", max_num_batched_tokens=32, kv_cache_memory_bytes=16 << 20)
TEXT_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
LEAD = {"qwen2_vl": 8, "gemma3": 3}  # text before the image: Gemma-3's image takes most of its length
IMAGE_PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def _prompts(arch: str) -> list[Any]:
    # Text before the image: its prefill reaches the image once the text requests decode.
    words = (
        "<s>"
        + "one two three four five six seven eight nine ten " * LEAD[arch]
        + f"then {PLACEHOLDER[arch]} please"
    )
    pictures = [random_image(40, 30, 11), random_image(28, 36, 12)]
    return [
        {"prompt_token_ids": list(range(20, 30))},
        {"prompt_token_ids": list(range(40, 50))},
        *({"prompt": words, "multi_modal_data": {"image": [p]}} for p in pictures),
    ]


def _propose_always(llm: LLM) -> None:
    """Text sequences propose `cap` tokens in every decode step; image sequences none."""
    llm.engine.speculator._ngram = lambda seq, cap: (  # type: ignore[method-assign]
        [] if seq.request.mm is not None else [3 + (seq.token_ids[-1] + k) % 400 for k in range(cap)]
    )


def _record_layouts(llm: LLM) -> list[list[tuple[int, bool]]]:
    """Each step's items as (proposals, whether its chunk holds image tokens), in row order."""
    layouts: list[list[tuple[int, bool]]] = []
    execute = llm.engine.runner.execute

    def recorded(scheduled: Any, slots: Any) -> Any:
        layout = []
        for item in scheduled:
            mm, start = item.seq.request.mm, item.seq.num_computed_tokens
            holds = mm is not None and bool(mm.images_in(start, start + item.num_new_tokens))
            layout.append((len(item.draft_tokens), holds))
        layouts.append(layout)
        return execute(scheduled, slots)

    llm.engine.runner.execute = recorded  # type: ignore[method-assign]
    return layouts


@pytest.mark.parametrize("arch", ["qwen2_vl", "gemma3"])
def test_image_prefill_after_speculating_rows_equals_no_speculation(
    arch: str, tmp_path: Any, tokenizer_dir: str
) -> None:
    path = str(tmp_path / arch)
    save_tiny_vlm(path, arch, tokenizer_dir, seed=30)
    prompts = _prompts(arch)
    params = [TEXT_PARAMS, TEXT_PARAMS, IMAGE_PARAMS, IMAGE_PARAMS]
    expected = LLM(path, **OPTIONS).generate(prompts, params, use_tqdm=False)
    spec = LLM(path, **OPTIONS, speculative_config=ALWAYS)
    _propose_always(spec)
    layouts = _record_layouts(spec)
    got = spec.generate(prompts, params, use_tqdm=False)
    after_proposals = [
        layout
        for layout in layouts
        if any(holds and any(d for d, _ in layout[:i]) for i, (_, holds) in enumerate(layout))
    ]
    assert after_proposals, layouts  # an image chunk ran after a speculating sequence's rows
    assert tokens(got) == tokens(expected)
    for ours, theirs in zip(got, expected):
        ours_lp = [next(iter(p.values())).logprob for p in ours.outputs[0].logprobs]
        theirs_lp = [next(iter(p.values())).logprob for p in theirs.outputs[0].logprobs]
        assert ours_lp == pytest.approx(theirs_lp, abs=1e-5)
