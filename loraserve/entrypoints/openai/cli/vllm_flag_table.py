"""Every `vllm serve` flag that loraserve accepts without acting on it, or refuses, and why.

Built from vLLM's own argument definitions, v0.11 (`vllm/engine/arg_utils.py` EngineArgs and
AsyncEngineArgs, `vllm/entrypoints/openai/cli/cli_args.py` FrontendArgs and make_arg_parser), plus a few
flags of earlier releases that deployment scripts still carry (marked "vLLM < 0.11"). The flags that
work are ordinary `serve` flags, generated from option fields (`cli_options.py`);
tests/entrypoints/openai/test_vllm_flags.py holds the whole table, so no flag changes class by accident.

Kinds: "works" (the flag's vLLM meaning already holds here, e.g. no request logging), "notice"
(accepted with a one-line notice of what it means here, for the values in `harmless`; any other value
is a one-line error), "refused" (a one-line error: the feature does not exist here; a boolean flag's
`--no-` form is harmless).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class CompatFlag:
    names: tuple[str, ...]  # "--tensor-parallel-size", "-tp"
    kind: str  # "works" | "notice" | "refused"
    note: str  # what the flag means on this engine
    takes: str = "value"  # "value" | "values" | "flag" (store_true) | "bool" (--x / --no-x)
    harmless: Callable[[Any], bool] | None = None  # notice: the values accepted (None: every value)

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def _number(check: Callable[[float], bool]) -> Callable[[Any], bool]:
    def harmless(value: Any) -> bool:
        try:
            return check(float(value))
        except (TypeError, ValueError):
            return False

    return harmless


def _among(*values: str) -> Callable[[Any], bool]:
    return lambda value: str(value) in values


_ONE = _number(lambda v: v == 1)
_ZERO = _number(lambda v: v == 0)
_ONE_DEVICE = "loraserve runs the whole model on one device (CPU or one GPU); 1 is the only size"
_NO_MULTIMODAL = (
    "loraserve serves images only (no video, audio or embedding inputs); this setting has nothing to act on"
)
_MM_CACHE = "processed images are not cached; image embeddings are, by content hash (--mm-embedding-cache)"
_NO_MOE_PARALLEL = "expert parallelism and load balancing need several devices; loraserve uses one"
_NO_CUDA_GRAPHS = "loraserve runs eagerly and captures no CUDA graphs"
_NO_TOOLS = "tool servers (MCP, built-in tools of the Responses API) are not supported"
_NO_GUIDED = (
    "not read: set the field of that name in --structured-outputs-config (JSON), e.g. "
    "'{\"disable_any_whitespace\": true}'"
)
_NO_DP = "data parallelism across processes or nodes is not supported; run one loraserve per device"


def notice(
    names: str, note: str, takes: str = "value", harmless: Callable[[Any], bool] | None = None
) -> CompatFlag:
    return CompatFlag(tuple(names.split()), "notice", note, takes, harmless)


def refused(names: str, note: str, takes: str = "value") -> CompatFlag:
    return CompatFlag(tuple(names.split()), "refused", note, takes)


def holds(names: str, note: str, takes: str = "flag") -> CompatFlag:
    return CompatFlag(tuple(names.split()), "works", note, takes)


COMPAT_FLAGS: tuple[CompatFlag, ...] = (
    # ---- make_arg_parser and FrontendArgs ----------------------------------------------------------
    refused(
        "--headless", "headless mode serves multi-node data parallelism, which loraserve does not run", "flag"
    ),
    notice(
        "--api-server-count -asc", "loraserve runs one API server process; 1 is the only count", harmless=_ONE
    ),
    refused(
        "--enable-ssl-refresh", "certificates are read once at startup; restart to load new ones", "bool"
    ),
    notice(
        "--disable-frontend-multiprocessing", "the API server and the engine always share one process", "bool"
    ),
    refused("--tool-server", _NO_TOOLS),
    notice("--max-log-len", "loraserve never logs prompts, so there is nothing to shorten"),
    refused(
        "--enable-force-include-usage", "usage is sent only when stream_options.include_usage asks", "bool"
    ),
    notice("--enable-log-outputs", "loraserve never logs generated text", "bool"),
    notice(
        "--h11-max-header-count",
        "uvicorn offers no header-count limit; 256 (vLLM's default) is the only value",
        harmless=_number(lambda v: v == 256),
    ),
    notice("--log-error-stack", "internal errors (500s) are always logged with their traceback", "bool"),
    refused("--tokens-only", "there is no tokens-in/tokens-out endpoint", "bool"),
    notice(
        "--enable-log-requests",
        "loraserve never logs request contents (the access log lists requests)",
        "bool",
    ),
    holds("--disable-log-requests", "loraserve never logs request contents", "bool"),
    # ---- ModelConfig -------------------------------------------------------------------------------
    notice("--runner", "loraserve runs generative models only", harmless=_among("auto", "generate")),
    notice("--convert", "loraserve converts no model into a pooling model", harmless=_among("auto", "none")),
    notice("--task", "loraserve runs text generation only", harmless=_among("auto", "generate")),
    refused(
        "--code-revision", "remote code comes from --revision; a separate code revision is not supported"
    ),
    notice("--enforce-eager", "loraserve always runs eagerly (no CUDA graphs)", "bool"),
    notice(
        "--logprobs-mode",
        "logprobs are the model's raw log-softmax, vLLM's default mode",
        harmless=_among("raw_logprobs"),
    ),
    refused("--disable-sliding-window", "sliding-window models run with their window", "bool"),
    notice("--disable-cascade-attn", "loraserve has no cascade attention", "bool"),
    refused("--enable-prompt-embeds", "prompts are text or token ids", "bool"),
    refused("--hf-token", "pass the token as HF_TOKEN in the environment (or `hf auth login`)"),
    refused("--pooler-config --override-pooler-config", "pooling models are not supported"),
    notice("--logits-processor-pattern", "requests cannot bring logits processors (they get a 400)"),
    refused("--enable-sleep-mode", "there is no sleep/wake-up API", "bool"),
    refused("--override-attention-dtype", "attention runs in the model dtype"),
    refused("--logits-processors", "custom logits processors are not supported", "values"),
    refused("--io-processor-plugin", "IO processor plugins are not supported"),
    # ---- LoadConfig --------------------------------------------------------------------------------
    notice("--safetensors-load-strategy", "safetensors files are read one at a time"),
    refused("--model-loader-extra-config", "there are no loader plugins to configure"),
    notice("--ignore-patterns", "only the files loraserve needs are downloaded anyway", "values"),
    notice("--use-tqdm-on-load", "weight loading is logged per file", "bool"),
    notice("--pt-load-map-location", "pickle checkpoints are read on the CPU, then moved"),
    # ---- StructuredOutputsConfig -------------------------------------------------------------------
    refused("--reasoning-parser", "reasoning parsers are not supported"),
    notice("--guided-decoding-disable-fallback", _NO_GUIDED, "bool"),
    notice("--guided-decoding-disable-any-whitespace", _NO_GUIDED, "bool"),
    notice("--guided-decoding-disable-additional-properties", _NO_GUIDED, "bool"),
    # ---- ParallelConfig ----------------------------------------------------------------------------
    notice(
        "--distributed-executor-backend", "one process drives the one device; no executor backend is used"
    ),
    notice("--pipeline-parallel-size -pp", _ONE_DEVICE, harmless=_ONE),
    notice("--tensor-parallel-size -tp", _ONE_DEVICE, harmless=_ONE),
    notice("--decode-context-parallel-size -dcp", _ONE_DEVICE, harmless=_ONE),
    notice("--data-parallel-size -dp", _ONE_DEVICE, harmless=_ONE),
    refused("--data-parallel-rank -dpn", _NO_DP),
    refused("--data-parallel-start-rank -dpr", _NO_DP),
    refused("--data-parallel-size-local -dpl", _NO_DP),
    refused("--data-parallel-address -dpa", _NO_DP),
    refused("--data-parallel-rpc-port -dpp", _NO_DP),
    notice("--data-parallel-backend -dpb", "there is no data parallelism to run"),
    refused("--data-parallel-hybrid-lb", _NO_DP, "bool"),
    notice("--enable-expert-parallel", _NO_MOE_PARALLEL, "bool"),
    notice("--all2all-backend", _NO_MOE_PARALLEL),
    notice("--enable-dbo", "dual-batch overlap needs several devices", "bool"),
    notice("--dbo-decode-token-threshold", "dual-batch overlap needs several devices"),
    notice("--dbo-prefill-token-threshold", "dual-batch overlap needs several devices"),
    notice("--disable-nccl-for-dp-synchronization", _NO_DP, "bool"),
    notice("--enable-eplb", _NO_MOE_PARALLEL, "bool"),
    notice("--eplb-config", _NO_MOE_PARALLEL),
    notice("--expert-placement-strategy", _NO_MOE_PARALLEL),
    notice("--num-redundant-experts", _NO_MOE_PARALLEL),
    notice("--eplb-window-size", _NO_MOE_PARALLEL),
    notice("--eplb-step-interval", _NO_MOE_PARALLEL),
    notice("--eplb-log-balancedness", _NO_MOE_PARALLEL, "bool"),
    notice("--max-parallel-loading-workers", "weights are read by one loader"),
    notice("--ray-workers-use-nsight", "no Ray workers are started", "bool"),
    notice("--disable-custom-all-reduce", "one device: there is no all-reduce", "bool"),
    refused("--worker-cls", "the model runs in the engine's own process, with no worker class"),
    refused("--worker-extension-cls", "the model runs in the engine's own process, with no worker class"),
    notice(
        "--enable-multimodal-encoder-data-parallel", "one device: the vision tower is not sharded", "flag"
    ),
    # ---- CacheConfig -------------------------------------------------------------------------------
    notice(
        "--gpu-memory-utilization",
        "the KV cache is sized by --kv-cache-memory (default: a share of the available memory), not by --gpu-memory-utilization",
        harmless=_number(lambda v: 0 < v <= 1),
    ),
    notice(
        "--swap-space",
        "preempted sequences are recomputed, never swapped to CPU memory",
        harmless=_number(lambda v: v >= 0),
    ),
    notice(
        "--prefix-caching-hash-algo", "prefix-cache blocks are keyed by sha256 of their tokens and adapter"
    ),
    notice("--cpu-offload-gb", "weights stay on the serving device", harmless=_ZERO),
    notice(
        "--calculate-kv-scales",
        "fp8 KV scales stay 1.0, vLLM's default without calibration (int8 keeps a scale per block)",
        "bool",
    ),
    notice("--kv-sharing-fast-prefill", "there is no cross-layer KV sharing", "bool"),
    notice("--mamba-cache-dtype", "Mamba models are not supported"),
    notice("--mamba-ssm-cache-dtype", "Mamba models are not supported"),
    notice("--mamba-block-size", "Mamba models are not supported"),
    # ---- MultiModalConfig --------------------------------------------------------------------------
    notice("--enable-mm-embeds", _NO_MULTIMODAL, "bool"),
    notice("--media-io-kwargs", "images are decoded by PIL with loraserve's own limits (--max-image-pixels)"),
    notice("--mm-processor-cache-gb", _MM_CACHE),
    notice("--disable-mm-preprocessor-cache", _MM_CACHE, "flag"),
    notice("--mm-processor-cache-type", _MM_CACHE),
    notice("--mm-shm-cache-max-object-size-mb", _MM_CACHE),
    notice("--mm-encoder-tp-mode", "one device: the vision tower is not sharded"),
    notice("--mm-encoder-attn-backend", "the vision tower runs transformers' attention (SDPA)"),
    notice("--interleave-mm-strings", _NO_MULTIMODAL, "bool"),
    notice("--skip-mm-profiling", _NO_MULTIMODAL, "bool"),
    notice("--video-pruning-rate", _NO_MULTIMODAL),
    # ---- LoRAConfig --------------------------------------------------------------------------------
    notice(
        "--lora-extra-vocab-size", "adapters that add tokens are refused, so no extra vocabulary is reserved"
    ),
    notice("--fully-sharded-loras", "one device: adapters are not sharded", "bool"),
    refused(
        "--default-mm-loras",
        "per-modality default adapters are not served: name the adapter in each request's model field",
    ),
    # ---- ObservabilityConfig -----------------------------------------------------------------------
    notice("--show-hidden-metrics-for-version", "/metrics hides no deprecated metrics"),
    refused("--otlp-traces-endpoint", "OpenTelemetry tracing is not supported"),
    notice("--collect-detailed-traces", "OpenTelemetry tracing is not supported", "values"),
    # ---- SchedulerConfig ---------------------------------------------------------------------------
    notice("--max-num-partial-prefills", "every prefill that fits the token budget runs in the step"),
    notice("--max-long-partial-prefills", "every prefill that fits the token budget runs in the step"),
    notice("--long-prefill-token-threshold", "every prefill that fits the token budget runs in the step"),
    notice("--num-lookahead-slots", "speculative decoding reserves the KV slots of its proposals by itself"),
    notice(
        "--disable-chunked-mm-input",
        "images whose tokens attend both ways (Gemma-3) are never split across steps; others may be",
        "bool",
    ),
    refused("--scheduler-cls", "the scheduler cannot be replaced"),
    notice("--disable-hybrid-kv-cache-manager", "there is one KV-cache manager", "bool"),
    notice("--async-scheduling", "steps are scheduled synchronously", "bool"),
    # ---- CompilationConfig and VllmConfig ----------------------------------------------------------
    notice("--cudagraph-capture-sizes --cuda-graph-sizes", _NO_CUDA_GRAPHS, "values"),
    notice("--max-cudagraph-capture-size", _NO_CUDA_GRAPHS),
    refused("--kv-transfer-config", "KV transfer between instances is not supported"),
    refused("--kv-events-config", "KV-cache events are not published"),
    notice("--compilation-config -O", "loraserve does not compile the model (it runs eagerly)"),
    notice("--additional-config", "there are no platform plugins to pass it to"),
    holds("--disable-log-stats", "loraserve logs no periodic statistics (/metrics has them)"),
    notice("--aggregate-engine-logging", "there is one engine", "flag"),
    # ---- flags of vLLM < 0.11 that scripts still carry ---------------------------------------------
    notice("--max-seq-len-to-capture", "vLLM < 0.11: " + _NO_CUDA_GRAPHS),
    notice("--use-v2-block-manager", "vLLM < 0.11: there is one block manager", "flag"),
    notice("--num-scheduler-steps", "vLLM < 0.11: one token per step", harmless=_ONE),
    notice("--disable-async-output-proc", "vLLM < 0.11: outputs are processed synchronously", "flag"),
    notice("--preemption-mode", "vLLM < 0.11: preemption always recomputes", harmless=_among("recompute")),
    notice("--scheduler-delay-factor", "vLLM < 0.11: requests are scheduled as soon as they fit"),
    notice(
        "--tokenizer-pool-size", "vLLM < 0.11: requests are tokenized in the server process", harmless=_ZERO
    ),
    refused(
        "--speculative-model --num-speculative-tokens",
        'vLLM < 0.11\'s spelling: use --speculative-config \'{"model": DRAFT, "num_speculative_tokens": K}\'',
    ),
    refused("--long-lora-scaling-factors", "vLLM < 0.11: long-context LoRA is not supported"),
)
