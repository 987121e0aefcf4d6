"""Beam search throughput: `LLM.beam_search` (width 4) against transformers' `generate(num_beams=4)`.

16 prompts of 32 tokens, 32 new tokens per beam, on the random SmolLM-135M-shaped model (its beams
never reach eos, so both systems decode exactly 16 x 4 x 32 beam tokens; on one untimed batch the
best beam of each prompt is compared between them: in float32 they agree up to near-ties). transformers gets the 16 prompts as one batch
(64 rows with the beams), its best case. One untimed run each, then one timed run each in turn.
Usage: python -m benchmarks.beam_search [--dtype auto] [--threads N] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks.common import (
    build_model,
    cpu_class,
    interleaved_timed,
    limit_threads,
    random_prompts,
    save_results,
)

WIDTH = 4
NUM_PROMPTS = 16
PROMPT_LEN = 32


def run_beam_search(dtype: torch.dtype, new_tokens: int = 32, repeats: int = 1) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from loraserve import LLM, BeamSearchParams

    path = build_model()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    llm = LLM(path, dtype=str(dtype).replace("torch.", ""), max_num_seqs=NUM_PROMPTS * WIDTH)
    params = BeamSearchParams(WIDTH, new_tokens, ignore_eos=True)
    kwargs = dict(
        num_beams=WIDTH,
        num_return_sequences=WIDTH,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        early_stopping=False,
    )

    def transformers_run(ids: list[list[int]]) -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(torch.tensor(ids), **kwargs)
        assert out.shape[1] == PROMPT_LEN + new_tokens
        return [out[i * WIDTH, PROMPT_LEN:].tolist() for i in range(len(ids))]

    def loraserve_run(ids: list[list[int]]) -> list[list[int]]:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in ids], params)
        assert all(len(s.tokens) == PROMPT_LEN + new_tokens for o in outs for s in o.sequences)
        return [o.sequences[0].tokens[PROMPT_LEN:] for o in outs]

    prompts = random_prompts(NUM_PROMPTS, PROMPT_LEN, model.config.vocab_size)
    # The timed runs each get prompts of their own; the best beams are compared on one batch here.
    check = random_prompts(NUM_PROMPTS, PROMPT_LEN, model.config.vocab_size, seed=1)
    same = sum(a == b for a, b in zip(transformers_run(check), loraserve_run(check), strict=True))
    timings = interleaved_timed(
        {"transformers": transformers_run, "loraserve": loraserve_run}, prompts, repeats
    )
    tokens = NUM_PROMPTS * WIDTH * new_tokens
    rows = {name: tokens / seconds for name, (seconds, _) in timings.items()}
    return {
        "cpu": cpu_class(),
        "dtype": str(dtype).replace("torch.", ""),
        "beam_width": WIDTH,
        "prompts": NUM_PROMPTS,
        "prompt_len": PROMPT_LEN,
        "new_tokens": new_tokens,
        "transformers_tok_per_s": rows["transformers"],
        "loraserve_tok_per_s": rows["loraserve"],
        "loraserve_over_transformers": rows["loraserve"] / rows["transformers"],
        "same_best_beam": f"{same}/{NUM_PROMPTS}",
    }


def main() -> None:
    from loraserve.config import resolve_device, resolve_dtype

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (default: torch's)")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    limit_threads(args.threads)
    result = run_beam_search(resolve_dtype(args.dtype, resolve_device("cpu")), args.new_tokens)
    print(f"{result['cpu']}, {result['dtype']}")
    print(
        f"beam search, width {WIDTH}, {NUM_PROMPTS} prompts x ({PROMPT_LEN} + {result['new_tokens']}) tokens:"
    )
    print(f"  transformers generate(num_beams={WIDTH}): {result['transformers_tok_per_s']:.1f} beam tok/s")
    print(f"  loraserve LLM.beam_search:              {result['loraserve_tok_per_s']:.1f} beam tok/s")
    print(f"  ratio {result['loraserve_over_transformers']:.2f}x; same best beam {result['same_best_beam']}")
    save_results("beam_search", result)


if __name__ == "__main__":
    main()
