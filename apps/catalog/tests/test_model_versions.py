"""Model versions: Gemma 3 270M from its GGUF (acceptance 2), config.json registration, API rules."""

import pytest

from apps.catalog.models import ModelVersion
from apps.catalog.services import file_sha256, model_version_register
from apps.conftest import GEMMA_LIKE_CONFIG, SHA_A
from inference_worker.registry import gguf_path

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def gemma_gguf():
    return gguf_path("gemma-3-270m")


def test_gemma3_270m_from_gguf_metadata_has_hybrid_layout_and_exact_kv_bytes(gemma_gguf):
    mv = model_version_register(name="gemma-3-270m", version="q4km", gguf_path=str(gemma_gguf))
    mv = ModelVersion.objects.get(pk=mv.pk)
    assert (mv.num_hidden_layers, mv.num_sliding_layers, mv.num_full_layers) == (18, 15, 3)
    assert mv.sliding_window == 512
    assert (mv.num_attention_heads, mv.num_key_value_heads, mv.head_dim) == (4, 1, 256)
    assert [i for i, t in enumerate(mv.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert mv.architecture_source == f"gguf:{gemma_gguf.resolve()}"
    assert mv.kv_bytes_per_token("full_attention") == mv.kv_bytes_per_token("sliding_attention") == 1024
    assert mv.kv_bytes(8192) == 33_030_144
    assert mv.kv_bytes(32768) == 108_527_616
    assert mv.kv_bytes(8192, hybrid=False) == 150_994_944
    assert round(mv.kv_bytes(8192, hybrid=False) / mv.kv_bytes(8192), 2) == 4.57
    assert round(mv.kv_bytes(32768, hybrid=False) / mv.kv_bytes(32768), 2) == 5.57


def test_builtin_model_via_api_defaults_weights_uri_and_sha256_and_shows_kv(admin_api, gemma_gguf):
    r = admin_api.post("/api/v1/model-versions/", {"name": "gemma-3-270m", "version": "builtin",
                                                   "builtin_model": "gemma-3-270m"}, format="json")
    assert r.status_code == 201, r.json()
    body = r.json()
    assert body["weights_uri"] == gemma_gguf.resolve().as_uri()
    assert body["sha256"] == file_sha256(gemma_gguf)
    assert body["architecture_source"] == "builtin:gemma-3-270m"
    assert body["kv"] == {
        "dtype": "float16", "bytes_per_token_full_layer": 1024, "bytes_per_token_sliding_layer": 1024,
        "at": [
            {"num_tokens": 8192, "hybrid_bytes": 33_030_144, "all_full_bytes": 150_994_944, "reduction": 4.57},
            {"num_tokens": 32768, "hybrid_bytes": 108_527_616, "all_full_bytes": 603_979_776, "reduction": 5.57},
            {"num_tokens": 131072, "hybrid_bytes": 410_517_504, "all_full_bytes": 2_415_919_104, "reduction": 5.89},
        ],
    }


def test_register_from_config_json_and_filter(admin_api):
    body = {"name": "gemma-like", "version": "v1", "weights_uri": "s3://m/g", "sha256": SHA_A,
            "config": GEMMA_LIKE_CONFIG}
    r = admin_api.post("/api/v1/model-versions/", body, format="json")
    assert r.status_code == 201, r.json()
    assert (r.json()["num_sliding_layers"], r.json()["architecture_source"]) == (15, "config.json")
    dense = {**GEMMA_LIKE_CONFIG, "model_type": "llama", "num_key_value_heads": 2, "head_dim": 64}
    dense.pop("sliding_window")
    r = admin_api.post("/api/v1/model-versions/", {**body, "name": "dense", "config": dense}, format="json")
    assert r.status_code == 201, r.json()
    assert r.json()["kv"]["at"][0]["reduction"] == 1.0
    assert [m["name"] for m in admin_api.get("/api/v1/model-versions/?model_type=llama").json()["results"]] == ["dense"]
    assert admin_api.get("/api/v1/model-versions/?name_contains=GEMMA").json()["count"] == 1


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"sha256": "xyz"}, "sha256"),
        ({"sha256": ""}, "sha256"),
        ({"weights_uri": ""}, "weights_uri"),
        ({"config": {"model_type": "bert"}}, "config"),
        ({"config": {"model_type": "llama"}}, "config"),
        ({"gguf_path": "/etc/passwd.gguf"}, "gguf_path"),
        ({"builtin_model": "gpt-5"}, "builtin_model"),
    ],
)
def test_register_rejects_bad_input_with_field_message(admin_api, over, field):
    body = {"name": "m", "version": "v1", "weights_uri": "s3://m", "sha256": SHA_A, "config": GEMMA_LIKE_CONFIG}
    body.update(over)
    if "gguf_path" in over or "builtin_model" in over:
        body.pop("config")
    r = admin_api.post("/api/v1/model-versions/", body, format="json")
    assert r.status_code == 400
    assert field in r.json(), r.json()


