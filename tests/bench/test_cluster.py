"""The emulated cluster's decisions that need no root: rates, the tbf bucket, the one-line refusals."""

from __future__ import annotations

import pytest

from bench import cluster
from bench.cluster import Cluster, ClusterUnavailable


def test_rates_are_tc_rates_and_a_bad_one_is_named():
    assert cluster.rate_bits("none") is None
    assert cluster.rate_bits("4gbit") == 4e9 and cluster.rate_bits("1gbit") == 1e9
    with pytest.raises(ValueError, match="'10mbps' is not one of none, 4gbit, 1gbit"):
        Cluster("10mbps")


def test_the_bucket_holds_a_gso_segment_and_four_ms_of_the_rate():
    assert cluster.tbf_burst_bytes(1e9) == 500_000
    assert cluster.tbf_burst_bytes(4e9) == 2_000_000
    assert cluster.tbf_burst_bytes(1e6) == 65536  # a slow link still takes the veth's largest segment


def test_without_root_or_iproute2_it_refuses_in_one_line(monkeypatch):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    reason = cluster.unavailable()
    assert reason and "needs root" in reason and "\n" not in reason
    with pytest.raises(ClusterUnavailable, match="needs root"), Cluster("1gbit"):
        pass
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    assert cluster.unavailable() == (
        "the emulated cluster needs iproute2 (tc not found): apt-get install iproute2")


def test_two_clusters_of_one_process_get_their_own_namespaces_and_addresses():
    a, b = Cluster("none"), Cluster("1gbit")
    assert {n.namespace for n in a.nodes}.isdisjoint(n.namespace for n in b.nodes)
    assert {n.address for n in a.nodes}.isdisjoint(n.address for n in b.nodes)
    assert all(n.address.startswith("10.213.") for n in (*a.nodes, *b.nodes))
