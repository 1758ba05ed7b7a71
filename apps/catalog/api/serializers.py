"""Serializers for model versions: read (with KV numbers), register and update."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from apps.catalog.models import KV_REPORT_TOKENS, ModelVersion
from apps.catalog.services import UPDATABLE_FIELDS
from apps.core.serializers import StrictFieldsMixin
from inference_worker.config import FULL_ATTENTION, SLIDING_ATTENTION
from inference_worker.registry import BUILTIN_MODELS


class KvAtTokensSerializer(serializers.Serializer):
    num_tokens = serializers.IntegerField()
    hybrid_bytes = serializers.IntegerField()
    all_full_bytes = serializers.IntegerField()
    reduction = serializers.FloatField(help_text="all_full_bytes / hybrid_bytes, rounded to 2 decimals.")


class KvSerializer(serializers.Serializer):
    dtype = serializers.CharField(help_text="KV cache dtype the numbers assume.")
    bytes_per_token_full_layer = serializers.IntegerField()
    bytes_per_token_sliding_layer = serializers.IntegerField()
    at = KvAtTokensSerializer(many=True)


class ModelVersionSerializer(serializers.ModelSerializer):
    kv = serializers.SerializerMethodField()

    class Meta:
        model = ModelVersion
        fields = [
            "id", "name", "version", "description", "container_image", "weights_uri", "sha256",
            "architecture_source", "model_type", "num_hidden_layers", "num_full_layers", "num_sliding_layers",
            "layer_types", "sliding_window", "num_attention_heads", "num_key_value_heads", "head_dim", "dtype",
            "max_position_embeddings", "kv", "created_at", "updated_at",
        ]
        read_only_fields = fields

    @extend_schema_field(KvSerializer)
    def get_kv(self, obj: ModelVersion) -> dict[str, Any]:
        config = obj.model_config()
        at = []
        for n in KV_REPORT_TOKENS:
            hybrid, full = config.kv_bytes(n), config.kv_bytes(n, hybrid=False)
            at.append({"num_tokens": n, "hybrid_bytes": hybrid, "all_full_bytes": full,
                       "reduction": round(full / hybrid, 2)})
        return {
            "dtype": "float16",
            "bytes_per_token_full_layer": config.kv_bytes_per_token(FULL_ATTENTION),
            "bytes_per_token_sliding_layer": config.kv_bytes_per_token(SLIDING_ATTENTION),
            "at": at,
        }


ARCHITECTURE_FIELDS = ("architecture_source", "model_type", "num_hidden_layers", "num_full_layers",
                       "num_sliding_layers", "layer_types", "sliding_window", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "dtype", "max_position_embeddings")
""":class:`ModelVersionSerializer` fields that registration reads from the architecture source."""


class ModelVersionRegisterSerializer(StrictFieldsMixin, serializers.Serializer):
    """The body of ``POST /api/v1/model-versions/``: names, weights and exactly one architecture source.

    Raises (from ``is_valid(raise_exception=True)``):
        ValidationError: HTTP 400 naming each invalid, unknown or read-only field (an architecture field such as
            ``num_hidden_layers`` is read from the source, never sent), or none or several sources.
    """

    # consulted only for the fields refused (those not declared below): what a read of the resource shows
    how_to_change = {
        **{name: "This field is read-only." for name in ModelVersionSerializer.Meta.fields},
        **{name: "Read from the architecture source (config, gguf_path or builtin_model), never sent."
           for name in ARCHITECTURE_FIELDS},
    }
    name = serializers.CharField(max_length=100)
    version = serializers.CharField(max_length=100)
    description = serializers.CharField(required=False, allow_blank=True, default="")
    container_image = serializers.CharField(max_length=255, required=False, allow_blank=True, default="")
    weights_uri = serializers.CharField(max_length=500, required=False, allow_blank=True, default="",
                                        help_text="Defaults to file://<path> for gguf_path/builtin_model.")
    sha256 = serializers.CharField(max_length=64, required=False, allow_blank=True, default="",
                                   help_text="Defaults to the file's digest for gguf_path/builtin_model.")
    config = serializers.DictField(required=False, help_text="The model's HF config.json as a JSON object.")
    gguf_path = serializers.CharField(max_length=1000, required=False,
                                      help_text="Absolute path of a .gguf file on the server (FERRY_MODEL_ROOTS).")
    builtin_model = serializers.ChoiceField(choices=sorted(BUILTIN_MODELS), required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        sources = [k for k in ("config", "gguf_path", "builtin_model") if k in attrs]
        if len(sources) != 1:
            raise serializers.ValidationError(
                "Give exactly one architecture source: config (the config.json object), gguf_path or builtin_model."
            )
        return attrs


IMMUTABLE_MESSAGE = "Immutable after registration; register a new version instead (POST /api/v1/model-versions/)."


class ModelVersionUpdateSerializer(StrictFieldsMixin, serializers.ModelSerializer):
    """The body of ``PUT``/``PATCH /api/v1/model-versions/{id}/``: the metadata a version may change.

    Raises (from ``is_valid(raise_exception=True)``):
        ValidationError: HTTP 400 naming each invalid or unknown field; a field fixed at registration (name,
            version, weights, architecture source) says to register a new version.
    """

    how_to_change = {
        **{name: "This field is read-only." for name in ModelVersionSerializer.Meta.fields},
        **{name: IMMUTABLE_MESSAGE for name in (*ModelVersionRegisterSerializer._declared_fields, *ARCHITECTURE_FIELDS)
           if name not in UPDATABLE_FIELDS},
    }

    class Meta:
        model = ModelVersion
        fields = list(UPDATABLE_FIELDS)
