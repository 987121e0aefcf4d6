"""vLLM command lines as they are: its compatibility flags, `--config` YAML files, `LLM(...)` keywords.

`add_compat_args` registers every flag of `vllm_flag_table.COMPAT_FLAGS` (with `=` forms, aliases and
`--no-` forms as vLLM spells them); their values never reach EngineArgs: `check_compat_args` removes
them from the namespace after printing a one-line notice for a harmless value, or failing with a
one-line error otherwise. `expand_config_file` turns `--config FILE` into flags placed before the
command line's own, so the command line wins, as in vLLM. `llm_engine_kwargs` applies the same table
to keyword arguments of `LLM(...)` (`gpu_memory_utilization=0.9` is accepted there too).
Nothing here imports torch: `--help` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from loraserve.entrypoints.openai.cli.vllm_flag_table import COMPAT_FLAGS, CompatFlag

logger = logging.getLogger(__name__)

_DEST_PREFIX = "vllm_compat__"
_BY_DEST = {flag.dest: flag for flag in COMPAT_FLAGS}


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM flags accepted for compatibility",
        "Accepted so that vLLM command lines run unchanged: [works] its meaning holds here already, [notice] "
        "accepted with a notice for harmless values, [refused] a clear error.",
    )
    for flag in COMPAT_FLAGS:
        kwargs: dict[str, Any] = {
            "dest": _DEST_PREFIX + flag.dest,
            "default": argparse.SUPPRESS,
            "help": f"[{flag.kind}] {flag.note}",
        }
        if flag.takes == "flag":
            kwargs["action"] = "store_true"
        elif flag.takes == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif flag.takes == "values":
            kwargs["nargs"] = "+"
        group.add_argument(*flag.names, **kwargs)


def _shown(flag: CompatFlag, value: Any) -> str:
    name = flag.names[0]
    if flag.takes == "flag":
        return name
    if flag.takes == "bool":
        return name if value else "--no-" + name[2:]
    values = value if isinstance(value, list) else [value]
    return " ".join([name, *map(str, values)])


def compat_problem(flag: CompatFlag, value: Any) -> str | None:
    """Why `value` cannot be honoured (a one-line error), or None when it is harmless."""
    if value is None:  # LLM(quantization=None): vLLM's own "off"
        return None
    shown = _shown(flag, value)
    if flag.kind == "refused" and not (flag.takes == "bool" and value is False):
        return f"{shown} is not supported: {flag.note}"
    values = value if isinstance(value, list) else [value]
    if flag.kind == "notice" and flag.harmless is not None and not all(flag.harmless(v) for v in values):
        return f"{shown} cannot be honoured: {flag.note}"
    return None


def check_compat_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Notice or refuse each compatibility flag given, then drop it from `args`."""
    for flag in COMPAT_FLAGS:
        dest = _DEST_PREFIX + flag.dest
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        delattr(args, dest)
        problem = compat_problem(flag, value)
        if problem is not None:
            parser.error(problem)
        if flag.kind != "works":
            print(f"{parser.prog}: notice: {_shown(flag, value)} has no effect here: {flag.note}", file=sys.stderr)


def classify(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option string of `parser` -> "works" | "notice" | "refused" (the table test's view)."""
    kinds = {name: flag.kind for flag in COMPAT_FLAGS for name in flag.names}
    result = {}
    for action in parser._actions:
        for option in action.option_strings:
            result[option] = kinds.get(option, "works")
    return result


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--config FILE`: the YAML mapping's `key: value` pairs as flags, after the subcommand and model and
    before every other flag, so that flags on the command line win (vLLM's order)."""
    index = next((i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")), None)
    if index is None:
        return argv
    if argv[index] == "--config":
        if index + 1 >= len(argv):
            parser.error("--config needs a YAML file")
        path, rest = argv[index + 1], argv[:index] + argv[index + 2 :]
    else:
        path, rest = argv[index].partition("=")[2], argv[:index] + argv[index + 1 :]
    start = 0
    while start < len(rest) and not rest[start].startswith("-"):
        start += 1  # the subcommand ("serve") and the positional model stay first
    return rest[:start] + _config_flags(path, parser) + rest[start:]


def _config_flags(path: str, parser: argparse.ArgumentParser) -> list[str]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {' '.join(str(exc).split())}")
    if not isinstance(config, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    flags: list[str] = []
    for key, value in config.items():
        name = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(name)
        elif value is False:
            if "--no-" + name[2:] in parser._option_string_actions:
                flags.append("--no-" + name[2:])
        elif isinstance(value, list):
            flags += [name, *map(str, value)]
        elif isinstance(value, dict):
            import json

            flags += [name, json.dumps(value)]
        elif value is not None:
            flags += [name, str(value)]
    return flags


def llm_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`LLM(**kwargs)`: a vLLM keyword of the compatibility table is dropped with a warning when harmless
    and refused (ValueError) otherwise; every other keyword goes to EngineArgs as it is."""
    from dataclasses import fields

    from loraserve.engine.arg_utils import EngineArgs

    known = {f.name for f in fields(EngineArgs)}
    kept = {}
    for key, value in kwargs.items():
        flag = _BY_DEST.get(key)
        if key in known or flag is None:
            kept[key] = value
            continue
        problem = compat_problem(flag, value)
        if problem is not None:
            raise ValueError(f"{key}={value!r}: {problem.partition(': ')[2]}")
        if flag.kind != "works":
            logger.warning("%s=%r has no effect here: %s", key, value, flag.note)
    return kept
