"""``ModelVersion``: a model at a version, with the architecture read from its config or GGUF.

The architecture columns are copied from :class:`inference_worker.config.ModelConfig` at
registration (service ``model_version_register``) and never edited; ``architecture`` keeps the
parser's full ``to_dict()`` so :meth:`ModelVersion.model_config` rebuilds the dataclass and the
KV numbers come from the one formula in ``inference_worker.config``.
"""

from __future__ import annotations

from dataclasses import fields

from django.core.validators import RegexValidator
from django.db import models

from inference_worker.config import ModelConfig

SHA256_VALIDATOR = RegexValidator(r"^[0-9a-f]{64}$", "sha256 must be 64 lowercase hexadecimal characters.")
NAME_VALIDATOR = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", "Use letters, digits, '.', '_' or '-' (start with a letter or digit)."
)
KV_DTYPE_BYTES = 2  # KV numbers are quoted for an fp16/bf16 cache
KV_REPORT_TOKENS = (8192, 32768, 131072)


class ModelVersion(models.Model):
    name = models.CharField(max_length=100, validators=[NAME_VALIDATOR])
    version = models.CharField(max_length=100, validators=[NAME_VALIDATOR])
    description = models.TextField(blank=True)
    container_image = models.CharField(max_length=255, blank=True, help_text="Worker image, e.g. ghcr.io/org/ferry:1.2")
    weights_uri = models.CharField(max_length=500, help_text="Where workers fetch weights (file://, s3://, hf://...).")
    sha256 = models.CharField(max_length=64, validators=[SHA256_VALIDATOR], help_text="SHA-256 of the weights file.")
    architecture_source = models.CharField(
        max_length=600, help_text="Where the architecture was read: config.json, gguf:<path> or builtin:<name>."
    )
    architecture = models.JSONField(help_text="ModelConfig.to_dict() of the parsed architecture.")
    model_type = models.CharField(max_length=32, help_text="Architecture family: gemma3, llama.")
    num_hidden_layers = models.PositiveIntegerField()
    num_full_layers = models.PositiveIntegerField()
    num_sliding_layers = models.PositiveIntegerField()
    layer_types = models.JSONField(help_text="Per layer: sliding_attention or full_attention.")
    sliding_window = models.PositiveIntegerField(null=True, blank=True, help_text="Tokens; empty = no sliding layers.")
    num_attention_heads = models.PositiveIntegerField()
    num_key_value_heads = models.PositiveIntegerField()
    head_dim = models.PositiveIntegerField()
    dtype = models.CharField(max_length=16)
    max_position_embeddings = models.PositiveIntegerField(help_text="Maximum context in tokens.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name", "version"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="catalog_modelversion_unique_name_version")]

    def __str__(self) -> str:
        return f"{self.name}:{self.version}"

    def model_config(self) -> ModelConfig:
        """Rebuild the parser's dataclass from the stored ``architecture`` dict.

        Raises:
            ValueError: the stored dict is inconsistent (ModelConfig validation).
        """
        names = {f.name for f in fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in self.architecture.items() if k in names})

    def kv_bytes_per_token(self, layer_type: str) -> int:
        """K+V bytes per token in one layer of ``layer_type`` at fp16 (``ModelConfig.kv_bytes_per_token``)."""
        return self.model_config().kv_bytes_per_token(layer_type, dtype_bytes=KV_DTYPE_BYTES)

    def kv_bytes(self, num_tokens: int, *, hybrid: bool = True) -> int:
        """fp16 KV bytes resident at ``num_tokens`` tokens, hybrid or all-full (``ModelConfig.kv_bytes``)."""
        return self.model_config().kv_bytes(num_tokens, hybrid=hybrid, dtype_bytes=KV_DTYPE_BYTES)
