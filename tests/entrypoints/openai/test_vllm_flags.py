"""Every `vllm serve` flag, as vLLM v0.11 defines it (vllm/engine/arg_utils.py EngineArgs and
AsyncEngineArgs, vllm/entrypoints/openai/cli/cli_args.py FrontendArgs and make_arg_parser), with its class
here: "works", "notice" (accepted with a one-line notice when harmless) or "refused" (a one-line
error). The table below is the contract: a flag that disappears or changes class fails this test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraserve.entrypoints.openai.cli.cli_args import make_serve_parser, parse_serve_args
from loraserve.entrypoints.openai.cli.vllm_compat import classify

W, N, R = "works", "notice", "refused"
VLLM_0_11_FLAGS: dict[str, str] = {
    # make_arg_parser and FrontendArgs
    "--headless": R,
    "--api-server-count": N,
    "-asc": N,
    "--config": W,
    "--host": W,
    "--port": W,
    "--uds": W,
    "--uvicorn-log-level": W,
    "--disable-uvicorn-access-log": W,
    "--allow-credentials": W,
    "--allowed-origins": W,
    "--allowed-methods": W,
    "--allowed-headers": W,
    "--api-key": W,
    "--lora-modules": W,
    "--chat-template": W,
    "--chat-template-content-format": W,
    "--trust-request-chat-template": W,
    "--response-role": W,
    "--ssl-keyfile": W,
    "--ssl-certfile": W,
    "--ssl-ca-certs": W,
    "--enable-ssl-refresh": R,
    "--ssl-cert-reqs": W,
    "--root-path": W,
    "--middleware": W,
    "--return-tokens-as-token-ids": W,
    "--disable-frontend-multiprocessing": N,
    "--enable-request-id-headers": W,
    "--enable-auto-tool-choice": W,
    "--exclude-tools-when-tool-choice-none": W,
    "--tool-call-parser": W,
    "--tool-parser-plugin": W,
    "--tool-server": R,
    "--log-config-file": W,
    "--max-log-len": N,
    "--disable-fastapi-docs": W,
    "--enable-prompt-tokens-details": W,
    "--enable-server-load-tracking": W,
    "--enable-force-include-usage": R,
    "--enable-tokenizer-info-endpoint": W,
    "--enable-log-outputs": N,
    "--h11-max-incomplete-event-size": W,
    "--h11-max-header-count": N,
    "--log-error-stack": N,
    "--tokens-only": R,
    "--enable-log-requests": N,
    "--disable-log-requests": W,
    # ModelConfig
    "--model": W,
    "--runner": N,
    "--convert": N,
    "--task": N,
    "--tokenizer": W,
    "--tokenizer-mode": W,
    "--trust-remote-code": W,
    "--dtype": W,
    "--seed": W,
    "--hf-config-path": W,
    "--allowed-local-media-path": N,
    "--allowed-media-domains": N,
    "--revision": W,
    "--code-revision": R,
    "--rope-scaling": W,
    "--rope-theta": W,
    "--tokenizer-revision": W,
    "--max-model-len": W,
    "--quantization": W,
    "-q": W,
    "--enforce-eager": N,
    "--max-logprobs": W,
    "--logprobs-mode": N,
    "--disable-sliding-window": R,
    "--disable-cascade-attn": N,
    "--skip-tokenizer-init": W,
    "--enable-prompt-embeds": R,
    "--served-model-name": W,
    "--config-format": W,
    "--hf-token": R,
    "--hf-overrides": W,
    "--pooler-config": R,
    "--override-pooler-config": R,
    "--logits-processor-pattern": N,
    "--generation-config": W,
    "--override-generation-config": W,
    "--enable-sleep-mode": R,
    "--model-impl": W,
    "--override-attention-dtype": R,
    "--logits-processors": R,
    "--io-processor-plugin": R,
    # LoadConfig
    "--load-format": W,
    "--download-dir": W,
    "--safetensors-load-strategy": N,
    "--model-loader-extra-config": R,
    "--ignore-patterns": N,
    "--use-tqdm-on-load": N,
    "--pt-load-map-location": N,
    # StructuredOutputsConfig
    "--reasoning-parser": R,
    "--guided-decoding-backend": W,
    "--guided-decoding-disable-fallback": N,
    "--guided-decoding-disable-any-whitespace": N,
    "--guided-decoding-disable-additional-properties": N,
    # ParallelConfig
    "--distributed-executor-backend": N,
    "--pipeline-parallel-size": N,
    "-pp": N,
    "--tensor-parallel-size": N,
    "-tp": N,
    "--decode-context-parallel-size": N,
    "-dcp": N,
    "--data-parallel-size": N,
    "-dp": N,
    "--data-parallel-rank": R,
    "-dpn": R,
    "--data-parallel-start-rank": R,
    "-dpr": R,
    "--data-parallel-size-local": R,
    "-dpl": R,
    "--data-parallel-address": R,
    "-dpa": R,
    "--data-parallel-rpc-port": R,
    "-dpp": R,
    "--data-parallel-backend": N,
    "-dpb": N,
    "--data-parallel-hybrid-lb": R,
    "--enable-expert-parallel": N,
    "--all2all-backend": N,
    "--enable-dbo": N,
    "--dbo-decode-token-threshold": N,
    "--dbo-prefill-token-threshold": N,
    "--disable-nccl-for-dp-synchronization": N,
    "--enable-eplb": N,
    "--eplb-config": N,
    "--expert-placement-strategy": N,
    "--num-redundant-experts": N,
    "--eplb-window-size": N,
    "--eplb-step-interval": N,
    "--eplb-log-balancedness": N,
    "--max-parallel-loading-workers": N,
    "--ray-workers-use-nsight": N,
    "--disable-custom-all-reduce": N,
    "--worker-cls": R,
    "--worker-extension-cls": R,
    "--enable-multimodal-encoder-data-parallel": N,
    # CacheConfig
    "--block-size": W,
    "--gpu-memory-utilization": N,
    "--kv-cache-memory-bytes": W,
    "--swap-space": N,
    "--kv-cache-dtype": N,
    "--num-gpu-blocks-override": W,
    "--enable-prefix-caching": W,
    "--prefix-caching-hash-algo": N,
    "--cpu-offload-gb": N,
    "--calculate-kv-scales": N,
    "--kv-sharing-fast-prefill": N,
    "--mamba-cache-dtype": N,
    "--mamba-ssm-cache-dtype": N,
    "--mamba-block-size": N,
    # MultiModalConfig
    "--limit-mm-per-prompt": N,
    "--enable-mm-embeds": N,
    "--media-io-kwargs": N,
    "--mm-processor-kwargs": N,
    "--mm-processor-cache-gb": N,
    "--disable-mm-preprocessor-cache": N,
    "--mm-processor-cache-type": N,
    "--mm-shm-cache-max-object-size-mb": N,
    "--mm-encoder-tp-mode": N,
    "--mm-encoder-attn-backend": N,
    "--interleave-mm-strings": N,
    "--skip-mm-profiling": N,
    "--video-pruning-rate": N,
    # LoRAConfig
    "--enable-lora": W,
    "--max-loras": W,
    "--max-lora-rank": W,
    "--lora-extra-vocab-size": N,
    "--lora-dtype": W,
    "--max-cpu-loras": W,
    "--fully-sharded-loras": N,
    "--default-mm-loras": N,
    # ObservabilityConfig
    "--show-hidden-metrics-for-version": N,
    "--otlp-traces-endpoint": R,
    "--collect-detailed-traces": N,
    # SchedulerConfig
    "--max-num-batched-tokens": W,
    "--max-num-seqs": W,
    "--max-num-partial-prefills": N,
    "--max-long-partial-prefills": N,
    "--long-prefill-token-threshold": N,
    "--num-lookahead-slots": N,
    "--scheduling-policy": W,
    "--enable-chunked-prefill": W,
    "--disable-chunked-mm-input": N,
    "--scheduler-cls": R,
    "--disable-hybrid-kv-cache-manager": N,
    "--async-scheduling": N,
    # CompilationConfig, VllmConfig and the rest
    "--cudagraph-capture-sizes": N,
    "--cuda-graph-sizes": N,
    "--max-cudagraph-capture-size": N,
    "--speculative-config": R,
    "--kv-transfer-config": R,
    "--kv-events-config": R,
    "--compilation-config": N,
    "-O": N,
    "--additional-config": N,
    "--structured-outputs-config": W,
    "--disable-log-stats": W,
    "--aggregate-engine-logging": N,
}
# Boolean flags that vLLM also spells --no-<flag> (BooleanOptionalAction).
VLLM_NO_FORMS = [
    "--no-enable-lora",
    "--no-enable-prefix-caching",
    "--no-enable-chunked-prefill",
    "--no-enforce-eager",
    "--no-skip-tokenizer-init",
    "--no-allow-credentials",
    "--no-enable-sleep-mode",
    "--no-enable-expert-parallel",
]
# Flags of earlier vLLM releases that deployment scripts still carry.
OLDER_FLAGS = {
    "--max-seq-len-to-capture": N,
    "--use-v2-block-manager": N,
    "--num-scheduler-steps": N,
    "--disable-async-output-proc": N,
    "--preemption-mode": N,
    "--scheduler-delay-factor": N,
    "--tokenizer-pool-size": N,
    "--speculative-model": R,
    "--num-speculative-tokens": R,
    "--long-lora-scaling-factors": R,
    "--enable-lora-bias": W,
}


def test_every_vllm_flag_has_its_class() -> None:
    classes = classify(make_serve_parser())
    expected = {**VLLM_0_11_FLAGS, **OLDER_FLAGS}
    assert {flag: classes.get(flag, "unknown") for flag in expected} == expected
    assert all(classes.get(flag) == W for flag in VLLM_NO_FORMS)


def test_every_working_flag_is_generated_from_its_field() -> None:
    """The engine, server and front-end flags come from the option fields (EngineArgs, the configs it
    shares, ServerConfig, FrontendOptions): each generated flag is in the parser with the field as its
    dest, and every vLLM flag of the table that works here is one of them, a compatibility flag whose
    vLLM meaning holds, or the parser's own (--config, --model)."""
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.entrypoints.openai.cli.cli_options import generated_flags
    from loraserve.entrypoints.openai.cli.server_config import ServerConfig
    from loraserve.entrypoints.openai.cli.vllm_flag_table import COMPAT_FLAGS
    from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions

    parser = make_serve_parser()
    actions = {name: action for action in parser._actions for name in action.option_strings}
    generated: set[str] = set()
    dests: set[str] = set()
    for field_name, option, _ in generated_flags(EngineArgs, ServerConfig, FrontendOptions):
        for flag in option.flags:
            assert actions[flag].dest == field_name, flag
            assert (actions[flag].help or "").startswith(option.help.split("%(")[0]), flag
        generated.update(option.flags)
        dests.add(field_name)
    holds = {name for flag in COMPAT_FLAGS if flag.kind == W for name in flag.names}
    working = {flag for flag, kind in {**VLLM_0_11_FLAGS, **OLDER_FLAGS}.items() if kind == W}
    assert working - generated - holds == {"--config", "--model"}
    assert not generated & holds  # each flag has one home
    # Every parser flag is generated (its --no- form too), a compatibility flag, or the parser's own.
    others = {action.dest for action in actions.values()} - dests
    assert {dest for dest in others if not dest.startswith("vllm_compat")} == {"help", "model", "config"}


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
        (["--speculative-config", "{}"], "--speculative-config {} is not supported"),
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
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 cannot be honoured"),
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
