"""Admin for model versions: registration parses the architecture with the same service as the API."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError

from apps.catalog import services
from apps.catalog.models import KV_REPORT_TOKENS, ModelVersion
from apps.core.forms import form_errors
from inference_worker.registry import BUILTIN_MODELS

ARCHITECTURE_FIELDS = (
    "architecture_source", "model_type", "num_hidden_layers", "num_full_layers", "num_sliding_layers",
    "layer_types", "sliding_window", "num_attention_heads", "num_key_value_heads", "head_dim", "dtype",
    "max_position_embeddings",
)


class ModelVersionRegisterForm(forms.ModelForm):
    weights_uri = forms.CharField(max_length=500, required=False, help_text="Default: file://<path> of a GGUF source.")
    sha256 = forms.CharField(max_length=64, required=False, help_text="Default: the GGUF file's digest.")
    config = forms.CharField(widget=forms.Textarea, required=False, help_text="Paste the model's config.json.")
    gguf_path = forms.CharField(max_length=1000, required=False, help_text="Absolute path of a .gguf on the server.")
    builtin_model = forms.ChoiceField(choices=[("", "---")] + [(n, n) for n in BUILTIN_MODELS], required=False)

    class Meta:
        model = ModelVersion
        fields = ["name", "version", "description", "container_image"]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.errors:
            return data
        config = None
        if data.get("config"):
            try:
                config = json.loads(data["config"])
            except json.JSONDecodeError as exc:
                raise ValidationError({"config": f"Not valid JSON: {exc}"}) from exc
            if not isinstance(config, dict):
                raise ValidationError({"config": "config.json must be a JSON object."})
        try:
            self.instance = services.model_version_build(
                name=data["name"], version=data["version"], description=data.get("description", ""),
                container_image=data.get("container_image", ""), weights_uri=data.get("weights_uri", ""),
                sha256=data.get("sha256", ""), config=config, gguf_path=data.get("gguf_path") or None,
                builtin_model=data.get("builtin_model") or None,
            )
        except ValidationError as exc:
            raise ValidationError(form_errors(exc, self.fields)) from exc
        return data

    def _post_clean(self) -> None:
        """Model validation already ran in ``model_version_build``."""


@admin.register(ModelVersion)
class ModelVersionAdmin(admin.ModelAdmin):
    list_display = ("name", "version", "model_type", "num_hidden_layers", "num_sliding_layers", "num_full_layers",
                    "sliding_window", "num_key_value_heads", "head_dim", "created_at")
    list_filter = ("model_type", "num_key_value_heads", "created_at")
    search_fields = ("name", "version", "sha256", "weights_uri", "container_image")
    readonly_fields = ("weights_uri", "sha256", *ARCHITECTURE_FIELDS, "kv_cache", "created_at", "updated_at")

    @admin.display(description="KV cache (fp16, hybrid vs all-full)")
    def kv_cache(self, obj: ModelVersion) -> str:
        rows = [f"{obj.kv_bytes_per_token('full_attention')} B/token/layer"]
        for n in KV_REPORT_TOKENS:
            hybrid, full = obj.kv_bytes(n), obj.kv_bytes(n, hybrid=False)
            rows.append(f"{n} tokens: {hybrid / 2**20:.1f} MiB vs {full / 2**20:.1f} MiB ({full / hybrid:.2f}x)")
        return "; ".join(rows)

    def get_form(self, request, obj=None, change=False, **kwargs):  # noqa: ANN001, ANN201 - Django signature
        if obj is None:
            kwargs["form"] = ModelVersionRegisterForm
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):  # noqa: ANN001, ANN201 - Django signature
        if obj is None:
            return ["name", "version", "description", "container_image", "weights_uri", "sha256",
                    "config", "gguf_path", "builtin_model"]
        return ["name", "version", "description", "container_image", *self.readonly_fields]

    def get_readonly_fields(self, request, obj=None):  # noqa: ANN001, ANN201 - Django signature
        return () if obj is None else ("name", "version", *self.readonly_fields)

    def save_model(self, request, obj, form, change) -> None:  # noqa: ANN001 - Django signature
        if change:
            services.model_version_update(model_version=obj, description=obj.description,
                                          container_image=obj.container_image)
        else:
            services.model_version_save_new(model_version=obj)
