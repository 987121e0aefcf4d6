"""Options declared once: a dataclass field carries its default, its help, its flag and its check.

`option(default, help=..., ...)` is a `dataclasses.field` whose metadata holds an `Option`. Whatever
needs the option reads it from the field: the `serve` flags are generated from these fields
(`entrypoints/openai/cli/cli_options.py`), `LLM(**kwargs)` takes exactly the fields, and `check_options`
runs the checks wherever such a dataclass is built. A check error names fields by their names; the
command line shows the same error with flag names (`OptionError.with_names`).

`shares_options(*configs)` gives a flat argument class (EngineArgs) the option fields of the configs
it builds, so that an option such as `max_loras` is written once, on `LoRAConfig`, and still is a
keyword and a flag of its own. Torch-free, so flag parsing never imports torch.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass
from typing import Any

_KEY = "loraserve.option"
# A cross-field check: (the object) -> an error message naming fields by their names, or None.
CrossCheck = Callable[[Any], "str | None"]


@dataclass(frozen=True, slots=True)
class Option:
    """How one field is offered to users; `flags` empty: the field is a keyword only (no flag)."""

    help: str
    flags: tuple[str, ...] = ()  # first is the name vLLM uses; the rest are aliases
    type: Callable[[str], Any] | None = None  # a flag's value parser (argparse `type`)
    choices: Sequence[str] | None = None
    nargs: str | None = None
    action: str | None = None  # "store_true" | "bool" (--x/--no-x) | "extend" | "append" | None
    metavar: str | None = None
    group: str = "engine"  # the --help section
    check: Callable[[Any], str | None] | None = None  # value -> what is wrong with it (after the name)


def option(
    default: Any = MISSING,
    *,
    help: str,
    flag: str | Sequence[str] | None = None,
    default_factory: Callable[[], Any] | None = None,
    **kwargs: Any,
) -> Any:
    """A dataclass field declaring one option. `flag`: its names ("--max-loras"; several for
    aliases); None derives it from the field name, "" declares a keyword-only option."""
    flags: tuple[str, ...] | None = (flag,) if isinstance(flag, str) else (tuple(flag) if flag else None)
    metadata = {_KEY: (flags, kwargs, help)}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def option_of(f: Field[Any]) -> Option | None:
    """The field's Option (flag names filled in from its name), or None for a plain field."""
    declared = f.metadata.get(_KEY)
    if declared is None:
        return None
    flags, kwargs, help_text = declared
    if flags is None:
        flags = ("--" + f.name.replace("_", "-"),)
    return Option(help=help_text, flags=tuple(name for name in flags if name), **kwargs)


def declared_options(cls: Any) -> Iterator[tuple[Field[Any], Option]]:
    """Each option field of a dataclass (class or instance), in declaration order."""
    for f in dataclasses.fields(cls):
        declared = option_of(f)
        if declared is not None:
            yield f, declared


def field_default(f: Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


class OptionError(ValueError):
    """A value an option cannot take; the message names fields by their names."""

    def __init__(self, message: str, names: Sequence[str]) -> None:
        super().__init__(message)
        self.names = tuple(names)

    def with_names(self, spelling: Mapping[str, str]) -> str:
        """The message with each named field spelled as `spelling` gives (its flag), without the
        trailing period (command-line errors are one clause)."""
        text = str(self)
        for name in sorted(self.names, key=len, reverse=True):
            if name in spelling:
                text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", spelling[name], text)
        return text.removesuffix(".")


def check_options(obj: Any) -> None:
    """Run every field check (on values that are set) and the class's cross checks
    (`__option_checks__`, each naming fields); the first problem raises OptionError."""
    names = [f.name for f in dataclasses.fields(obj)]
    for f, declared in declared_options(obj):
        value = getattr(obj, f.name)
        if declared.check is not None and value is not None:
            problem = declared.check(value)
            if problem is not None:
                raise OptionError(f"{f.name} {problem}", [f.name])
    for cross in getattr(type(obj), "__option_checks__", ()):
        problem = cross(obj)
        if problem is not None:
            raise OptionError(problem, [name for name in names if re.search(rf"\b{name}\b", problem)])


def at_least(low: int) -> Callable[[Any], str | None]:
    """A field check: the value is >= low."""
    return lambda value: None if value >= low else f"must be >= {low}, got {value}."


def shares_options(*configs: type) -> Callable[[type], type]:
    """Class decorator, applied under @dataclass: add each option field of `configs` (default, help,
    flag and check as declared there) after the class's own fields, and their cross checks."""

    def add(cls: Any) -> Any:
        annotations = cls.__dict__.get("__annotations__", {})
        for config in configs:
            for f, _ in declared_options(config):
                if f.name in annotations:
                    raise TypeError(f"{cls.__name__}.{f.name} is declared on {config.__name__} already")
                annotations[f.name] = f.type
                setattr(cls, f.name, _copy(f))
        cls.__annotations__ = annotations
        own = tuple(cls.__dict__.get("__option_checks__", ()))
        shared = tuple(check for config in configs for check in getattr(config, "__option_checks__", ()))
        cls.__option_checks__ = own + shared
        return cls

    return add


def _copy(f: Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def cli_spellings(*classes: Any) -> dict[str, str]:
    """field name -> its flag, over the option fields of `classes` (for `OptionError.with_names`)."""
    return {
        f.name: declared.flags[0]
        for cls in classes
        for f, declared in declared_options(cls)
        if declared.flags
    }
