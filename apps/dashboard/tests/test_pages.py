"""Pages: sign-in, role-dependent controls, fleet overview, model-version KV numbers, plotly.js from the
plotly package (static finder, collectstatic), and the CPU alert profile."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from django.contrib.staticfiles import finders
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.dashboard import selectors
from apps.dashboard.finders import PLOTLY_STATIC_PATH, plotly_package_data_dir
from apps.dashboard.services import CPU_RULES, pool_alert_rules_apply_cpu
from apps.dashboard.views import DEFAULT_ROLLOUT_STEPS
from apps.fleet.services import cluster_link_create
from apps.rollouts.services import rollout_plan_create
from apps.telemetry.models import AlertRule
from apps.telemetry.selectors import alert_rules_effective
from apps.telemetry.services import alert_rules_load_defaults


def test_anonymous_is_sent_to_the_login_page(db):
    response = Client().get("/pools/1/")
    assert (response.status_code, response["Location"]) == (302, "/login/?next=/pools/1/")


def test_login_with_username_and_password_opens_the_fleet(operator_session):
    client = Client()
    page = client.get("/login/")
    assert page.status_code == 200 and b'id="sign-in"' in page.content
    response = client.post("/login/", {"username": "olga", "password": "correct-horse-battery-9"})
    assert (response.status_code, response["Location"]) == (302, "/")
    assert client.get("/").status_code == 200
    refused = Client().post("/login/", {"username": "olga", "password": "wrong"})
    assert refused.status_code == 200 and b"didn't match" in refused.content


def test_operator_sees_controls_and_viewer_sees_none(pool, make_pool, make_model_version, operator_session,
                                                     viewer_session):
    plan = rollout_plan_create(name="to-v2", pools=[pool, make_pool("prefill", role="prefill")], target_model_version=make_model_version("v2"),
                               strategy="canary", steps=[{"set_weight": 10}])
    controls = {f"/pools/{pool.pk}/": b'id="scale-form"', f"/rollouts/{plan.pk}/": b'id="rollout-controls"',
                "/rollouts/": b'id="rollout-create"'}
    for url, marker in controls.items():
        operator_page, viewer_page = operator_session.get(url), viewer_session.get(url)
        assert operator_page.status_code == viewer_page.status_code == 200
        assert marker in operator_page.content
        assert marker not in viewer_page.content
        assert b'data-can-operate="0"' in viewer_page.content
    assert b'data-verb="abort"' in operator_session.get(f"/rollouts/{plan.pk}/").content


def test_unknown_pool_and_rollout_pages_are_404(operator_session):
    assert operator_session.get("/pools/424242/").status_code == 404
    assert operator_session.get("/rollouts/424242/").status_code == 404


def test_fleet_overview_groups_by_datacenter_with_constant_queries(make_cluster, make_pool, cluster, viewer_session):
    other = make_cluster("dc-b")
    make_pool("prefill", role="prefill")
    cluster_link_create(source=cluster, destination=other, bandwidth_gbps=10.0, rtt_ms=2.5)
    with CaptureQueriesContext(connection) as few:
        selectors.fleet_overview()
    make_pool("decode", role="decode", replicas=3)
    make_pool("decode-b", role="decode", cluster=other)
    with CaptureQueriesContext(connection) as more:
        overview = selectors.fleet_overview()
    assert len(few) == len(more) == 5
    assert [(dc["name"], [c["name"] for c in dc["clusters"]]) for dc in overview["datacenters"]] == [
        ("dc-a", ["dc-a"]), ("dc-b", ["dc-b"])]
    pools = {p["name"]: p for p in overview["datacenters"][0]["clusters"][0]["pools"]}
    assert (pools["decode"]["replicas"], pools["decode"]["ready_replicas"], pools["decode"]["role"]) == (3, 0, "decode")
    (link,) = overview["links"]
    assert (link["source"], link["destination"], link["bandwidth_gbps"], link["source_pool_ids"]) == (
        "dc-a", "dc-b", 10.0, [pools["prefill"]["id"]])
    page = viewer_session.get("/")
    assert page.status_code == 200 and b'id="fleet-overview"' in page.content


def test_model_versions_page_compares_hybrid_and_all_full_kv(model_version, viewer_session):
    (row,) = selectors.model_version_rows()
    # Gemma-3-270M-like: b = 2 * 1 KV head * 256 * 2 bytes = 1024 B per token per layer; 3 full + 15 sliding, W=512.
    assert (row["kv_bytes_per_token_full"], row["kv_bytes_per_token_sliding"]) == (1024, 1024)
    assert row["kv"][0] == {"tokens": 8192, "hybrid_bytes": 1024 * (3 * 8192 + 15 * 512),
                            "all_full_bytes": 1024 * 18 * 8192, "ratio": 4.57}
    assert [k["ratio"] for k in row["kv"]] == [4.57, 5.57, 5.89]
    page = viewer_session.get("/model-versions/").content.decode()
    assert "all-full = 4.57× hybrid" in page and "3 + 15" in page


def test_plotly_js_comes_from_the_plotly_package_and_is_collected(tmp_path, settings):
    source = plotly_package_data_dir() / "plotly.min.js"
    assert finders.find(PLOTLY_STATIC_PATH) == str(source)
    settings.STATIC_ROOT = tmp_path
    call_command("collectstatic", "--noinput", stdout=io.StringIO())
    collected = Path(tmp_path) / PLOTLY_STATIC_PATH
    assert collected.read_bytes() == source.read_bytes()
    assert (Path(tmp_path) / "dashboard/js/common.js").is_file()


def test_cpu_alert_profile_overrides_gpu_defaults_for_one_pool(make_pool):
    alert_rules_load_defaults()
    cpu_pool, other = make_pool("cpu-decode"), make_pool("cpu-prefill", role="prefill")
    pool_alert_rules_apply_cpu(pool=cpu_pool)
    pool_alert_rules_apply_cpu(pool=cpu_pool)  # idempotent
    assert AlertRule.objects.filter(pool=cpu_pool).count() == len(CPU_RULES)
    effective = alert_rules_effective([cpu_pool.pk, other.pk])
    mine = {r.name: (r.signal, r.comparison, r.threshold, r.for_seconds) for r in effective[cpu_pool.pk]}
    assert mine["ttft-p99-high"] == ("ttft_p99_s", ">", 10.0, 30)
    assert mine["engine-busy-high"] == ("engine_busy_ratio", ">", 0.95, 120)
    assert "gpu-utilization-low" not in mine  # disabled for the pool
    assert mine["request-failure-rate-high"] == ("error_rate", ">", 0.01, 0)  # hardware-independent default kept
    defaults = {r.name: r.threshold for r in effective[other.pk]}
    assert defaults["ttft-p99-high"] == 0.5 and "gpu-utilization-low" in defaults


def test_cpu_alert_profile_refuses_gpu_pools_and_the_command_applies_it(make_pool):
    gpu_pool = make_pool("gpu-decode", gpu_kind="nvidia-h200", gpu_count=1)
    cpu_pool = make_pool("cpu-decode")
    with pytest.raises(ValueError, match="GPU"):
        pool_alert_rules_apply_cpu(pool=gpu_pool)
    out = io.StringIO()
    call_command("dashboard_cpu_alert_rules", stdout=out)
    assert out.getvalue() == f"pool {cpu_pool.pk} (dc-a/cpu-decode): {len(CPU_RULES)} CPU rules applied\n"
    assert not AlertRule.objects.filter(pool=gpu_pool).exists()


def test_rollout_form_targets_the_newest_version_the_chosen_pools_do_not_run(make_pool, make_model_version,
                                                                              model_version, operator_session):
    v1 = model_version
    decode, prefill = make_pool("decode", model_version=v1), make_pool("prefill", role="prefill", model_version=v1)
    v2, v3 = make_model_version("v2"), make_model_version("v3")
    other_model = make_model_version("x1", name="llama-like")  # the newest of all, but no chosen pool serves it
    decode_b = make_pool("decode-b", model_version=v3)
    form = selectors.rollout_form()
    assert [v["label"] for v in form["versions"]] == ["llama-like:x1", "gemma-like:v3", "gemma-like:v2",
                                                      "gemma-like:v1"]
    assert form["default_target"] == v2.pk  # every pool: v1 and v3 are run
    cases = {(decode.pk, prefill.pk): v3.pk, (decode_b.pk,): v2.pk, (decode.pk, decode_b.pk): v2.pk}
    for pool_ids, expected in cases.items():
        assert selectors.rollout_form(list(pool_ids))["default_target"] == expected, pool_ids
    make_pool("decode-c", model_version=v2)
    assert selectors.rollout_form()["default_target"] == other_model.pk  # no gemma-like version is free
    make_pool("decode-d", model_version=other_model)
    assert selectors.rollout_form()["default_target"] is None  # every version is run
    page = operator_session.get("/rollouts/").content.decode()
    assert 'id="rollout-form-data"' in page and "<option value=" in page and " selected>" not in page


def test_rollout_form_preselects_the_default_target_and_steps_that_end_by_themselves(
        make_pool, make_model_version, model_version, operator_session):
    v1 = model_version
    pools = [make_pool("decode", model_version=v1), make_pool("prefill", role="prefill", model_version=v1)]
    v2 = make_model_version("v2")
    page = operator_session.get("/rollouts/").content.decode()
    assert f'<option value="{v2.pk}" selected>gemma-like:v2</option>' in page
    assert f'<option value="{v1.pk}">gemma-like:v1</option>' in page
    assert ('<textarea id="rc-steps" rows="4">[{&quot;set_weight&quot;: 25}, {&quot;pause&quot;: {&quot;seconds&quot;: '
            '20}}, {&quot;set_weight&quot;: 50}, {&quot;pause&quot;: {&quot;seconds&quot;: 20}}]</textarea>') in page
    # The pre-filled plan is valid as it stands, and no pause waits for a resume.
    plan = rollout_plan_create(name="from-the-form", pools=pools, target_model_version=v2, strategy="canary",
                               steps=DEFAULT_ROLLOUT_STEPS)
    assert [s["pause"]["seconds"] for s in plan.steps if "pause" in s] == [20, 20]


def test_role_less_user_sees_only_the_no_role_page(pool, make_pool, make_model_version):
    """A signed-in user with no role (an account an admin has not given one yet) reads no page."""
    from django.contrib.auth.models import User

    client = Client()
    client.force_login(User.objects.create_user("newcomer", password="correct-horse-battery-9"))
    plan = rollout_plan_create(name="r", pools=[pool, make_pool("prefill", role="prefill")],
                               target_model_version=make_model_version("v2"),
                               strategy="canary", steps=[{"set_weight": 10}])
    for path in ("/", f"/pools/{pool.pk}/", "/rollouts/", f"/rollouts/{plan.pk}/", "/model-versions/"):
        response = client.get(path)
        assert (path, response.status_code) == (path, 403)
        assert b'id="no-role"' in response.content and pool.name.encode() not in response.content


def test_sign_in_is_locked_for_the_user_and_address_after_five_failures(operator_session):
    """django-axes: the 5th failure for olga from one address locks that pair out (429), and then even the right
    password is refused; the same user from another address still signs in."""
    attacker = Client(REMOTE_ADDR="203.0.113.9")
    for _ in range(4):
        assert attacker.post("/login/", {"username": "olga", "password": "guess"}).status_code == 200
    assert attacker.post("/login/", {"username": "olga", "password": "guess"}).status_code == 429
    locked = attacker.post("/login/", {"username": "olga", "password": "correct-horse-battery-9"})
    assert locked.status_code == 429 and b'id="locked-out"' in locked.content
    elsewhere = Client(REMOTE_ADDR="198.51.100.7")
    assert elsewhere.post("/login/", {"username": "olga", "password": "correct-horse-battery-9"}).status_code == 302


def test_no_page_claims_offline_the_stream_badge_is_hidden_until_a_stream_sets_it(
        pool, make_pool, make_cluster, make_model_version, operator_session):
    """A new user saw "offline" on the rollouts list and model versions pages, which have no live stream: every page
    renders the badge hidden and empty; only a page's ``FerryStream`` shows it (connecting, live, offline)."""
    link = cluster_link_create(source=pool.cluster, destination=make_cluster("dc-b"), bandwidth_gbps=10.0, rtt_ms=3.0)
    plan = rollout_plan_create(name="to-v2", pools=[pool, make_pool("prefill", role="prefill")],
                               target_model_version=make_model_version("v2"), strategy="canary",
                               steps=[{"set_weight": 10}])
    badge = b'<span id="ws-status" class="ws-status" title="live stream of this page" hidden></span>'
    for url in ("/", f"/pools/{pool.pk}/", "/rollouts/", f"/rollouts/{plan.pk}/", "/model-versions/", "/alerts/",
                f"/links/{link.pk}/"):
        content = operator_session.get(url).content
        assert content.count(b'id="ws-status"') == 1 and badge in content, url
        assert b"offline" not in content, url
    common = finders.find("dashboard/js/common.js")
    script = Path(common).read_text()
    assert 'this.setStatus("connecting");' in script and "node.hidden = false;" in script
