"""GGUF models: find the file, check it can be loaded, convert it once into a cached HF-format folder.

A `.gguf` file (or a folder holding exactly one) is served like any HF folder: transformers' GGUF
reader turns its metadata into a config and a tokenizer (with the chat template) and dequantizes its
tensors, which are saved as safetensors in the serving dtype. The native model classes then load that
folder, so LoRA adapters trained on the HF model apply on top. The cache folder is keyed by the file's
sha256 and the dtype, so a changed file is converted again and never meets stale weights.

Quantized Llama/Qwen files keep their linear weights quantized (gguf_quantized.py; the folder's
`quantized.json` says which), unless LORASERVE_GGUF_DEQUANTIZE is set: the old dense folder, in its own
cache entry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from loraserve import envs
from loraserve.model_loader import gguf_quantized
from loraserve.model_loader.gguf_header import read_gguf_header
from loraserve.model_loader.staging import publish, stage

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
CONVERTER_VERSION = "3"  # 2: Phi-3 LongRoPE read from the file; 3: Qwen MoE expert widths
_COMPLETE = "COMPLETE.json"
_HASH_CHUNK = 16 << 20
_PARSE_LOCK = threading.RLock()  # one_gguf_parse


class GGUFError(ValueError):
    """A GGUF file that cannot be served; the message names the file and the problem."""


def find_gguf_file(model: str) -> str | None:
    """The GGUF file `model` names: the file itself, or the only `.gguf` in a folder; else None."""
    path = os.path.expanduser(model)
    if os.path.isfile(path):
        return os.path.abspath(path) if path.endswith(GGUF_SUFFIX) or _has_gguf_magic(path) else None
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    found = sorted(name for name in os.listdir(path) if name.endswith(GGUF_SUFFIX))
    if len(found) > 1:
        raise GGUFError(
            f"folder {model!r} holds {len(found)} GGUF files ({', '.join(found)}); name the one to serve."
        )
    return os.path.abspath(os.path.join(path, found[0])) if found else None


def _has_gguf_magic(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def file_digest(path: str) -> str:
    """sha256 of the file's bytes (hashlib releases the GIL; ~1 GB/s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class GGUFSummary:
    """What the file declares, read from its header without dequantizing anything."""

    architecture: str
    tensor_types: tuple[str, ...]


# llama.cpp's names for architectures transformers' reader lists under its own model type (it renames
# them the same way when it loads the file).
_HF_ARCH_NAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
}


def inspect_gguf(path: str) -> GGUFSummary:
    """Read the header and refuse, by name, an architecture or a tensor type that cannot be converted.
    Remembered per (file, size, mtime) in this process: parsing a file's tensor table takes seconds, and
    every engine on the file asks (a refusal is not remembered: it raises again)."""
    try:
        stat = os.stat(path)
    except OSError:
        return _inspect(path, -1, -1)
    return _inspect(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _inspect(path: str, size: int, mtime_ns: int) -> GGUFSummary:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    name = os.path.basename(path)
    try:
        header = read_gguf_header(path)
    except (ValueError, OSError) as e:
        raise GGUFError(f"{name} is not a readable GGUF file: {e}") from e
    arch = header.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"GGUF file {name} has no general.architecture field.")
    if _HF_ARCH_NAMES.get(arch, arch) not in GGUF_SUPPORTED_ARCHITECTURES:
        known = ", ".join(
            name for name in GGUF_SUPPORTED_ARCHITECTURES if name not in ("general", "tokenizer")
        )
        raise GGUFError(
            f"GGUF file {name} has architecture {arch!r}, which cannot be converted "
            f"(GGUF architectures that load: {known})."
        )
    experts = header.metadata.get(f"{arch}.expert_count")
    if arch in ("llama", "mistral") and isinstance(experts, int) and experts > 0:
        # transformers reads a llama-architecture file as a dense Llama: a Mixtral file's experts
        # (`ffn_*_exps`) have nowhere to go.
        raise GGUFError(
            f"GGUF file {name} has architecture {arch!r} with experts (Mixtral-style), which "
            "transformers' GGUF reader cannot convert; serve the model's HF checkpoint instead."
        )
    checked: dict[str, None] = {}
    for tensor in header.tensors:
        try:
            qtype = GGMLQuantizationType(tensor.type_code)
        except ValueError as e:
            raise GGUFError(f"GGUF file {name}: tensor {tensor.name!r} has unknown type {tensor.type_code}.") from e
        if qtype.name in checked:
            continue
        try:  # one (zero) block is enough to learn whether the type can be dequantized
            block = np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
            dequantize(block, qtype)
        except NotImplementedError as e:
            raise GGUFError(
                f"GGUF file {name}: tensor {tensor.name!r} uses quantization type "
                f"{qtype.name}, which cannot be dequantized here ({e})."
            ) from e
        checked[qtype.name] = None
    return GGUFSummary(arch, tuple(checked))


