"""Versioned, authenticated wire format for a prefill's KV cache (protocol version 3, reads 2).

One frame, all integers big-endian::

    preamble    32 B   magic b"\\x89FERRYKV", protocol version u16, flags u16 (0),
                       header length u32, payload length u64, key id 8 B
    header      JSON, UTF-8, space-padded so the payload starts on a 64-byte boundary
    header tag  32 B   protocol 3 only: keyed BLAKE3 of preamble+header under the header key
    payload     per layer in index order: K then V, each [num_layer_tokens, num_kv_heads, head_dim]
                row-major in ``dtype``; optionally one zstd frame over all of it
    trailer     32 B   tag: keyed BLAKE3 of everything before it (256-bit output)

Protocol 3 adds the header tag so that a receiver authenticates the preamble and header (key id,
sizes, model version, request id) *before* it reads or allocates the payload: a peer without the link
secret can make it hold no more than the header (at most :data:`MAX_HEADER_BYTES`). Protocol 2 frames
(no header tag; their only tag is the trailer over the whole frame) are still accepted for one release
(:data:`ACCEPTED_PROTOCOLS`) so a fleet can upgrade prefill and decode pools in either order; the
receiver then bounds them by what it can check unauthenticated (a request it waits for, sizes of the
model's KV geometry). The header key is derived from the link secret with its own context
(:data:`HEADER_KEY_CONTEXT`), so a header tag can never be replayed as a trailer or the other way round.

Authentication: the tag is BLAKE3 in keyed-hash mode under a 32-byte MAC key derived from the
per-link secret with BLAKE3's key-derivation mode (context :data:`MAC_KEY_CONTEXT`). The key id is
the first 8 bytes of another derivation of the same secret (context :data:`KEY_ID_CONTEXT`): it
names the secret without revealing it, and only classifies a tag mismatch -- same key id: the bytes
changed in flight (``checksum``); another key id: the sender holds another secret (``auth``). The tag
alone decides whether a frame is accepted. Source: the BLAKE3 specification (O'Connor, Aumasson,
Neves, Wilcox-O'Hearn, 2020): the keyed_hash and derive_key modes, and its 128-bit security claim;
the ``blake3`` package binds the official Rust implementation.

Why not HMAC-SHA256 (protocol 1) with a CRC-32 beside it: on this project's 2-core EPYC (SHA-NI,
AVX-512), one core hashes 2.1 GB/s with HMAC-SHA256 and 8.3 GB/s with keyed BLAKE3, and the CRC-32
the sender also computed runs at 7 GB/s (33 MB in 1 MiB updates; ``bench/pd_transfer.py`` prints
these rates); both sides hash every byte, so the MAC bounded a CPU-bound loopback link. Keyed BLAKE3 keeps a 256-bit key and a 256-bit tag, and its
claimed 128-bit security matches HMAC-SHA256's bound against generic forgery (birthday bound on
its 256-bit chaining state).

The header carries the request id, model version id and weights sha256 (KV is only valid for the
weights that produced it), dtype, token count ``N``, and per layer group (layers sharing a window)
the window, layers, shape and ``first_position`` -- the first absolute position carried: 0 for full
layers, ``N - min(N, W-1)`` for sliding ones (see :mod:`inference_worker.kv_transfer.layout`).

Validation order on receipt: magic, protocol version and lengths (preamble; each length capped:
the payload by :func:`max_payload_bytes` of the model's KV geometry at the receiver's max context),
the header tag (protocol 3), the header's fields, model identity and sizes, and only then the payload
and the trailer tag (a mismatch is classified by the key id as above).
"""

from __future__ import annotations

import hmac
import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import blake3
import torch
import zstandard

from inference_worker.kv_transfer.errors import (
    AuthenticationFailed,
    CorruptPayload,
    PayloadTooLarge,
    ProtocolVersionMismatch,
    TruncatedPayload,
    WrongWeights,
)
from inference_worker.kv_transfer.layout import KVLayout, transfer_tokens

