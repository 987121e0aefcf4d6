"""The `serve` command line: vLLM's flag names, parsed into EngineArgs and ServerConfig.

The engine, server and front-end flags are generated from the option fields that declare them
(EngineArgs and the configs it shares, ServerConfig, FrontendOptions; see `cli_options.py`); vLLM's
flags without an effect here are in `vllm_compat.py`. The checks are the fields' own:
`check_serve_args` builds those dataclasses once the flags are read and reports what they refuse with
the flags' names. Nothing here imports torch or transformers, so `--help` and
flag errors are instant.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from loraserve import envs
from loraserve.engine.arg_utils import EngineArgs
from loraserve.entrypoints.openai.cli.cli_options import add_option_flags
from loraserve.entrypoints.openai.cli.server_config import ServerConfig
from loraserve.entrypoints.openai.cli.vllm_compat import (
    add_compat_args,
    check_compat_args,
    expand_config_file,
)
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.options import OptionError, cli_spellings

# The --help sections, in this order; each option field names its own.
_GROUPS = (
    "server",
    "model",
    "scheduler and cache",
    "LoRA",
    "model loading, tokenizer and sampling defaults",
    "structured outputs",
    "speculative decoding",
    "HTTP front end",
    "limits and shutdown",
    "Responses API",
    "replicas (Ray Serve)",
)
EPILOG = (
    "Environment: LORASERVE_ALLOW_RUNTIME_LORA_UPDATING=true enables /v1/load_lora_adapter, "
    "/v1/unload_lora_adapter and resolver plugins; LORASERVE_PLUGINS filters plugins; "
    "LORASERVE_LORA_RESOLVER_CACHE_DIR and LORASERVE_LORA_RESOLVER_HF_REPO_LIST configure the "
    "built-in resolvers; LORASERVE_API_KEY is the default --api-key (VLLM_* spellings accepted)."
)


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad flag as one line (plus a pointer to --help) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every `serve` flag, with vLLM's names and meanings."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Model folder or Hugging Face repo id. Omitted: the embedded demo model and its adapters.",
    )
    parser.add_argument("--model", default=None, help="Same as the positional MODEL.")
    groups = {title: parser.add_argument_group(title) for title in _GROUPS}
    add_option_flags(groups, ServerConfig, unset_is_none=False)
    add_option_flags(groups, EngineArgs, unset_is_none=True)
    add_option_flags(groups, FrontendOptions, unset_is_none=True)
    key = envs.get_env("API_KEY")
    parser.set_defaults(api_key=[key] if key else None)
    add_compat_args(parser)
    parser.add_argument(
        "--config", default=None, help="YAML file of flag: value pairs (flags given here win)."
    )


def make_serve_parser(prog: str = "loraserve serve") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog,
        description="Serve one base model and its LoRA adapters over an OpenAI-compatible HTTP API.",
        epilog=EPILOG,
    )
    add_serve_args(parser)
    return parser


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Cross-flag checks; reports through `parser.error` (one line, exit 2). vLLM flags that have no
    effect here print a one-line notice and leave `args`."""
    check_compat_args(parser, args)
    args.config = None  # read already (expand_config_file)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; give one of them")
    args.model = args.model or args.model_tag
    if args.lora_modules and not args.enable_lora and args.model is not None:
        parser.error("--lora-modules needs --enable-lora")
    check_options_of(parser, args)
    check_tool_parser(parser, args.tool_parser_plugin, args.tool_call_parser)
    if args.chat_template is not None:
        from loraserve.entrypoints.openai.server.frontend import load_chat_template

        try:
            load_chat_template(args.chat_template)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    return args


def check_options_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The option fields' own checks, on the flags given, as one-line errors with flag names. Without
    a model the demo's defaults are not applied yet: the engine's checks run when they are (launcher)."""
    try:
        ServerConfig.from_cli_args(args)
        FrontendOptions.from_cli_args(args)
        if args.model is not None:
            EngineArgs.from_cli_args(args)
    except OptionError as exc:
        parser.error(exc.with_names(cli_spellings(ServerConfig, FrontendOptions, EngineArgs)))


def check_tool_parser(parser: argparse.ArgumentParser, plugin: str | None, name: str | None) -> None:
    """--tool-parser-plugin imports (its errors in one line), and --tool-call-parser names a parser
    (vLLM's text otherwise)."""
    if not plugin and not name:
        return
    from loraserve.entrypoints.openai.tool_parsers.manager import ToolParserManager

    if plugin:
        try:
            ToolParserManager.import_tool_parser(plugin)
        except Exception as exc:  # whatever the plugin file raises: one line naming it
            parser.error(f"--tool-parser-plugin {plugin!r} failed to load: {type(exc).__name__}: {exc}")
    if name and name not in ToolParserManager.tool_parsers:
        parser.error(
            f"invalid tool call parser: {name} (chose from {{ {','.join(ToolParserManager.names())} }})"
        )


def parse_serve_args(argv: list[str] | None = None, prog: str = "loraserve serve") -> argparse.Namespace:
    parser = make_serve_parser(prog)
    argv = expand_config_file(sys.argv[1:] if argv is None else argv, parser)
    return check_serve_args(parser, parser.parse_args(argv))
