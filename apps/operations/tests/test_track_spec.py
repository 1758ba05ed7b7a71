"""The worker command a pool track gets: each model version runs its own weights.

Regression: on a local cluster every version of a model was started as ``--model <name>``, so a v2 registered
with its own prepared artifact (bf16 weights, another sha256) loaded v1's built-in fp32 artifact.
"""

from apps.catalog.services import model_version_register
from apps.conftest import GEMMA_LIKE_CONFIG, SHA_A
from apps.fleet.services import pool_create
from apps.operations.backends import track_spec


def _version(tmp_path, version, uri):
    return model_version_register(name="gemma-like", version=version, weights_uri=uri, sha256=SHA_A,
                                  config=GEMMA_LIKE_CONFIG)


def _args(pool):
    return track_spec(pool, pool.tracks.get(name="stable")).worker_args()


def test_local_track_loads_the_versions_own_artifact_under_the_model_name(cluster, tmp_path):
    artifact = tmp_path / "gemma-like@bf16"
    artifact.mkdir()
    v2 = _version(tmp_path, "v2", artifact.as_uri())
    pool = pool_create(name="decode", role="decode", replicas=1, cluster=cluster, model_version=v2)
    args = _args(pool)
    assert args[args.index("--model") + 1] == str(artifact)
    assert args[args.index("--served-model-name") + 1] == "gemma-like"
    assert args[args.index("--model-version") + 1] == "v2"


def test_missing_local_artifact_or_remote_uri_falls_back_to_the_model_name(cluster, tmp_path):
    for version, uri in (("v3", (tmp_path / "absent").as_uri()), ("v4", "https://models.example/gemma-like/v4")):
        pool = pool_create(name=f"decode-{version}", role="decode", replicas=1, cluster=cluster,
                           model_version=_version(tmp_path, version, uri))
        args = _args(pool)
        assert args[args.index("--model") + 1] == "gemma-like"
        assert "--served-model-name" not in args
