"""Fast, torch-free reader of a GGUF file's header: metadata key/values and tensor infos.

Why not ``gguf.GGUFReader`` alone: it builds a numpy view per array element while parsing the
header, which takes ~17 s on Gemma 3's 262k-token vocabulary. This reader walks the same header
(format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with ``struct`` and skips array
payloads it is not asked for, so parsing a config takes milliseconds. Tensor *data* is then read
with ``numpy.memmap`` and dequantized by the ``gguf`` package (``gguf.quants.dequantize``); this
module never dequantizes anything itself.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUFValueType -> struct format of one scalar (STRING=8 and ARRAY=9 handled separately).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Arrays whose values are returned (others are skipped and reported by length only).
_KEEP_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
                "tokenizer.ggml.scores", "general.tags", "general.languages")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry.

    ``shape`` is in GGUF order (fastest-varying first, i.e. reversed vs. numpy/torch);
    ``offset`` is in bytes from the start of the file; ``ggml_type`` is a ``GGMLQuantizationType`` value.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    """Parsed header: ``metadata`` (scalars, strings, and selected arrays), ``array_lengths`` of every
    array field, and ``tensors`` in file order."""

    path: Path
    version: int
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[GGUFTensorInfo, ...]


def read_gguf_header(path: str | Path, *, with_arrays: bool = False) -> GGUFHeader:
    """Parse the header of the GGUF file at ``path``.

    Args:
        with_arrays: also decode tokenizer arrays (tokens, scores, token types, merges); otherwise only
            their lengths are recorded (much faster).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a GGUF file (bad magic), an unsupported GGUF version, or a truncated header.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no GGUF file at {p}")
    with p.open("rb") as fh:
        try:
            return _parse(fh, p, with_arrays)
        except struct.error as exc:
            raise ValueError(f"{p}: truncated or corrupt GGUF header ({exc})") from exc


def _parse(fh: BinaryIO, path: Path, with_arrays: bool) -> GGUFHeader:
    magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    (version,) = _unpack(fh, "<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    tensor_count, kv_count = _unpack(fh, "<QQ")
    metadata: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(kv_count):
        key = _read_string(fh)
        (vtype,) = _unpack(fh, "<I")
        if vtype == _ARRAY:
            (etype,) = _unpack(fh, "<I")
            (count,) = _unpack(fh, "<Q")
            array_lengths[key] = count
            keep = with_arrays or key in ("general.tags", "general.languages")
            if keep and key in _KEEP_ARRAYS:
                metadata[key] = _read_array(fh, etype, count)
            else:
                _skip_array(fh, etype, count)
        else:
            metadata[key] = _read_value(fh, vtype)
    infos = []
    for _ in range(tensor_count):
        name = _read_string(fh)
        (n_dims,) = _unpack(fh, "<I")
        shape = _unpack(fh, "<" + "Q" * n_dims)
        ggml_type, rel_offset = _unpack(fh, "<IQ")
        infos.append((name, tuple(int(d) for d in shape), ggml_type, rel_offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-fh.tell() // alignment) * alignment
    tensors = tuple(GGUFTensorInfo(n, s, t, data_start + o) for n, s, t, o in infos)
    return GGUFHeader(path, version, metadata, array_lengths, tensors)


def _unpack(fh: BinaryIO, fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    return struct.unpack(fmt, fh.read(size))


def _read_string(fh: BinaryIO) -> str:
    (length,) = _unpack(fh, "<Q")
    return fh.read(length).decode("utf-8", errors="replace")


def _read_value(fh: BinaryIO, vtype: int) -> Any:
    if vtype == _STRING:
        return _read_string(fh)
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise ValueError(f"unknown GGUF value type {vtype}")
    return _unpack(fh, fmt)[0]


def _read_array(fh: BinaryIO, etype: int, count: int) -> list[Any]:
    if etype == _STRING:
        return [_read_string(fh) for _ in range(count)]
    fmt = _SCALAR_FORMATS.get(etype)
    if fmt is None:
        raise ValueError(f"unsupported GGUF array element type {etype}")
    size = struct.calcsize(fmt)
    return list(struct.unpack("<" + fmt[1] * count, fh.read(size * count)))


def _skip_array(fh: BinaryIO, etype: int, count: int) -> None:
    if etype == _STRING:
        for _ in range(count):
            (length,) = _unpack(fh, "<Q")
            fh.seek(length, 1)
        return
    fmt = _SCALAR_FORMATS.get(etype)
    if fmt is None:
        raise ValueError(f"unsupported GGUF array element type {etype}")
    fh.seek(struct.calcsize(fmt) * count, 1)