def test_two_sources_or_none_is_400(admin_api):
    base = {"name": "m", "version": "v1", "weights_uri": "s3://m", "sha256": SHA_A}
    for extra in ({}, {"config": GEMMA_LIKE_CONFIG, "builtin_model": "gemma-3-270m"}):
        r = admin_api.post("/api/v1/model-versions/", {**base, **extra}, format="json")
        assert r.status_code == 400
        assert r.json()["non_field_errors"] == [
            "Give exactly one architecture source: config (the config.json object), gguf_path or builtin_model."]


def test_name_version_unique(admin_api, model_version):
    r = admin_api.post("/api/v1/model-versions/", {"name": model_version.name, "version": "v1", "weights_uri": "s3://x",
                                                   "sha256": SHA_A, "config": GEMMA_LIKE_CONFIG}, format="json")
    assert r.status_code == 400
    assert "already exists" in str(r.json())


def test_update_changes_metadata_only(admin_api, model_version):
    r = admin_api.patch(f"/api/v1/model-versions/{model_version.pk}/", {"container_image": "ghcr.io/ferry/worker:2"},
                        format="json")
    assert r.status_code == 200
    assert (r.json()["container_image"], r.json()["sha256"]) == ("ghcr.io/ferry/worker:2", SHA_A)


IMMUTABLE = ["Immutable after registration; register a new version instead (POST /api/v1/model-versions/)."]


def test_update_of_an_immutable_field_is_a_400_naming_it_and_changes_nothing(admin_api, model_version):
    """A new digest was dropped without a word (200, the old sha256 kept, the container image changed)."""
    r = admin_api.patch(f"/api/v1/model-versions/{model_version.pk}/",
                        {"container_image": "ghcr.io/ferry/worker:2", "sha256": "b" * 64, "num_hidden_layers": 2,
                         "id": 7, "colour": "red"}, format="json")
    assert (r.status_code, r.json()) == (400, {
        "sha256": IMMUTABLE, "num_hidden_layers": IMMUTABLE, "id": ["This field is read-only."],
        "colour": ["Unknown field: it is not part of this resource."]})
    model_version.refresh_from_db()
    assert (model_version.container_image, model_version.sha256) == ("", SHA_A)


def test_register_refuses_architecture_fields_and_unknown_ones(admin_api):
    r = admin_api.post("/api/v1/model-versions/", {"name": "m", "version": "v1", "config": GEMMA_LIKE_CONFIG,
                                                   "weights_uri": "s3://m/v1", "sha256": SHA_A,
                                                   "sliding_window": 4096, "weights_url": "s3://m/v1"},
                       format="json")
    assert (r.status_code, r.json()) == (400, {
        "sliding_window": ["Read from the architecture source (config, gguf_path or builtin_model), never sent."],
        "weights_url": ["Unknown field: it is not part of this resource."]})
    assert admin_api.get("/api/v1/model-versions/").json()["count"] == 0


def test_version_in_use_cannot_be_deleted_409(admin_api, pool, model_version, make_model_version):
    r = admin_api.delete(f"/api/v1/model-versions/{model_version.pk}/")
    assert r.status_code == 409
    assert r.json()["detail"].startswith("Cannot delete: still in use by pool dc-a/decode")
    unused = make_model_version("v9")
    assert admin_api.delete(f"/api/v1/model-versions/{unused.pk}/").status_code == 204


def test_viewer_reads_but_cannot_register(viewer_api, model_version):
    assert viewer_api.get("/api/v1/model-versions/").json()["count"] == 1
    r = viewer_api.post("/api/v1/model-versions/", {"name": "m", "version": "v", "builtin_model": "gemma-3-270m"},
                        format="json")
    assert r.status_code == 403


def test_a_local_weights_files_checksum_is_verified_against_the_expected_sha256(admin_api, tmp_path, settings):
    """Local weights (a file:// URI under FERRY_MODEL_ROOTS) are checksummed: a wrong expected digest is refused
    with the file's own, a right one (any case) or none registers it."""
    settings.FERRY_MODEL_ROOTS = [str(tmp_path)]
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not really weights")
    digest = file_sha256(weights)
    body = {"name": "m", "version": "v1", "weights_uri": weights.as_uri(), "config": GEMMA_LIKE_CONFIG}
    r = admin_api.post("/api/v1/model-versions/", {**body, "sha256": SHA_A}, format="json")
    assert (r.status_code, r.json()) == (400, {"sha256": [
        f"The weights file {weights} has SHA-256 {digest}, not {SHA_A}: check the file (a partial or different "
        "download?) or the expected checksum; leave it empty to take the file's."]})
    assert ModelVersion.objects.count() == 0
    r = admin_api.post("/api/v1/model-versions/", {**body, "sha256": digest.upper()}, format="json")
    assert (r.status_code, r.json()["sha256"]) == (201, digest)
    r = admin_api.post("/api/v1/model-versions/", {**body, "version": "v2"}, format="json")
    assert (r.status_code, r.json()["sha256"]) == (201, digest)
