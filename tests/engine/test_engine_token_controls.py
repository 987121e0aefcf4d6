"""logit_bias, allowed_token_ids and bad_words through the offline engine (tiny random Llama), with
structured outputs, penalties and n > 1; LLM.generate's priority list, by completion order."""

from __future__ import annotations

from typing import Any

import pytest

from loraserve.entrypoints.llm import LLM
from loraserve.sampling_params import SamplingParams
from loraserve.sampling_tokens import tokenize_bad_words

PROMPTS = [[5, 17, 42, 99, 7], [8, 9, 10, 11], [300, 301, 302, 303, 304, 305]]


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> LLM:
    return LLM(tiny_model("llama"), dtype="float32", max_model_len=96)


def _greedy(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kwargs})


def _tokens(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def _contains(tokens: list[int], sequence: list[int]) -> bool:
    return any(tokens[i : i + len(sequence)] == sequence for i in range(len(tokens) - len(sequence) + 1))


def test_a_huge_negative_bias_moves_greedy_off_its_token(llm: LLM) -> None:
    plain = _tokens(llm, PROMPTS, _greedy())
    banned = plain[0][0]
    biased = _tokens(llm, PROMPTS, [_greedy(logit_bias={banned: -100.0}), _greedy(), _greedy()])
    assert biased[0][0] != banned and banned not in biased[0]  # every step, not only the first
    assert biased[1:] == plain[1:]  # rows without a bias in the same batches are unchanged
    pushed = _tokens(llm, PROMPTS[:1], _greedy(logit_bias={"77": 100.0}))  # a JSON-style key
    assert pushed == [[77] * 12]


def test_allowed_token_ids_restrict_every_token(llm: LLM) -> None:
    allowed = [11, 12, 13, 400, 401]
    sampled = SamplingParams(
        temperature=1.0, seed=3, n=4, max_tokens=16, ignore_eos=True, allowed_token_ids=allowed
    )
    outputs = llm.generate(PROMPTS, [sampled, _greedy(allowed_token_ids=allowed), _greedy()], use_tqdm=False)
    restricted = [seq.token_ids for out in outputs[:2] for seq in out.outputs]
    assert len(restricted) == 5 and all(set(tokens) <= set(allowed) for tokens in restricted)
    assert len({tuple(t) for t in restricted[:4]}) > 1  # still sampling among them
    assert not set(outputs[2].outputs[0].token_ids) <= set(allowed)  # the free row is not restricted


def _a_bad_word_in(llm: LLM, tokens: list[int]) -> tuple[str, list[list[int]]]:
    """A word whose token sequences (as vLLM tokenizes bad words) occur in `tokens`."""
    tokenizer = llm.get_tokenizer()
    for length in (2, 3, 1):
        for start in range(len(tokens) - length + 1):
            word = tokenizer.decode(tokens[start : start + length]).strip()
            if not word:
                continue
            sequences = tokenize_bad_words([word], tokenizer)
            if any(_contains(tokens, s) for s in sequences):
                return word, sequences
    raise AssertionError(f"no word to ban found in {tokens}")


def test_bad_words_never_appear_while_they_do_without(llm: LLM) -> None:
    plain = _tokens(llm, PROMPTS, _greedy(max_tokens=24))[0]
    word, sequences = _a_bad_word_in(llm, plain)
    params = [_greedy(max_tokens=24, bad_words=[word]), SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=24,
              ignore_eos=True, bad_words=[word], repetition_penalty=1.3)]  # fmt: skip
    outputs = llm.generate([PROMPTS[0], PROMPTS[0]], params, use_tqdm=False)
    for seq in (s for out in outputs for s in out.outputs):
        assert not any(_contains(list(seq.token_ids), s) for s in sequences), (word, seq.token_ids)
    assert list(outputs[0].outputs[0].token_ids) != plain


def test_token_controls_combine_with_a_grammar(llm: LLM) -> None:
    choice = {"choice": ["alpha beta", "gamma delta"]}
    free = llm.generate(PROMPTS[:1], _greedy(structured_outputs=choice), use_tqdm=False)[0].outputs[0]
    assert free.text in choice["choice"]
    first = free.token_ids[0]
    moved = llm.generate(PROMPTS[:1], _greedy(structured_outputs=choice, logit_bias={first: -100.0}),
                         use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert moved.text in choice["choice"] and moved.text != free.text
    # A grammar and an allowed list with nothing in common leave only the stop token: a dead end.
    tokenizer = llm.get_tokenizer()
    outside = [t for t in range(len(tokenizer)) if not tokenizer.decode([t]).strip()][:3]
    dead = llm.generate(PROMPTS[:1], _greedy(structured_outputs=choice, allowed_token_ids=outside or [0]),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert dead.finish_reason == "stop" and dead.text not in choice["choice"]


def test_vllms_errors_offline(llm: LLM, tiny_model: Any) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(
        ValueError, match=rf"token_id\(s\) \[{vocab}\] in logit_bias contain out-of-vocab token ids"
    ):
        llm.generate(PROMPTS[:1], _greedy(logit_bias={vocab: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids contains out-of-vocab token id!"):
        llm.generate(PROMPTS[:1], _greedy(allowed_token_ids=[vocab]), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    bare = LLM(tiny_model("llama"), dtype="float32", max_model_len=96, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        bare.generate(PROMPTS[:1], _greedy(bad_words=["x"]), use_tqdm=False)
    plain = _tokens(bare, PROMPTS[:1], _greedy())[0]
    banned = _tokens(bare, PROMPTS[:1], _greedy(bad_words_token_ids=[[plain[0]]]))[0]
    assert plain[0] not in banned


def test_generate_runs_prompts_by_priority(tiny_model: Any) -> None:
    llm = LLM(tiny_model("llama"), dtype="float32", max_num_seqs=1, scheduling_policy="priority")
    finished: list[str] = []
    step = llm.engine.step

    def counting_step() -> Any:
        outputs = step()
        finished.extend(out.request_id for out in outputs if out.finished)
        return outputs

    llm.engine.step = counting_step  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(
        [[9, 10], [11, 12], [13, 14], [15, 16]], params, use_tqdm=False, priority=[3, -2, 0, 3]
    )
    ids = [out.request_id for out in outputs]  # input order
    assert finished == [ids[1], ids[2], ids[0], ids[3]]  # one at a time: lower first, then arrival
    assert [out.prompt_token_ids for out in outputs] == [[9, 10], [11, 12], [13, 14], [15, 16]]
    with pytest.raises(
        ValueError, match=r"^The lengths of prompts \(2\) and priority \(1\) must be the same\.$"
    ):
        llm.generate([[9], [10]], params, use_tqdm=False, priority=[1])
    fcfs = LLM(tiny_model("llama"), dtype="float32")
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not enabled."):
        fcfs.generate([[9], [10]], params, use_tqdm=False, priority=[0, 1])
    assert not fcfs.engine.has_unfinished_requests()  # the first prompt was taken back
    assert len(fcfs.generate([[9], [10]], params, use_tqdm=False, priority=[0, 0])) == 2
