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


def test_kubernetes_tracks_get_the_kv_port_for_decode_and_the_cidrs_of_links_into_their_cluster(
        make_cluster, model_version):
    from apps.fleet.services import cluster_link_create

    kube = make_cluster("k8s-b", kind="kubernetes", agent_url="", namespace="ferry", in_cluster=True)
    a, c = make_cluster("dc-a"), make_cluster("dc-c")
    cluster_link_create(source=a, destination=kube, bandwidth_gbps=10, rtt_ms=2, source_cidrs=["10.8.0.0/16"])
    cluster_link_create(source=c, destination=kube, bandwidth_gbps=10, rtt_ms=2,
                        source_cidrs=["10.9.0.0/16", "10.8.0.0/16"])
    cluster_link_create(source=kube, destination=a, bandwidth_gbps=10, rtt_ms=2, source_cidrs=["10.1.0.0/16"])
    specs = {}
    for role, cluster in (("decode", kube), ("prefill", kube), ("colocated", a)):
        pool = pool_create(name=f"{role}-x", role=role, replicas=1, cluster=cluster, model_version=model_version)
        spec = track_spec(pool, pool.tracks.get(name="stable"))
        specs[role] = (spec.kv_port, spec.kv_peer_cidrs)
    assert specs == {"decode": (8001, ("10.8.0.0/16", "10.9.0.0/16")),  # links into k8s-b, deduplicated
                     "prefill": (None, ("10.8.0.0/16", "10.9.0.0/16")),
                     "colocated": (None, ())}  # local clusters: the agent picks ports, no policies
