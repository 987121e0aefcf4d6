"""Beam search vs transformers' `generate(num_beams=W)`: the same beams (token ids) and scores, base
model and adapters (PEFT); beams share their prompt's KV blocks and copy a shared partial block
before writing to it; a preempted beam is recomputed and the search still equals transformers'."""

from __future__ import annotations

import collections
import math
from typing import Any

import pytest
import torch
from support.beam_reference import hf_beams

from loraserve import LLM, BeamSearchParams, LoRARequest
from loraserve.beam_search import beam_score
from loraserve.demo.random_model import save_peft_adapter
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine

WIDTH = 3
NUM_NEW = 12
# (length_penalty, early_stopping): each of transformers' stopping rules, both signs of the penalty
SETTINGS = [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False), (1.5, True), (0.0, "never")]


def _prompts(vocab_size: int, lengths: tuple[int, ...] = (3, 17, 9, 30, 5), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def _assert_same_beams(
    ours: Any, prompt: list[int], reference: list[tuple[list[int], float]], length_penalty: float
) -> None:
    assert len(ours.sequences) == len(reference)
    for seq, (ref_ids, ref_score) in zip(ours.sequences, reference, strict=True):
        assert seq.tokens[: len(prompt)] == prompt
        generated = seq.tokens[len(prompt) :]
        assert generated == ref_ids
        score = beam_score(seq.cum_logprob, len(generated), length_penalty)
        assert math.isclose(score, ref_score, rel_tol=1e-5, abs_tol=1e-5), (score, ref_score)


def _frequent_token(llm: LLM, prompts: list[list[int]]) -> int:
    """A token the beams often produce: as an extra stop id, it makes beams finish early."""
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(WIDTH, NUM_NEW))
    counts = collections.Counter(
        t for o, p in zip(outs, prompts) for s in o.sequences for t in s.tokens[len(p) :]
    )
    return counts.most_common(1)[0][0]


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> str:
    return str(tiny_model("llama"))


@pytest.mark.parametrize(
    "engine_kwargs", [{}, {"max_num_batched_tokens": 64, "num_kv_blocks": 16}], ids=["roomy", "preempting"]
)
def test_beams_and_scores_equal_transformers(
    llama: str, hf_model: Any, engine_kwargs: dict[str, Any]
) -> None:
    """Every stopping rule, with beams ending early on a stop id; the second engine has so few KV
    blocks that beams are preempted (one at a time) and recomputed mid-search."""
    hf = hf_model(llama)
    llm = LLM(llama, dtype="float32", **engine_kwargs)
    prompts = _prompts(hf.config.vocab_size)
    stop = _frequent_token(llm, prompts)
    eos_ids = [hf.generation_config.eos_token_id, stop]
    finished_by_stop = 0
    for length_penalty, early_stopping in SETTINGS:
        params = BeamSearchParams(
            WIDTH,
            NUM_NEW,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            stop_token_ids=(stop,),
        )
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs, strict=True):
            ref = hf_beams(hf, prompt, WIDTH, NUM_NEW, length_penalty, early_stopping, eos_ids)
            _assert_same_beams(out, prompt, ref, length_penalty)
            finished_by_stop += sum(s.finish_reason == "stop" for s in out.sequences)
    assert finished_by_stop > 0  # the early-stopping rules were exercised, not only max_tokens
    if engine_kwargs:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.check_consistency() is None
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_beams_share_prompt_blocks_and_copy_on_write(llama: str) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=llama, dtype="float32"))
    blocks = engine.block_manager
    prompt = _prompts(500, lengths=(9,))[0]  # one partial block: the forks share it
    request = engine.add_request("r", {"prompt_token_ids": prompt}, BeamSearchParams(WIDTH, 6))
    engine.step()  # the prefill, then the first round forks the prompt into W beams
    assert len(request.seqs) == WIDTH
    first = list(request.seqs[0].block_ids)
    assert all(seq.block_ids == first for seq in request.seqs) and len(first) == 1
    assert blocks.ref_counts[first[0]] == WIDTH
    assert engine.check_consistency() is None
    batch = engine.scheduler.schedule()
    # All but the last writer copy the shared block; the copies are private, the source keeps one holder.
    assert len(batch.block_copies) == WIDTH - 1
    assert all(src == first[0] for src, _ in batch.block_copies)
    tables = [seq.block_ids[0] for seq in request.seqs]
    assert len(set(tables)) == WIDTH and all(blocks.ref_counts[b] == 1 for b in tables)
    assert engine.check_consistency() is None


