"""A direct reader of GGUF files: metadata and tensor directory parsed with `struct` in one pass, tensor
data as views of a memory map. (The gguf package's reader takes seconds on a 49k-token vocabulary.)"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy) order: GGUF's dimensions reversed
    ggml_type: int
    offset: int  # from the start of the file


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._read_bytes(4) != b"GGUF":
            raise GGUFFormatError("not a GGUF file (bad magic)")
        version = self._scalar("<I")
        if version < 2:
            raise GGUFFormatError(f"GGUF version {version} is too old (2 or newer is read)")
        num_tensors, num_fields = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            infos.append((name, tuple(reversed(dims)), self._scalar("<I"), self._scalar("<Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos]

    def tensor_data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as uint8, one row per tensor row (gguf.quants.dequantize decodes them)."""
        from gguf import GGML_QUANT_SIZES
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        num_elements = int(np.prod(info.shape))
        num_bytes = num_elements // block_size * type_size
        raw = np.frombuffer(self._map, dtype=np.uint8, count=num_bytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return raw.reshape(rows, -1) if len(info.shape) > 1 else raw

    # ---- parsing helpers ----------------------------------------------------------------------------
    def _read_bytes(self, n: int) -> bytes:
        data = self._map[self._pos:self._pos + n]
        if len(data) < n:
            raise GGUFFormatError("file ends inside its header")
        self._pos += n
        return data

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        return self._read_bytes(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _string_array(self, count: int) -> list[str]:
        data, pos, out = self._map, self._pos, []
        unpack_length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = unpack_length(data, pos)
            out.append(data[pos + 8:pos + 8 + length].decode("utf-8", errors="replace"))
            pos += 8 + length
        self._pos = pos
        return out

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            item_type, count = self._scalar("<I"), self._scalar("<Q")
            if item_type == _STRING:
                return self._string_array(count)
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += dtype.itemsize * count
                return values.tolist()
            return [self._value(item_type) for _ in range(count)]
        if value_type in _SCALARS:
            return self._scalar(_SCALARS[value_type])
        raise GGUFFormatError(f"unknown GGUF value type {value_type}")
