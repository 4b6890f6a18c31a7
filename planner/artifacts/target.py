"""The cluster a prediction is for: world size, ranks per node, backend and links (``simulate --target``).

A target is a TOML file::

    world_size = 4
    ranks_per_node = 2
    backend = "gloo"             # or "nccl"
    mesh = [2, 2]                # optional: HSDP, [replicate, shard]; default FSDP over every rank
    [link.inter_node]
    bandwidth = "1Gbit/s"        # bus bandwidth per rank; units explicit (Gbit/s, Mbit/s, GB/s, MB/s)
    latency = "50us"             # optional (ns, us, ms, s)
    per = "rank"                 # optional: "node" where one link per node is shared by its ranks' rings
    [link.intra_node]
    bandwidth = "recorded"       # the link the profile was recorded on (its ranks shared one node)

Instead of a file, a preset's name (``--target h100-ib400``; :func:`presets`),
or ``preset = "h100-ib400"`` in a file, its fields overridden by the file's.
A link's bandwidth may be an nccl-tests output file (``nccl_tests =
"all_gather.txt"``): the bus bandwidth by message size. Units are SI and explicit: a network's
``1Gbit/s`` is 10^9 bits per second, ``25GB/s`` is 25 * 10^9 bytes per
second.

[Note: Where a process group's ranks sit]
``init_device_mesh(device, (replicate, shard))`` lays the ranks out row-major:
a shard group is ``shard`` consecutive ranks, a replicate group the ranks
``shard`` apart, and torchrun numbers a node's ranks consecutively
(``--nproc-per-node``). A group's ring therefore crosses the inter-node link
when its ranks sit on more than one node, and runs on the intra-node link
otherwise. A group whose ranks sit unevenly on its nodes is refused: the
ring's per-node share would differ from node to node.

[Note: A link per node, shared]
A link's ``bandwidth`` is what one ring reaches over it (``per = "rank"``: a
NIC per GPU, nccl-tests' bus bandwidth). Where a node has one link for all its
ranks (``per = "node"``: one NIC per node, the emulated cluster's veth pair),
every group of a role with a rank on the node runs its collective at once
(FSDP2 issues the same collective on every group: the replicate groups'
all-reduces of one module together), and a ring sends one flow each way
across each node boundary it crosses. The node's link is then shared by the
groups of that role with a rank on it: ``ranks_per_node`` replicate groups
under HSDP with shard groups within a node, one shard group under FSDP. Each
ring gets ``bandwidth / sharing`` (TCP shares a link's rate fairly between
its flows; the HSDP runs in docs/decisions/in-step-scale-on-a-link.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from planner.artifacts.nccl_tests import BusBandwidthCurve, read_nccl_tests
from planner.errors import TargetError
from planner.units import count, parse_percent, parse_rate, parse_seconds

RECORDED = "recorded"


class Link(BaseModel):
    """One kind of link between ranks.

    Attributes:
        bandwidth: bus bandwidth per rank, as written (``"1Gbit/s"``), or ``"recorded"``: the link the profile was
            recorded on; :attr:`bytes_per_s` is it in bytes/s. ``None`` when ``nccl_tests`` gives it.
        nccl_tests: an nccl-tests output file (``all_gather_perf``): the bus bandwidth by message size in place of
            one figure ([Note: Reading nccl-tests] in :mod:`planner.artifacts.nccl_tests`); relative paths are
            relative to the target file.
        spread: how far the stated bandwidth may be off, as a percentage (``"10%"``: the published range of the
            figure); the band on a predicted step widens with it (``planner.simulation.band``).
        latency: per message, as written (``"50us"``); :attr:`latency_s` in seconds (0 when not given).
        per: ``"rank"``: ``bandwidth`` is each ring's own; ``"node"``: one link per node, shared by the rings of
            its ranks' groups that cross it at once ([Note: A link per node, shared]).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth: str | None = None
    nccl_tests: str | None = None
    spread: str = "0%"
    latency: str = "0us"
    per: Literal["rank", "node"] = "rank"
    _curve: BusBandwidthCurve | None = PrivateAttr(default=None)

    @field_validator("bandwidth")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if v is not None and v != RECORDED:
            parse_rate(v)
        return v

    @field_validator("latency")
    @classmethod
    def _time(cls, v: str) -> str:
        parse_seconds(v)
        return v

    @field_validator("spread")
    @classmethod
    def _spread(cls, v: str) -> str:
        parse_percent(v)
        return v

    @model_validator(mode="after")
    def _one_source_of_bandwidth(self) -> Link:
        if (self.bandwidth is None) == (self.nccl_tests is None):
            raise ValueError("give the link's bandwidth (\"400GB/s\", or \"recorded\") or nccl_tests = \"FILE\" "
                             "(the output of all_gather_perf), one of the two")
        if self.recorded and self.latency_s:
            raise ValueError(f"latency {self.latency!r} on the recorded link: its latency is in the profile's own "
                             "timings; leave latency out")
        if self.nccl_tests is not None:
            self._curve = read_nccl_tests(self.nccl_tests)
        return self

    @property
    def recorded(self) -> bool:
        """``bandwidth = "recorded"``: the link the profile was recorded on, timed as the profile timed it."""
        return self.bandwidth == RECORDED

    @property
    def curve(self) -> BusBandwidthCurve | None:
        """The nccl-tests curve, when ``nccl_tests`` gives the bandwidth."""
        return self._curve

    @property
    def bytes_per_s(self) -> float | None:
        """The bandwidth in bytes per second (an nccl-tests curve's peak); ``None`` for the recorded link."""
        if self._curve is not None:
            return self._curve.peak
        return None if self.recorded else parse_rate(self.bandwidth)

    def bytes_per_s_at(self, message_bytes: float) -> float | None:
        """The bus bandwidth for one collective's buffer of ``message_bytes``, bytes per second: the nccl-tests
        curve at that size, else the one figure; ``None`` for the recorded link."""
        if self._curve is not None:
            return self._curve.at(message_bytes)
        return self.bytes_per_s

    @property
    def spread_fraction(self) -> float:
        """``spread`` as a fraction (``"10%"`` -> 0.1)."""
        return parse_percent(self.spread)

    @property
    def latency_s(self) -> float:
        """The latency in seconds."""
        return parse_seconds(self.latency)

    def describe(self) -> str:
        """``400GB/s ±10%, latency 10us``, or the nccl-tests curve."""
        text = self._curve.describe() if self._curve is not None else str(self.bandwidth)
        text += " per node" if self.per == "node" else ""
        text += f" ±{self.spread}" if self.spread_fraction else ""
        return text + (f", latency {self.latency}" if not self.recorded and self.latency_s else "")


