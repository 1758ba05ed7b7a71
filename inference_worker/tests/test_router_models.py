"""Two models behind one router, real workers (issue 18, acceptances 3 and 4).

A Gemma 3 270M and a SmolLM2 135M decode worker (block size 4, CPU, fp32) sit in one routing table with
each version's tokenizer reference and digest salt. Each request reaches a replica of its ``model``;
an unknown model is a 404 from the router; and on a scripted multi-turn sequence the router's prefix
index (fed by the workers' KV events, hashed with each model's own tokenizer and root) predicts the
cached tokens each worker then reports, within one block.
"""

import json
import re
import time

import httpx
import pytest

from inference_worker import http_headers
from inference_worker.model.prepare import read_manifest
from inference_worker.tests.support.models import GEMMA, SMOLLM2, prepared_model_dir
from inference_worker.tests.support.router import RouterProcess
from inference_worker.tests.support.worker import WorkerProcess, start_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BLOCK = 4


def model_entry(name):
    directory = prepared_model_dir(name)
    config = json.loads((directory / "config.json").read_text())
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    return {"layer_types": layer_types, "sliding_window": config.get("sliding_window") or 0,
            "num_kv_heads": config["num_key_value_heads"],
            "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            "dtype": "float32", "model": name, "tokenizer": name, "weights_sha256": read_manifest(directory)["sha256"],
            "kv_dtype": "float32", "block_size": BLOCK}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    workers = {name: WorkerProcess("--role", "colocated", "--block-size", str(BLOCK), "--max-num-seqs", "2",
                                   "--replica", f"{name}-0", model=name) for name in (GEMMA, SMOLLM2)}
    start_together(*workers.values())
    table = {"version": 1,
             "tracks": [{"name": "stable", "model_version": "g1", "weight": 100},
                        {"name": "stable", "model_version": "s1", "weight": 100}],
             "pools": [{"name": "gemma", "role": "colocated", "replicas": [
                           {"name": "gemma-0", "url": workers[GEMMA].base_url, "track": "stable", "model_version": "g1"}]},
                       {"name": "smol", "role": "colocated", "replicas": [
                           {"name": "smol-0", "url": workers[SMOLLM2].base_url, "track": "stable",
                            "model_version": "s1"}]}],
             "models": {"g1": model_entry(GEMMA), "s1": model_entry(SMOLLM2)}}
    path = tmp_path_factory.mktemp("router-models") / "table.json"
    path.write_text(json.dumps(table))
    router = RouterProcess(path, "--table-interval", "0.2", "--scrape-interval", "0.5")
    url = router.url
    try:
        yield url
    finally:
        router.stop()
        for w in workers.values():
            w.stop()


def cached_totals(url):
    text = httpx.get(url + "/metrics").text
    totals = {}
    for kind in ("predicted", "reported"):
        for pool, value in re.findall(rf'ferry_router_{kind}_cached_tokens_total{{pool="(\w+)"}} ([0-9.e+]+)', text):
            totals[(kind, pool)] = float(value)
    return totals


def ask(url, model, **body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    return httpx.post(url + path, json={"model": model, "max_tokens": 2, "temperature": 0, **body}, timeout=120)


def test_each_request_reaches_a_replica_of_its_model_and_unknown_models_are_404(fleet):
    r = ask(fleet, GEMMA, prompt="The capital of France is")
    assert r.status_code == 200 and r.headers[http_headers.REPLICA] == "gemma-0" and r.json()["model"] == GEMMA
    r = ask(fleet, SMOLLM2, messages=[{"role": "user", "content": "Hi"}])
    assert r.status_code == 200 and r.headers[http_headers.REPLICA] == "smol-0" and r.json()["model"] == SMOLLM2
    r = ask(fleet, "llama-70b", prompt="x")
    assert r.status_code == 404 and "'llama-70b' is not served here" in r.json()["error"]["message"]
    assert [m["id"] for m in httpx.get(fleet + "/v1/models").json()["data"]] == [GEMMA, SMOLLM2]
    metrics = httpx.get(fleet + "/metrics").text  # decisions by reason: no prefill pool, cache scoring on
    for pool in ("gemma", "smol"):
        assert (f'ferry_router_decision_reasons_total{{cache="on",decision="local_prefill",pool="{pool}",'
                f'reason="no_prefill_replica"}} 1.0') in metrics


@pytest.mark.parametrize("model, pool", [(GEMMA, "gemma"), (SMOLLM2, "smol")])
def test_predicted_cached_tokens_match_the_workers_within_one_block(fleet, model, pool):
    story = ["Once upon a time a small ferry crossed a wide river every morning at dawn.",
             " The ferryman counted the passengers and the bicycles and the crates of apples.",
             " One day a fox asked to cross without paying, offering a riddle instead."]
    messages = []
    for turn in story:
        messages.append({"role": "user", "content": turn})
        before = cached_totals(fleet)
        body = {"messages": messages} if model == SMOLLM2 else {"prompt": "".join(m["content"] for m in messages)}
        r = ask(fleet, model, **body, user="session-1")
        assert r.status_code == 200, r.text
        after = cached_totals(fleet)
        predicted = after[("predicted", pool)] - before.get(("predicted", pool), 0)
        reported = after[("reported", pool)] - before.get(("reported", pool), 0)
        assert int(r.headers[http_headers.CACHED_TOKENS]) == reported
        assert abs(predicted - reported) <= BLOCK, (turn, predicted, reported)
        if len(messages) > 1:
            assert reported > 0
        messages.append({"role": "assistant", "content": r.json()["choices"][0].get("message", {}).get("content", "")
                         if model == SMOLLM2 else ""})
        time.sleep(0.5)  # KV events are sent every 50 ms; let the index catch up before the next turn
