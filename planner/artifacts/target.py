"""The cluster a prediction is for: world size, ranks per node, backend and links (``simulate --target``).

A target is a TOML file::

    world_size = 4
    ranks_per_node = 2
    backend = "gloo"             # or "nccl"
    mesh = [2, 2]                # optional: HSDP, [replicate, shard]; default FSDP over every rank
    [link.inter_node]
    bandwidth = "1Gbit/s"        # bus bandwidth per rank; units explicit (Gbit/s, Mbit/s, GB/s, MB/s)
    latency = "50us"             # optional (ns, us, ms, s)
    [link.intra_node]
    bandwidth = "recorded"       # the link the profile was recorded on (its ranks shared one node)

It is a typed model (pydantic), so later keys (presets, nccl-tests files)
extend it without a second parser. Units are SI and explicit: a network's
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
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator, model_validator

from planner.errors import TargetError

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([KMGT]?)(bit|B)/s\s*$")
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ns|us|ms|s)\s*$")
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_SECONDS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def bytes_per_s(text: str) -> float:
    """``"1Gbit/s"`` -> 1.25e8 bytes per second (SI prefixes K, M, G, T on ``bit/s`` or ``B/s``).

    Raises:
        ValueError: no number, or a unit other than those.
    """
    m = _RATE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"bandwidth {text!r}: write a positive number with its unit, e.g. '1Gbit/s', '400Mbit/s' or "
                         "'25GB/s'")
    return float(m.group(1)) * _PREFIX[m.group(2)] / (8.0 if m.group(3) == "bit" else 1.0)


def seconds(text: str) -> float:
    """``"50us"`` -> 5e-05 (units ns, us, ms, s).

    Raises:
        ValueError: no number, or another unit.
    """
    m = _TIME.match(text)
    if not m:
        raise ValueError(f"latency {text!r}: write a number with its unit, e.g. '50us', '2ms'")
    return float(m.group(1)) * _SECONDS[m.group(2)]


RECORDED = "recorded"


class Link(BaseModel):
    """One kind of link between ranks.

    Attributes:
        bandwidth: bus bandwidth per rank, as written (``"1Gbit/s"``), or ``"recorded"``: the link the profile was
            recorded on; :attr:`bytes_per_s` is it in bytes/s.
        latency: per message, as written (``"50us"``); :attr:`latency_s` in seconds (0 when not given).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth: str
    latency: str = "0us"

    @field_validator("bandwidth")
    @classmethod
    def _rate(cls, v: str) -> str:
        if v != RECORDED:
            bytes_per_s(v)
        return v

    @field_validator("latency")
    @classmethod
    def _time(cls, v: str) -> str:
        seconds(v)
        return v

    @model_validator(mode="after")
    def _recorded_has_its_own_latency(self) -> Link:
        if self.recorded and self.latency_s:
            raise ValueError(f"latency {self.latency!r} on the recorded link: its latency is in the profile's own "
                             "timings; leave latency out")
        return self

    @property
    def recorded(self) -> bool:
        """``bandwidth = "recorded"``: the link the profile was recorded on, timed as the profile timed it."""
        return self.bandwidth == RECORDED

    @property
    def bytes_per_s(self) -> float | None:
        """The bandwidth in bytes per second; ``None`` for the recorded link."""
        return None if self.recorded else bytes_per_s(self.bandwidth)

    @property
    def latency_s(self) -> float:
        """The latency in seconds."""
        return seconds(self.latency)


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
    """

    role: str
    size: int
    nodes: int
    link: Link | None
    intra_latency_s: float
    inter_latency_s: float


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
        link: the links.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    world_size: int = Field(ge=1)
    ranks_per_node: int = Field(ge=1)
    backend: Literal["gloo", "nccl"]
    mesh: tuple[PositiveInt, PositiveInt] | None = None
    link: Links = Field(default_factory=Links)

    @model_validator(mode="after")
    def _links_present(self) -> Target:
        if self.world_size % self.ranks_per_node:
            raise ValueError(f"world_size {self.world_size} is not a whole number of nodes of {self.ranks_per_node} "
                             "ranks")
        if self.mesh is not None and self.mesh[0] * self.mesh[1] != self.world_size:
            raise ValueError(f"mesh {list(self.mesh)} has {self.mesh[0] * self.mesh[1]} ranks, world_size "
                             f"{self.world_size}: write mesh = [replicate, shard] with replicate x shard = world_size")
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
    def replicate(self) -> int:
        """Ranks in a replicate group (1 for FSDP)."""
        return 1 if self.mesh is None else self.mesh[0]

    @property
    def shard(self) -> int:
        """Ranks in a shard group: the parameters are sharded over them (the world size for FSDP)."""
        return self.world_size if self.mesh is None else self.mesh[1]

    @property
    def groups(self) -> tuple[Group, Group]:
        """The shard group and the replicate group, as their ranks sit on nodes.

        Raises:
            ValueError: a group whose ranks sit unevenly on its nodes ([Note: Where a process group's ranks sit]).
        """
        out = []
        for role, size, stride in (("shard", self.shard, 1), ("replicate", self.replicate, self.shard)):
            per_node = Counter(k * stride // self.ranks_per_node for k in range(size))
            if len(set(per_node.values())) > 1:
                raise ValueError(f"the {role} group's {size} ranks sit unevenly on nodes of {self.ranks_per_node} "
                                 "ranks; make the shard size a divisor or a multiple of ranks_per_node")
            nodes = len(per_node)
            link = None if size == 1 else self.link.inter_node if nodes > 1 else self.link.intra_node
            intra, inter = self.link.intra_node, self.link.inter_node
            out.append(Group(role, size, nodes, link, intra.latency_s if intra else 0.0,
                             inter.latency_s if inter else 0.0))
        return out[0], out[1]

    def describe(self) -> str:
        """``4 ranks (2 per node), gloo, HSDP [2, 2]; shard group on 1 node (intra-node recorded), replicate
        group across 2 nodes (inter-node 1Gbit/s, latency 50us)``."""
        text = f"{self.world_size} ranks ({self.ranks_per_node} per node), {self.backend}"
        text += f", HSDP {list(self.mesh)}" if self.mesh is not None else ""
        parts = []
        for group in self.groups:
            if group.size == 1:
                continue
            where = f"across {group.nodes} nodes (inter-node" if group.nodes > 1 else "on 1 node (intra-node"
            latency = f", latency {group.link.latency}" if not group.link.recorded else ""
            parts.append(f"{group.role} group of {group.size} {where} {group.link.bandwidth}{latency})")
        return text + ("; " + ", ".join(parts) if parts else "")


def load_target(path: str | Path) -> Target:
    """Read a target TOML.

    Raises:
        TargetError: the file cannot be read, is not TOML, has an unknown key, a value out of range or without its
            unit, or lacks the link its nodes need (one line naming the key and the fix).
    """
    from planner.artifacts.config import read_toml

    path = Path(path)
    raw = read_toml(path, "target", TargetError)
    try:
        return Target.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        raise TargetError(f"target file {str(path)!r}: {where + ': ' if where else ''}{message}") from None
