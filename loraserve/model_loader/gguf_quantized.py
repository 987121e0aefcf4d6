"""A GGUF file's tensors under HF names with its quantized linear weights kept in their block formats.

The cached folder then holds one `model.safetensors` with the dense tensors in the serving dtype and,
for every weight kept quantized, its blocks as uint8 rows under the HF name; `quantized.json` names
those and their formats (`read_index`, and `weights.iterate_weights` turns them into QuantTensors).
Kept quantized: 2-D weights in a format the kernels serve (layers/quant/formats.py) of the
architectures whose GGUF tensors reach the model unchanged but for a permutation of rows (Llama's
q/k heads, which a block row survives), the token embedding included: the model gathers its rows
from the blocks (`layers/quant/embedding.py`), and a tied LM head runs on the same blocks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from loraserve.layers.quant.formats import QUANT_TYPES, QuantTensor

QUANT_INDEX = "quantized.json"
KEPT_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values (Mistral files say llama)


def keeps_quantized(architecture: str, tensor_types: tuple[str, ...]) -> bool:
    """Whether a file of this architecture and these tensor types is served with quantized weights."""
    return architecture in KEPT_ARCHITECTURES and any(name in QUANT_TYPES for name in tensor_types)


def convert_tensors(path: str, skeleton: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(HF name -> dense float32 tensor or QuantTensor, the quantized.json index) of the GGUF at `path`."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    reader = GGUFReader(path)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(
        config=load_gguf_checkpoint(path)["config"]
    )
    names = get_gguf_hf_weights_map(skeleton, processor)
    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        qtype = QUANT_TYPES.get(tensor.tensor_type.name)
        quantized = qtype is not None and len(tensor.shape) == 2
        data = np.asarray(tensor.data) if quantized else dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=data, name=tensor.name, tensor_key_mapping=names, parsed_parameters={}
        )
        if result.name not in names:
            continue
        name = names[result.name]
        array = result.weights
        if not (array.flags.writeable and array.flags.c_contiguous):  # the reader's read-only file mapping
            array = np.array(array)
        values = torch.from_numpy(array)
        if not quantized or qtype is None:
            tensors[name] = values
            continue
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dimensions innermost first
        tensors[name] = QuantTensor(values, qtype, shape)  # a tied LM head shares the embedding's at load
    index = {
        name: {"type": t.qtype.name, "shape": list(t.shape)}
        for name, t in tensors.items()
        if isinstance(t, QuantTensor)
    }
    return tensors, index


def save_tensors(out_dir: str, tensors: dict[str, Any], index: dict[str, Any], dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    flat = {
        name: (t.blocks if isinstance(t, QuantTensor) else t.to(dtype)).contiguous()
        for name, t in tensors.items()
    }
    save_file(flat, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt", "source": "gguf"})
    with open(os.path.join(out_dir, QUANT_INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f)


def read_index(model_path: str) -> dict[str, tuple[str, tuple[int, int]]]:
    """The folder's quantized tensors: HF name -> (format name, [out, in]); {} for a dense folder."""
    path = os.path.join(model_path, QUANT_INDEX)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        index = json.load(f)
    return {
        name: (entry["type"], (int(entry["shape"][0]), int(entry["shape"][1])))
        for name, entry in index.items()
    }


def as_quant_tensor(tensor: torch.Tensor, entry: tuple[str, tuple[int, int]]) -> QuantTensor:
    return QuantTensor(tensor, QUANT_TYPES[entry[0]], entry[1])
