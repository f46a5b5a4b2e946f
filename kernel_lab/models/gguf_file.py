"""The GGUF container, read straight from a memory map: metadata, tensor directory, tensor bytes.

    f = GGUFFile(path)            # parses the header, the metadata and the tensor directory; maps the file
    f.metadata["general.architecture"], f.tensors["blk.0.attn_q.weight"].ggml_type
    f.tensor_bytes(info)          # uint8 numpy view of the tensor's bytes in the map (no copy)

Why not gguf.GGUFReader: it turns every metadata item into numpy views, which for a vocabulary of 49k tokens
and as many merges takes seconds (about 3 s on the 2-core machine for the 1B files, most of a cold start);
this reads strings with one slice each and scalar arrays with one np.frombuffer, in a fraction of that.

Every offset is checked against the file's size before it is read: a truncated or corrupt file fails here,
with the offset and, past the header, the tensor's name (never a short read, an out-of-bounds view, or a
reshape error far from the cause).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    shape: tuple[int, ...]   # outermost first (GGUF stores innermost first)
    offset: int              # absolute, in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


class GGUFFile:
    def __init__(self, path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"model path {str(self.path)!r} is not a file")
        self.map = np.memmap(self.path, dtype=np.uint8, mode="c")  # copy-on-write: writable views, no copies
        self.size = len(self.map)
        self._buffer = memoryview(self.map)
        self._at = 0
        if self._take(4, "the magic") != MAGIC:
            raise ValueError(f"{str(self.path)!r} is not a GGUF file (no GGUF magic at offset 0)")
        version, n_tensors, n_kv = self._unpack("<I", "the version"), *self._unpack("<QQ", "the counts")
        if version not in (2, 3):
            raise ValueError(f"{str(self.path)!r}: GGUF version {version} is not supported (2 or 3)")
        self.metadata: dict = {}
        self.value_types: dict[str, tuple[int, int | None]] = {}  # key -> (GGUF value type, array item type)
        for _ in range(n_kv):
            key = self._string("a metadata key")
            self.metadata[key] = self._value(self._unpack("<I", f"the type of {key!r}"), key)
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{str(self.path)!r}: general.alignment {alignment} is not a power of two")
        directory = []
        for _ in range(n_tensors):
            name = self._string("a tensor name")
            n_dims = self._unpack("<I", f"tensor {name!r}'s rank")
            if n_dims > 4:
                raise ValueError(f"{str(self.path)!r}: tensor {name!r} has {n_dims} dimensions (at most 4)")
            dims = struct.unpack(f"<{n_dims}Q", self._take(8 * n_dims, f"tensor {name!r}'s shape"))
            ggml_type, offset = self._unpack("<IQ", f"tensor {name!r}'s type and offset")
            directory.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        data_start = -(-self._at // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset in directory:
            try:
                block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise ValueError(f"{str(self.path)!r}: tensor {name!r} has an unknown ggml type {ggml_type}") from None
            count = int(np.prod(shape, dtype=np.int64)) if shape else 1
            if count % block or (shape and shape[-1] % block):
                raise ValueError(f"{str(self.path)!r}: tensor {name!r} of shape {shape} does not divide into "
                                 f"blocks of {block} ({GGMLQuantizationType(ggml_type).name})")
            start, nbytes = data_start + offset, count // block * block_bytes
            if offset % alignment or start + nbytes > self.size:
                raise ValueError(f"{str(self.path)!r}: tensor {name!r} at offset {start} needs {nbytes} bytes but the "
                                 f"file ends at {self.size}" + (" (truncated?)" if start + nbytes > self.size
                                                                 else f" (offset not {alignment}-aligned)"))
            self.tensors[name] = TensorInfo(name, ggml_type, shape, start, nbytes)

    # ------------------------------------------------------------------------------------------- parsing
    def _take(self, n: int, what: str) -> bytes:
        if n < 0 or self._at + n > self.size:
            raise ValueError(f"{str(self.path)!r} is truncated or corrupt: {what} at offset {self._at} needs {n} "
                             f"bytes, the file has {self.size}")
        chunk = self._buffer[self._at:self._at + n]
        self._at += n
        return chunk.tobytes()

    def _unpack(self, fmt: str, what: str):
        values = struct.unpack(fmt, self._take(struct.calcsize(fmt), what))
        return values[0] if len(values) == 1 else values

    def _string(self, what: str) -> str:
        raw = self._take(self._unpack("<Q", what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{str(self.path)!r} is corrupt: {what} before offset {self._at} is not UTF-8") from None

    def _strings(self, count: int, key: str) -> list[str]:
        """`count` length-prefixed strings (a vocabulary: ~10^5 of them), read in one tight loop: through
        _string they took about a second per 10^5 on a 2-core VM, most of a 1B model's load."""
        buffer, size, at, out = self._buffer, self.size, self._at, []
        length = struct.Struct("<Q").unpack_from
        for i in range(count):
            n = length(buffer, at)[0] if at + 8 <= size else None
            if n is None or at + 8 + n > size:
                raise ValueError(f"{str(self.path)!r} is truncated or corrupt: item {i} of {key!r} at offset {at} "
                                 f"needs {8 if n is None else 8 + n} bytes, the file has {size}")
            try:
                out.append(str(buffer[at + 8:at + 8 + n], "utf-8"))
            except UnicodeDecodeError:
                raise ValueError(f"{str(self.path)!r} is corrupt: item {i} of {key!r} at offset {at} is not "
                                 "UTF-8") from None
            at += 8 + n
        self._at = at
        return out

    def _value(self, vtype: int, key: str):
        self.value_types[key] = (vtype, None)
        if vtype == STRING:
            return self._string(f"the value of {key!r}")
        if vtype == ARRAY:
            item_type, count = self._unpack("<IQ", f"the array header of {key!r}")
            self.value_types[key] = (vtype, item_type)
            if item_type == STRING:
                return self._strings(count, key)
            if item_type not in _NUMPY:
                raise ValueError(f"{str(self.path)!r}: {key!r} is an array of unsupported type {item_type}")
            dtype = np.dtype(_NUMPY[item_type])
            items = np.frombuffer(self._take(count * dtype.itemsize, f"the items of {key!r}"), dtype=dtype)
            return [bool(v) for v in items] if item_type == 7 else items.tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"{str(self.path)!r} is corrupt: {key!r} has value type {vtype} (offset {self._at})")
        return self._unpack(_SCALARS[vtype], f"the value of {key!r}")

    # ------------------------------------------------------------------------------------------- tensors
    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a uint8 view of the map (copy-on-write: writing never reaches the file)."""
        return self.map[info.offset:info.offset + info.nbytes]

    def tensor_data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