def gguf_folder(
    path: str, dtype: torch.dtype, hf_config_path: str | None = None, keep_quantized: bool | None = None
) -> str:
    """The cached HF-format folder for GGUF file `path` in `dtype`, converting it on first use.
    `keep_quantized`: None keeps quantized linears where loraserve serves them (unless
    LORASERVE_GGUF_DEQUANTIZE=1); False always dequantizes (a folder transformers itself can load)."""
    summary = inspect_gguf(path)
    digest = file_digest(path)
    keep = (
        keep_quantized is not False
        and not envs.gguf_dequantize()
        and gguf_quantized.keeps_quantized(summary.architecture, summary.tensor_types)
    )
    key = _cache_key(digest, dtype, hf_config_path, keep)
    folder = os.path.join(envs.cache_root(), "gguf", key)
    if os.path.isfile(os.path.join(folder, _COMPLETE)):
        return folder
    staging = stage(os.path.dirname(folder), ".convert-")
    start = time.perf_counter()
    logger.info(
        "Converting GGUF %s (%s; %s) to %s%s once; the result is cached in %s.",
        os.path.basename(path),
        summary.architecture,
        ", ".join(summary.tensor_types),
        dtype,
        " with its quantized linears kept" if keep else "",
        folder,
    )
    try:
        _convert_into(staging, path, dtype, hf_config_path, keep)
        _write_json(os.path.join(staging, _COMPLETE), {"source": path, "sha256": digest, "dtype": str(dtype)})
        publish(staging, folder, _COMPLETE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("Converted %s in %.1fs.", os.path.basename(path), time.perf_counter() - start)
    return folder


def _cache_key(digest: str, dtype: torch.dtype, hf_config_path: str | None, keep_quantized: bool) -> str:
    # quantized-2: the embedding kept quantized too, a tied LM head sharing its blocks
    parts = [digest, str(dtype), CONVERTER_VERSION] + (["quantized-2"] if keep_quantized else [])
    if hf_config_path:
        with open(_config_file(hf_config_path), "rb") as f:
            parts.append(hashlib.sha256(f.read()).hexdigest())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:40]


def _config_file(hf_config_path: str) -> str:
    path = os.path.expanduser(hf_config_path)
    config_file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(config_file):
        raise GGUFError(
            f"hf_config_path {hf_config_path!r} is neither a config.json file nor a folder holding one."
        )
    return config_file


