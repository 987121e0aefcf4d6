"""The offline API: `LLM(model, ...).generate(prompts, sampling_params, lora_request=...)` and `.chat(...)`."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, cast

from loraserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine
from loraserve.engine.tokenization import PromptInput
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loraserve.lora.request import LoRARequest


class LLM:
    """Generate with a base model and LoRA adapters in one process, batching all prompts together."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        """Engine options are the `EngineArgs` fields (`max_loras=4`, `dtype="float32"`, ...), with
        their defaults; vLLM keywords without an effect here (`gpu_memory_utilization=0.9`,
        `tensor_parallel_size=1`, ...) are accepted with a warning and refused (ValueError) when their
        value cannot be honoured; any other keyword is a TypeError."""
        from loraserve.entrypoints.openai.cli.vllm_compat import llm_engine_kwargs

        kwargs = llm_engine_kwargs(kwargs)
        # Offline, every prompt given is wanted: the queue limits that protect a server do not apply.
        kwargs.setdefault("max_num_queued_reqs", sys.maxsize)
        kwargs.setdefault("max_num_queued_tokens", sys.maxsize)
        args = EngineArgs.from_kwargs(model, kwargs)
        self.engine = LLMEngine.from_engine_args(args)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer  # None with skip_tokenizer_init

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling_params: the generation config's defaults (vLLM's)."""
        return SamplingParams(**self.engine.model_config.sampling_defaults)

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `priority` (vLLM's: one
        per prompt, lower first) needs scheduling_policy="priority" unless every value is 0."""
        prompt_list = _as_list(prompts)
        params_list = _aligned(sampling_params, len(prompt_list), "sampling_params") or [
            self.get_default_sampling_params()
        ] * len(prompt_list)
        lora_list = _aligned(lora_request, len(prompt_list), "lora_request") or [None] * len(prompt_list)
        priorities = _priorities(priority, len(prompt_list))
        for lora in {id(r): r for r in lora_list if r is not None}.values():
            self.engine.add_lora(lora)  # validate every adapter before queueing anything
        ids: list[str] = []
        try:
            for prompt, params, lora, level in zip(prompt_list, params_list, lora_list, priorities):
                request_id = str(next(self._request_counter))
                self.engine.add_request(request_id, prompt, params, lora, priority=level)
                ids.append(request_id)
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: Seq[PromptInput],
        params: BeamSearchParams,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the best `params.beam_width` beams of each prompt (a dict with
        "prompt" or "prompt_token_ids", a string or token ids), best first. Every prompt's beams run
        in the engine's shared batches; `concurrency_limit` (vLLM's) bounds how many prompts search
        at once."""
        prompt_list = [_prompt_input(p) for p in _as_list(prompts)]
        lora_list = _aligned(lora_request, len(prompt_list), "lora_request") or [None] * len(prompt_list)
        limit = concurrency_limit or len(prompt_list) or 1
        outputs: list[RequestOutput] = []
        for start in range(0, len(prompt_list), limit):
            chunk = slice(start, start + limit)
            outputs += self.generate(
                prompt_list[chunk],
                [params] * len(prompt_list[chunk]),  # type: ignore[list-item]
                lora_list[chunk],
                use_tqdm,
            )
        return [_beam_output(out, lora, self.get_tokenizer()) for out, lora in zip(outputs, lora_list)]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(finished) < len(ids):
                for output in self.engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            self.engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate. `tools` (OpenAI's
        tool definitions) reach the template as transformers' `apply_chat_template(tools=...)` takes them,
        as in vLLM's `LLM.chat`; the output is the model's text (a grammar in `sampling_params` can
        force calls, as the server's `tool_choice: "required"` does)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        processor = self.engine.mm_processor
        prompts: list[PromptInput] = []
        for conversation in conversations:
            rendered, urls = _image_messages(cast(list[dict[str, Any]], conversation))
            if urls and processor is None:
                raise ValueError(
                    f"The model ({self.engine.architecture}) takes text only: these messages hold images, "
                    "which it cannot read."
                )
            template = chat_template
            if template is None and not getattr(tokenizer, "chat_template", None) and processor is not None:
                template = getattr(processor.hf, "chat_template", None)  # a VLM's processor holds it
            kwargs: dict[str, Any] = dict(
                add_generation_prompt=add_generation_prompt,
                chat_template=template,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            if not urls:
                ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)
                prompts.append({"prompt_token_ids": list(ids)})
                continue
            assert processor is not None  # refused above
            if len(urls) > processor.images_per_prompt:
                raise ValueError(
                    f"At most {processor.images_per_prompt} image(s) may be provided in one prompt."
                )
            images = [load_image_sync(url, processor.limits) for url in urls]
            text = tokenizer.apply_chat_template(rendered, tokenize=False, **kwargs)
            mm = processor.process(str(text), images, add_special_tokens=False)
            prompts.append({"prompt_token_ids": mm.prompt_token_ids, "multi_modal_inputs": mm})
        return self.generate(prompts, sampling_params, lora_request, use_tqdm)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self.engine.pin_lora(lora_id)

    def lora_digest(self, lora_request: LoRARequest) -> str:
        """The content digest of an adapter (registering it first if needed): a `LoRARequest` with
        `version=` a prefix of it (8+ hex digits) runs only on that content."""
        self.engine.add_lora(lora_request)
        return self.engine.lora_digest(lora_request.lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()


def _image_messages(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation with each OpenAI `image_url` part as transformers' templates take it
    ({"type": "image"}), and the parts' URLs in order."""
    urls: list[str] = []
    rendered = []
    for message in conversation:
        content = message.get("content")
        if not isinstance(content, list) or not any(
            isinstance(p, dict) and p.get("type") == "image_url" for p in content
        ):
            rendered.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                value = part.get("image_url")
                url = value.get("url") if isinstance(value, dict) else value
                if not isinstance(url, str):
                    raise ValueError("an image_url part needs {'image_url': {'url': ...}}")
                urls.append(url)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, urls


def load_image_sync(url: str, limits: Any) -> Any:
    """One image URL (data:, file:// under the allowed path, http(s)) read and decoded, as the server
    reads them; a `MediaError` (a ValueError) says what is wrong."""
    from loraserve.multimodal.media import decode_image, fetch_http_sync, read_local_source, url_kind

    data = fetch_http_sync(url, limits) if url_kind(url) == "http" else read_local_source(url, limits)
    return decode_image(data, limits)


def _as_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single list of token ids
    return items


def _priorities(priority: Seq[int] | None, count: int) -> list[int]:
    if priority is None:
        return [0] * count
    if isinstance(priority, (str, bytes)) or not isinstance(priority, Seq):
        raise TypeError(f"priority must be a list of integers, one per prompt, got {priority!r}.")
    if len(priority) != count:  # vLLM's text
        raise ValueError(f"The lengths of prompts ({count}) and priority ({len(priority)}) must be the same.")
    if not all(isinstance(p, int) and not isinstance(p, bool) for p in priority):
        raise TypeError(f"priority must be a list of integers, one per prompt, got {list(priority)!r}.")
    return list(priority)


def _aligned(value: Any, count: int, name: str) -> list[Any] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{name} has {len(value)} entries but there are {count} prompts.")
        return list(value)
    return [value] * count


def _prompt_input(prompt: Any) -> PromptInput:
    """vLLM's TextPrompt / TokensPrompt dicts, or a bare string or token list."""
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
        return str(prompt["prompt"])
    return prompt  # type: ignore[no-any-return]


def _beam_output(output: RequestOutput, lora: LoRARequest | None, tokenizer: Any) -> BeamSearchOutput:
    """vLLM's result shape: each beam's tokens are the prompt's then its own, its text decodes them all."""
    sequences = []
    for beam in output.outputs:
        tokens = [*output.prompt_token_ids, *beam.token_ids]
        text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
        sequences.append(
            BeamSearchSequence(
                tokens=tokens,
                lora_request=lora,
                cum_logprob=beam.cumulative_logprob or 0.0,
                text=text,
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
            )
        )
    return BeamSearchOutput(sequences)