MAGIC = b"\x89FERRYKV"
PROTOCOL_VERSION = 3
"""The protocol senders of this release write."""
ACCEPTED_PROTOCOLS = (2, 3)
"""Protocols a receiver of this release reads (2 for one release, so pools can upgrade in any order)."""
PREAMBLE = struct.Struct("!8sHHIQ8s")
TRAILER = struct.Struct("!32s")
HEADER_TAG = struct.Struct("!32s")
KEY_ID_OFFSET = 24
"""Byte offset of the 8-byte key id in the preamble."""
MAC_KEY_CONTEXT = "Ferry KV transfer 2026-11-30 per-link MAC key"
KEY_ID_CONTEXT = "Ferry KV transfer 2026-11-30 per-link key id"
HEADER_KEY_CONTEXT = "Ferry KV transfer 2026-12-01 per-link header key (protocol 3)"
_NO_KEY_ID = bytes(8)
MAX_HEADER_BYTES = 64 << 10
"""Largest header accepted (a real one is about 1 KiB for 18 layers; the receiver's header buffer is this big)."""
DEFAULT_MAX_PAYLOAD_BYTES = 8 << 30
COMPRESSIONS = ("none", "zstd")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PAYLOAD_ALIGN = 64


def check_link_secret(secret: bytes) -> bytes:
    """Return ``secret`` if it is bytes of at least 16; raise ValueError otherwise."""
    if not isinstance(secret, bytes | bytearray) or len(secret) < 16:
        raise ValueError("the per-link secret must be at least 16 bytes")
    return bytes(secret)


class LinkKey:
    """The keys derived from one per-link secret: the 32-byte MAC key and the 8-byte key id.

    Raises:
        ValueError: the secret is not bytes of at least 16.
    """

    def __init__(self, secret: bytes):
        secret = check_link_secret(secret)
        self.mac_key = blake3.blake3(secret, derive_key_context=MAC_KEY_CONTEXT).digest()
        self.key_id = blake3.blake3(secret, derive_key_context=KEY_ID_CONTEXT).digest(length=8)
        self.header_key = blake3.blake3(secret, derive_key_context=HEADER_KEY_CONTEXT).digest()

    def mac(self, data=b""):
        """A keyed BLAKE3 hasher (``update`` any buffer; it releases the GIL), fed ``data`` first."""
        return blake3.blake3(data, key=self.mac_key)

    def header_tag(self, preamble_and_header) -> bytes:
        """Protocol 3's 32-byte header tag: keyed BLAKE3 of preamble+header under the header key."""
        return blake3.blake3(preamble_and_header, key=self.header_key).digest()


def max_payload_bytes(raw_bytes: int) -> int:
    """Largest payload that can carry ``raw_bytes`` of KV: ``raw_bytes`` itself, or zstd's worst case
    (``ZSTD_COMPRESSBOUND``: ``raw + raw/256`` plus ``(128 KiB - raw) / 2048`` under 128 KiB; zstd's
    ``zstd.h``), plus 64 bytes for the frame header and checksum."""
    small = ((128 << 10) - raw_bytes) >> 11 if raw_bytes < (128 << 10) else 0
    return raw_bytes + (raw_bytes >> 8) + small + 64


def verify_header_tag(tag: bytes, preamble_and_header, key_id: bytes, link_key: LinkKey) -> None:
    """Check protocol 3's header tag before anything of the payload is read.

    Raises:
        CorruptPayload: mismatch and the frame names this link's key (bytes changed in flight).
        AuthenticationFailed: mismatch and the frame names another key (wrong secret or forgery).
    """
    if hmac.compare_digest(link_key.header_tag(preamble_and_header), bytes(tag)):
        return
    if hmac.compare_digest(bytes(key_id), link_key.key_id):
        raise CorruptPayload("header tag mismatch under this link's key, which the frame names (bytes changed "
                             "in flight, or a forged header)")
    raise AuthenticationFailed(f"the frame header is sealed with another link secret (key id "
                               f"{bytes(key_id).hex()}, this link's is {link_key.key_id.hex()})")


class FrameSealer:
    """Running keyed-BLAKE3 tag over a frame's preamble, header and payload, fed in order.

    ``secret`` is the per-link secret (bytes, >= 16) or a :class:`LinkKey` derived from it.
    """

    def __init__(self, secret: bytes | LinkKey):
        self.key = secret if isinstance(secret, LinkKey) else LinkKey(secret)
        self._mac = self.key.mac()

    def update(self, data) -> None:
        """Feed the next bytes (any buffer; nothing is copied)."""
        self._mac.update(data)

    def trailer(self) -> bytes:
        """The 32-byte trailer (the tag) for everything fed so far."""
        return TRAILER.pack(self._mac.digest())


