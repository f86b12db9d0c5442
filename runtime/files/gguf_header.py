"""A GGUF file's header: key/values and tensor infos, parsed with the standard library
alone (no numpy, no torch), so that `infer list` and `infer info` read a model without
importing either. gguf.py maps the tensors' data over the same parse.

Layout (GGUF v2/v3, little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x   (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset, offsets aligned

A string is a u64 byte length followed by UTF-8 bytes; an array is u32 element type,
u64 count, then the elements (arrays may nest). GGUF lists dims innermost first, so
torch shapes are the reversed dims.

Arrays (the vocabulary, merges, token types: a few hundred thousand values) are only
stepped over when the header is parsed, and decoded each time they are asked for (`get`,
`metadata`), not kept: describing a model never decodes its vocabulary, and a loaded
model does not hold its vocabulary's strings twice. We parse the header
ourselves rather than with gguf.GGUFReader, which builds a numpy view per field and so
takes seconds to open a file with a large vocabulary.
"""

from __future__ import annotations

import itertools
import math
import mmap
import re
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ... import InferError
from .ggml_types import GGML_BLOCKS, GGMLType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # arrays of arrays; garbage could otherwise recurse without bound


def is_gguf(path: Path) -> bool:
    """True if `path` is a file that starts with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


# ---------------------------------------------------------------------------------------
# Key/value parsing
# ---------------------------------------------------------------------------------------

# GGUF value types (gguf.GGUFValueType) -> struct of fixed-size scalars.
_SCALARS = {
    0: struct.Struct("<B"),  # UINT8
    1: struct.Struct("<b"),  # INT8
    2: struct.Struct("<H"),  # UINT16
    3: struct.Struct("<h"),  # INT16
    4: struct.Struct("<I"),  # UINT32
    5: struct.Struct("<i"),  # INT32
    6: struct.Struct("<f"),  # FLOAT32
    7: struct.Struct("<?"),  # BOOL
    10: struct.Struct("<Q"),  # UINT64
    11: struct.Struct("<q"),  # INT64
    12: struct.Struct("<d"),  # FLOAT64
}
_STRING = 8
_ARRAY = 9
# The fewest bytes one element of each value type takes, to reject absurd array counts early.
_MIN_SIZE = {**{t: s.size for t, s in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class _Array:
    """An array value stepped over, not yet decoded: where it starts (its element type)
    and how many elements it has; for a long array of strings, where each string's
    length is and where the last ends (so decoding it reads no length again)."""

    at: int
    count: int
    heads: array | None = field(default=None, compare=False, repr=False)
    end: int = 0


class _Cursor:
    """A cursor over the file's bytes that raises InferError instead of reading past the end."""

    def __init__(self, buf: memoryview, path: Path, pos: int = 0):
        self.buf = buf
        self.size = len(buf)
        self.pos = pos
        self.path = path

    def fail(self, problem: str) -> InferError:
        return InferError(f"{self.path}: {problem}")

    def truncated(self, what: str) -> InferError:
        return self.fail(f"truncated GGUF file: {what} runs past the end of the file")

    def need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise self.truncated(what)

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def value(self, vtype: int, what: str) -> Any:
        """A scalar or string value, or an array stepped over (an _Array)."""
        if vtype in _SCALARS:
            scalar = _SCALARS[vtype]
            self.need(scalar.size, what)
            (v,) = scalar.unpack_from(self.buf, self.pos)
            self.pos += scalar.size
            return v
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            return self.skip_array(what, depth=1)
        raise self.fail(f"{what} has unknown value type {vtype}")

    def _array_head(self, what: str, depth: int) -> tuple[int, int]:
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        etype = self.u32(what)
        count = self.u64(what)
        if etype not in _MIN_SIZE:
            raise self.fail(f"{what} is an array of unknown value type {etype}")
        if count * _MIN_SIZE[etype] > self.size - self.pos:
            raise self.fail(
                f"truncated GGUF file: {what} claims {count} elements, more than the file holds"
            )
        return etype, count

    def skip_array(self, what: str, depth: int) -> _Array:
        """Step over an array, checking only that it lies inside the file."""
        at = self.pos
        etype, count = self._array_head(what, depth)
        if etype in _SCALARS:
            self.pos += count * _SCALARS[etype].size
        elif etype == _STRING:
            # Only the lengths are read: a vocabulary is ~100k strings.
            buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
            heads = [] if count >= _BULK_STRINGS and depth == 1 else None
            try:
                if heads is None:
                    for _ in itertools.repeat(None, count):
                        pos += 8 + unpack(buf, pos)[0]
                else:
                    append = heads.append
                    for _ in itertools.repeat(None, count):
                        append(pos)
                        pos += 8 + unpack(buf, pos)[0]
            except (struct.error, OverflowError):  # a length that leads past the end
                raise self.truncated(what) from None
            if pos > self.size:
                raise self.truncated(what)
            self.pos = pos
            # 8 bytes a position, not a python int each (36 bytes)
            return _Array(at, count, None if heads is None else array("q", heads), pos)
        else:
            for _ in range(count):
                self.skip_array(what, depth + 1)
        return _Array(at, count)

    def array(self, what: str, depth: int) -> list:
        """The array at the cursor (its head included), decoded."""
        etype, count = self._array_head(what, depth)
        if etype in _SCALARS:
            # Numeric arrays (token scores, token types) in one read.
            scalar = _SCALARS[etype]
            values = struct.unpack_from(f"<{count}{scalar.format[1:]}", self.buf, self.pos)
            self.pos += count * scalar.size
            return list(values)
        if etype == _STRING:
            return self._string_array(count, what)
        return [self.array(what, depth + 1) for _ in range(count)]

    def _string_array(self, count: int, what: str) -> list[str]:
        # Short arrays, and long ones holding a string that is not UTF-8 (named here). A
        # length past the end shows as a failed read or as an end beyond the file,
        # checked once.
        buf, pos, unpack = self.buf, self.pos, _U64.unpack_from
        out = []
        append = out.append
        try:
            for _ in itertools.repeat(None, count):
                end = pos + 8 + unpack(buf, pos)[0]
                append(str(buf[pos + 8 : end], "utf-8"))
                pos = end
        except (struct.error, OverflowError):
            raise self.truncated(what) from None
        except UnicodeDecodeError:
            if pos + 8 <= end <= self.size:
                raise self.fail(f"{what}: element {len(out)} is not valid UTF-8") from None
            raise self.truncated(what) from None
        if pos > self.size:
            raise self.truncated(what)
        self.pos = pos
        return out

    def decoded(self, key: str, value: Any) -> Any:
        """`value` of `key`, an array stepped over decoded now."""
        if not isinstance(value, _Array):
            return value
        if value.heads:  # the vocabulary, merges: decoded together (_decode_strings)
            strings = _decode_strings(self.buf, value.heads, value.end)
            if strings is not None:
                return strings
        # Otherwise one at a time, which also names a string that is not UTF-8.
        return _Cursor(self.buf, self.path, value.at).array(f"value of {key!r}", depth=1)


