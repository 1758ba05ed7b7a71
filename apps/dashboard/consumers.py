"""Channels consumers of the dashboard: they only join groups and forward the telemetry layer's messages.

Routes (``apps.dashboard.websocket_urls``): ``ws/fleet/``, ``ws/pools/<id>/``, ``ws/rollouts/<id>/``.

Protocol, server -> client (JSON):

- ``{"type": "snapshot", "stream": ..., "seq": n, ...}`` on connect and after a resync request
  (``apps.dashboard.selectors``: ``fleet_snapshot``, ``pool_snapshot``);
- the telemetry layer's messages as broadcast (``telemetry.signals``, ``telemetry.fleet``,
  ``telemetry.alert``, each with ``seq``) plus ``stream`` naming the group they came from
  (``fleet`` or ``pool.<id>``); a rollout's group also forwards the ``rollout.state`` messages that
  :mod:`apps.rollouts.broadcast` sends after every committed change of the plan.

Client -> server: ``{"type": "resync", "stream": ...}`` when the client sees a gap in a stream's
sequence numbers (or after reconnecting); the consumer answers with that stream's snapshot.
``{"type": "seq", "stream": ...}`` asks for the stream's last sequence number (answer
``{"type": "seq", "stream": ..., "seq": n}``): the client asks every few seconds, so a dropped *final*
message (no later one to reveal the gap) is noticed and resynced too.

Connections without an authenticated user, or from a user without a role, are refused (close before
accept: HTTP 403 at the handshake); the ASGI stack (``controlplane.asgi``) also rejects foreign origins. An authenticated
connection is accepted at once and then looks its target up (an unknown pool or rollout closes with
code 4404): daphne drops handshakes the application has not accepted within its websocket connect
timeout (5 s by default), and 50 tabs opening together must not queue their snapshot reads behind
the handshake. Snapshot reads run on a thread pool (``thread_sensitive=False``), not one shared thread.
"""

from __future__ import annotations

import functools

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from apps.accounts.roles import user_role
from apps.core.process_loop import loop_iteration_started
from apps.dashboard import selectors
from apps.fleet.models import Pool
from apps.rollouts.broadcast import rollout_group
from apps.rollouts.models import RolloutPlan
from apps.telemetry.broadcast import FLEET_GROUP, pool_group
from apps.telemetry.history import SignalHistory


def reads(func):
    """Run a read-only ORM/Redis function from a consumer on the thread pool, closing its connection after.
    Each read starts as a request does (:func:`~apps.core.process_loop.loop_iteration_started`): a pool thread
    lives as long as the server, and with ``DEBUG`` on its query log would keep every read's queries."""

    @functools.wraps(func)
    def started_like_a_request(*args, **kwargs):
        loop_iteration_started()
        return func(*args, **kwargs)

    return database_sync_to_async(started_like_a_request, thread_sensitive=False)


CLOSE_UNAUTHENTICATED = 4401
CLOSE_NO_ROLE = 4403
CLOSE_NOT_FOUND = 4404




class StreamConsumer(AsyncJsonWebsocketConsumer):
    """Base: authenticate, join ``self.streams`` (stream name -> group), snapshot, forward, resync."""

    streams: dict[str, str]

    async def resolve_streams(self) -> dict[str, str] | None:
        """Stream name -> group for this connection; ``None`` when the target does not exist."""
        raise NotImplementedError

    async def snapshot(self, stream: str) -> dict:
        """The snapshot of one stream (database and Redis reads run in a thread)."""
        raise NotImplementedError

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=CLOSE_UNAUTHENTICATED)
            return
        if await reads(user_role)(user) is None:
            await self.close(code=CLOSE_NO_ROLE)
            return
        await self.accept()
        streams = await self.resolve_streams()
        if streams is None:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        self.streams = streams
        for group in self.streams.values():
            await self.channel_layer.group_add(group, self.channel_name)
        for stream in self.streams:
            await self.send_json(await self.snapshot(stream))

    async def disconnect(self, code: int) -> None:
        for group in getattr(self, "streams", {}).values():
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if kind not in ("resync", "seq"):
            await self.send_json({"type": "error", "message": 'Only {"type": "resync" or "seq", "stream": ...} is '
                                                              "accepted."})
            return
        stream = content.get("stream")
        targets = [stream] if stream in self.streams else list(self.streams)
        for name in targets:
            if kind == "seq":
                await self.send_json({"type": "seq", "stream": name, "seq": await self.current_seq(name)})
            else:
                await self.send_json(await self.snapshot(name))

    @reads
    def current_seq(self, stream: str) -> int:
        """The last sequence number sent to ``stream``'s group (a Redis read)."""
        return SignalHistory().current_seq(self.streams[stream])

    async def _forward(self, event: dict, stream: str) -> None:
        await self.send_json({**event, "stream": stream})

    # Group message handlers (Channels maps type "telemetry.signals" to telemetry_signals).
    async def telemetry_signals(self, event: dict) -> None:
        await self._forward(event, selectors.pool_stream(event["pool_id"]))

    async def telemetry_fleet(self, event: dict) -> None:
        await self._forward(event, "fleet")

    async def telemetry_alert(self, event: dict) -> None:
        # The pool group and the fleet group both carry alerts; each has its own sequence numbers.
        stream = "fleet" if "fleet" in self.streams else selectors.pool_stream(event["alert"]["pool_id"])
        await self._forward(event, stream)


class FleetConsumer(StreamConsumer):
    """``ws/fleet/``: the fleet group (every pool's signals each poll, alerts)."""

    async def resolve_streams(self) -> dict[str, str]:
        return {"fleet": FLEET_GROUP}

    @reads
    def snapshot(self, stream: str) -> dict:
        return selectors.fleet_snapshot()


class PoolConsumer(StreamConsumer):
    """``ws/pools/<pool_id>/``: one pool's group (pool-level and per-track signals, its alerts)."""

    @reads
    def resolve_streams(self) -> dict[str, str] | None:
        pool_id = self.scope["url_route"]["kwargs"]["pool_id"]
        if not Pool.objects.filter(pk=pool_id).exists():
            return None
        return {selectors.pool_stream(pool_id): pool_group(pool_id)}

    @reads
    def snapshot(self, stream: str) -> dict:
        return selectors.pool_snapshot(int(stream.split(".", 1)[1]))


class RolloutConsumer(StreamConsumer):
    """``ws/rollouts/<rollout_id>/``: the groups of the rollout's pools and the rollout's own group."""

    @reads
    def resolve_streams(self) -> dict[str, str] | None:
        rollout_id = self.scope["url_route"]["kwargs"]["rollout_id"]
        try:
            pool_ids = selectors.rollout_pool_ids(rollout_id)
        except RolloutPlan.DoesNotExist:
            return None
        streams = {selectors.pool_stream(pid): pool_group(pid) for pid in pool_ids}
        streams[f"rollout.{rollout_id}"] = rollout_group(rollout_id)
        return streams

    @reads
    def snapshot(self, stream: str) -> dict:
        kind, _, ident = stream.partition(".")
        if kind == "rollout":
            seq = SignalHistory().current_seq(rollout_group(ident))  # read first: later messages have larger numbers
            # the state only: the page draws the recorded history once, from its own HTML
            return {"type": "snapshot", "stream": stream, "seq": seq,
                    "rollout": selectors.rollout_detail(int(ident), history=False)}
        return selectors.pool_snapshot(int(ident))

    async def rollout_state(self, event: dict) -> None:
        await self._forward(event, f"rollout.{self.scope['url_route']['kwargs']['rollout_id']}")