def verify_trailer(tag: bytes, trailer, key_id: bytes, link_key: LinkKey) -> None:
    """Check a received trailer against the tag the receiver computed over the frame.

    ``key_id`` is the frame's preamble key id; it only classifies a mismatch.

    Raises:
        CorruptPayload: tag mismatch and the frame names this link's key (bytes changed in flight).
        AuthenticationFailed: tag mismatch and the frame names another key (wrong secret or forgery).
    """
    (received,) = TRAILER.unpack(bytes(trailer))
    if hmac.compare_digest(tag, received):
        return
    if hmac.compare_digest(bytes(key_id), link_key.key_id):
        raise CorruptPayload("checksum mismatch: the keyed BLAKE3 tag does not verify under this link's key, "
                             "which the frame names (bytes changed in flight)")
    raise AuthenticationFailed(f"the frame is sealed with another link secret (key id {bytes(key_id).hex()}, "
                               f"this link's is {link_key.key_id.hex()})")


@dataclass(frozen=True)
class Preamble:
    """A parsed preamble (its lengths are not authenticated yet)."""

    version: int
    header_len: int
    payload_len: int
    key_id: bytes

    @property
    def header_tag_len(self) -> int:
        """Bytes of header tag after the header (32 in protocol 3, 0 in protocol 2)."""
        return HEADER_TAG.size if self.version >= 3 else 0


def parse_preamble(data, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                   accepted: tuple[int, ...] = ACCEPTED_PROTOCOLS) -> Preamble:
    """Parse the 32-byte preamble.

    Raises:
        CorruptPayload: wrong magic, or a header length of 0 or over :data:`MAX_HEADER_BYTES`.
        ProtocolVersionMismatch: a protocol version not in ``accepted``.
        PayloadTooLarge: payload length above ``max_payload_bytes``.
    """
    magic, version, _flags, header_len, payload_len, key_id = PREAMBLE.unpack(bytes(data[: PREAMBLE.size]))
    if magic != MAGIC:
        raise CorruptPayload(f"not a Ferry KV frame (magic {magic!r})")
    if version not in accepted:
        raise ProtocolVersionMismatch(f"peer speaks KV protocol {version}, this side reads {accepted}")
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise CorruptPayload(f"header length {header_len} is outside 1..{MAX_HEADER_BYTES}")
    if payload_len > max_payload_bytes:
        raise PayloadTooLarge(f"payload of {payload_len} bytes exceeds the limit of {max_payload_bytes}")
    return Preamble(version, header_len, payload_len, key_id)


