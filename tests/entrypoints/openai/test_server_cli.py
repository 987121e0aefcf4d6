"""The command line: flag parsing into EngineArgs, one-line errors, and a real `serve` process that
starts, registers --lora-modules (both spellings), answers the OpenAI client and stops on SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import fields
from typing import Any

import httpx
import openai
import pytest
import torch
from support.serve_process import CLI, ServeProcess

from loraserve.engine.arg_utils import EngineArgs
from loraserve.entrypoints.openai.cli.cli_args import parse_serve_args
from loraserve.entrypoints.openai.cli.cli_options import generated_flags
from loraserve.entrypoints.openai.cli.server_config import ServerConfig
from loraserve.entrypoints.openai.server.frontend_options import frontend_dests
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath
from loraserve.option_types import human_int


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_flags_map_to_engine_args() -> None:
    args = parse_serve_args(
        [
            "some/model",
            "--served-model-name",
            "a",
            "b",
            "--dtype",
            "float32",
            "--max-model-len",
            "4k",
            "--hf-overrides",
            '{"rope_theta": 5.0}',
            "--trust-remote-code",
            "--model-impl",
            "transformers",
            "--seed",
            "3",
            "--device",
            "cpu",
            "--max-num-seqs",
            "7",
            "--max-num-batched-tokens",
            "512",
            "--enable-lora",
            "--lora-modules",
            "x=/p/x",
            '{"name": "y", "path": "/p/y", "base_model_name": "b"}',
            "--lora-modules",
            "z=/p/z",
            "--max-loras",
            "2",
            "--max-cpu-loras",
            "5",
            "--max-lora-rank",
            "32",
            "--lora-dtype",
            "bfloat16",
            "--enable-lora-bias",
            "--block-size",
            "32",
            "--kv-cache-memory",
            "64MiB",
            "--no-enable-prefix-caching",
            "--max-queued-share",
            "0.25",
            "--queue-wait-timeout",
            "2",
            "--api-key",
            "k",
            "--port",
            "0",
        ]
    )
    assert args.lora_modules == [
        LoRAModulePath("x", "/p/x"),
        LoRAModulePath("y", "/p/y", "b"),
        LoRAModulePath("z", "/p/z"),
    ]
    engine_args = EngineArgs.from_cli_args(args)
    expected = dict(
        model="some/model",
        served_model_name=["a", "b"],
        dtype="float32",
        max_model_len=4000,
        hf_overrides={"rope_theta": 5.0},
        trust_remote_code=True,
        model_impl="transformers",
        seed=3,
        device="cpu",
        max_num_seqs=7,
        max_num_batched_tokens=512,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=5,
        max_lora_rank=32,
        lora_dtype="bfloat16",
        enable_lora_bias=True,
        block_size=32,
        kv_cache_memory_bytes=64 << 20,
        enable_prefix_caching=False,
        max_queued_share=0.25,
        queue_wait_timeout_s=2.0,
    )
    assert {k: getattr(engine_args, k) for k in expected} == expected
    assert [human_int(v) for v in ("4096", "8k", "8K", "1GiB", "1G", "2GB")] == [
        4096,
        8000,
        8192,
        1 << 30,
        1 << 30,
        2 * 10**9,
    ]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["serve", "m", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        (["serve", "m", "--hf-overrides", "{bad"], "invalid JSON"),
        (["serve", "m", "--enable-lora", "--lora-modules", "no-equals-sign"], "expected name=path"),
        (["serve", "m", "--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["serve", "m", "--max-num-seqs", "0"], "must be a positive integer"),
        (
            ["serve", "m", "--max-loras", "4", "--max-cpu-loras", "2"],
            "--max-cpu-loras (2) must be >= --max-loras (4)",
        ),
        (["serve", "m", "--dtype", "int3"], "invalid choice"),
        (
            ["serve", "m", "--max-logprobs", "-2"],
            "--max-logprobs must be >= 0 (or -1: the vocabulary size), got -2",
        ),
        (["serve", "m", "--port", "70000"], "--port must be in 0..65535, got 70000"),
        (["serve", "m", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules names 'a' twice"),
        (["serve", "m", "--max-queued-share", "0"], "must be more than 0 and at most 1"),
        (["serve", "m", "--queue-wait-timeout", "-1"], "must be a finite number of seconds >= 0"),
    ],
)
def test_bad_flags_are_one_line(argv: list[str], fragment: str, capsys: pytest.CaptureFixture) -> None:
    from loraserve.entrypoints.cli import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_bad_flag_in_a_process() -> None:
    result = run_cli("serve", "m", "--enable-lora", "--lora-modules", '{"name": "x"}')
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "'name' and 'path'" in result.stderr


def test_bad_model_is_one_line(
    tmp_path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraserve.entrypoints.openai.cli import launcher

    monkeypatch.setattr(launcher, "configure_logging", lambda: None)  # keep pytest's logging setup
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LORASERVE_PLUGINS", "")
    args = parse_serve_args([str(tmp_path / "no-such-model"), "--host", "127.0.0.1", "--port", "0"])
    assert launcher.serve_main(args, "loraserve serve") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("loraserve serve: error:") and "no-such-model" in err[0]
    assert "0x" not in err[0]


def test_unset_flags_keep_engine_defaults_and_every_flag_is_a_field() -> None:
    args = parse_serve_args(["some/model"])
    assert EngineArgs.from_cli_args(args) == EngineArgs(model="some/model")
    assert ServerConfig.from_cli_args(args) == ServerConfig()
    # A flag is read into EngineArgs, ServerConfig or FrontendOptions by its dest: one that names no
    # field would be silently dropped. vLLM flags without an effect here leave the namespace once checked.
    readers = {f.name for cls in (EngineArgs, ServerConfig) for f in fields(cls)} | frontend_dests()
    assert set(vars(args)) - readers == {"model_tag", "config"}


def test_the_demo_defaults_follow_the_flags_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a model the demo registers its adapters; its max_loras (all of them) yields to a smaller
    --max-cpu-loras and to --max-loras, and the engine's checks run on the result."""
    from loraserve.demo import run as demo_run
    from loraserve.entrypoints.openai.cli.launcher import use_demo_model

    adapters = {"a": "/p/a", "b": "/p/b", "c": "/p/c"}
    monkeypatch.setattr(
        demo_run, "demo_setup", lambda: demo_run.DemoSetup("/p/model", "demo", adapters, True)
    )

    def demo_engine_args(*flags: str) -> EngineArgs:
        args = parse_serve_args(list(flags))
        use_demo_model(args)
        return EngineArgs.from_cli_args(args)

    alone = demo_engine_args("--max-cpu-loras", "2")  # vLLM's max_loras default is 1; the demo's is 3
    assert (alone.enable_lora, alone.max_loras, alone.max_cpu_loras) == (True, 2, 2)
    assert (demo_engine_args().max_loras, demo_engine_args("--max-loras", "1").max_loras) == (3, 1)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(2\) must be >= max_loras \(3\)"):
        demo_engine_args("--max-loras", "3", "--max-cpu-loras", "2")


