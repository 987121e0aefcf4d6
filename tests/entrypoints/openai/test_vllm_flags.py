"""Every `vllm serve` flag, as vLLM v0.11 defines it (vllm/engine/arg_utils.py EngineArgs and
AsyncEngineArgs, vllm/entrypoints/openai/cli/cli_args.py FrontendArgs and make_arg_parser), with its class
here: "works", "notice" (accepted with a one-line notice when harmless) or "refused" (a one-line
error). The table below is the contract: a flag that disappears or changes class fails this test.
What each class does on a command line (the notices, the errors, the values that reach the engine) is
in test_vllm_flag_parsing.py.
"""

from __future__ import annotations

from loraserve.entrypoints.openai.cli.cli_args import make_serve_parser
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
    "--allowed-local-media-path": W,
    "--allowed-media-domains": W,
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
    "--kv-cache-dtype": W,
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
    "--limit-mm-per-prompt": W,
    "--enable-mm-embeds": N,
    "--media-io-kwargs": N,
    "--mm-processor-kwargs": W,
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
    "--default-mm-loras": R,
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
    "--speculative-config": W,
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