@dataclass
class KVFrame:
    """An encoded frame ready to send: ``prefix`` (preamble + header), payload ``pieces``, sealed on send.

    ``prefix`` has no key id yet (zeros) and no header tag; :meth:`sealed_prefix` adds the sender's.
    """

    header: dict
    prefix: bytes
    pieces: list
    raw_bytes: int
    """Uncompressed KV bytes."""
    payload_bytes: int
    """Payload bytes on the wire (compressed when compression is on)."""
    protocol: int = PROTOCOL_VERSION

    @property
    def payload_offset(self) -> int:
        """Byte offset of the payload in the sealed frame (after the header tag in protocol 3)."""
        return len(self.prefix) + (HEADER_TAG.size if self.protocol >= 3 else 0)

    @property
    def wire_bytes(self) -> int:
        """Whole frame size in bytes: prefix (+ header tag) + payload + trailer."""
        return self.payload_offset + self.payload_bytes + TRAILER.size

    def sealed_prefix(self, link_key: LinkKey) -> bytes:
        """``prefix`` with the sender's 8-byte key id in the preamble, then (protocol 3) the header tag."""
        prefix = self.prefix[:KEY_ID_OFFSET] + link_key.key_id + self.prefix[KEY_ID_OFFSET + 8:]
        return prefix + link_key.header_tag(prefix) if self.protocol >= 3 else prefix

    def iter_chunks(self, chunk_bytes: int = 1 << 20, *, link_key: LinkKey) -> Iterator[memoryview]:
        """Sealed prefix (:meth:`sealed_prefix`), then the payload in slices of at most ``chunk_bytes`` (views,
        no copies); no trailer."""
        yield memoryview(self.sealed_prefix(link_key))
        for piece in self.pieces:
            view = memoryview(piece).cast("B")
            for start in range(0, len(view), chunk_bytes):
                yield view[start:start + chunk_bytes]

    def to_bytes(self, link_secret: bytes | LinkKey) -> bytes:
        """The whole sealed frame as one bytes object (a copy; the sender streams instead)."""
        sealer = FrameSealer(link_secret)
        parts = []
        for chunk in self.iter_chunks(link_key=sealer.key):
            sealer.update(chunk)
            parts.append(chunk)
        parts.append(sealer.trailer())
        return b"".join(parts)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Row-major bytes of a CPU tensor as a memoryview (zero-copy when already contiguous on CPU)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def encode_kv(
    *,
    request_id: str,
    model_version_id: str,
    weights_sha256: str,
    layout: KVLayout,
    num_tokens: int,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    compression: str = "none",
    zstd_level: int = 1,
    protocol: int = PROTOCOL_VERSION,
) -> KVFrame:
    """Encode the KV a decode step needs after a prefill of ``num_tokens`` tokens.

    Args:
        kv: per layer ``(K, V)``, each ``[num_cached_tokens, num_kv_heads, head_dim]`` in
            ``layout.dtype`` and holding the *last* cached positions ending at ``num_tokens - 1``.
            Full layers must hold exactly ``num_tokens`` rows; sliding layers at least
            ``min(num_tokens, W-1)`` (only those last rows are sent).
        compression: ``"none"`` (default; payload pieces are views of the tensors) or ``"zstd"``.
        protocol: wire protocol to write (one of :data:`ACCEPTED_PROTOCOLS`; 2 only to talk to an older release).

    Raises:
        ValueError: wrong number of layers, dtype, shape or too few rows; unknown compression or protocol.
    """
    if protocol not in ACCEPTED_PROTOCOLS:
        raise ValueError(f"protocol must be one of {ACCEPTED_PROTOCOLS}, got {protocol!r}")
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
    if len(kv) != layout.num_layers:
        raise ValueError(f"expected K/V for {layout.num_layers} layers, got {len(kv)}")
    if len(weights_sha256) != 64:
        raise ValueError("weights_sha256 must be 64 hex characters")
    dtype = TORCH_DTYPES[layout.dtype]
    pieces: list = []
    for i, ((k, v), window) in enumerate(zip(kv, layout.layer_windows, strict=True)):
        n = transfer_tokens(num_tokens, window)
        for name, t in (("K", k), ("V", v)):
            if t.dtype != dtype:
                raise ValueError(f"layer {i} {name}: dtype {t.dtype}, layout says {dtype}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (layout.num_kv_heads, layout.head_dim):
                raise ValueError(f"layer {i} {name}: shape {tuple(t.shape)}, expected [T, "
                                 f"{layout.num_kv_heads}, {layout.head_dim}]")
            rows = t.shape[0]
            if (window is None and rows != num_tokens) or not n <= rows <= num_tokens:
                need = f"{num_tokens}" if window is None else f"{n}..{num_tokens}"
                raise ValueError(f"layer {i} {name}: {rows} cached tokens, need {need}")
            pieces.append(_tensor_bytes(t[rows - n:]))  # [n, num_kv_heads, head_dim]
    raw_bytes = sum(p.nbytes for p in pieces)
    if compression == "zstd":
        cobj = zstandard.ZstdCompressor(level=zstd_level).compressobj(size=raw_bytes)
        pieces = [cobj.compress(p) for p in pieces] + [cobj.flush()]
    payload_bytes = sum(memoryview(p).nbytes for p in pieces)
    header = {
        "request_id": str(request_id),
        "model_version_id": str(model_version_id),
        "weights_sha256": weights_sha256.lower(),
        "dtype": layout.dtype,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "num_tokens": num_tokens,
        "layer_groups": _layer_groups(layout, num_tokens),
        "compression": compression,
        "raw_bytes": raw_bytes,
        "payload_bytes": payload_bytes,
    }
    body = json.dumps(header, separators=(",", ":")).encode()
    tag_len = HEADER_TAG.size if protocol >= 3 else 0
    body += b" " * (-(PREAMBLE.size + len(body) + tag_len) % _PAYLOAD_ALIGN)
    if len(body) > MAX_HEADER_BYTES:
        raise ValueError(f"KV header of {len(body)} bytes exceeds {MAX_HEADER_BYTES}")
    preamble = PREAMBLE.pack(MAGIC, protocol, 0, len(body), payload_bytes, _NO_KEY_ID)
    return KVFrame(header, preamble + body, pieces, raw_bytes, payload_bytes, protocol)


def _layer_groups(layout: KVLayout, num_tokens: int) -> list[dict]:
    groups: dict[int | None, list[int]] = {}
    for i, window in enumerate(layout.layer_windows):
        groups.setdefault(window, []).append(i)
    out = []
    for window, layers in groups.items():
        n = transfer_tokens(num_tokens, window)
        out.append({"sliding_window": window, "layers": layers, "first_position": num_tokens - n,
                    "shape": [n, layout.num_kv_heads, layout.head_dim]})
    return out


@dataclass
class KVPayload:
    """A validated, decoded KV payload; tensors are views of the received buffer."""

    request_id: str
    model_version_id: str
    weights_sha256: str
    num_tokens: int
    layout: KVLayout
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (K, V), each ``[num_layer_tokens, num_kv_heads, head_dim]``."""
    first_positions: list[int]
    """Per layer, the absolute position of row 0 (0 for full layers, ``N - min(N, W-1)`` for sliding)."""
    compression: str
    raw_bytes: int
    wire_bytes: int


def parse_header(data) -> dict:
    """Decode the header JSON. Raises CorruptPayload if it is not a JSON object."""
    try:
        header = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptPayload(f"header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptPayload("header is not a JSON object")
    return header


def check_identity(header: dict, *, model_version_id: str, weights_sha256: str) -> None:
    """Raise WrongWeights unless the header names this model version and weights hash."""
    got = (header.get("model_version_id"), str(header.get("weights_sha256", "")).lower())
    want = (model_version_id, weights_sha256.lower())
    if got != want:
        raise WrongWeights(f"KV from model version {got[0]!r} (weights {got[1][:12]}...), "
                           f"this side serves {want[0]!r} (weights {want[1][:12]}...)")


def decode_payload(header: dict, payload, *, wire_bytes: int, layout: KVLayout | None = None) -> KVPayload:
    """Validate an authenticated header against ``payload`` and return the per-layer tensors.

    ``payload`` should be a writable buffer (a bytearray slice) for zero-copy tensors; a read-only one
    is copied. ``layout``, when given, must match the header's layout.

    Raises:
        CorruptPayload: missing/invalid fields, layout mismatch, sizes or decompression failure.
    """
    try:
        dtype = header["dtype"]
        num_tokens = int(header["num_tokens"])
        heads, head_dim = int(header["num_kv_heads"]), int(header["head_dim"])
        windows: list[int | None] = [None] * sum(len(g["layers"]) for g in header["layer_groups"])
        for group in header["layer_groups"]:
            for i in group["layers"]:
                windows[i] = group["sliding_window"]
        got_layout = KVLayout(tuple(windows), heads, head_dim, dtype)
        groups_ok = all(
            g["first_position"] == num_tokens - transfer_tokens(num_tokens, g["sliding_window"])
            and g["shape"] == [transfer_tokens(num_tokens, g["sliding_window"]), heads, head_dim]
            for g in header["layer_groups"])
        compression, raw_bytes = header["compression"], int(header["raw_bytes"])
        payload_bytes = int(header["payload_bytes"])
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise CorruptPayload(f"invalid KV header: {exc!r}") from exc
    if num_tokens < 1 or not groups_ok or sorted(i for g in header["layer_groups"] for i in g["layers"]) != list(
            range(len(windows))):
        raise CorruptPayload("layer groups are inconsistent with num_tokens and the layer count")
    if layout is not None and layout != got_layout:
        raise CorruptPayload(f"KV layout {got_layout} does not match this model's {layout}")
    if raw_bytes != got_layout.transfer_bytes(num_tokens) or payload_bytes != len(payload):
        raise CorruptPayload(f"sizes disagree: raw {raw_bytes} vs {got_layout.transfer_bytes(num_tokens)} "
                             f"expected, payload {len(payload)} vs {payload_bytes} announced")
    if compression == "zstd":
        try:
            payload = bytearray(zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_bytes))
        except zstandard.ZstdError as exc:
            raise CorruptPayload(f"zstd decompression failed: {exc}") from exc
        if len(payload) != raw_bytes:
            raise CorruptPayload(f"decompressed {len(payload)} bytes, header says {raw_bytes}")
    elif compression != "none" or raw_bytes != payload_bytes:
        raise CorruptPayload(f"unknown compression {compression!r} or size mismatch")
    view = memoryview(payload)
    if view.readonly:
        view = memoryview(bytearray(view))
    tdtype = TORCH_DTYPES[dtype]
    layers, firsts, offset = [], [], 0
    for window in windows:
        n = transfer_tokens(num_tokens, window)
        count = n * heads * head_dim
        kv = []
        for _ in range(2):
            t = torch.frombuffer(view, dtype=tdtype, count=count, offset=offset) if count else torch.empty(
                0, dtype=tdtype)
            kv.append(t.view(n, heads, head_dim))  # [n, num_kv_heads, head_dim]
            offset += count * got_layout.dtype_bytes
        layers.append((kv[0], kv[1]))
        firsts.append(num_tokens - n)
    return KVPayload(str(header.get("request_id")), str(header.get("model_version_id")),
                     str(header.get("weights_sha256")), num_tokens, got_layout, layers, firsts, compression,
                     raw_bytes, wire_bytes)


def decode_frame(data, *, link_secret: bytes | LinkKey, model_version_id: str, weights_sha256: str,
                 layout: KVLayout | None = None, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> KVPayload:
    """Validate and decode one whole frame held in memory (see the module docstring for the order).

    Raises:
        TruncatedPayload, CorruptPayload, AuthenticationFailed, ProtocolVersionMismatch, PayloadTooLarge,
        WrongWeights: as named.
    """
    link_key = link_secret if isinstance(link_secret, LinkKey) else LinkKey(link_secret)
    view = memoryview(data).cast("B")
    if len(view) < PREAMBLE.size:
        raise TruncatedPayload(f"{len(view)} bytes, shorter than the {PREAMBLE.size}-byte preamble")
    pre = parse_preamble(view, max_payload_bytes)
    header_end = PREAMBLE.size + pre.header_len
    payload_start = header_end + pre.header_tag_len
    end = payload_start + pre.payload_len
    if len(view) < end + TRAILER.size:
        raise TruncatedPayload(f"frame of {len(view)} bytes, header announces {end + TRAILER.size}")
    if pre.header_tag_len:
        verify_header_tag(view[header_end:payload_start], view[:header_end], pre.key_id, link_key)
    verify_trailer(link_key.mac(view[:end]).digest(), view[end:end + TRAILER.size], pre.key_id, link_key)
    header = parse_header(view[PREAMBLE.size:header_end])
    check_identity(header, model_version_id=model_version_id, weights_sha256=weights_sha256)
    return decode_payload(header, view[payload_start:end], wire_bytes=end + TRAILER.size, layout=layout)


ACK_LENGTH = struct.Struct("!I")
MAX_ACK_BYTES = 4096


def encode_ack(reason: str | None, detail: str = "") -> bytes:
    """The receiver's reply to one frame: ``{"ok": true}`` or the failure ``reason`` and detail, length-prefixed."""
    body = json.dumps({"ok": reason is None, "reason": reason or "none", "detail": detail[:1000]}).encode()
    return ACK_LENGTH.pack(len(body)) + body


def parse_ack(body: bytes) -> tuple[str | None, str]:
    """Parse an ack body; return ``(None, "")`` for success or ``(reason, detail)``.

    Raises:
        CorruptPayload: not a valid ack.
    """
    try:
        ack = json.loads(body.decode())
        return (None, "") if ack["ok"] else (str(ack["reason"]), str(ack.get("detail", "")))
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CorruptPayload(f"invalid ack from the receiver: {exc!r}") from exc
