"""The routing table's content for two models (issue 18): tracks per served model, and per model version the
model name, tokenizer reference, digest salt and block size; the router parses it and routes by ``model``."""

from django.utils import timezone

from apps.fleet import selectors
from apps.fleet.models import Replica
from apps.fleet.routing_table import routing_table_content
from inference_worker.router.pipeline import eligibility, models_served
from inference_worker.router.table import RoutingTable


def test_two_models_each_get_their_tracks_and_salt_and_the_router_routes_by_model(model_version, make_model_version,
                                                                                   make_pool):
    gemma, smol = model_version, make_model_version("s1", name="smol-like")
    pools = {"g": make_pool("decode-g", model_version=gemma), "s": make_pool("decode-s", model_version=smol)}
    for key, pool in pools.items():
        Replica.objects.create(pool=pool, track="stable", name=f"{key}-0", endpoint=f"http://{key}:8000", ready=True,
                               version=pool.tracks.get().model_version.version, last_seen=timezone.now())
    content = routing_table_content(list(selectors.routing_pools()), [])
    assert content["tracks"] == [{"name": "stable", "model_version": "v1", "weight": 100},
                                 {"name": "stable", "model_version": "s1", "weight": 100}]
    entry = content["models"]["s1"]
    assert (entry["model"], entry["tokenizer"], entry["weights_sha256"], entry["kv_dtype"], entry["block_size"]) == (
        "smol-like", "smol-like", smol.sha256, entry["dtype"], 16)
    table = RoutingTable.from_dict({"version": 1, **content})
    assert models_served(table) == ["gemma-like", "smol-like"]
    assert [r.name for r in eligibility(table, model="smol-like", sticky_key="k").decode] == ["s-0"]
    assert [r.name for r in eligibility(table, model="gemma-like", sticky_key="k").decode] == ["g-0"]
    assert table.model_info["v1"].can_hash
