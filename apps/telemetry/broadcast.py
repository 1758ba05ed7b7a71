"""The one helper that sends telemetry to the Channels layer, and the group names.

Groups: ``telemetry.fleet`` (every pool's pool-level signals) and ``telemetry.pool.<id>`` (one
pool: pool-level and per-track signals, firing alerts). Every message carries ``seq``, the
group's next number from Redis (``SignalHistory.next_seq``), so a consumer that sees a gap asks
for a snapshot (``selectors.telemetry_snapshot``). Message ``type`` values, for consumers:
``telemetry.signals`` (pool group), ``telemetry.fleet`` (fleet group), ``telemetry.alert``
(both groups, when an alert fires or resolves).
"""

from __future__ import annotations

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from apps.telemetry.history import SignalHistory

FLEET_GROUP = "telemetry.fleet"


def pool_group(pool_id: int | str) -> str:
    """The Channels group of one pool (group names allow ASCII letters, digits, ``-_.``)."""
    return f"telemetry.pool.{pool_id}"


def telemetry_broadcast(group: str, message_type: str, payload: dict, *, history: SignalHistory) -> dict:
    """Send ``payload`` to ``group`` as ``{"type": message_type, "seq": n, **payload}``; returns it.

    Raises ``RuntimeError`` when no channel layer is configured (``CHANNEL_LAYERS``).
    """
    layer = get_channel_layer()
    if layer is None:
        raise RuntimeError("no channel layer configured: set CHANNEL_LAYERS (channels_redis) in settings")
    message = {"type": message_type, "seq": history.next_seq(group), **payload}
    async_to_sync(layer.group_send)(group, message)
    return message
