"""`loraserve serve`'s parser on vLLM's flags, by class (the table of classes is test_vllm_flags.py):
harmless values print one notice and never reach the engine, values that cannot be honoured are
one-line errors, working flags reach EngineArgs and the front-end options, a --config file is read
before the command line, `LLM` takes vLLM's keywords, and parsing never imports torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraserve.entrypoints.openai.cli.cli_args import parse_serve_args


def parse(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[Any, list[str]]:
    args = parse_serve_args(["some/model", *argv])
    return args, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "argv, notice",
    [
        (
            ["--gpu-memory-utilization", "0.9"],
            "--gpu-memory-utilization 0.9 has no effect here: the KV cache",
        ),
        (["--gpu-memory-utilization=1"], "--gpu-memory-utilization 1 has no effect here"),
        (["--tensor-parallel-size", "1"], "--tensor-parallel-size 1 has no effect here: loraserve runs"),
        (["-tp=1"], "--tensor-parallel-size 1 has no effect here"),
        (["--enforce-eager"], "--enforce-eager has no effect here: loraserve always runs eagerly"),
        (["--swap-space", "16"], "--swap-space 16 has no effect here: preempted sequences are recomputed"),
        (["--disable-frontend-multiprocessing"], "--disable-frontend-multiprocessing has no effect here"),
        (["--no-enable-sleep-mode"], "--no-enable-sleep-mode has no effect here"),
        (["-O3"], "--compilation-config 3 has no effect here"),
        (["--disable-log-requests", "--disable-log-stats"], None),  # their meaning holds: no notice
    ],
)
def test_harmless_flags_print_one_notice(
    argv: list[str], notice: str | None, capsys: pytest.CaptureFixture
) -> None:
    args, err = parse(argv, capsys)
    assert err == ([] if notice is None else [err[0]]) and (notice is None or notice in err[0])
    assert not [name for name in vars(args) if name.startswith("vllm_compat")]  # they never reach the engine


@pytest.mark.parametrize(
    "argv, error",
    [
        (
            ["--tensor-parallel-size", "2"],
            "--tensor-parallel-size 2 cannot be honoured: loraserve runs the whole model",
        ),
        (["--gpu-memory-utilization=1.5"], "--gpu-memory-utilization 1.5 cannot be honoured"),
        (["--quantization", "awq"], "--quantization 'awq' is not served; loraserve quantizes"),
        (
            ["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
            "--speculative-config is not valid: speculative method 'eagle' needs trained heads",
        ),
        (
            ["--speculative-model", "draft"],
            "--speculative-model draft is not supported: vLLM < 0.11's spelling: use --speculative-config",
        ),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
        (
            ["--enable-auto-tool-choice", "--tool-call-parser", "hermez"],
            "invalid tool call parser: hermez (chose from { hermes,llama3_json,mistral,pythonic })",
        ),
        (
            ["--tool-parser-plugin", "no/such/plugin.py"],
            "--tool-parser-plugin 'no/such/plugin.py' failed to load",
        ),
        (["--tool-server", "localhost:1"], "--tool-server localhost:1 is not supported: tool servers"),
        (["--kv-cache-dtype", "fp8_inc"], "--kv-cache-dtype 'fp8_inc' is not served (Intel Gaudi's fp8"),
        (["--tokenizer-mode", "mistral"], "invalid choice: 'mistral'"),
        (["--load-format", "tensorizer"], "invalid choice: 'tensorizer'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--chat-template", "no/such/file.jinja"], "neither a file nor a Jinja template"),
    ],
)
def test_values_that_cannot_be_honoured_are_one_line_errors(
    argv: list[str], error: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as info:
        parse(argv, capsys)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and error in err[0], err


def test_working_flags_reach_engine_args_and_frontend(capsys: pytest.CaptureFixture) -> None:
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.entrypoints.openai.server.frontend import FrontendOptions

    args, _ = parse(
        [
            "--revision",
            "v2",
            "--tokenizer-mode=slow",
            "--tokenizer-revision",
            "t1",
            "--config-format",
            "hf",
            "--load-format",
            "safetensors",
            "--download-dir",
            "/d",
            "--skip-tokenizer-init",
            "--max-logprobs",
            "40",
            "--generation-config",
            "vllm",
            "--override-generation-config",
            '{"temperature": 0.2}',
            "--no-enable-chunked-prefill",
            "--rope-theta",
            "5e5",
            "--rope-scaling",
            '{"rope_type": "linear", "factor": 2}',
            "--num-gpu-blocks-override",
            "64",
            "--kv-cache-memory-bytes",
            "2GiB",
            "--kv-cache-dtype",
            "fp8_e5m2",
            "--model-impl",
            "vllm",
            "--api-key",
            "k1",
            "k2",
            "--allowed-origins",
            '["https://a.example"]',
            "--allow-credentials",
            "--root-path",
            "/api",
            "--response-role",
            "bot",
            "--uds",
            "/tmp/s.sock",
            "--ssl-certfile",
            "c.pem",
            "--ssl-keyfile",
            "k.pem",
            "--uvicorn-log-level",
            "warning",
            "--middleware",
            "a.b",
            "--middleware",
            "c.d",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "pythonic",
            "--exclude-tools-when-tool-choice-none",
        ],
        capsys,
    )
    engine = EngineArgs.from_cli_args(args)
    assert (engine.revision, engine.tokenizer_mode, engine.tokenizer_revision, engine.load_format) == (
        "v2",
        "slow",
        "t1",
        "safetensors",
    )
    assert (
        engine.download_dir,
        engine.skip_tokenizer_init,
        engine.max_logprobs,
        engine.generation_config,
    ) == ("/d", True, 40, "vllm")
    assert (
        engine.override_generation_config == {"temperature": 0.2} and engine.enable_chunked_prefill is False
    )
    assert engine._hf_overrides() == {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2}}
    assert (engine.num_kv_blocks, engine.kv_cache_memory_bytes, engine.model_impl) == (64, 2 << 30, "vllm")
    assert engine.kv_cache_dtype == "fp8_e5m2"
    assert args.api_key == ["k1", "k2"]
    front = FrontendOptions.from_cli_args(args)
    assert front.allowed_origins == ("https://a.example",) and front.allow_credentials
    assert (
        front.enable_auto_tool_choice,
        front.tool_call_parser,
        front.exclude_tools_when_tool_choice_none,
    ) == (
        True,
        "pythonic",
        True,
    )
    assert (front.root_path, front.response_role, front.uds, front.uvicorn_log_level) == (
        "/api",
        "bot",
        "/tmp/s.sock",
        "warning",
    )
    assert front.middleware == ("a.b", "c.d")


def test_config_file_flags_come_first_so_the_command_line_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "model: from/yaml\nport: 7001\nmax_model_len: 512\nenable-prefix-caching: false\n"
        "served-model-name: [a, b]\ntensor-parallel-size: 1\nhf-overrides: {rope_theta: 3.0}\n"
    )
    args = parse_serve_args(["--config", str(config), "--port", "7002"])
    assert (args.model, args.port, args.max_model_len, args.enable_prefix_caching) == (
        "from/yaml",
        7002,
        512,
        False,
    )
    assert args.served_model_name == ["a", "b"] and args.hf_overrides == {"rope_theta": 3.0}
    assert "--tensor-parallel-size 1 has no effect here" in capsys.readouterr().err


def test_llm_takes_vllm_keywords(tiny_model: Any, caplog: pytest.LogCaptureFixture) -> None:
    from loraserve import LLM

    llm = LLM(
        tiny_model("llama"),
        dtype="float32",
        gpu_memory_utilization=0.8,
        tensor_parallel_size=1,
        enforce_eager=True,
        disable_log_stats=True,
        quantization=None,
        max_num_seqs=8,
    )
    assert llm.engine.config.scheduler.max_num_seqs == 8
    assert "gpu_memory_utilization=0.8 has no effect here" in caplog.text
    with pytest.raises(
        ValueError, match="tensor_parallel_size=4: loraserve runs the whole model on one device"
    ):
        LLM(tiny_model("llama"), tensor_parallel_size=4)
    with pytest.raises(TypeError):
        LLM(tiny_model("llama"), no_such_option=1)


def test_flag_parsing_never_imports_torch() -> None:
    code = (
        "import sys; from loraserve.entrypoints.openai.cli.cli_args import parse_serve_args; "
        "parse_serve_args(['m', '--gpu-memory-utilization', '0.9', '-tp', '1', '--allowed-origins', '[\"*\"]']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
