"""loraserve.options: option fields, their checks, their flag spellings in errors, and sharing them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from loraserve.options import OptionError, at_least, check_options, cli_spellings, option, shares_options


def _ordered(obj: object) -> str | None:
    low, high = obj.low, obj.high  # type: ignore[attr-defined]
    return None if high is None or high >= low else f"high ({high}) must be >= low ({low})."


@dataclass(frozen=True)
class Limits:
    __option_checks__ = (_ordered,)

    low: int = option(1, check=at_least(1), help="Low.")
    high: int | None = option(None, flag=("--high", "-H"), help="High.")
    note: str = option("", flag="", help="A keyword-only option.")

    def __post_init__(self) -> None:
        check_options(self)


def test_checks_name_fields_and_errors_spell_them_as_flags() -> None:
    with pytest.raises(OptionError, match=r"^low must be >= 1, got 0\.$"):
        Limits(low=0)
    with pytest.raises(OptionError) as info:
        Limits(low=3, high=2)
    assert str(info.value) == "high (2) must be >= low (3)."
    assert info.value.with_names(cli_spellings(Limits)) == "--high (2) must be >= --low (3)"
    assert cli_spellings(Limits) == {"low": "--low", "high": "--high"}  # "note" has no flag


def test_shared_options_keep_default_help_and_checks() -> None:
    @dataclass
    @shares_options(Limits)
    class Args:
        name: str = "x"

    assert (Args().low, Args().high) == (1, None)
    with pytest.raises(OptionError, match="high"):
        check_options(Args(low=5, high=1))
    with pytest.raises(TypeError, match="declared on Limits already"):

        @shares_options(Limits)
        class Twice:
            low: int = 2
