"""The costs the cluster simulator runs on, measured on this machine with the real engine.

- decode step time vs batch size (a + b x B, least squares over a few batch sizes, every sequence on
  its own adapter so the LoRA ops are in it), and the extra cost of each prompt token in a step;
- cold load: reading and validating one adapter from the store into host memory (`prefetch_lora`);
- slot upload: writing one host-cached adapter into a compute slot (`LoRAManager.activate`).

`python -m benchmarks.cluster_costs` measures the SmolLM-135M-shaped model with rank-16 adapters on
all 7 projections (benchmarks/common.py) and writes benchmarks/results/cluster_costs.json.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from loraserve.sampling_params import SamplingParams

BATCH_SIZES = (1, 4, 8, 16)
PROMPT_LEN = 128


@dataclass(frozen=True, slots=True)
class Costs:
    step_base_s: float  # a decode step's fixed cost
    step_per_seq_s: float  # and its cost per sequence in the batch
    prefill_per_token_s: float  # each prompt token of a request joining the batch
    cold_load_s: float  # adapter store -> host memory
    slot_upload_s: float  # host memory -> compute slot
    source: str

    def step_s(self, num_seqs: int, num_prefill_tokens: int = 0, num_uploads: int = 0) -> float:
        return (
            self.step_base_s
            + self.step_per_seq_s * num_seqs
            + self.prefill_per_token_s * num_prefill_tokens
            + self.slot_upload_s * num_uploads
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Costs:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def measure(
    model_path: str, adapter_paths: list[str], threads: int, max_loras: int = 16, max_lora_rank: int = 16
) -> Costs:
    """Time the engine on `model_path` with `threads` torch threads (the cores one replica gets)."""
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.llm_engine import LLMEngine
    from loraserve.lora.request import LoRARequest

    torch.set_num_threads(threads)
    need = max(BATCH_SIZES) + 8
    assert len(adapter_paths) >= need and max_loras <= max(BATCH_SIZES), f"measuring needs {need} adapters"
    requests = [LoRARequest(f"a{i:03d}", i + 1, p) for i, p in enumerate(adapter_paths)]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model_path, enable_lora=True, max_loras=max_loras, max_cpu_loras=len(requests),
        max_lora_rank=max_lora_rank, max_model_len=PROMPT_LEN + 64,
    ))  # fmt: skip
    ids = itertools.count()
    vocab = engine.model_config.vocab_size
    loads = []
    for request in requests[: max(BATCH_SIZES)]:
        start = time.perf_counter()
        engine.prefetch_lora(request)
        loads.append(time.perf_counter() - start)
    # Batches larger than the slots reuse adapters, as the scheduler would batch them.
    step_points = [
        (b, _decode_step_s(engine, [requests[i % max_loras] for i in range(b)], ids, vocab)) for b in BATCH_SIZES
    ]
    base, per_seq = _fit_line(step_points)
    prefill = _prefill_step_s(engine, requests[0], ids, vocab) - (base + per_seq)
    uploads = [_upload_s(engine, request) for request in requests[max(BATCH_SIZES) : need]]
    return Costs(
        step_base_s=max(base, 0.0),
        step_per_seq_s=per_seq,
        prefill_per_token_s=max(prefill, 0.0) / PROMPT_LEN,
        cold_load_s=statistics.median(loads),
        slot_upload_s=statistics.median(uploads),
        source=f"measured: {model_path.split('/')[-1]}, {threads} thread(s), dtype {engine.model_config.dtype}",
    )


def _decode_step_s(engine: Any, loras: list[Any], ids: Any, vocab: int, num_steps: int = 6) -> float:
    """Median time of a decode step with one sequence per adapter in `loras`."""
    params = SamplingParams(temperature=0, max_tokens=num_steps + 3, ignore_eos=True)
    for lora in loras:
        engine.add_request(f"m{next(ids)}", [(7 * len(loras) + j) % (vocab - 10) + 10 for j in range(8)],
                           params, lora)  # fmt: skip
    engine.step()  # the prefill
    engine.step()
    times = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def _prefill_step_s(engine: Any, lora: Any, ids: Any, vocab: int, repeats: int = 3) -> float:
    times = []
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for r in range(repeats):
        engine.add_request(f"p{next(ids)}", [(r * 31 + j) % (vocab - 10) + 10 for j in range(PROMPT_LEN)],
                           params, lora)  # fmt: skip
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def _upload_s(engine: Any, request: Any) -> float:
    """One host-cached adapter written into a slot (its slot taken from an idle adapter)."""
    manager = engine.lora
    manager.register(request)
    start = time.perf_counter()
    manager.activate({request.lora_id})
    elapsed = time.perf_counter() - start
    manager.end_step()
    return elapsed


def _fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def main() -> None:
    from benchmarks.common import build_adapters, build_model, save_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the cores of one replica)")
    args = parser.parse_args()
    model = build_model()
    costs = measure(model, build_adapters(model, max(BATCH_SIZES) + 8), args.threads)
    for key, value in costs.to_json().items():
        print(f"{key:>22}: {value * 1000:.2f} ms" if isinstance(value, float) else f"{key:>22}: {value}")
    save_results("cluster_costs", costs.to_json())


if __name__ == "__main__":
    main()