# String arrays at least this long are decoded in bulk (numpy is imported for them only):
# where their lengths are is kept when the header is read, and the strings are cut and
# decoded at once.
_BULK_STRINGS = 4096
# Bytes that are not UTF-8, as decoding with surrogateescape spells them (0xFF apart).
_NOT_UTF8 = re.compile("[\udc80-\udcfe]")


def _decode_strings(buf: memoryview, heads: array, end: int) -> list[str] | None:
    """The strings whose 8-byte lengths are at `heads`, the last ending at `end`; None if
    one is not valid UTF-8. Every length's last byte becomes 0xFF, a byte UTF-8 never
    holds, the other seven are dropped, and the whole decodes once and splits there."""
    import numpy as np

    start = heads[0]
    raw = np.frombuffer(buf, np.uint8, end - start, start)
    at = np.frombuffer(heads, np.int64) - start
    step = np.zeros(len(raw) + 1, np.int8)
    step[at] = 1
    step[at + 7] = -1
    joined = raw[np.cumsum(step[:-1], dtype=np.int8) == 0]
    joined[at - 7 * np.arange(len(at))] = 0xFF  # where each length's last byte went
    text = joined.tobytes().decode("utf-8", "surrogateescape")
    out = text.split("\udcff")
    # A string holding 0xFF splits in two; any other byte that is not UTF-8 shows as such.
    if len(out) != len(heads) + 1 or _NOT_UTF8.search(text):
        return None
    return out[1:]


