"""The synchronous engine: add requests, run `step()` (schedule -> run -> update -> outputs).

It wires the parts together and owns the request table; the scheduler owns each sequence's state,
the output processor its text, the model loader the weights, tokenization the prompt and eos ids,
`RequestPrep` a new request's sampling params and sequences, `EngineAdapters` the rules of its
adapter API (the `LoRAManager` owns the adapters), `StepFailures` which requests a failed step ends
and when the engine gives up, the `Speculator` (with a speculative config) a step's proposals, which
`spec_verify.verify` turns into the tokens each sequence emits.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Collection
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.beam_search import BeamSearchParams
from loraserve.config import EngineConfig
from loraserve.engine.admission import check_admission
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.engine_stats import engine_stats
from loraserve.engine.image_prompt import image_processor, prepare_image_prompt
from loraserve.engine.iteration_stats import IterationTokens, cache_config_info
from loraserve.engine.kv_budget import PreemptionWarning, kv_budget, kv_cache_dtype
from loraserve.engine.lora_adapters import EngineAdapters
from loraserve.engine.model_runner import ModelRunner
from loraserve.engine.output_processor import OutputProcessor
from loraserve.engine.request_prep import RequestPrep
from loraserve.engine.scheduler import SampledToken, Scheduler
from loraserve.engine.sequence import CacheSalt, Request, RequestSalt
from loraserve.engine.spec_verify import verify
from loraserve.engine.speculator import build_speculator
from loraserve.engine.step_failures import StepFailures
from loraserve.engine.tokenization import PromptInput, end_of_sequence_ids, load_tokenizer
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams
from loraserve.structured_output.manager import StructuredOutputs

if TYPE_CHECKING:
    from loraserve.lora.manager import LoRAManager
    from loraserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from loraserve.model_loader.loader import get_model

        self.config = config
        self.model_config = config.model
        self.lora_config = config.lora
        torch.manual_seed(config.model.seed)
        self.tokenizer = load_tokenizer(config.model)
        self.model: Any = get_model(config.model, config.device)
        self.lora: LoRAManager | None = _lora_manager(self.model, config)
        self.kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, config.model.dtype)
        self.architecture = str(getattr(self.model, "architecture_name", type(self.model).__name__))
        self.mm_processor = image_processor(self.model, self.architecture, config)
        self.images_received = 0  # images of the requests added (metrics)
        num_blocks = self._num_kv_blocks()
        spec: KVCacheSpec = cast(Any, self.model).kv_cache_spec()  # (narrowed to nn.Module above)
        self.block_manager = BlockManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, spec.rope_switch_length
        )
        seq_ids = itertools.count()  # new sequences' ids (`RequestPrep`) and forked beams' (the scheduler)
        self.scheduler = Scheduler(
            config.scheduler,
            self.block_manager,
            config.lora.max_loras if config.lora else None,
            self.lora.can_activate if self.lora is not None else None,
            seq_ids,
            config.model.vocab_size,
        )
        self.eos_ids = end_of_sequence_ids(self.tokenizer, config.model)
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            config.cache.block_size,
            config.model.dtype,
            config.device,
            config.lora.max_loras if config.lora else None,
            self.lora,
            self.eos_ids.eos_token_id,
            self.kv_dtype,
            config.multimodal.mm_embedding_cache_bytes,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.eos_ids.eos_token_id, config.model.max_model_len)
        self.structured = StructuredOutputs(
            self.tokenizer,
            config.model.vocab_size,
            [t for t in (self.eos_ids.eos_token_id, *self.eos_ids.extra_eos_ids) if t is not None],
            config.structured_outputs.disable_any_whitespace,
        )
        # What turns an add_request call's params into the request's sampling params and sequences:
        self.prep = RequestPrep(
            config.model, self.tokenizer, self.eos_ids, config.device, self.structured, seq_ids
        )
        self.requests: dict[str, Request] = {}
        self.iteration_tokens = IterationTokens()  # vllm:iteration_tokens_total
        self.preemption_warning = PreemptionWarning(num_blocks)
        self.cache_info = cache_config_info(
            config.cache, num_blocks, self.kv_budget.bytes
        )  # vllm:cache_config_info
        self.adapters = EngineAdapters(self.lora, self.requests)  # the adapter API's rules
        self.step_failures = StepFailures(self.requests, self.scheduler, self.outputs, self.lora)
        if self.lora is not None:  # the host cache keeps the adapters queued requests still need
            self.lora.follow_demand(self.scheduler.adapters_in_demand)
        self.speculator = build_speculator(
            config, self.scheduler, num_blocks, self.eos_ids.eos_token_id, self.tokenizer
        )
        logger.info(
            "Engine ready: %s (%s, %s) on %s, %d KV blocks of %d tokens, LoRA %s",
            config.model.model,
            type(self.model).__name__,
            config.model.dtype,
            config.device,
            num_blocks,
            config.cache.block_size,
            "on" if config.lora else "off",
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def _num_kv_blocks(self) -> int:
        spec = self.model.kv_cache_spec()
        budget = kv_budget(
            self.config.cache,
            spec,
            self.kv_dtype,
            self.config.device,
            self.model_config.max_model_len,
            self.config.scheduler.max_num_seqs,
        )
        self.kv_budget = budget
        block_size = self.config.cache.block_size
        needed = -(-self.model_config.max_model_len // block_size)
        if budget.num_blocks < needed:
            raise ValueError(
                f"The KV cache holds {budget.num_blocks} blocks of {block_size} tokens, fewer than one "
                f"sequence of max_model_len={self.model_config.max_model_len} needs ({needed}); raise the "
                f"KV-cache memory or lower max_model_len."
            )
        return budget.num_blocks

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | BeamSearchParams | None = None,
        lora_request: LoRARequest | None = None,
        arrival_time: float | None = None,
        group_id: str | None = None,
        priority: int = 0,
        grammar: Any = None,
    ) -> Request:
        """Validate and queue a request. Raises ValueError (bad prompt/params), LoRAAdapterError, or
        EngineOverloadedError (the queue is full: retry later). A dict prompt may carry vLLM's
        `cache_salt`; `priority` needs scheduling_policy "priority". `BeamSearchParams` make it a
        beam search (its one output, at the end, holds the best beams). `grammar`: the request's
        constraint already compiled (the async engine's compile pool); None compiles it here."""
        if request_id in self.requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if priority != 0 and self.config.scheduler.scheduling_policy != "priority":  # vLLM's text
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        text, prompt_ids, mm = prepare_image_prompt(
            prompt, self.mm_processor, self.architecture, self.tokenizer, self.config
        )
        self.images_received += len(mm.images) if mm is not None else 0
        beam, params = self.prep.params(params, len(prompt_ids))
        width = beam.width if beam is not None else params.n
        check_admission(self.config.scheduler, self.scheduler.queue_load(), width, width * len(prompt_ids))
        salt: CacheSalt | None = None
        if lora_request is not None:
            lora_request, salt = self.adapters.for_request(lora_request)
        request_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if request_salt:
            salt = RequestSalt(salt, str(request_salt))
        # Compiled (or found in the cache) before anything is queued: a bad schema is a ValueError.
        if params.structured_outputs is None:
            grammar = None
        elif grammar is None:
            grammar = self.structured.compile(params.structured_outputs)
        request = Request(
            request_id,
            text,
            prompt_ids,
            params,
            lora_request,
            arrival_time or time.time(),
            salt,
            group_id=group_id,
            priority=priority,
            beam=beam,
            mm=mm,
        )
        request.seqs.extend(self.prep.sequences(request, grammar))
        self.requests[request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
        return request

    def check_admission(self, num_seqs: int, num_prefill_tokens: int) -> None:
        """Raise EngineOverloadedError (or RequestTooLargeError) unless a request of this size fits the
        queue now: what a multi-prompt API call asks before adding its prompts one by one."""
        check_admission(self.config.scheduler, self.scheduler.queue_load(), num_seqs, num_prefill_tokens)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        aborted = []
        for request_id in ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
            aborted.append(self.outputs.build_output(request))
        self.adapters.settle()
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch: schedule -> run -> update -> outputs. If it raises, its requests fail and the
        engine goes on (`StepFailures.step_failed`); StepFailureLimitError when it cannot."""
        begin = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.preempted:
            self.preemption_warning.note(len(batch.preempted), self.scheduler.num_preemptions)
        if batch.is_empty:
            return []
        try:
            if self.speculator is not None:
                self.speculator.propose(batch)
            masks = self.structured.start_step(batch.scheduled)  # grammar masks, filled while the model runs
        except Exception as exc:  # no constrained row may sample unmasked: the step fails, the engine goes on
            ended = self.step_failures.step_failed(batch.scheduled, exc)
            self.adapters.settle()
            return ended
        self.iteration_tokens.observe(sum(item.num_query_tokens for item in batch.scheduled))
        run = self.runner.run(
            batch.scheduled,
            None if masks is None else partial(self.structured.apply, masks),
            batch.block_copies,
        )
        outputs: list[RequestOutput] = []
        try:
            outputs += self.step_failures.adapters_failed(run.failed)
            if run.error is not None:
                raise run.error
            if run.result is not None:
                failed = run.request_errors  # requests whose own work failed: they end alone
                dead = masks.dead_offsets if masks is not None else None
                emitted = verify(run.result, run.sampled, dead)
                if failed:
                    emitted = [out for out in emitted if out.seq.request not in failed]
                sampled = self.outputs.process(run.result, emitted, failed)
                scheduled = (
                    [s for s in run.scheduled if s.seq.request not in failed] if failed else run.scheduled
                )
                searched = self.scheduler.update(scheduled, sampled, run.beams, failed)
                outputs += self.step_failures.requests_failed(failed)
                outputs += self._request_outputs(sampled)
                outputs += self._beam_outputs(searched)
                if self.speculator is not None:
                    self.speculator.observe(scheduled, emitted, time.perf_counter() - begin)
        except Exception as exc:
            outputs += self.step_failures.step_failed(run.scheduled, exc)
        else:
            self.step_failures.succeeded()
        finally:
            self.structured.wait(masks)
        self.adapters.settle()
        return outputs

    def check_consistency(self) -> str | None:
        """What is wrong with the engine's bookkeeping (queues vs requests, KV blocks, adapter slots);
        None if it is sound."""
        return self.step_failures.check_consistency()

    def _request_outputs(self, sampled: list[SampledToken]) -> list[RequestOutput]:
        """One output per request that got a token; finished requests leave the table."""
        outputs = []
        for request in dict.fromkeys(token.seq.request for token in sampled):
            outputs.append(self.outputs.build_output(request))
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def _beam_outputs(self, searched: list[Request]) -> list[RequestOutput]:
        """The one output of each beam search that ended this step; it leaves the table."""
        outputs = []
        for request in searched:
            outputs.append(self.outputs.build_output(request))
            self.requests.pop(request.request_id, None)
        return outputs

    # ---- adapters (the rules are `EngineAdapters`'; the manager owns the adapters) --------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load, validate and register an adapter; False if its id is registered already, unless
        `lora_request.load_inplace`: then its weights are read again (no request may be using it).
        A scale is a request's, not the adapter's: it is not kept."""
        return self.adapters.add(lora_request)

    def replace_lora(self, old_lora_id: int, lora_request: LoRARequest) -> bool:
        """Serve `lora_request` (a new id) in place of adapter `old_lora_id`: running requests finish on
        the old weights, new ones (old id included) get the new weights (`LoRAManager.replace`)."""
        return self.adapters.replace(old_lora_id, lora_request)

    def is_lora_in_use(self, lora_id: int) -> bool:
        """Whether an unfinished request uses the adapter (engine thread)."""
        return lora_id in self.adapters.in_use()

    def is_lora_registered(self, lora_id: int) -> bool:
        """Whether `add_lora` (or a request) registered this adapter; safe to call from any thread."""
        return self.adapters.is_registered(lora_id)

    def prefetch_lora(self, lora_request: LoRARequest, also_keep: Collection[int] = ()) -> None:
        """Read and validate an adapter into the host cache ahead of `add_lora` / `add_request`, so
        the step loop never waits on its disk read; `also_keep` (an adapter it replaces) is not
        evicted for it. Safe to call from any thread; a no-op with LoRA off (`add_request` says so)."""
        self.adapters.prefetch(lora_request, also_keep)

    def remove_lora(self, lora_id: int) -> bool:
        """Unregister an adapter: now if no request uses it, else once they finish (`lora_removed`
        completes then). False if it is not registered."""
        return self.adapters.remove(lora_id)

    def lora_removed(self, lora_id: int) -> concurrent.futures.Future[None]:
        """Completes once adapter `lora_id` is gone (at once unless its removal waits on requests)."""
        return self.adapters.removed(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep a registered adapter in a compute slot until removed; False if pinned already."""
        return self.adapters.manager().pin(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.adapters.list()

    def lora_digest(self, lora_id: int) -> str:
        """The content digest of a registered adapter (waits while it hashes; any thread); what
        `LoRARequest.version` prefixes. LoRAAdapterNotFoundError when it is not registered."""
        return self.adapters.manager().digest(lora_id)

    def lora_version_residency(self) -> dict[str, str]:
        """Version keys ("name@<12 digest digits>") -> "slot" or "host", every registered adapter in memory (any
        thread): what a replica reports to the router, which routes by version."""
        return self.adapters.version_residency()

    def lora_residency(self) -> dict[str, str]:
        """Adapter name -> its highest residency level, "slot" or "host", for every adapter in memory
        (any thread; what a replica reports to the adapter-affinity router)."""
        return self.adapters.residency()

    def stats(self) -> dict[str, Any]:
        """A snapshot for metrics (any thread); the keys are listed in `engine_stats.engine_stats`."""
        stats = engine_stats(
            self.scheduler,
            self.block_manager,
            self.step_failures.total,
            self.lora,
            self.iteration_tokens,
            self.cache_info,
            None
            if self.runner.images is None
            else {"images_received": self.images_received, **self.runner.images.stats()},
        )
        stats["num_request_failures"] = self.step_failures.requests_failed_alone
        if self.speculator is not None:
            stats["spec_decode"] = self.speculator.stats.snapshot()
        return stats


def _lora_manager(model: Any, config: EngineConfig) -> LoRAManager | None:
    """The engine's adapter manager; None with LoRA off. ValueError when the model has nothing to adapt."""
    if config.lora is None:
        return None
    from loraserve.lora.manager import LoRAManager
    from loraserve.lora.targets import LoRATargets

    if not LoRATargets.from_model(model).modules:
        raise ValueError(
            f"--enable-lora: {getattr(model, 'architecture_name', type(model).__name__)} "
            "has no module that can take a LoRA adapter (no linear layer but the vocab projection)."
        )
    return LoRAManager(model, config.lora, config.model.dtype, config.device)
