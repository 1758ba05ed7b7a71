"""Writes for the catalog: register, update and delete model versions."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction

from apps.catalog.models import ModelVersion
from inference_worker.config import ModelConfig
from inference_worker.registry import BUILTIN_MODELS
from inference_worker.registry import gguf_path as builtin_gguf_path

UPDATABLE_FIELDS = ("description", "container_image")


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, streamed."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _allowed_gguf_path(raw: str) -> Path:
    path = Path(raw).expanduser()
    if not path.is_absolute() or path.suffix != ".gguf":
        raise ValidationError({"gguf_path": ["Give an absolute path to a .gguf file on the server."]})
    resolved = path.resolve()
    roots = [Path(r).resolve() for r in settings.FERRY_MODEL_ROOTS]
    if not any(resolved.is_relative_to(root) for root in roots):
        raise ValidationError({"gguf_path": [
            f"{raw} is outside the allowed model directories ({', '.join(map(str, roots))}); "
            "set FERRY_MODEL_ROOTS to allow another directory."
        ]})
    if not resolved.is_file():
        raise ValidationError({"gguf_path": [f"No file at {raw}."]})
    return resolved


def local_weights_file(weights_uri: str) -> Path | None:
    """The regular file a ``file://`` weights URI names when it lies under ``FERRY_MODEL_ROOTS`` (the only
    local files the control plane reads), else None (another scheme, a directory such as a prepared artifact,
    a missing file or one outside the roots: nothing to checksum here)."""
    parsed = urlparse(weights_uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        return None
    path = Path(url2pathname(parsed.path)).resolve()
    roots = [Path(r).resolve() for r in settings.FERRY_MODEL_ROOTS]
    if not path.is_file() or not any(path.is_relative_to(root) for root in roots):
        return None
    return path


def _parse_architecture(
    *, config: dict[str, Any] | None, gguf_path: str | None, builtin_model: str | None
) -> tuple[ModelConfig, str, Path | None]:
    given = [k for k, v in (("config", config), ("gguf_path", gguf_path), ("builtin_model", builtin_model))
             if v is not None]
    if len(given) != 1:
        raise ValidationError({"non_field_errors": [
            "Give exactly one architecture source: config (the config.json object), gguf_path or builtin_model."
        ]})
    try:
        if config is not None:
            return ModelConfig.from_hf_config(config), "config.json", None
        if gguf_path is not None:
            path = _allowed_gguf_path(gguf_path)
            return ModelConfig.from_gguf(path), f"gguf:{path}", path
        if builtin_model not in BUILTIN_MODELS:
            raise ValidationError({"builtin_model": [f"Unknown model; choose one of {', '.join(BUILTIN_MODELS)}."]})
        path = builtin_gguf_path(builtin_model)
        return ModelConfig.from_gguf(path), f"builtin:{builtin_model}", path
    except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
        field = given[0]
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise ValidationError({field: [f"Cannot read the architecture: {message}"]}) from exc


def model_version_build(
    *,
    name: str,
    version: str,
    weights_uri: str = "",
    sha256: str = "",
    container_image: str = "",
    description: str = "",
    config: dict[str, Any] | None = None,
    gguf_path: str | None = None,
    builtin_model: str | None = None,
) -> ModelVersion:
    """Build and validate (not save) a model version whose architecture ``ModelConfig`` parses.

    Exactly one source: ``config`` (an HF config.json dict), ``gguf_path`` (a .gguf file under
    ``FERRY_MODEL_ROOTS``) or ``builtin_model`` (``inference_worker.registry.BUILTIN_MODELS``). For a file
    source, ``weights_uri`` defaults to ``file://<path>``. Local weights are checksummed: when ``weights_uri``
    names a file under ``FERRY_MODEL_ROOTS`` (:func:`local_weights_file`), ``sha256`` (the expected digest)
    must equal the file's SHA-256, and defaults to it.

    Raises:
        ValidationError: no/several sources, unreadable architecture, missing weights_uri or
            sha256 for a config.json source, a local weights file whose SHA-256 is not ``sha256``, invalid
            fields, or (name, version) already exists.
    """
    model_config, source, path = _parse_architecture(config=config, gguf_path=gguf_path, builtin_model=builtin_model)
    if path is not None:
        weights_uri = weights_uri or path.as_uri()
    local = local_weights_file(weights_uri)
    if local is not None:
        digest = file_sha256(local)
        if sha256 and sha256.lower() != digest:
            raise ValidationError({"sha256": [
                f"The weights file {local} has SHA-256 {digest}, not {sha256.lower()}: check the file (a partial or "
                "different download?) or the expected checksum; leave it empty to take the file's."]})
        sha256 = digest
    missing = {f: [f"{f} is required when registering from config.json."]
               for f, v in (("weights_uri", weights_uri), ("sha256", sha256)) if not v}
    if missing:
        raise ValidationError(missing)
    mv = ModelVersion(
        name=name, version=version, description=description, container_image=container_image,
        weights_uri=weights_uri, sha256=sha256.lower(), architecture_source=source,
        architecture=model_config.to_dict(), model_type=model_config.architecture,
        num_hidden_layers=model_config.num_hidden_layers, num_full_layers=model_config.num_full_layers,
        num_sliding_layers=model_config.num_sliding_layers, layer_types=list(model_config.layer_types),
        sliding_window=model_config.sliding_window, num_attention_heads=model_config.num_attention_heads,
        num_key_value_heads=model_config.num_key_value_heads, head_dim=model_config.head_dim,
        dtype=model_config.dtype, max_position_embeddings=model_config.max_position_embeddings,
    )
    mv.full_clean()
    return mv


def model_version_save_new(*, model_version: ModelVersion) -> ModelVersion:
    """Insert a version built by :func:`model_version_build` (the admin validates in its form first)."""
    with transaction.atomic():
        model_version.save(force_insert=True)
    return model_version


def model_version_register(**kwargs: Any) -> ModelVersion:
    """Register a model version: :func:`model_version_build` (same keyword arguments) then insert it.

    Raises:
        ValidationError: see :func:`model_version_build`.
    """
    return model_version_save_new(model_version=model_version_build(**kwargs))


def model_version_update(*, model_version: ModelVersion, **changes: Any) -> ModelVersion:
    """Change a version's description or container image (the architecture and weights are immutable).

    Raises:
        ValidationError: a field other than description/container_image, or an invalid value.
    """
    bad = sorted(set(changes) - set(UPDATABLE_FIELDS))
    if bad:
        raise ValidationError({f: ["Immutable after registration; register a new version instead."] for f in bad})
    for field, value in changes.items():
        setattr(model_version, field, value)
    model_version.full_clean()
    with transaction.atomic():
        model_version.save(update_fields=[*changes, "updated_at"])
    return model_version


def model_version_delete(*, model_version: ModelVersion) -> None:
    """Delete a version. Raises ``ProtectedError`` (HTTP 409) while a pool or rollout uses it."""
    with transaction.atomic():
        model_version.delete()
