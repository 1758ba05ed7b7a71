"""``/api/v1/client-keys/``: client API keys for the routers (admin only, reads included).

``GET`` list / detail (name, display prefix, limits, state, use count; never a secret or a hash),
``POST`` create (201, with ``key`` shown this once), ``PATCH {id}/`` limits, ``POST {id}/rotate/``
(``{"grace_s": N}`` optional; 200 with the new ``key``), ``POST {id}/revoke/`` (200). There is no DELETE: a
revoked key stays listed with its history. Every write is audited as an Action and republishes the routing
table (:mod:`apps.operations.client_keys`).
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.models import ClientApiKey
from apps.accounts.roles import ADMIN
from apps.accounts.selectors import client_key_list
from apps.core.filters import FilterSet
from apps.core.serializers import StrictFieldsMixin, StrictFloatField, empty_body_check
from apps.operations import client_keys
from apps.operations.client_keys import MAX_GRACE_S


class ClientApiKeySerializer(StrictFieldsMixin, serializers.ModelSerializer):
    active = serializers.BooleanField(read_only=True, help_text="False once revoked.")
    rate_per_s = StrictFloatField(required=False, allow_null=True, min_value=1e-9,
                                        help_text="Requests per second (token bucket); null: unlimited.")
    allowed_models = serializers.ListField(child=serializers.CharField(max_length=200), required=False,
                                           max_length=64, help_text="Model names the key may use; []: every model.")

    class Meta:
        model = ClientApiKey
        fields = ["id", "name", "prefix", "active", "rate_per_s", "burst", "allowed_models", "created_at",
                  "rotated_at", "previous_valid_until", "revoked_at", "last_used_at", "use_count"]
        read_only_fields = ["id", "prefix", "active", "created_at", "rotated_at", "previous_valid_until",
                            "revoked_at", "last_used_at", "use_count"]
        extra_kwargs = {"burst": {"min_value": 1}}


class ClientApiKeyUpdateSerializer(ClientApiKeySerializer):
    how_to_change = {"name": "A key's name cannot change: create a key with the new name, then revoke this one.",
                     "prefix": "The prefix follows the secret: POST .../rotate/ for a new secret."}
    class Meta(ClientApiKeySerializer.Meta):
        read_only_fields = [*ClientApiKeySerializer.Meta.read_only_fields, "name"]


class IssuedKeySerializer(ClientApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The client key, shown once: store it now.")

    class Meta(ClientApiKeySerializer.Meta):
        fields = [*ClientApiKeySerializer.Meta.fields, "key"]


class RotateSerializer(StrictFieldsMixin, serializers.Serializer):
    grace_s = StrictFloatField(required=False, default=0, min_value=0, max_value=MAX_GRACE_S,
                                     help_text="Seconds the old secret stays valid (0: refused at once).")


class ClientApiKeyFilterSet(FilterSet):
    class Meta:
        model = ClientApiKey
        fields = ["name"]


def _issued(issued: client_keys.IssuedKey) -> dict:
    return {**IssuedKeySerializer(issued.client_key).data, "key": issued.key}


class ClientApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin,
                          mixins.UpdateModelMixin, viewsets.GenericViewSet):
    """Client API keys (admin only: list and detail too)."""

    serializer_class = ClientApiKeySerializer
    filterset_class = ClientApiKeyFilterSet
    ordering_fields = ["name", "created_at", "last_used_at", "use_count"]
    ordering = ["name"]
    write_role = ADMIN
    action_roles = {"list": ADMIN, "retrieve": ADMIN}
    lookup_value_regex = r"[0-9]+"
    http_method_names = ["get", "post", "patch", "head", "options"]

    def get_queryset(self):
        return client_key_list()

    def get_serializer_class(self):
        return ClientApiKeyUpdateSerializer if self.action == "partial_update" else ClientApiKeySerializer

    @extend_schema(responses={201: IssuedKeySerializer})
    def create(self, request: Request, *args, **kwargs) -> Response:
        """Create a key; the answer carries ``key``, shown this once."""
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = client_keys.client_key_create(requested_by=request.user, **serializer.validated_data)
        return Response(_issued(issued), status=status.HTTP_201_CREATED)

    def perform_update(self, serializer) -> None:  # noqa: ANN001 - DRF signature
        serializer.instance = client_keys.client_key_update(client_key=serializer.instance,
                                                            requested_by=self.request.user,
                                                            **serializer.validated_data)

    @extend_schema(request=RotateSerializer, responses={200: IssuedKeySerializer})
    @action(detail=True, methods=["post"])
    def rotate(self, request: Request, pk: str | None = None) -> Response:
        """New secret; the old one is refused at once, or after ``grace_s`` seconds. Answers the new ``key``."""
        serializer = RotateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        issued = client_keys.client_key_rotate(client_key=self.get_object(), requested_by=request.user,
                                               grace_s=serializer.validated_data["grace_s"])
        return Response(_issued(issued))

    @extend_schema(request=None, responses={200: ClientApiKeySerializer})
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        """Revoke the key: routers refuse it from their next routing-table poll (409 when already revoked; 400 when
        the body carries a field)."""
        empty_body_check(request.data)
        revoked = client_keys.client_key_revoke(client_key=self.get_object(), requested_by=request.user)
        return Response(ClientApiKeySerializer(revoked).data)