def test_served_model_names_give_the_engine_the_first(tiny_model: Any) -> None:
    args = parse_serve_args([tiny_model("llama"), "--served-model-name", "a", "b"])
    assert EngineArgs.from_cli_args(args).create_engine_config().model.served_model_name == "a"


def test_help_lists_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loraserve.entrypoints.openai.cli.launcher", "--help"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0
    flags = [name for _, option, _ in generated_flags(ServerConfig, EngineArgs) for name in option.flags]
    assert len(flags) > 40 and "--max-loras" in flags and "--kv-cache-memory-bytes" in flags
    for flag in [*flags, "--no-enable-prefix-caching", "--uds", "--config"]:
        assert flag in result.stdout, flag


def test_serve_process(tiny_model: Any, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter

    model_dir = tiny_model("llama")
    adapter = str(tmp_path / "sql")
    save_peft_adapter(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        adapter,
        7,
        model_dir,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
    )
    module_json = json.dumps({"name": "sql-json", "path": adapter, "base_model_name": "tiny"})
    flags = [
        model_dir,
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--kv-cache-memory",
        "16MiB",
        "--enable-lora",
        "--lora-modules",
        f"sql={adapter}",
        module_json,
        "--api-key",
        "secret",
    ]
    with ServeProcess(flags) as server:
        url = server.url
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "sql", "sql-json"} and cards["sql"].root == adapter
        result = client.completions.create(model="sql-json", prompt="The quick", max_tokens=3)
        assert result.usage.completion_tokens <= 3 and result.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(url + "/v1/models").status_code == 401
        status, output = server.stop()
    assert status == 0, output
    assert "sql (" in output and "Serving on http://127.0.0.1" in output and "Traceback" not in output


def test_a_dead_engine_ends_the_process_with_status_1(
    tokenizer: Any, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`loraserve serve` exits non-zero once its engine is dead, so that a supervisor restarts it."""
    from support.fake_engine import FakeEngine

    from loraserve.engine.async_engine import AsyncLLMEngine
    from loraserve.entrypoints.openai.cli import launcher

    engine = FakeEngine(tokenizer)
    engine.kill(RuntimeError("CUDA error: illegal memory access"))  # the engine dies while serving
    monkeypatch.setattr(AsyncLLMEngine, "from_engine_args", classmethod(lambda cls, args: engine))
    monkeypatch.setattr(launcher, "configure_logging", lambda: None)
    monkeypatch.setenv("LORASERVE_PLUGINS", "")
    args = parse_serve_args(["some-model", "--host", "127.0.0.1", "--port", "0"])
    status: list[int] = []
    serving = threading.Thread(
        target=lambda: status.append(launcher.serve_main(args, "loraserve serve")), daemon=True
    )
    serving.start()
    serving.join(30)  # a server that outlives its engine would still be serving here
    assert status == [1]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "EngineDeadError" in err[0] and "CUDA error" in err[0]