@contextlib.contextmanager
def one_gguf_parse(path: str) -> Iterator[None]:
    """While converting `path`, every `gguf.GGUFReader(path)` is one reader and `gguf.get_tensor_name_map`
    answers each (architecture, layers) once. transformers parses the file again for the config, twice
    for the tokenizer and once per tensor load, and a parse builds a numpy view per metadata element
    (~10 s each for SmolLM2's 100k tokenizer strings on an AVX2 EPYC); its weight-name map is rebuilt
    for each of the model's ~400 modules (32 ms each). Both are read-only once built, so sharing them
    changes nothing but the time (SmolLM2 kept quantized in bf16: 43 s -> 14 s with the header read)."""
    import gguf

    with _PARSE_LOCK:  # the patch is process-wide: two at once would restore each other's
        real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        shared = real_reader(path)
        target = os.path.realpath(path)

        def reader(file: Any, mode: Any = "r") -> Any:
            same = mode == "r" and os.path.realpath(os.fspath(file)) == target
            return shared if same else real_reader(file, mode)

        gguf.GGUFReader = reader  # type: ignore[misc,assignment]
        gguf.get_tensor_name_map = functools.cache(real_name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map  # type: ignore[misc]


def _convert_into(out_dir: str, path: str, dtype: torch.dtype, hf_config_path: str | None, keep: bool) -> None:
    with one_gguf_parse(path):
        _convert_with_reader(out_dir, path, dtype, hf_config_path, keep)


def _convert_with_reader(
    out_dir: str, path: str, dtype: torch.dtype, hf_config_path: str | None, keep: bool
) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = os.path.dirname(path), os.path.basename(path)
    if hf_config_path:
        config = AutoConfig.from_pretrained(_config_file(hf_config_path))
    else:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        _add_longrope(config, path)
        _add_moe_widths(config, path)
    config.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
    with torch.device("meta"):  # only the parameter names, to map GGUF names onto HF ones
        skeleton = AutoModelForCausalLM.from_config(config)
    if keep:
        kept, index = gguf_quantized.convert_tensors(path, skeleton)
        missing = _missing_weights(skeleton, kept, config)
        if missing:
            raise GGUFError(f"GGUF file {name} lacks weights the model needs: {missing[:5]}.")
        gguf_quantized.save_tensors(out_dir, kept, index, dtype)
        return
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    missing = _missing_weights(skeleton, tensors, config)
    if missing:
        raise GGUFError(f"GGUF file {name} lacks weights the model needs: {missing[:5]}.")
    save_file(
        {key: value.to(dtype).contiguous() for key, value in tensors.items()},
        os.path.join(out_dir, "model.safetensors"),
        metadata={"format": "pt", "source": "gguf"},
    )


def _add_longrope(config: Any, path: str) -> None:
    """Phi-3.5-style files keep LongRoPE as `rope_factors_long` / `rope_factors_short` tensors and the
    original length in `phi3.rope.scaling.original_context_length`, which transformers' reader does
    not turn into config; without them the model would run on plain rope. Set them as the HF config
    has them (the attention factor as the file gives it, else transformers derives the same one)."""
    if getattr(config, "model_type", None) != "phi3":
        return
    from gguf import GGUFReader

    reader = GGUFReader(path)
    factors = {
        t.name: [float(v) for v in t.data] for t in reader.tensors if t.name.startswith("rope_factors_")
    }
    original = reader.fields.get("phi3.rope.scaling.original_context_length")
    if (
        "rope_factors_long.weight" not in factors
        or "rope_factors_short.weight" not in factors
        or original is None
    ):
        return
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(
        rope_type="longrope",
        long_factor=factors["rope_factors_long.weight"],
        short_factor=factors["rope_factors_short.weight"],
        original_max_position_embeddings=int(original.parts[original.data[0]][0]),
    )
    attn = reader.fields.get("phi3.rope.scaling.attn_factor")
    if attn is not None:
        params["attention_factor"] = float(attn.parts[attn.data[0]][0])
    config.original_max_position_embeddings = params["original_max_position_embeddings"]
    config.rope_parameters = params


# llama.cpp's MoE metadata transformers' reader drops (it leaves the config's defaults, the widths of
# Qwen1.5-MoE-A2.7B / Qwen3-30B-A3B), under `{arch}.` -> the HF config attribute.
_MOE_FIELDS = {
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",
}


def _add_moe_widths(config: Any, path: str) -> None:
    """Set the expert widths (and top-k renormalisation) a Qwen2-MoE / Qwen3-MoE file states."""
    if getattr(config, "model_type", None) not in ("qwen2_moe", "qwen3_moe"):
        return
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch_field = reader.fields["general.architecture"]
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode("utf-8", errors="replace")
    for key, attribute in _MOE_FIELDS.items():
        field = reader.fields.get(f"{arch}.{key}")
        if field is not None:
            value = field.parts[field.data[0]][0]
            setattr(config, attribute, bool(value) if attribute == "norm_topk_prob" else int(value))


def _missing_weights(skeleton: Any, tensors: dict[str, Any], config: Any) -> list[str]:
    tied = getattr(config, "tie_word_embeddings", False)
    expected = [name for name, _ in skeleton.named_parameters() if not (tied and name == "lm_head.weight")]
    return [name for name in expected if name not in tensors]


def _write_json(path: str, value: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f)
