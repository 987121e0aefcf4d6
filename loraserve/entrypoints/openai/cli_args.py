"""The `serve` command line: vLLM's flag names, parsed into EngineArgs and ServerOptions.

An engine flag's dest is the name of its `EngineArgs` field, which `EngineArgs.from_cli_args` reads;
the server flags (host, port, api key, adapters to register) go to the launcher. Nothing here imports
torch or transformers, so `--help` and flag errors are instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from loraserve import envs
from loraserve.entrypoints.openai.cli_limit_args import add_limit_args
from loraserve.entrypoints.openai.cli_replica_args import add_replica_args
from loraserve.entrypoints.openai.cli_types import positive_int
from loraserve.entrypoints.openai.cli_vllm_args import (
    add_vllm_engine_args,
    add_vllm_frontend_args,
    check_vllm_args,
)
from loraserve.entrypoints.openai.serving_models import LoRAModulePath
from loraserve.entrypoints.openai.vllm_compat import add_compat_args, check_compat_args, expand_config_file

_DTYPES = ["auto", "float32", "float", "fp32", "bfloat16", "bf16", "float16", "half", "fp16"]


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad flag as one line (plus a pointer to --help) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {exc.msg}") from exc
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def lora_module(value: str) -> LoRAModulePath:
    """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}`."""
    value = value.strip()
    if value.startswith("{"):
        data = json_object(value)
        unknown = set(data) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
            raise argparse.ArgumentTypeError(
                f"a JSON --lora-modules entry needs string 'name' and 'path' (optional 'base_model_name') "
                f"and nothing else, got {value!r}"
            )
        if not data["name"] or not data["path"]:
            raise argparse.ArgumentTypeError(f"name and path must not be empty in {value!r}")
        return LoRAModulePath(data["name"], data["path"], data.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {value!r}")
    return LoRAModulePath(name.strip(), path.strip())


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
    _add_server_args(parser.add_argument_group("server"))
    _add_model_args(parser.add_argument_group("model"))
    _add_scheduler_args(parser.add_argument_group("scheduler and cache"))
    _add_lora_args(parser.add_argument_group("LoRA"))
    add_vllm_engine_args(parser.add_argument_group("model loading, tokenizer and sampling defaults"))
    add_vllm_frontend_args(parser.add_argument_group("HTTP front end"))
    add_compat_args(parser)
    parser.add_argument("--config", default=None, help="YAML file of flag: value pairs (flags given here win).")
    add_limit_args(parser.add_argument_group("limits and shutdown"))
    add_replica_args(parser.add_argument_group("replicas (Ray Serve)"))


def _add_server_args(server: Any) -> None:
    server.add_argument("--host", default="0.0.0.0", help="Interface to listen on (default: all interfaces).")
    server.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default: 8000).")
    key = envs.get_env("API_KEY")
    server.add_argument(
        "--api-key",
        nargs="+",
        default=[key] if key else None,
        help="Require 'Authorization: Bearer KEY' (any of the keys given) on every route but /health "
        "(default: $LORASERVE_API_KEY).",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Let requests bring their own chat template (chat_template, chat_template_kwargs.chat_template); "
        "off by default, since a template is code the server runs.",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Name(s) clients use in the 'model' field (default: MODEL as given). The first one is reported.",
    )


def _add_model_args(model: Any) -> None:
    model.add_argument(
        "--tokenizer",
        default=None,
        help="Tokenizer folder or hub id (default: the model's; for GGUF, the one in its metadata).",
    )
    model.add_argument(
        "--hf-config-path",
        default=None,
        help="config.json (or its folder) to use for a GGUF model instead of the file's metadata.",
    )
    model.add_argument(
        "--dtype",
        default="auto",
        choices=_DTYPES,
        help="Weight and activation dtype (default: auto = the checkpoint's, fp32 on CPUs without bf16).",
    )
    model.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="Longest prompt + completion in tokens, e.g. 2048 or 4k (default: from the config).",
    )
    model.add_argument(
        "--hf-overrides",
        type=json_object,
        default=None,
        help="JSON object of model config overrides, e.g. '{\"rope_theta\": 20000}'.",
    )
    model.add_argument(
        "--trust-remote-code", action="store_true", help="Allow custom code from the model repo."
    )
    model.add_argument(
        "--model-impl",
        default="auto",
        choices=["auto", "native", "vllm", "transformers"],
        help="auto: native implementation when there is one (vllm = native), else the transformers fallback.",
    )
    model.add_argument("--seed", type=int, default=0, help="Random seed for sampling (default: 0).")
    model.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto).")


def _add_scheduler_args(sched: Any) -> None:
    sched.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=128,
        help="Most sequences in one batch (default: %(default)s).",
    )
    sched.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=2048,
        help="Most tokens processed in one engine step, prefill chunks included (default: %(default)s).",
    )
    sched.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="Tokens per KV-cache block (default: %(default)s).",
    )
    sched.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory_bytes",
        metavar="KV_CACHE_MEMORY",
        type=positive_int,
        default=1 << 30,
        help="Bytes for the KV cache, e.g. 512MiB or 4GiB (default: 1GiB).",
    )
    sched.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Reuse KV blocks of shared prompt prefixes (keyed by adapter too).",
    )


def _add_lora_args(lora: Any) -> None:
    lora.add_argument(
        "--enable-lora", action=argparse.BooleanOptionalAction, default=False, help="Serve LoRA adapters."
    )
    lora.add_argument(
        "--lora-modules",
        type=lora_module,
        nargs="+",
        action="extend",
        default=[],
        help="Adapters to register at startup: name=path or a JSON object "
        '{"name": ..., "path": ..., "base_model_name": ...}; several allowed.',
    )
    lora.add_argument(
        "--max-loras",
        type=positive_int,
        default=None,
        help="Adapters usable in one batch (default: 1; for the demo model, all of its adapters).",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=None,
        help="Adapters kept in host memory (default: --max-loras).",
    )
    lora.add_argument(
        "--max-lora-rank",
        type=positive_int,
        default=16,
        help="Largest adapter rank accepted (default: %(default)s).",
    )
    lora.add_argument(
        "--lora-dtype",
        default="auto",
        choices=_DTYPES,
        help="Adapter weight dtype (default: auto = the model's).",
    )
    lora.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="Put LoRA only on these modules (e.g. o_proj qkv_proj); adapters' weights for others are "
        "skipped with a warning (default: every LoRA-capable module).",
    )
    lora.add_argument("--enable-lora-bias", action="store_true", help="Accept adapters with bias terms.")


def make_serve_parser(prog: str = "loraserve serve") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog,
        description="Serve one base model and its LoRA adapters over an OpenAI-compatible HTTP API.",
        epilog="Environment: LORASERVE_ALLOW_RUNTIME_LORA_UPDATING=true enables /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter and resolver plugins; LORASERVE_PLUGINS filters plugins; "
        "LORASERVE_LORA_RESOLVER_CACHE_DIR and LORASERVE_LORA_RESOLVER_HF_REPO_LIST configure the "
        "built-in resolvers (VLLM_* spellings accepted).",
    )
    add_serve_args(parser)
    return parser


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Cross-flag checks; reports through `parser.error` (one line, exit 2). vLLM flags that have no
    effect here print a one-line notice and leave `args`."""
    check_compat_args(parser, args)
    check_vllm_args(parser, args)
    args.config = None  # read already (expand_config_file)
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; give one of them")
    args.model = args.model or args.model_tag
    if args.lora_modules and not args.enable_lora and args.model is not None:
        parser.error("--lora-modules needs --enable-lora")
    max_loras = args.max_loras or 1
    if args.max_cpu_loras is not None and args.max_cpu_loras < max_loras:
        parser.error(f"--max-cpu-loras ({args.max_cpu_loras}) must be >= --max-loras ({max_loras})")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    seen: set[str] = set()
    for module in args.lora_modules:
        if module.name in seen:
            parser.error(f"--lora-modules names {module.name!r} twice")
        seen.add(module.name)
    return args


def parse_serve_args(argv: list[str] | None = None, prog: str = "loraserve serve") -> argparse.Namespace:
    parser = make_serve_parser(prog)
    argv = expand_config_file(sys.argv[1:] if argv is None else argv, parser)
    return check_serve_args(parser, parser.parse_args(argv))
