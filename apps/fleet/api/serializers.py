"""Serializers for clusters, links and pools; field validation comes from the models' validators."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import cache
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from apps.core.serializers import StrictFieldsMixin, ValuesRepresentation
from apps.fleet.models import (
    MAX_REPLICAS,
    Cluster,
    ClusterLink,
    Pool,
    PoolTrack,
    Replica,
    Router,
    validate_pool_engine,
)


class ClusterSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    class Meta:
        model = Cluster
        fields = ["id", "name", "kind", "datacenter", "labels", "status", "kubeconfig_path", "kubeconfig_secret",
                  "context", "namespace", "in_cluster", "agent_url", "gateway_httproute", "production", "created_at",
                  "updated_at"]
        read_only_fields = ["status", "created_at", "updated_at"]


class RouterSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    cluster_name = serializers.CharField(source="cluster.name", read_only=True)

    class Meta:
        model = Router
        fields = ["id", "name", "cluster", "cluster_name", "url", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]


class ClusterLinkSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    source_name = serializers.CharField(source="source.name", read_only=True)
    destination_name = serializers.CharField(source="destination.name", read_only=True)

    class Meta:
        model = ClusterLink
        fields = ["id", "source", "source_name", "destination", "destination_name", "bandwidth_gbps", "rtt_ms", "source_cidrs",
                  "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        source = attrs.get("source", getattr(self.instance, "source", None))
        destination = attrs.get("destination", getattr(self.instance, "destination", None))
        if source is not None and source == destination:
            raise serializers.ValidationError({"destination": "A link needs two different clusters."})
        return attrs


class PoolTrackSerializer(serializers.ModelSerializer):
    class Meta:
        model = PoolTrack
        fields = ["name", "model_version", "replicas", "weight", "active", "extra_args"]
        read_only_fields = fields


class PoolSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    how_to_change = {"tracks": "Tracks are read-only here: the rollout controller writes them (POST /api/v1/rollouts/), "
                               "the total replicas change with POST /api/v1/pools/{id}/scale/."}
    replicas = serializers.IntegerField(
        min_value=0, max_value=MAX_REPLICAS, required=False,
        help_text="Required on create. Total desired replicas over all tracks. Set on create; change it with POST .../scale/.",
    )
    tracks = PoolTrackSerializer(many=True, read_only=True)

    class Meta:
        model = Pool
        fields = ["id", "name", "cluster", "role", "model_version", "replicas", "tracks", "gpu_kind", "gpu_count",
                  "cpu", "memory", "node_selector", "tolerations", "autoscaling_enabled", "min_replicas",
                  "max_replicas", "autoscaling_signal", "autoscaling_target", "scale_up_stabilization_s",
                  "scale_down_stabilization_s", "schedule_overrides",
                  "schedule_time_zone", "drain_timeout_s", "engine", "remote_threshold_min_tokens",
                  "remote_threshold_max_tokens", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        current = self.instance
        cluster = attrs.get("cluster", current.cluster if current is not None else None)
        try:
            validate_pool_engine(attrs.get("engine", current.engine if current is not None else Pool.Engine.FERRY),
                                 attrs.get("role", current.role if current is not None else ""),
                                 cluster.kind if cluster is not None else None)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from exc
        low, high = (attrs.get(f, getattr(current, f, None)) for f in
                     ("remote_threshold_min_tokens", "remote_threshold_max_tokens"))
        if low is not None and high is not None and low > high:
            raise serializers.ValidationError({"remote_threshold_min_tokens": [
                f"Must be <= remote_threshold_max_tokens ({high}), got {low}: lower it or raise the maximum."]})
        if self.instance is not None and "replicas" in attrs:
            raise serializers.ValidationError({"replicas": "Change replicas with POST /api/v1/pools/{id}/scale/."})
        if self.instance is None and "replicas" not in attrs:
            raise serializers.ValidationError({"replicas": "This field is required."})
        return attrs


@cache
def pool_values_representation() -> tuple[ValuesRepresentation, ValuesRepresentation]:
    """(pool, track) :class:`ValuesRepresentation` of :class:`PoolSerializer` and :class:`PoolTrackSerializer`,
    built once per process; a pool's ``replicas`` and ``tracks`` are computed from its track rows."""
    return (ValuesRepresentation(PoolSerializer, provided=("replicas", "tracks")),
            ValuesRepresentation(PoolTrackSerializer))


def pool_list_representation(pool_rows: Iterable[Mapping[str, Any]],
                             track_rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``PoolSerializer(pools, many=True).data`` (as plain dicts) from ``values()`` rows: ``pool_rows`` with the
    pool representation's ``columns``, ``track_rows`` with ``pool_id`` and the track representation's ``columns``
    in ``PoolTrack``'s order (every track of those pools). ``replicas`` is the sum of the tracks' replicas
    (:attr:`apps.fleet.models.Pool.replicas`).

    Raises:
        KeyError: a row lacks a column.
    """
    pool_representation, track_representation = pool_values_representation()
    tracks_by_pool: dict[int, list[Mapping[str, Any]]] = {}
    for track in track_rows:
        tracks_by_pool.setdefault(track["pool_id"], []).append(track)
    out = []
    for pool in pool_rows:
        tracks = tracks_by_pool.get(pool["id"], [])
        out.append(pool_representation.represent({
            **pool, "replicas": sum(track["replicas"] for track in tracks),
            "tracks": [track_representation.represent(track) for track in tracks]}))
    return out


class PoolScaleSerializer(StrictFieldsMixin, serializers.Serializer):
    """The body of ``POST /api/v1/pools/{id}/scale/``.

    Raises (from ``is_valid(raise_exception=True)``):
        ValidationError: HTTP 400 naming a missing or out-of-range ``replicas`` and each unknown field.
    """

    replicas = serializers.IntegerField(min_value=0, max_value=MAX_REPLICAS, help_text="New total desired replicas.")


class PoolWorkerTokenRotateSerializer(StrictFieldsMixin, serializers.Serializer):
    keep_previous = serializers.BooleanField(
        default=True, help_text="Keep accepting the old token until the next rotation, so nothing fails while the "
                                "replicas roll (false: the old token leaked; replicas not yet rolled refuse calls).")


class ReplicaSerializer(serializers.ModelSerializer):
    pool_name = serializers.CharField(source="pool.name", read_only=True)
    cluster = serializers.IntegerField(source="pool.cluster_id", read_only=True)

    class Meta:
        model = Replica
        fields = ["id", "pool", "pool_name", "cluster", "track", "name", "endpoint", "ready", "alive", "version",
                  "restart_count", "exit_code", "exited_at", "message", "first_seen", "last_seen"]
        read_only_fields = fields
