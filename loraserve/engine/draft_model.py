"""`DraftModel`: the draft_model method's proposer, a smaller model with the target's tokenizer.

It is loaded as the target is (`create_model_config` + `get_model`: a GGUF file keeps its quantized
blocks, an HF folder takes the config's `quantization`), and runs through a `ModelRunner` of its own
with a paged KV cache of its own (as many blocks as the target's, in the target's `--kv-cache-dtype`,
committed lazily) and a `BlockManager` without prefix caching. Each speculating sequence has a
mirror `Sequence` here: the target's tokens, then the proposals of the step; its KV stays valid up to
the first token the target did not keep, which `_sync` finds, so the next round computes only what
changed (the whole prompt the first time, up to max_num_batched_tokens a step).

`propose` runs one forward pass per proposal depth over every sequence still proposing, and samples
each row as the target will (its sampling params, its history with the proposals so far, the row's
pre-drawn noise: coupled draws). Adapters: `draft_lora_modules` maps a target adapter's name to a
draft adapter, loaded at start into the draft's own `LoRAManager`; a request of any other adapter (or
none) proposes with the base draft. A pass whose draft adapter fails to reload proposes nothing for
its sequences; the target's verification is what decides the output, so no request fails for it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from loraserve.cache_config import kv_cache_torch_dtype
from loraserve.config import EngineConfig
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.model_runner import ModelRunner
from loraserve.engine.sampler import Sampler, SamplingRow
from loraserve.engine.sequence import Request, Sequence
from loraserve.engine.step_types import ScheduledSeq
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams
from loraserve.speculative_config import SpeculativeConfig

_MIRROR_PARAMS = SamplingParams(
    max_tokens=1
)  # what the runner reads of a mirror's params: no prompt logprobs


@dataclass(slots=True, eq=False)
class Mirror:
    target: Sequence
    seq: Sequence  # the draft's view: the target's tokens, then this step's proposals
    synced: int = 0  # the target's length when the mirror last copied its tokens


class DraftModel:
    def __init__(
        self,
        config: EngineConfig,
        spec: SpeculativeConfig,
        num_blocks: int,
        eos_token_id: int | None,
        tokenizer: Any,
    ) -> None:
        from loraserve.model_loader.config import create_model_config
        from loraserve.model_loader.loader import get_model

        assert spec.model is not None
        target = config.model
        draft_config = create_model_config(
            spec.model,
            dtype=target.dtype,
            device=config.device,
            max_model_len=spec.max_model_len,
            seed=target.seed,
        )
        if spec.quantization is not None:
            draft_config = replace(draft_config, quantization=spec.quantization)
        _check_same_vocabulary(draft_config, target, tokenizer)
        self.max_model_len = draft_config.max_model_len
        self.model = get_model(draft_config, config.device)
        self.lora, self.adapters = _draft_adapters(self.model, config, spec)
        self.block_size = config.cache.block_size
        self.blocks = BlockManager(num_blocks, self.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(
            self.model, num_blocks, self.block_size, target.dtype, config.device,
            config.lora.max_loras if self.lora is not None and config.lora else None, self.lora, eos_token_id,
            kv_cache_torch_dtype(config.cache.kv_cache_dtype, target.dtype),  # the target's KV format
        )  # fmt: skip
        self.chunk = config.scheduler.max_num_batched_tokens  # a mirror's catch-up per step at most
        self.eos_token_id = eos_token_id
        self.sampler = Sampler()
        self._mirrors: dict[int, Mirror] = {}

    def release_finished(self) -> None:
        """Free the mirrors of finished sequences."""
        for seq_id in [seq_id for seq_id, m in self._mirrors.items() if m.target.is_finished]:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        mirror = self._mirrors.pop(seq_id)
        self.blocks.free(mirror.seq)
        mirror.seq.block_ids = []

    def propose(self, wanted: list[tuple[Sequence, int, torch.Tensor | None]]) -> dict[int, list[int]]:
        """Up to `num` proposals for each (target sequence, num, its rows' noise or None when greedy)."""
        mirrors = [(self._mirror(seq), num, noise) for seq, num, noise in wanted]
        proposals: dict[int, list[int]] = {seq.seq_id: [] for seq, _, _ in wanted}
        active = mirrors
        depth = 0
        while active:
            ran = self._pass(active, depth, proposals, {m.seq.seq_id for m, _, _ in mirrors})
            depth += 1
            active = [x for x in ran if len(proposals[x[0].target.seq_id]) < x[1]]
        return proposals

    def _mirror(self, target: Sequence) -> Mirror:
        mirror = self._mirrors.get(target.seq_id)
        if mirror is None:
            lora = self.adapters.get(target.request.lora_name or "")
            request = Request(f"draft-{target.seq_id}", None, [], _MIRROR_PARAMS, lora, 0.0)
            seq = Sequence(target.seq_id, request, 0, [], target.num_prompt_tokens, None, None)
            mirror = self._mirrors[target.seq_id] = Mirror(target, seq)
        tokens, own = mirror.target.token_ids, mirror.seq.token_ids
        common = mirror.synced
        while common < min(len(own), len(tokens)) and own[common] == tokens[common]:
            common += 1  # the proposals the target kept
        mirror.seq.num_computed_tokens = min(mirror.seq.num_computed_tokens, common)
        del own[common:]
        own.extend(tokens[common:])
        mirror.synced = len(tokens)
        return mirror

    def _pass(
        self,
        active: list[tuple[Mirror, int, torch.Tensor | None]],
        depth: int,
        proposals: dict[int, list[int]],
        keep: set[int],
    ) -> list[tuple[Mirror, int, torch.Tensor | None]]:
        """One forward over `active`'s uncomputed tokens; returns those that sampled a proposal."""
        scheduled, ran = [], []
        for entry in active:
            seq = entry[0].seq
            num_new = min(seq.num_tokens - seq.num_computed_tokens, self.chunk)
            if not self._allocate(seq, num_new, keep):
                continue
            scheduled.append(ScheduledSeq(seq, num_new))
            if seq.num_computed_tokens + num_new == seq.num_tokens:
                ran.append(entry)
        if not scheduled:
            return []
        result = self._forward(scheduled)
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        if result is None:
            return []
        row_of = {seq.seq_id: i for i, seq in enumerate(result.sample_seqs)}
        ran = [entry for entry in ran if entry[0].seq.seq_id in row_of]
        if not ran:
            return []
        index = torch.tensor([row_of[m.seq.seq_id] for m, _, _ in ran], dtype=torch.long)
        rows = [self._row(m, proposals[m.target.seq_id], noise, depth) for m, _, noise in ran]
        for (mirror, _, _), token in zip(
            ran, self.sampler(result.logits[index], rows).token_ids, strict=True
        ):
            proposals[mirror.target.seq_id].append(token)
            mirror.seq.token_ids.append(token)
        return ran

    def _allocate(self, seq: Sequence, num_new: int, keep: set[int]) -> bool:
        """Blocks for the pass; when short, the mirrors this round does not use give theirs back."""
        blocks = self.blocks.allocate(seq, num_new)
        if blocks is None:
            for seq_id in [i for i in self._mirrors if i not in keep]:
                self._drop(seq_id)
            blocks = self.blocks.allocate(seq, num_new)
        if blocks is None:
            return False
        seq.block_ids.extend(blocks)
        return True

    def _forward(self, scheduled: list[ScheduledSeq]) -> Any:
        lora_slots = None
        if self.lora is not None:
            lora_slots, failed = self.lora.prepare_step({s.seq.lora_id for s in scheduled if s.seq.lora_id})
            scheduled = [s for s in scheduled if s.seq.lora_id not in failed]
        try:
            return self.runner.execute(scheduled, lora_slots) if scheduled else None
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def _row(self, mirror: Mirror, so_far: list[int], noise: torch.Tensor | None, depth: int) -> SamplingRow:
        """The target's sampling of this position, as its verification row will sample it."""
        target = mirror.target
        params = target.params
        prompt_ids = target.token_ids[: target.num_prompt_tokens] if params.repetition_penalty != 1.0 else []
        output_ids = (
            target.output_token_ids + so_far
            if (params.has_penalties or params.min_tokens > 0 or params.bad_words_prefix_len > 0)
            else []
        )
        return SamplingRow(params, prompt_ids, output_ids, None, self.eos_token_id,
                           None if noise is None else noise[depth])  # fmt: skip


def _check_same_vocabulary(draft: Any, target: Any, tokenizer: Any) -> None:
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): a draft model must share the target's tokenizer."
        )
    if tokenizer is None:
        return
    from loraserve.engine.tokenization import load_tokenizer

    if load_tokenizer(draft).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "the draft model's tokenizer differs from the target's: a draft model must share it."
        )


def _draft_adapters(
    model: Any, config: EngineConfig, spec: SpeculativeConfig
) -> tuple[Any, dict[str, LoRARequest]]:
    """The draft's LoRA manager (None without draft adapters) and target adapter name -> draft adapter."""
    if not spec.draft_lora_modules:
        return None, {}
    if config.lora is None:
        raise ValueError("draft_lora_modules needs LoRA on (enable_lora=True).")
    from loraserve.lora.manager import LoRAManager

    modules = dict(spec.draft_lora_modules)
    lora_config = replace(config.lora, max_cpu_loras=max(len(modules), config.lora.max_loras))
    manager = LoRAManager(model, lora_config, config.model.dtype, config.device)
    adapters = {}
    for lora_id, (name, path) in enumerate(sorted(modules.items()), start=1):
        request = LoRARequest(f"draft:{name}", lora_id, path)
        manager.register(request, explicit=True)  # a bad draft adapter fails the start, with its error
        adapters[name] = request
    return manager, adapters
