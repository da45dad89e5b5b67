"""A GGUF file's header read in one pass: scalar and string metadata, array lengths, the tensor table.

gguf's `GGUFReader` parses every element of every array into numpy views (SmolLM2's vocabulary and
merges: ~2.5 million memmap slices), 2.0 s on an Intel Xeon before specee read one config value;
this walks the same bytes with `struct` and skips arrays (their element count is kept; string
arrays are stepped over by their lengths), 0.02-0.1 s. The tensors come out as gguf's own
`ReaderTensor`s over one read-only memory map, shaped as `GGUFReader` shapes them, so everything
downstream (dequantization, raw blocks) is unchanged.
"""
from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# GGUF value types: struct code of the fixed-size ones; 8 is a string, 9 an array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
# what reading a truncated or corrupt header raises (struct past the end, bad UTF-8, runaway nesting, ...)
READ_ERRORS = (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, struct.error, RecursionError)
NUMPY_ITEMS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
               "I32": np.int32, "I64": np.int64}  # every other type's data is its raw bytes (uint8)


class Header:
    """metadata: {key: value} of scalars and strings; array_lengths: {key: element count} of arrays;
    metadata_end: where the key-value pairs end; tensors: gguf ReaderTensors (data memory-mapped);
    data_offset: where tensor data starts."""

    def __init__(self, path: str | Path):
        self.map = np.memmap(path, mode="r")
        self.buf = memoryview(self.map)
        if bytes(self.buf[:4]) != MAGIC:
            raise ValueError("GGUF magic invalid")
        self.order, self.pos = "<", 4
        version = self.scalar(4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order, self.pos = ">", 4
            version = self.scalar(4)
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {VERSIONS})")
        tensor_count, kv_count = self.scalar(10), self.scalar(10)
        self.metadata: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        for _ in range(kv_count):
            key, kind = self.string(), self.scalar(4)
            if kind == ARRAY:
                self.array_lengths[key] = self.skip_array()
            else:
                self.metadata[key] = self.value(kind)
        self.metadata_end = self.pos  # bytes 0 .. metadata_end: the version and every key-value pair
        infos = [self.tensor_info() for _ in range(tensor_count)]
        if len({info[0] for info in infos}) < len(infos):  # which of two tensors of one name loads would be chance
            seen: set[str] = set()
            twice = next(name for name, *_ in infos if name in seen or seen.add(name))
            raise ValueError(f"tensor {twice} appears twice")
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        self.data_offset = -(-self.pos // alignment) * alignment
        self.tensors = [self.tensor(*info) for info in infos]

    def unpack(self, code: str) -> Any:
        size = struct.calcsize(code)
        if self.pos + size > len(self.buf):
            raise ValueError(f"the header runs past the end of the file ({len(self.buf)} bytes)")
        value = struct.unpack_from(self.order + code, self.buf, self.pos)[0]
        self.pos += size
        return value

    def scalar(self, kind: int) -> Any:
        return self.unpack(SCALARS[kind])

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        text = str(self.buf[self.pos : self.pos + n], "utf-8")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind not in SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(kind)

    def skip_array(self) -> int:
        """Step over an array (nested ones too); returns its element count."""
        kind, count = self.scalar(4), self.unpack("Q")
        if kind == STRING:
            read_length, pos, end = struct.Struct(self.order + "Q").unpack_from, self.pos, len(self.buf)
            for _ in range(count):  # the vocabulary and merges: 100,000s of strings, so no per-item calls
                if pos + 8 > end:
                    raise ValueError(f"the header runs past the end of the file ({end} bytes)")
                pos += 8 + read_length(self.buf, pos)[0]
            self.pos = pos
        elif kind == ARRAY:
            for _ in range(count):
                self.skip_array()
        elif kind in SCALARS:
            self.pos += count * struct.calcsize(SCALARS[kind])
        else:
            raise ValueError(f"unknown GGUF array type {kind}")
        if self.pos > len(self.buf):
            raise ValueError("an array runs past the end of the file")
        return count

    def tensor_info(self) -> tuple[str, list[int], int, int]:
        name, n_dims = self.string(), self.scalar(4)
        if n_dims > MAX_DIMS:
            raise ValueError(f"tensor {name} has {n_dims} dimensions (GGML has at most {MAX_DIMS})")
        dims = [self.scalar(10) for _ in range(n_dims)]
        return name, dims, self.scalar(4), self.scalar(10)

    def tensor(self, name: str, dims: list[int], raw_type: int, offset: int):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        ggml_type = GGMLQuantizationType(raw_type)
        n_elements = math.prod(int(d) for d in dims)  # Python ints: numpy's int64 product wrapped (2**32 x 2**32 = 0)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elements * type_size // block_size
        shape = tuple(reversed(dims))
        item = NUMPY_ITEMS.get(ggml_type.name)
        if item is None:
            item, count, shape = np.uint8, n_bytes, quant_shape_to_byte_shape(shape, ggml_type)
        else:
            count = n_elements
        start = self.data_offset + offset
        dtype = np.dtype(item).newbyteorder(self.order)
        if start + count * dtype.itemsize > len(self.map):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(self.map, dtype=dtype, count=count, offset=start).reshape(shape)
        return ReaderTensor(name=name, tensor_type=ggml_type, shape=np.array(dims, dtype=np.uint64),
                            n_elements=n_elements, n_bytes=n_bytes, data_offset=start, data=data, field=None)
