"""The KV tier record: a versioned, authenticated entry holding what resumes one context; torch-free.

Layout (all integers little-endian)::

    b"FKVT" | uint16 version | uint32 header_len | uint64 body_len | header (JSON, UTF-8) | body | tag (32 B)

The header names what the KV is valid for and where each layer's rows start: ``model_id``,
``weights_sha256``, ``kv_dtype``, ``block_size``, ``num_kv_heads``, ``head_dim``, ``num_tokens`` (E, the
context's computed tokens), ``token_ids`` (its E token ids), and per layer ``window`` (W or null) and
``first`` (the first stored position; rows ``first .. E-1``). The body is, per layer, K then V rows
``[E - first, num_kv_heads, head_dim]`` in ``kv_dtype``. The tag is keyed BLAKE3 over everything before
it, under a key derived (BLAKE3 ``derive_key``, context :data:`KEY_CONTEXT`) from the tier secret, which
is distributed like the KV link secret (``--kv-tier-secret`` / ``FERRY_KV_TIER_SECRET``).

:func:`decode_record` checks, in order, and raises :class:`RecordError` with a reason (the metric label):
``truncated`` (shorter than its declared lengths), ``format`` (bad magic, unknown version, longer than
declared, bad header), ``signature`` (tag mismatch: corrupted, or another tier secret), ``weights``
(another weights sha256, KV dtype, block size or KV geometry than this engine's).
"""

from __future__ import annotations

import hmac
import json
import struct
from dataclasses import dataclass

from blake3 import blake3

MAGIC = b"FKVT"
VERSION = 1
KEY_CONTEXT = "ferry kv tier record v1 tag key"
_PREFIX = struct.Struct("<4sHIQ")
TAG_BYTES = 32
MAX_HEADER_BYTES = 64 << 20
REASONS = ("truncated", "format", "signature", "weights")


class RecordError(ValueError):
    """A record that must not be loaded; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def tier_key(secret: bytes) -> bytes:
    """The 32-byte tag key derived from the tier secret.

    Raises:
        ValueError: a secret shorter than 16 bytes.
    """
    if len(secret) < 16:
        raise ValueError("the KV tier secret must be at least 16 bytes")
    return blake3(secret, derive_key_context=KEY_CONTEXT).digest()


@dataclass(frozen=True)
class RecordHeader:
    """The authenticated header (see the module docstring for each field)."""

    model_id: str
    weights_sha256: str
    kv_dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    token_ids: tuple[int, ...]
    windows: tuple[int | None, ...]
    firsts: tuple[int, ...]

    def layer_rows(self) -> list[int]:
        """Rows stored per layer (``E - first``)."""
        return [self.num_tokens - first for first in self.firsts]

    def to_json(self) -> bytes:
        """Canonical JSON bytes."""
        return json.dumps({"model_id": self.model_id, "weights_sha256": self.weights_sha256,
                           "kv_dtype": self.kv_dtype, "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                           "head_dim": self.head_dim, "num_tokens": self.num_tokens, "token_ids": list(self.token_ids),
                           "windows": list(self.windows), "firsts": list(self.firsts)},
                          separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> RecordHeader:
        """Parse and check the header's shape.

        Raises:
            RecordError: ``format`` on a missing field, a wrong type or positions out of range.
        """
        try:
            d = json.loads(raw)
            header = cls(str(d["model_id"]), str(d["weights_sha256"]), str(d["kv_dtype"]), int(d["block_size"]),
                         int(d["num_kv_heads"]), int(d["head_dim"]), int(d["num_tokens"]),
                         tuple(int(t) for t in d["token_ids"]),
                         tuple(None if w is None else int(w) for w in d["windows"]), tuple(int(f) for f in d["firsts"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise RecordError("format", f"unreadable header: {exc!r}") from None
        if len(header.token_ids) != header.num_tokens or len(header.windows) != len(header.firsts) or any(
                not 0 <= f <= header.num_tokens for f in header.firsts) or header.block_size < 1:
            raise RecordError("format", "header positions do not fit its token count")
        return header


def encode_record(header: RecordHeader, layers: list[tuple[bytes, bytes]], key: bytes) -> bytes:
    """The signed record for ``header`` and per-layer ``(K bytes, V bytes)``.

    Raises:
        ValueError: layer count different from the header's.
    """
    if len(layers) != len(header.firsts):
        raise ValueError(f"{len(layers)} layers of KV for a header of {len(header.firsts)}")
    head = header.to_json()
    body = b"".join(k + v for k, v in layers)
    data = _PREFIX.pack(MAGIC, VERSION, len(head), len(body)) + head + body
    return data + blake3(data, key=key).digest()


def decode_record(data: bytes, key: bytes) -> tuple[RecordHeader, memoryview]:
    """Authenticate and parse a record; returns its header and a view of its body.

    Raises:
        RecordError: see the module docstring for the reasons and their order.
    """
    if len(data) < _PREFIX.size:
        raise RecordError("truncated", f"{len(data)} bytes, shorter than the fixed prefix")
    magic, version, header_len, body_len = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise RecordError("format", f"magic {magic!r} version {version}; this worker reads {MAGIC!r} v{VERSION}")
    expected = _PREFIX.size + header_len + body_len + TAG_BYTES
    if header_len > MAX_HEADER_BYTES:
        raise RecordError("format", f"header of {header_len} bytes")
    if len(data) < expected:
        raise RecordError("truncated", f"{len(data)} bytes of {expected}")
    if len(data) > expected:
        raise RecordError("format", f"{len(data)} bytes, {expected} declared")
    signed = memoryview(data)[: expected - TAG_BYTES]
    if not hmac.compare_digest(blake3(signed, key=key).digest(), bytes(data[expected - TAG_BYTES:])):
        raise RecordError("signature", "the tag does not match (corrupted, or written under another tier secret)")
    header = RecordHeader.from_json(bytes(data[_PREFIX.size : _PREFIX.size + header_len]))
    return header, memoryview(data)[_PREFIX.size + header_len : expected - TAG_BYTES]


def read_header_unverified(data: bytes) -> RecordHeader | None:
    """The header of a record's leading bytes without checking the tag (indexing a disk tier at start-up;
    every load verifies the whole record). None when it cannot be parsed."""
    if len(data) < _PREFIX.size:
        return None
    magic, version, header_len, _ = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION or len(data) < _PREFIX.size + header_len:
        return None
    try:
        return RecordHeader.from_json(bytes(data[_PREFIX.size : _PREFIX.size + header_len]))
    except RecordError:
        return None


def header_prefix_len(data: bytes) -> int | None:
    """Bytes needed to read the header (prefix + header), from the first :data:`_PREFIX` bytes."""
    if len(data) < _PREFIX.size:
        return None
    return _PREFIX.size + _PREFIX.unpack_from(data)[2]


PREFIX_BYTES = _PREFIX.size
