"""The target model: units, links, and one-line errors for what a target TOML gets wrong."""

from __future__ import annotations

import pytest

from planner.artifacts.target import Target, load_target
from planner.errors import TargetError
from planner.units import parse_bytes, parse_percent, parse_rate, parse_seconds

GOOD = """world_size = 2
ranks_per_node = 1
backend = "gloo"
[link.inter_node]
bandwidth = "1Gbit/s"
latency = "50us"
"""


def test_units_are_explicit_and_si():
    assert parse_rate("1Gbit/s") == 1.25e8 and parse_rate("400Mbit/s") == 5e7 and parse_rate("1e9bit/s") == 1.25e8
    assert parse_rate("25GB/s") == 25e9 and parse_rate("2.5 GB/s") == 2.5e9
    assert parse_seconds("50us") == pytest.approx(5e-5) and parse_seconds("2ms") == pytest.approx(2e-3)
    assert parse_percent("10%") == pytest.approx(0.1)
    for bad in ("1 Gbps", "1G", "fast", "-1Gbit/s", "0Gbit/s", "1Gib/s", "1Gb/s"):
        with pytest.raises(ValueError, match="write a positive number with its unit"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="'50 usec'"):
        parse_seconds("50 usec")


def test_sizes_are_read_by_pydantic_bytesize_with_the_unit_matched_exactly():
    assert parse_bytes("1.5GiB") == 3 * 2**29 and parse_bytes("2000MB") == 2 * 10**9 and parse_bytes(" 7 B ") == 7
    assert parse_bytes("1TiB") == 2**40 and parse_bytes("1KB") == 1000
    for bad in ("1500", "1.5Gb", "1.5gib", "1.5GiBs", "GiB", "-1GiB", "1e3MB"):  # "1.5Gb" is a gigabit to some
        with pytest.raises(ValueError, match="is not a size"):
            parse_bytes(bad)
    # a unit written in another case is refused, and the error names every accepted spelling
    with pytest.raises(ValueError, match=r"'10gb' is not a size: .*units are case-sensitive: B; KB, MB, GB, TB "
                                         r"\(powers of 1000\); KiB, MiB, GiB, TiB \(powers of 1024\)$"):
        parse_bytes("10gb")
    with pytest.raises(ValueError, match="case-sensitive: bit/s or B/s, after K, M, G or T"):
        parse_rate("1gbit/s")
    with pytest.raises(ValueError, match="case-sensitive: ns, us, ms or s$"):
        parse_seconds("2MS")


def test_a_target_reads_and_describes_itself(tmp_path):
    (tmp_path / "t.toml").write_text(GOOD)
    t = load_target(tmp_path / "t.toml")
    assert (t.world_size, t.nodes, t.backend) == (2, 2, "gloo")
    shard_group = t.groups[0]
    assert shard_group.link.bytes_per_s == 1.25e8 and shard_group.link.latency_s == pytest.approx(5e-5)
    assert t.describe() == ("2 ranks (1 per node), gloo; shard group of 2 across 2 nodes (inter-node 1Gbit/s, "
                            "latency 50us)")
    one_node = Target(world_size=8, ranks_per_node=8, backend="nccl",
                      link={"intra_node": {"bandwidth": "200GB/s"}})
    one_link = one_node.groups[0].link
    assert one_node.nodes == 1 and one_link.bandwidth == "200GB/s" and one_link.latency_s == 0


def test_under_tensor_parallelism_the_shard_group_is_the_dp_ranks_striding_over_each_tp_group():
    """8 ranks, 4 per node, TP 2: the TP groups are consecutive ranks on a node, a dp group (the shard group) takes
    one rank of each, 4 ranks on 2 nodes, and 2 such rings share each node's link."""
    t = Target(world_size=8, ranks_per_node=4, backend="nccl", tensor_parallel=2,
               link={"intra_node": {"bandwidth": "200GB/s"}, "inter_node": {"bandwidth": "50GB/s", "per": "node"}})
    shard, replicate = t.groups
    assert (t.shard, shard.size, shard.nodes, shard.sharing, replicate.size) == (4, 4, 2, 2, 1)
    assert t.describe().startswith("8 ranks (4 per node), nccl, FSDP 4 x TP 2; shard group of 4 across 2 nodes")
    on_a_node = Target(world_size=8, ranks_per_node=8, backend="nccl", tensor_parallel=2,
                       link={"intra_node": {"bandwidth": "200GB/s"}})
    assert (on_a_node.shard, on_a_node.groups[0].nodes) == (4, 1)
    with pytest.raises(ValueError, match="divisor of ranks_per_node"):
        Target(world_size=8, ranks_per_node=2, backend="nccl", tensor_parallel=4,
               link={"inter_node": {"bandwidth": "50GB/s"}})


def test_a_what_if_keeps_the_profiles_tp_degree_and_refuses_another():
    """[Note: A what-if keeps the TP degree]: a target without one takes the profile's; another is one line."""
    import dataclasses

    from planner.artifacts.fingerprint import Fingerprint
    from planner.simulation.link import keep_tensor_parallel

    fp = Fingerprint(("", "b"), (1, 2), (4, 8), 4, "cuda", ("torch.float32",), "2.13", tensor_parallel=2)
    t = Target(world_size=16, ranks_per_node=8, backend="nccl",
               link={"intra_node": {"bandwidth": "200GB/s"}, "inter_node": {"bandwidth": "50GB/s"}})
    kept = keep_tensor_parallel(t, fp)
    assert (kept.tensor_parallel, kept.shard) == (2, 8) and keep_tensor_parallel(t, dataclasses.replace(
        fp, tensor_parallel=None)) is t
    with pytest.raises(TargetError, match="the target's tensor_parallel = 4, the profile's 2") as e:
        keep_tensor_parallel(Target(**{**t.model_dump(), "tensor_parallel": 4}), fp)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("text", "needle"), [
    (GOOD.replace('"1Gbit/s"', '"1 Gbps"'), "link.inter_node.bandwidth: bandwidth '1 Gbps': write a positive number"),
    (GOOD.split("[link")[0], "the shard group of 2 ranks on 2 nodes needs [link.inter_node] with its bandwidth"),
    (GOOD.replace("ranks_per_node = 1", "ranks_per_node = 2"),
     "the shard group of 2 ranks on 1 node needs [link.intra_node]"),
    ("mesh = [2, 2]\n" + GOOD, "mesh [2, 2] has 4 ranks, world_size 2: write mesh = [replicate, shard]"),
    (GOOD.replace("ranks_per_node = 1", "ranks_per_node = 3"), "not a whole number of nodes of 3 ranks"),
    (GOOD.replace('"gloo"', '"mpi"'), "backend: Input should be 'gloo' or 'nccl'"),
    (GOOD + "speed = 3\n", "speed: Extra inputs are not permitted"),
    (GOOD.replace("latency", "latncy"), "link.inter_node.latncy: Extra inputs are not permitted"),
    ("world_size = [", "is not valid TOML"),
])
def test_a_bad_target_is_one_line_naming_the_key(tmp_path, text, needle):
    (tmp_path / "t.toml").write_text(text)
    with pytest.raises(TargetError) as e:
        load_target(tmp_path / "t.toml")
    assert needle in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TargetError, match="cannot read target file"):
        load_target(tmp_path / "missing.toml")
