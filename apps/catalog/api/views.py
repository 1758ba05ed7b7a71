"""``/api/v1/model-versions/``: list, retrieve, register (admin), update metadata, delete (admin)."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.roles import ADMIN
from apps.catalog import selectors, services
from apps.catalog.api.filtersets import ModelVersionFilterSet
from apps.catalog.api.serializers import (
    ModelVersionRegisterSerializer,
    ModelVersionSerializer,
    ModelVersionUpdateSerializer,
)


class ModelVersionViewSet(viewsets.ModelViewSet):
    serializer_class = ModelVersionSerializer
    filterset_class = ModelVersionFilterSet
    ordering_fields = ["name", "version", "created_at", "num_hidden_layers"]
    ordering = ["name", "version"]
    write_role = ADMIN

    def get_queryset(self):
        return selectors.model_version_list()

    @extend_schema(request=ModelVersionRegisterSerializer, responses={201: ModelVersionSerializer})
    def create(self, request: Request, *args, **kwargs) -> Response:
        serializer = ModelVersionRegisterSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        mv = services.model_version_register(**serializer.validated_data)
        return Response(ModelVersionSerializer(mv).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=ModelVersionUpdateSerializer, responses=ModelVersionSerializer)
    def update(self, request: Request, *args, **kwargs) -> Response:
        mv = self.get_object()
        serializer = ModelVersionUpdateSerializer(mv, data=request.data, partial=kwargs.get("partial", False))
        serializer.is_valid(raise_exception=True)
        mv = services.model_version_update(model_version=mv, **serializer.validated_data)
        return Response(ModelVersionSerializer(mv).data)

    @extend_schema(request=ModelVersionUpdateSerializer, responses=ModelVersionSerializer)
    def partial_update(self, request: Request, *args, **kwargs) -> Response:
        return self.update(request, *args, partial=True, **kwargs)

    def perform_destroy(self, instance) -> None:
        services.model_version_delete(model_version=instance)
