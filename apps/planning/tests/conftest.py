"""Planning fixtures: two clusters joined by a link, a prefill and a decode pool, the profile fixture files."""

from __future__ import annotations

from pathlib import Path

import pytest

from apps.fleet.services import cluster_link_create, pool_create
from apps.planning.services import profile_import

FIXTURES = Path(__file__).with_name("fixtures")


@pytest.fixture
def two_dcs(make_cluster, model_version):
    """Clusters dc-p and dc-d, a 10 Gbit/s 5 ms link from dc-p to dc-d, pools prefill (dc-p) and decode (dc-d)."""
    compute, bandwidth = make_cluster("dc-p"), make_cluster("dc-d")
    link = cluster_link_create(source=compute, destination=bandwidth, bandwidth_gbps=10.0, rtt_ms=5.0)
    prefill = pool_create(name="prefill", cluster=compute, role="prefill", model_version=model_version, replicas=0)
    decode = pool_create(name="decode", cluster=bandwidth, role="decode", model_version=model_version, replicas=0)
    return {"prefill": prefill, "decode": decode, "link": link}


@pytest.fixture
def profiles(two_dcs):
    """The fixture profiles imported for both pools: (prefill profile, decode profile)."""
    return (profile_import(pool=two_dcs["prefill"], text=(FIXTURES / "prefill_profile.json").read_text()),
            profile_import(pool=two_dcs["decode"], text=(FIXTURES / "decode_profile.json").read_text()))


WORKLOAD = {"prompt_median": 256, "prompt_p90": 1024, "prompt_cap": 2048, "output_median": 16, "rate_per_s": 1.0,
            "ttft_slo_s": 2.0, "tpot_slo_s": 0.1, "attainment": 0.9, "max_link_share": 1.0}
