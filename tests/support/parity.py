"""Checks of served outputs against transformers / PEFT on tiny random models (native model tests):
greedy tokens and prompt logprobs equal in float32, bf16 outputs within bf16 noise of float32 (for
mixture-of-experts models, but for one routing flip per sequence)."""

from __future__ import annotations

import copy
import functools
import math
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from loraserve import SamplingParams

# bf16 keeps 8 significant bits, and random models amplify it: transformers' own bf16 logprobs land
# up to ~0.1 from its float32 ones. Ours round elsewhere (fused kernels, float32 sums), so the two
# errors are independent: ours must stay within BF16_FACTOR times transformers' bf16 error on the same
# tokens (at least BF16_FLOOR), while the adapters move the logprobs by far more (checked by callers).
BF16_FLOOR, BF16_FACTOR = 0.05, 3.0


T = TypeVar("T")
_MEMO: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def memoized(model: Any, key: Any, compute: Callable[[], T]) -> T:
    """compute() once per (reference model, key), for as long as the model lives. A test's reference
    (transformers / PEFT in eval mode) is fixed once loaded, and its parametrizations (our dtypes and
    kernels) score the same inputs on it again: most of a parity test's time. The key must name all
    that the result depends on besides the model's weights (the active adapter, the ids)."""
    table = _MEMO.setdefault(model, {})
    if key not in table:
        table[key] = compute()
    return table[key]


def bf16_twin(model: Any) -> Any:
    """A bf16 copy of the reference model, made once per model."""
    return memoized(model, "bf16 twin", lambda: copy.deepcopy(model).to(torch.bfloat16))


def random_prompts(lengths: tuple[int, ...], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def hf_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def hf_greedy(model: Any, prompt: list[int], num_new: int) -> list[int]:
    """Greedy tokens from the model fed one token at a time with its cache: no end-of-sequence rule
    (`generate`'s min_new_tokens would mask EOS, which the served requests, ignoring EOS, may pick)."""
    cache, ids, tokens = None, torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(num_new):
            result = model(ids, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            tokens.append(int(result.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


def hf_greedy_full(model: Any, prompt: list[int], num_new: int = 8) -> list[int]:
    """Greedy tokens by full forwards (transformers' `generate` with min_new_tokens masks the EOS token,
    which ignore_eos serving may pick, and its cached decode rounds otherwise than its full forward)."""
    ids = list(prompt)
    for _ in range(num_new):
        ids.append(int(hf_logprobs(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def greedy_params(num_new: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_new, ignore_eos=True, prompt_logprobs=0, logprobs=0)


def check_exact(out: Any, prompt: list[int], tokens: list[int], reference: torch.Tensor) -> None:
    """float32: the same greedy tokens and every prompt logprob within 1e-4."""
    assert out.outputs[0].token_ids == tokens
    for pos in range(1, len(prompt)):
        assert math.isclose(
            out.prompt_logprobs[pos][prompt[pos]].logprob,
            reference[pos - 1, prompt[pos]].item(),
            abs_tol=1e-4,
        )


def check_bf16(out: Any, prompt: list[int], reference_of: Any, bf16_of: Any, what: str) -> None:
    """One bf16 output against the float32 reference scoring the same tokens: every logprob, and the
    gap of every generated token to the reference's greedy choice, within BF16_FACTOR times the reference
    model's own bf16 error on those tokens (near-ties may break either way in bf16, so greedy sequences are
    not compared exactly)."""
    errors, gaps, hf_errors = _bf16_errors(out, prompt, reference_of, bf16_of)
    tol = max(BF16_FLOOR, BF16_FACTOR * hf_errors.max().item())
    error, gap = errors.max().item(), gaps.max().item()
    assert error <= tol and gap <= tol, f"{what}: error {error:.4f}, gap {gap:.4f}, bound {tol:.4f}"


def check_bf16_routed(out: Any, prompt: list[int], reference_of: Any, bf16_of: Any, what: str) -> None:
    """`check_bf16` for mixture-of-experts models, allowing one routing flip per sequence: where a
    token's k-th and (k+1)-th experts nearly tie, bf16 rounding (ours or transformers', each in other
    places) may swap them, a jump in that token's output however close the rest is. So every token's
    logprob error and generated-token gap stay within BF16_FACTOR times transformers' own worst bf16
    error on the sequence but at most one, and the median error within BF16_FACTOR times transformers'
    median."""
    errors, gaps, hf_errors = _bf16_errors(out, prompt, reference_of, bf16_of)
    tol = max(BF16_FLOOR, BF16_FACTOR * hf_errors.max().item())
    median_tol = max(BF16_FLOOR, BF16_FACTOR * hf_errors.median().item())
    assert int((errors > tol).sum()) + int((gaps > tol).sum()) <= 1, (
        f"{what}: errors {errors.max():.4f}, gaps {gaps.max():.4f}, bound {tol:.4f}"
    )
    assert errors.median() <= median_tol, f"{what}: median error {errors.median():.4f} > {median_tol:.4f}"


def _bf16_errors(
    out: Any, prompt: list[int], reference_of: Any, bf16_of: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every scored token, our logprob's distance to the float32 reference's and the reference
    model's own bf16 distance; for every generated token, its gap to the reference's greedy choice."""
    completion = out.outputs[0]
    ids = prompt + list(completion.token_ids)
    ours = [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(prompt))]
    ours += [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
    rows, nxt = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
    reference = reference_of(ids)[:-1]
    theirs = reference[rows, nxt]
    hf_errors = (bf16_of(ids)[:-1][rows, nxt] - theirs).abs()
    errors = (torch.tensor(ours, dtype=torch.float32) - theirs).abs()
    gaps = reference[len(prompt) - 1 :].max(-1).values - theirs[len(prompt) - 1 :]
    return errors, gaps, hf_errors


def peft_model(base_path: str, adapters: dict[str, str]) -> Any:
    """PEFT on the float32 base with every adapter of `adapters` loaded (name -> folder), once per
    (base, adapters) in the session: callers only switch the active adapter, which the memoized
    scores below name in their keys."""
    return _load_peft_model(base_path, tuple(adapters.items()))


@functools.cache
def _load_peft_model(base_path: str, adapter_items: tuple[tuple[str, str], ...]) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    (first, folder), *rest = adapter_items
    model = PeftModel.from_pretrained(base, folder, adapter_name=first)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def with_adapter(model: Any, name: str | None, compute: Callable[[], T]) -> T:
    """compute() with PEFT adapter `name` active (None: the base model)."""
    if name is None:
        with model.disable_adapter():
            return compute()
    model.set_adapter(name)
    return compute()


def peft_logprobs(model: Any, name: str | None, ids: list[int]) -> torch.Tensor:
    compute = lambda: with_adapter(model, name, lambda: hf_logprobs(model, ids))  # noqa: E731
    return memoized(model, ("logprobs", name, tuple(ids)), compute)


def peft_greedy(model: Any, name: str | None, prompt: list[int], num_new: int) -> list[int]:
    compute = lambda: with_adapter(model, name, lambda: hf_greedy(model, prompt, num_new))  # noqa: E731
    return memoized(model, ("greedy", name, tuple(prompt), num_new), compute)