def _file_bytes(path: Path) -> int:
    """The size of a file that could be a GGUF file (one that holds at least a magic)."""
    try:
        size = path.stat().st_size
    except OSError as err:
        raise InferError(f"{path}: cannot open GGUF file ({err.strerror})") from None
    if size < 4:
        raise InferError(f"{path}: not a GGUF file (only {size} bytes)")
    return size


def _map(path: Path) -> memoryview:
    """The whole file, mapped read-only."""
    with open(path, "rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _start(buf: memoryview, path: Path) -> tuple[_Cursor, int]:
    """A cursor past the magic and the version, both checked; and the version."""
    r = _Cursor(buf, path)
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise r.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    r.pos = 4
    version = r.u32("header")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise r.fail(
            f"unsupported GGUF version {version}{hint}; supported: "
            + ", ".join(map(str, SUPPORTED_VERSIONS))
        )
    return r, version


def _key_values(r: _Cursor, n_kv: int) -> Iterator[tuple[str, Any]]:
    """Each key/value at the cursor, in file order, arrays stepped over."""
    for i in range(n_kv):
        key = r.string(f"key {i}")
        vtype = r.u32(f"key {key!r}")
        yield key, r.value(vtype, f"value of {key!r}")


def read_value(path: Path, key: str) -> Any:
    """One key's value, reading the file's key/values no further than that key (what
    `infer list` reads: general.file_type); None if the file has no such key."""
    path = Path(path)
    _file_bytes(path)
    r, _ = _start(_map(path), path)
    r.u64("header")  # tensor count
    for k, value in _key_values(r, r.u64("header")):
        if k == key:
            return r.decoded(k, value)
    return None


# ---------------------------------------------------------------------------------------
# The header
# ---------------------------------------------------------------------------------------

_BLOCK_INDEX_RE = re.compile(r"blk\.(\d+)\.")
_FLOAT_CODES = {GGMLType.F32: "f", GGMLType.F16: "e", GGMLType.F64: "d"}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the header describes it."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    ggml_type: GGMLType
    shape: tuple[int, ...]  # torch order (rows, cols) = reversed GGUF dims
    offset: int  # absolute byte offset of its data in the file
    nbytes: int


class GGUFHeader:
    """A GGUF file's key/values and tensor infos, every count, offset and size checked
    against the file; array values decoded when asked for."""

    def __init__(self, path):
        self.path = Path(path)
        self.file_bytes = _file_bytes(self.path)
        self._buf = self._map_file()
        r, self.version = _start(self._buf, self.path)
        n_tensors = r.u64("header")
        n_kv = r.u64("header")
        # Each key/value takes at least 13 bytes, each tensor info at least 32.
        if n_kv * 13 + n_tensors * 32 > self.file_bytes:
            raise r.fail(
                f"bad GGUF header: {n_kv} key/values and {n_tensors} tensors "
                f"cannot fit in {self.file_bytes} bytes"
            )

        self._values: dict[str, Any] = {}  # arrays as _Array until decoded
        for key, value in _key_values(r, n_kv):
            if key in self._values:
                raise r.fail(f"duplicate key {key!r}")
            self._values[key] = value

        self.alignment = self.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(self.alignment, int) or self.alignment <= 0:
            raise r.fail(f"bad general.alignment {self.alignment!r}")
        if self.alignment & (self.alignment - 1):
            raise r.fail(f"general.alignment {self.alignment} is not a power of two")

        infos = []  # (name, ggml_type, shape, relative offset)
        for i in range(n_tensors):
            name = r.string(f"tensor info {i}")
            what = f"tensor info of {name!r}"
            n_dims = r.u32(what)
            if not 1 <= n_dims <= MAX_DIMS:
                raise r.fail(f"tensor {name!r} has {n_dims} dims (GGUF allows 1 to {MAX_DIMS})")
            dims = [r.u64(what) for _ in range(n_dims)]
            if 0 in dims:
                raise r.fail(f"tensor {name!r} has a dimension of 0 ({dims})")
            raw_type = r.u32(what)
            offset = r.u64(what)
            try:
                ggml_type = GGMLType(raw_type)
            except ValueError:
                raise r.fail(f"tensor {name!r} has unknown ggml type {raw_type}") from None
            infos.append((name, ggml_type, tuple(reversed(dims)), offset))

        # Tensor data starts at the first aligned offset after the tensor infos.
        self.data_offset = -(-r.pos // self.alignment) * self.alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, ggml_type, shape, offset in infos:
            if name in self.tensors:
                raise r.fail(f"duplicate tensor {name!r}")
            block_size, type_size = GGML_BLOCKS[ggml_type]
            if shape[-1] % block_size:
                raise r.fail(
                    f"tensor {name!r}: row length {shape[-1]} is not a multiple of the "
                    f"{ggml_type.name} block size {block_size}"
                )
            if offset % self.alignment:
                raise r.fail(
                    f"tensor {name!r}: data offset {offset} is not aligned to {self.alignment}"
                )
            nbytes = math.prod(shape) // block_size * type_size
            start = self.data_offset + offset
            if start + nbytes > self.file_bytes:
                raise r.fail(
                    f"truncated GGUF file: data of tensor {name!r} ends at byte "
                    f"{start + nbytes}, past the end of the file ({self.file_bytes} bytes)"
                )
            self.tensors[name] = TensorInfo(name, ggml_type, shape, start, nbytes)
        self._check_spans(r)

        # Blocks the tensors hold: blk.0 to blk.N-1 (what block_count must say).
        blocks = (_BLOCK_INDEX_RE.match(name) for name in self.tensors)
        self.n_blocks = max((int(m.group(1)) + 1 for m in blocks if m), default=0)

        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise r.fail("no general.architecture key")
        self.arch: str = arch

    def _map_file(self) -> memoryview:
        """The whole file, mapped (gguf.GGUFFile maps it for its tensors' data too)."""
        return _map(self.path)

    def _check_spans(self, r: _Cursor) -> None:
        """Writers lay tensors back to back, each padded to the alignment: a gap means a
        tensor's type or shape was changed to one that takes fewer bytes."""
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, prev_end, prev), (start, _, name) in itertools.pairwise(spans):
            if start < prev_end:
                raise r.fail(f"tensors {prev!r} and {name!r} overlap in the file")
            if start - prev_end >= self.alignment:
                raise r.fail(
                    f"{start - prev_end} bytes no tensor holds after {prev!r}: "
                    "its type or shape does not match its data"
                )
        if spans and (
            spans[0][0] != self.data_offset or self.file_bytes - spans[-1][1] >= self.alignment
        ):
            where = "before the first" if spans[0][0] != self.data_offset else "after the last"
            raise r.fail(
                f"bytes no tensor holds {where} tensor: a type or shape does not match its data"
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, v{self.version}, arch={self.arch!r}, "
            f"{len(self._values)} keys, {len(self.tensors)} tensors)"
        )

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` as a python value, else `default`. An array is decoded each
        time it is asked for and not kept: a vocabulary and its merges (tens of MB as
        python strings) live only as long as the tokenizer being built needs them."""
        value = self._values.get(key, default)
        if isinstance(value, _Array):
            return _Cursor(self._buf, self.path).decoded(key, value)
        return value

    def count(self, key: str) -> int | None:
        """The element count of an array value, without decoding it; None for any other."""
        value = self._values.get(key)
        if isinstance(value, _Array):
            return value.count
        return len(value) if isinstance(value, list) else None

    @property
    def metadata(self) -> dict[str, Any]:
        """Every key/value, in file order, as python values (every array decoded anew)."""
        return {key: self.get(key) for key in self._values}

    def floats(self, name: str) -> list[float]:
        """The values of a small float tensor (rope factors), in file order."""
        t = self.tensors[name]
        n = math.prod(t.shape)
        if t.ggml_type == GGMLType.BF16:  # the high half of a float32
            bits = struct.unpack_from(f"<{n}H", self._buf, t.offset)
            return list(struct.unpack(f"<{n}f", struct.pack(f"<{n}I", *(b << 16 for b in bits))))
        if t.ggml_type not in _FLOAT_CODES:
            raise InferError(f"{self.path}: tensor {name!r} cannot be of type {t.ggml_type.name}")
        return list(struct.unpack_from(f"<{n}{_FLOAT_CODES[t.ggml_type]}", self._buf, t.offset))