def test_beam_search_runs_beside_sampling_requests(llama: str, hf_model: Any) -> None:
    """Beams share batches with ordinary requests; neither changes the other's result."""
    from loraserve import SamplingParams

    hf = hf_model(llama)
    llm = LLM(llama, dtype="float32")
    prompts = _prompts(hf.config.vocab_size, lengths=(7, 20))
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, greedy)
        engine.add_request(
            f"b{i}", {"prompt_token_ids": p}, BeamSearchParams(WIDTH, NUM_NEW, ignore_eos=True)
        )
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for i, p in enumerate(prompts):
        assert done[f"g{i}"].outputs[0].token_ids == alone[i].outputs[0].token_ids
        ref = hf_beams(hf, p, WIDTH, NUM_NEW, 1.0, False, [hf.generation_config.eos_token_id])
        assert [o.token_ids for o in done[f"b{i}"].outputs] == [ids for ids, _ in ref]


def test_num_return_sequences_and_aborting(llama: str) -> None:
    llm = LLM(llama, dtype="float32")
    prompt = _prompts(500, lengths=(11,))[0]
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(4, 5, num_return_sequences=2))[0]
    full = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(4, 5))[0]
    assert [s.tokens for s in out.sequences] == [s.tokens for s in full.sequences[:2]]
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": prompt}, BeamSearchParams(4, 50))
    for _ in range(3):
        engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and engine.check_consistency() is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": math.inf}, "length_penalty"),
        ({"num_return_sequences": 5}, "num_return_sequences"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict[str, Any], match: str) -> None:
    values: dict[str, Any] = {"beam_width": 4, "max_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**values)


ADAPTER = dict(
    r=8,
    lora_alpha=16,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)


def test_adapter_beams_equal_peft(llama: str, hf_model: Any, tmp_path: Any) -> None:
    """Two adapters and the base model in one beam-search call; each equals PEFT's generate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    paths = {}
    for seed, name in enumerate(("a", "b")):
        paths[name] = str(tmp_path / name)
        save_peft_adapter(hf_model(llama), paths[name], seed=70 + seed, base_name=llama, **ADAPTER)
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, paths["a"], adapter_name="a")
    peft.load_adapter(paths["b"], adapter_name="b")
    llm = LLM(llama, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = _prompts(500, lengths=(6, 19, 13))
    loras = [LoRARequest("a", 1, paths["a"]), LoRARequest("b", 2, paths["b"]), None]
    cases = [(p, lora) for p in prompts for lora in loras]
    params = BeamSearchParams(WIDTH, NUM_NEW, length_penalty=0.7)
    outs = llm.beam_search([{"prompt_token_ids": p} for p, _ in cases], params, [lora for _, lora in cases])
    eos = [base.generation_config.eos_token_id]
    for (prompt, lora), out in zip(cases, outs, strict=True):
        if lora is None:
            with peft.disable_adapter():
                ref = hf_beams(peft, prompt, WIDTH, NUM_NEW, 0.7, False, eos)
        else:
            peft.set_adapter(lora.lora_name)
            ref = hf_beams(peft, prompt, WIDTH, NUM_NEW, 0.7, False, eos)
        _assert_same_beams(out, prompt, ref, 0.7)
        assert all(seq.lora_request is lora for seq in out.sequences)


@pytest.mark.parametrize("arch", ["mistral", "qwen3", "gpt2", "gpt_neox"])
def test_other_architectures_equal_transformers(arch: str, tiny_model: Any, hf_model: Any) -> None:
    """Sliding windows, q/k norms, GPT-2's layout and the transformers backend: copies of shared blocks
    and forks are the engine's, whatever the model."""
    path = tiny_model(arch)
    hf = hf_model(path)
    llm = LLM(path, dtype="float32")
    prompts = _prompts(hf.config.vocab_size, lengths=(13, 6))
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(WIDTH, 10))
    for prompt, out in zip(prompts, outs, strict=True):
        _assert_same_beams(out, prompt, hf_beams(hf, prompt, WIDTH, 10), 1.0)
