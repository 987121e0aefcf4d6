"""Checkpoint tensors as a stream of (HF name, tensor) pairs, whatever the file layout.

Safetensors come first (sharded through `model.safetensors.index.json`, which also decides which files
count); pickle checkpoints (`*.bin`/`*.pt`) are read with `torch.load(weights_only=True)` so a file
that would run code is refused rather than executed. Mistral-format folders stream their
`consolidated*.safetensors` under HF names.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open

from loraserve import envs
from loraserve.layers.quant.formats import QuantTensor, repack_rows
from loraserve.model_loader import gguf_quantized, mistral

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"
# Trainer and optimizer state that sits next to weights in fine-tuning output folders.
_NON_WEIGHT_FILES = {"training_args.bin", "optimizer.pt", "optimizer.bin", "scheduler.pt", "scaler.pt"}


def _indexed_files(model_path: str, index_name: str) -> list[str] | None:
    index_path = os.path.join(model_path, index_name)
    if not os.path.isfile(index_path):
        return None
    with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path} has no weight_map.")
    files = sorted(set(weight_map.values()))
    missing = [name for name in files if not os.path.isfile(os.path.join(model_path, name))]
    if missing:
        raise ValueError(f"{index_path} lists weight files that are not in {model_path}: {missing}.")
    return [os.path.join(model_path, name) for name in files]


def _files_with_suffix(
    model_path: str, suffixes: tuple[str, ...], skip_prefix: str | None = None
) -> list[str]:
    names = sorted(
        name
        for name in os.listdir(model_path)
        if name.endswith(suffixes)
        and name not in _NON_WEIGHT_FILES
        and not (skip_prefix and name.startswith(skip_prefix))
    )
    return [os.path.join(model_path, name) for name in names]


def hf_weight_files(model_path: str, load_format: str = "auto") -> tuple[list[str], bool]:
    """(weight files, is_safetensors) of an HF-format folder: safetensors first, else pickles
    (load_format "safetensors" or "pt" takes only that kind, as vLLM's --load-format does)."""
    if load_format in ("auto", "safetensors"):
        indexed = _indexed_files(model_path, SAFETENSORS_INDEX)
        if indexed is not None:
            return indexed, True
        # Mistral repos ship consolidated*.safetensors next to the HF files; they are the other format.
        safetensors = _files_with_suffix(model_path, (".safetensors",), skip_prefix="consolidated")
        if safetensors:
            return safetensors, True
    if load_format in ("auto", "pt"):
        indexed = _indexed_files(model_path, PICKLE_INDEX)
        if indexed is not None:
            return indexed, False
        pickles = _files_with_suffix(model_path, (".bin", ".pt", ".pth"), skip_prefix="consolidated")
        if pickles:
            return pickles, False
    looked_for = {
        "auto": f"{SAFETENSORS_INDEX}, *.safetensors, {PICKLE_INDEX} and *.bin/*.pt files",
        "safetensors": f"{SAFETENSORS_INDEX} and *.safetensors files (load_format='safetensors')",
        "pt": f"{PICKLE_INDEX} and *.bin/*.pt files (load_format='pt')",
    }
    raise ValueError(
        f"No weights found in {model_path}: looked for {looked_for.get(load_format, load_format)}."
    )


def hub_snapshot(
    model: str,
    revision: str | None,
    allow_patterns: list[str],
    ignore_patterns: list[str] | None = None,
    cache_dir: str | None = None,
) -> str:
    """Local snapshot folder of hub repo `model` with the files matching the patterns (in `cache_dir`,
    --download-dir, instead of the Hugging Face cache when given)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = envs.hf_hub_offline()
    try:
        return snapshot_download(
            model,
            revision=revision,
            allow_patterns=allow_patterns,
            ignore_patterns=ignore_patterns,
            local_files_only=offline,
            cache_dir=cache_dir,
        )
    except HFValidationError as e:
        raise ValueError(
            f"model {model!r} is neither an existing local folder nor a valid Hugging Face repo id ({e}). "
            "Expected a Hugging Face repo id (org/name) or a local folder containing config.json or params.json."
        ) from e
    except LocalEntryNotFoundError as e:
        if offline:
            raise ValueError(
                f"model {model!r} is not a local folder and is not in the Hugging Face cache, and HF_HUB_OFFLINE "
                "is set so it cannot be downloaded. Download it while online first, or pass a local folder."
            ) from e
        raise ValueError(
            f"could not download model {model!r} from the Hugging Face Hub and it is not cached: {e}"
        ) from e
    except HfHubHTTPError as e:
        raise ValueError(f"could not fetch model {model!r} (revision {revision!r}) from the Hub: {e}") from e


def download_weights(
    model: str,
    model_path: str,
    revision: str | None,
    config_format: str,
    load_format: str = "auto",
    cache_dir: str | None = None,
) -> None:
    """Fetch the weight files of hub repo `model` into its snapshot `model_path` (no-op for local folders
    and for load_format "dummy")."""
    if os.path.isdir(os.path.expanduser(model)) or load_format == "dummy":
        return
    if config_format == "mistral":
        hub_snapshot(model, revision, ["consolidated*.safetensors"], cache_dir=cache_dir)
        return
    if load_format != "pt":
        hub_snapshot(
            model, revision, ["*.safetensors", "*.safetensors.index.json"], ["consolidated*"], cache_dir
        )
    if load_format == "pt" or not _files_with_suffix(
        model_path, (".safetensors",), skip_prefix="consolidated"
    ):
        patterns = ["*.bin", "*.pt", "*.pth", "*.bin.index.json"]
        hub_snapshot(model, revision, patterns, ["consolidated*"], cache_dir)


def iterate_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            yield name, f.get_tensor(name)


def iterate_pickle(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of a torch.save file; anything beyond tensors and plain containers is refused."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"Refusing to load {path}: it contains pickled objects other than tensors, which could run "
            f"arbitrary code (torch.load weights_only=True rejected it: {str(e).splitlines()[0]}). "
            "Convert the checkpoint to safetensors."
        ) from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a dict of named tensors.")
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{path}: entry {name!r} is a {type(tensor).__name__}, not a tensor.")
        yield name, tensor


def _with_progress(
    files: list[str], reader: Callable[[str], Iterator[tuple[str, torch.Tensor]]]
) -> Iterator[tuple[str, torch.Tensor]]:
    for number, path in enumerate(files, start=1):
        logger.info("Loading weights: %d/%d files (%s)", number, len(files), os.path.basename(path))
        yield from reader(path)


def iterate_weights(
    model_path: str, config_format: str = "hf", load_format: str = "auto"
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """Every checkpoint tensor under its HF name, one file at a time (CPU tensors; a GGUF folder's
    kept-quantized weights as QuantTensors)."""
    if config_format == "auto":
        has_params = os.path.isfile(os.path.join(model_path, mistral.PARAMS_FILE))
        config_format = "mistral" if has_params else "hf"
    if config_format == "mistral":
        params = mistral.read_params(model_path)
        files = mistral.consolidated_files(model_path)
        return mistral.map_consolidated_tensors(_with_progress(files, iterate_safetensors), params)
    if config_format != "hf":
        raise ValueError(f"config_format must be 'hf', 'mistral' or 'auto', got {config_format!r}.")
    files, is_safetensors = hf_weight_files(model_path, load_format)
    weights = _with_progress(files, iterate_safetensors if is_safetensors else iterate_pickle)
    index = gguf_quantized.read_index(model_path)
    return _quantized(weights, index) if index else weights


def _quantized(
    weights: Iterator[tuple[str, torch.Tensor]], index: dict[str, tuple[str, tuple[int, int]]]
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """The tensors `quantized.json` names as QuantTensors (a GGUF folder's kept-quantized weights)."""
    for name, tensor in weights:
        entry = index.get(name)
        # in the kernels' row layout at once: a tied LM head and the embedding share one tensor
        yield name, tensor if entry is None else repack_rows(gguf_quantized.as_quant_tensor(tensor, entry))
