"""Typed failures of a KV transfer, each with the ``reason`` label it is counted under.

``reason`` values are the ``reason`` label of ``ferry_kv_transfer_total`` (inference_worker.metrics).
``retryable`` tells the sender whether another attempt can succeed (a network fault can heal; a wrong
key or another model's KV cannot).
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base class: a KV payload was not delivered or not accepted."""

    reason = "unknown"
    retryable = False


class CorruptPayload(KVTransferError):
    """Bytes changed in flight (the keyed-BLAKE3 tag fails under this link's own key), bad magic, or a header
    inconsistent with the payload."""

    reason = "checksum"
    retryable = True


class TruncatedPayload(KVTransferError):
    """The connection ended before the whole frame arrived (e.g. the sender died mid-send)."""

    reason = "truncated"
    retryable = True


class AuthenticationFailed(KVTransferError):
    """The frame's keyed-BLAKE3 tag does not verify and its key id names another secret (wrong key or forgery)."""

    reason = "auth"


class WrongWeights(KVTransferError):
    """Authentic KV, but produced by another model version or other weights: never decode on it."""

    reason = "version_mismatch"


class ProtocolVersionMismatch(KVTransferError):
    """The peer speaks another wire-protocol version."""

    reason = "protocol"


class PayloadTooLarge(KVTransferError):
    """The frame announces more bytes than the receiver accepts."""

    reason = "capacity"


class Timeout(KVTransferError, TimeoutError):
    """No progress within the connect/read timeout, or the KV did not arrive before the decode deadline."""

    reason = "timeout"
    retryable = True


class LatePayload(KVTransferError):
    """The payload arrived after the decode side gave up on its request id."""

    reason = "late"


class UnexpectedPayload(KVTransferError):
    """No decode request is waiting for this request id."""

    reason = "unexpected"


class ConnectionFailed(KVTransferError):
    """The receiver could not be reached or the connection broke (after all retries on the sender)."""

    reason = "connection"
    retryable = True


ERRORS_BY_REASON: dict[str, type[KVTransferError]] = {
    cls.reason: cls
    for cls in (CorruptPayload, TruncatedPayload, AuthenticationFailed, WrongWeights, ProtocolVersionMismatch,
                PayloadTooLarge, Timeout, LatePayload, UnexpectedPayload, ConnectionFailed)
}
"""Error class for each ``reason`` (the receiver sends the reason back; the sender re-raises its class)."""

FAILURE_REASONS = tuple(ERRORS_BY_REASON)
"""Every failure ``reason`` this package counts."""
