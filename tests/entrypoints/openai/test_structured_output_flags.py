"""--structured-outputs-config and --guided-decoding-backend as vLLM spells them: a served backend
and the JSON whitespace rule reach the engine config; unavailable backends and unknown fields are
refused at start, in one line."""

from __future__ import annotations

from typing import Any

import pytest

from loraserve.entrypoints.openai.cli.cli_args import parse_serve_args


def test_flags_reach_the_engine_config(tiny_model: Any) -> None:
    from loraserve.engine.arg_utils import EngineArgs

    args = parse_serve_args(
        [
            tiny_model("llama"),
            "--structured-outputs-config",
            '{"backend": "xgrammar", "disable_any_whitespace": true}',
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config().structured_outputs
    assert (config.backend, config.disable_any_whitespace) == ("xgrammar", True)
    args = parse_serve_args([tiny_model("llama"), "--guided-decoding-backend", "auto"])
    config = EngineArgs.from_cli_args(args).create_engine_config().structured_outputs
    assert (config.backend, config.disable_any_whitespace) == ("auto", False)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--guided-decoding-backend", "guidance"], "structured outputs backend 'guidance'"),
        (["--guided-decoding-backend", "nonsense"], "invalid choice"),
        (["--structured-outputs-config", '{"backend": "outlines"}'], "structured outputs backend 'outlines'"),
        (["--structured-outputs-config", '{"colour": 1}'], "unknown field(s): colour"),
        (["--structured-outputs-config", '{"reasoning_parser": "deepseek_r1"}'], "reasoning parser"),
    ],
)
def test_unavailable_backends_are_refused_at_start(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture
) -> None:
    from loraserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "m", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_the_offline_api_refuses_them_too(tiny_model: Any) -> None:
    from loraserve.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="backend 'guidance'"):
        LLM(tiny_model("llama"), structured_outputs_config={"backend": "guidance"})
