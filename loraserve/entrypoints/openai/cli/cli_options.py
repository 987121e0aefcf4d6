"""The `serve` flags generated from option fields (`loraserve.options`): names, aliases, value type,
choices, help and default all come from the field that declares the option.

A flag of an EngineArgs or FrontendOptions field defaults to None in the namespace ("not given"), so that the field's own
default applies and the demo can tell what the user set; a flag of a ServerConfig field defaults to the
field's default, since the launcher reads those from the namespace directly.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from typing import Any

from loraserve.options import Option, declared_options, field_default

_ACTIONS: Mapping[str | None, Any] = {
    "store_true": "store_true",
    "bool": argparse.BooleanOptionalAction,
    "extend": "extend",
    "append": "append",
    None: "store",
}


def generated_flags(*classes: Any) -> Iterator[tuple[str, Option, Any]]:
    """(field name, Option, default) of each option of `classes` that has a flag."""
    for cls in classes:
        for f, declared in declared_options(cls):
            if declared.flags:
                yield f.name, declared, field_default(f)


def add_option_flags(groups: Mapping[str, Any], cls: Any, *, unset_is_none: bool) -> None:
    """Add a flag for each option field of `cls` to the argument group its Option names."""
    for name, declared, default in generated_flags(cls):
        kwargs: dict[str, Any] = {
            "dest": name,
            "action": _ACTIONS[declared.action],
            "default": None if unset_is_none else default,
            # %(default)s in a help text is the field's default, whatever the namespace's default is.
            "help": declared.help.replace("%(default)s", str(default)) or None,
        }
        for key in ("type", "choices", "nargs", "metavar"):
            value = getattr(declared, key)
            if value is not None:
                kwargs[key] = list(value) if key == "choices" else value
        groups[declared.group].add_argument(*declared.flags, **kwargs)