class Links(BaseModel):
    """The target's links: ``[link.inter_node]`` between nodes, ``[link.intra_node]`` within one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inter_node: Link | None = None
    intra_node: Link | None = None


@dataclass(frozen=True)
class Group:
    """One process group of a target's mesh, as its ranks sit on nodes ([Note: Where a process group's ranks sit]).

    Attributes:
        role: ``"shard"`` (FSDP2's all-gather and reduce-scatter) or ``"replicate"`` (HSDP's all-reduce).
        size: ranks in the group.
        nodes: nodes its ranks sit on.
        link: the link its ring is paced by: the inter-node link across nodes, else the intra-node one (``None``
            for a group of one rank, which sends nothing).
        intra_latency_s: the intra-node link's latency, s (its ring's steps within a node pay it).
        inter_latency_s: the inter-node link's latency, s.
        sharing: the rings that share ``link`` at once: on a link ``per = "node"`` crossed by the group, the
            groups of its role with a rank on one node; else 1 ([Note: A link per node, shared]).
    """

    role: str
    size: int
    nodes: int
    link: Link | None
    intra_latency_s: float
    inter_latency_s: float
    sharing: int = 1


class Target(BaseModel):
    """The cluster a prediction is for.

    Attributes:
        world_size: ranks in all.
        ranks_per_node: ranks on one node; the ranks of a ring cross the inter-node link when there is more
            than one node.
        backend: ``"gloo"`` or ``"nccl"`` (what the collectives put on the wire differs:
            :mod:`planner.simulation.link`).
        mesh: ``(replicate, shard)`` for HSDP (``fully_shard(mesh=init_device_mesh(..., (replicate, shard)))``);
            ``None``: FSDP over every rank, ``(1, world_size)``.
        tensor_parallel: FSDP + TP's degree: groups of this many consecutive ranks (within a node) split each
            block, and FSDP shards over the other ``world_size // tensor_parallel`` (a rank's dp group strides by
            it). ``None``: the profile's own ([Note: A what-if keeps the TP degree]); 1: no tensor parallelism.
        link: the links.
        preset: the preset it starts from (:func:`presets`), its fields overridden by the file's.
        source: where the preset's figures come from (published nccl-tests results, vendor figures).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str | None = None
    source: str | None = None
    world_size: int = Field(ge=1)
    ranks_per_node: int = Field(ge=1)
    backend: Literal["gloo", "nccl"]
    mesh: tuple[PositiveInt, PositiveInt] | None = None
    tensor_parallel: PositiveInt | None = None
    link: Links = Field(default_factory=Links)

    @model_validator(mode="after")
    def _links_present(self) -> Target:
        if self.world_size % self.ranks_per_node:
            raise ValueError(f"world_size {self.world_size} is not a whole number of nodes of {self.ranks_per_node} "
                             "ranks")
        if self.mesh is not None and self.mesh[0] * self.mesh[1] != self.world_size:
            raise ValueError(f"mesh {list(self.mesh)} has {self.mesh[0] * self.mesh[1]} ranks, world_size "
                             f"{self.world_size}: write mesh = [replicate, shard] with replicate x shard = world_size")
        if self.tp > 1 and (self.mesh is not None or self.ranks_per_node % self.tp):
            raise ValueError(f"tensor_parallel = {self.tp} needs FSDP (no mesh: HSDP + TP is not tuned) and a "
                             f"divisor of ranks_per_node ({self.ranks_per_node}): TP's groups sit within a node")
        for group in self.groups:
            if group.link is None and group.size > 1:
                which = "inter_node" if group.nodes > 1 else "intra_node"
                example = "1Gbit/s" if group.nodes > 1 else "100GB/s"
                raise ValueError(f"the {group.role} group of {group.size} ranks on {group.nodes} node"
                                 f"{'s' if group.nodes > 1 else ''} needs [link.{which}] with its bandwidth, e.g. "
                                 f"bandwidth = \"{example}\"")
        return self

    @property
    def nodes(self) -> int:
        """Nodes in all."""
        return self.world_size // self.ranks_per_node

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1 without)."""
        return self.tensor_parallel or 1

    @property
    def replicate(self) -> int:
        """Ranks in a replicate group (1 for FSDP)."""
        return 1 if self.mesh is None else self.mesh[0]

    @property
    def shard(self) -> int:
        """Ranks in a shard group: the parameters are sharded over them (the world size for FSDP, the dp ranks
        under FSDP + TP)."""
        return self.world_size // self.tp if self.mesh is None else self.mesh[1]

    @property
    def groups(self) -> tuple[Group, Group]:
        """The shard group and the replicate group, as their ranks sit on nodes.

        Raises:
            ValueError: a group whose ranks sit unevenly on its nodes ([Note: Where a process group's ranks sit]).
        """
        out = []
        node_zero = range(min(self.ranks_per_node, self.world_size))
        tp = self.tp  # a shard group strides over the TP ranks, a replicate group over a shard group's
        for role, size, stride in (("shard", self.shard, tp), ("replicate", self.replicate, self.shard * tp)):
            per_node = Counter(k * stride // self.ranks_per_node for k in range(size))
            if len(set(per_node.values())) > 1:
                raise ValueError(f"the {role} group's {size} ranks sit unevenly on nodes of {self.ranks_per_node} "
                                 "ranks; make the shard size a divisor or a multiple of ranks_per_node")
            nodes = len(per_node)
            link = None if size == 1 else self.link.inter_node if nodes > 1 else self.link.intra_node
            intra, inter = self.link.intra_node, self.link.inter_node
            sharing = 1
            if nodes > 1 and link is not None and link.per == "node":  # [Note: A link per node, shared]
                sharing = len({(r // (self.shard * tp), r % tp) if role == "shard" else r % (self.shard * tp)
                               for r in node_zero})
            out.append(Group(role, size, nodes, link, intra.latency_s if intra else 0.0,
                             inter.latency_s if inter else 0.0, sharing))
        return out[0], out[1]

    def describe(self) -> str:
        """``4 ranks (2 per node), gloo, HSDP [2, 2]; shard group on 1 node (intra-node recorded), replicate
        group across 2 nodes (inter-node 1Gbit/s, latency 50us)``."""
        text = f"{count(self.world_size, 'rank')} ({self.ranks_per_node} per node), {self.backend}"
        text += f", HSDP {list(self.mesh)}" if self.mesh is not None else ""
        text += f", FSDP {self.shard} x TP {self.tp}" if self.tp > 1 else ""
        parts = []
        for group in self.groups:
            if group.size == 1:
                continue
            where = f"across {group.nodes} nodes (inter-node" if group.nodes > 1 else "on 1 node (intra-node"
            shared = f", shared by {group.sharing} rings" if group.sharing > 1 else ""
            parts.append(f"{group.role} group of {group.size} {where} {group.link.describe()}{shared})")
        name = f"preset {self.preset}: " if self.preset else ""
        return name + text + ("; " + ", ".join(parts) if parts else "")


PRESETS_DIR = "presets"  # package data of ``planner``: one TOML per preset


def presets() -> dict[str, str]:
    """The shipped presets: name -> its ``source`` (``planner/presets/*.toml``) as one paragraph."""
    from importlib.resources import files

    from planner.artifacts.config import read_toml

    out = {}
    for entry in sorted(files("planner").joinpath(PRESETS_DIR).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            raw = read_toml(Path(str(entry)), "preset", TargetError)
            out[entry.name.removesuffix(".toml")] = " ".join(str(raw.get("source", "")).split())
    return out


def _preset(name: str) -> dict:
    from importlib.resources import files

    from planner.artifacts.config import read_toml

    known = presets()
    if name not in known:
        raise TargetError(f"no preset {name!r}; presets are {', '.join(known)} (or give a target TOML file)")
    raw = read_toml(Path(str(files("planner").joinpath(PRESETS_DIR, f"{name}.toml"))), "preset", TargetError)
    return {**raw, "preset": name}


def _merged(base: dict, over: dict) -> dict:
    """``over``'s keys on ``base``'s; a link table that names its bandwidth (or nccl_tests) replaces both."""
    out = {k: v for k, v in base.items()}
    for key, value in over.items():
        if key == "link" and isinstance(value, dict) and isinstance(base.get("link"), dict):
            links = dict(base["link"])
            for which, link in value.items():
                mine = dict(links.get(which) or {})
                if isinstance(link, dict) and ({"bandwidth", "nccl_tests"} & link.keys()):
                    mine.pop("bandwidth", None)
                    mine.pop("nccl_tests", None)
                links[which] = {**mine, **link} if isinstance(link, dict) else link
            out["link"] = links
        else:
            out[key] = value
    return out


def _relative_to(raw: dict, directory: Path) -> dict:
    links = raw.get("link")
    if not isinstance(links, dict):
        return raw
    fixed = {}
    for which, link in links.items():
        if isinstance(link, dict) and isinstance(link.get("nccl_tests"), str):
            link = {**link, "nccl_tests": str(directory / link["nccl_tests"])}
        fixed[which] = link
    return {**raw, "link": fixed}


def load_target(spec: str | Path, **overrides: object) -> Target:
    """A target from a TOML file or a preset's name (``"h100-ib400"``), ``overrides`` on top.

    A file may start from a preset (``preset = "h100-ib400"``) and override any of its fields; a link table that
    gives ``bandwidth`` or ``nccl_tests`` replaces the preset's figure, its other keys kept.

    Args:
        spec: the target TOML's path, or a preset's name (:func:`presets`).
        overrides: fields to replace (``world_size=64``, ``mesh=(8, 8)``); ``None`` values are ignored.

    Raises:
        TargetError: no such file or preset; the file cannot be read, is not TOML, has an unknown key, a value out
            of range or without its unit, an unreadable nccl-tests file, or lacks the link its nodes need (one line
            naming the key and the fix).
    """
    from planner.artifacts.config import read_toml

    path = Path(spec)
    if path.is_file() or path.suffix == ".toml" or "/" in str(spec):
        raw = _relative_to(read_toml(path, "target", TargetError), path.parent)
        where = f"target file {str(path)!r}"
    else:
        raw, where = {"preset": str(spec)}, f"preset {str(spec)!r}"
    if isinstance(raw.get("preset"), str):
        raw = _merged(_preset(raw["preset"]), raw)
    raw = {**raw, **{k: v for k, v in overrides.items() if v is not None}}
    try:
        return Target.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where_key = ".".join(str(x) for x in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        raise TargetError(f"{where}: {where_key + ': ' if where_key else ''}{message}") from None
