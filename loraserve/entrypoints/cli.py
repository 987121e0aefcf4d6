"""The `loraserve` command: `serve` (the OpenAI-compatible server) and `demo` (offline generations).

Imports stay lazy so `loraserve --help` and flag errors answer instantly.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from loraserve import __version__
from loraserve.entrypoints.openai.cli_args import OneLineErrorParser, add_serve_args, check_serve_args

DEMO_PROMPTS = ["The quick brown fox", "SELECT name, count(*) FROM", "Bonjour, comment"]


def make_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `loraserve` parser and its `serve` subparser (which reports cross-flag errors)."""
    parser = OneLineErrorParser(
        prog="loraserve", description="Serve one base LLM and many LoRA adapters in shared batches."
    )
    parser.add_argument("--version", action="version", version=f"loraserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineErrorParser)
    serve = commands.add_parser(
        "serve",
        help="Start the OpenAI-compatible server.",
        description="Serve one base model and its LoRA adapters over an OpenAI-compatible HTTP API. "
        "Without MODEL, the embedded demo model and its adapters are served.",
        epilog="Environment: LORASERVE_ALLOW_RUNTIME_LORA_UPDATING=true enables /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter and resolver plugins; LORASERVE_PLUGINS filters plugins; "
        "LORASERVE_LORA_RESOLVER_CACHE_DIR and LORASERVE_LORA_RESOLVER_HF_REPO_LIST configure the "
        "built-in resolvers; LORASERVE_API_KEY is the default --api-key (VLLM_* spellings accepted).",
    )
    add_serve_args(serve)
    demo = commands.add_parser(
        "demo",
        help="Build the demo model and adapters, and print a few generations.",
        description="Build (once) the embedded demo model and its PEFT adapters, then generate greedily "
        "for a few prompts with the base model and every adapter, all in shared batches.",
    )
    demo.add_argument(
        "--max-tokens", type=int, default=16, help="Tokens to generate per prompt (default 16)."
    )
    demo.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto).")
    demo.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="A prompt to use (repeatable; default: three samples).",
    )
    return parser, serve


async def run_demo(args: argparse.Namespace) -> None:
    from loraserve.demo import build_demo
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine
    from loraserve.lora.request import LoRARequest
    from loraserve.sampling_params import SamplingParams

    paths = build_demo()
    print(f"Demo model: {paths.model_dir} (random weights: the text is noise by design; what matters is that")
    print("the base model and every adapter run in one shared batch and each gives its own output)")
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=paths.model_dir, device=args.device, enable_lora=True, max_loras=len(paths.adapters))
    )
    await engine.start()
    try:
        adapters: list[LoRARequest | None] = [None]
        for lora_int_id, (name, path) in enumerate(paths.adapters.items(), start=1):
            lora_request = LoRARequest(lora_name=name, lora_int_id=lora_int_id, lora_path=path)
            await engine.add_lora(lora_request)
            adapters.append(lora_request)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        prompts = args.prompt or DEMO_PROMPTS
        jobs = [(lora, prompt) for lora in adapters for prompt in prompts]
        texts = await asyncio.gather(
            *(_generate(engine, prompt, params, f"demo-{i}", lora) for i, (lora, prompt) in enumerate(jobs))
        )
        for (lora, prompt), text in zip(jobs, texts, strict=True):
            label = lora.lora_name if lora is not None else "base"
            print(f"[{label:>12}] {prompt!r} -> {text!r}")
    finally:
        await engine.shutdown()


async def _generate(engine: object, prompt: str, params: object, request_id: str, lora: object) -> str:
    text = ""
    async for output in engine.generate(prompt, params, request_id, lora_request=lora):  # type: ignore[attr-defined]
        text = output.outputs[0].text
    return text


def main(argv: list[str] | None = None) -> int:
    parser, serve_parser = make_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "serve":
        from loraserve.entrypoints.openai.launcher import serve_main

        check_serve_args(serve_parser, args)
        return serve_main(args, "loraserve serve")
    from loraserve.entrypoints.openai.launcher import configure_logging, one_line

    configure_logging()
    try:
        asyncio.run(run_demo(args))
    except Exception as exc:
        print(f"loraserve demo: error: {one_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
