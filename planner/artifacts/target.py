"""The cluster a prediction is for: world size, ranks per node, backend and links (``simulate --target``).

A target is a TOML file::

    world_size = 2
    ranks_per_node = 1
    backend = "gloo"             # or "nccl"
    [link.inter_node]
    bandwidth = "1Gbit/s"        # bus bandwidth per rank; units explicit (Gbit/s, Mbit/s, GB/s, MB/s)
    latency = "50us"             # optional (ns, us, ms, s)

It is a typed model (pydantic), so later keys (meshes, intra-node links,
presets, nccl-tests files) extend it without a second parser. Units are
SI and explicit: a network's ``1Gbit/s`` is 10^9 bits per second, ``25GB/s``
is 25 * 10^9 bytes per second.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

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


class Link(BaseModel):
    """One kind of link between ranks.

    Attributes:
        bandwidth: bus bandwidth per rank, as written (``"1Gbit/s"``); :attr:`bytes_per_s` is it in bytes/s.
        latency: per message, as written (``"50us"``); :attr:`latency_s` in seconds (0 when not given).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bandwidth: str
    latency: str = "0us"

    @field_validator("bandwidth")
    @classmethod
    def _rate(cls, v: str) -> str:
        bytes_per_s(v)
        return v

    @field_validator("latency")
    @classmethod
    def _time(cls, v: str) -> str:
        seconds(v)
        return v

    @property
    def bytes_per_s(self) -> float:
        """The bandwidth in bytes per second."""
        return bytes_per_s(self.bandwidth)

    @property
    def latency_s(self) -> float:
        """The latency in seconds."""
        return seconds(self.latency)


class Links(BaseModel):
    """The target's links: ``[link.inter_node]`` between nodes, ``[link.intra_node]`` within one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inter_node: Link | None = None
    intra_node: Link | None = None


class Target(BaseModel):
    """The cluster a prediction is for.

    Attributes:
        world_size: ranks in all.
        ranks_per_node: ranks on one node; the ranks of a ring cross the inter-node link when there is more
            than one node.
        backend: ``"gloo"`` or ``"nccl"`` (what the collectives put on the wire differs:
            :mod:`planner.simulation.link`).
        link: the links.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    world_size: int = Field(ge=1)
    ranks_per_node: int = Field(ge=1)
    backend: Literal["gloo", "nccl"]
    link: Links = Field(default_factory=Links)

    @model_validator(mode="after")
    def _links_present(self) -> Target:
        if self.world_size % self.ranks_per_node:
            raise ValueError(f"world_size {self.world_size} is not a whole number of nodes of {self.ranks_per_node} "
                             "ranks")
        if self.nodes > 1 and self.link.inter_node is None:
            raise ValueError(f"{self.nodes} nodes need [link.inter_node] with its bandwidth, e.g. "
                             "bandwidth = \"1Gbit/s\"")
        if self.nodes == 1 and self.world_size > 1 and self.link.intra_node is None:
            raise ValueError("one node of several ranks needs [link.intra_node] with its bandwidth, e.g. "
                             "bandwidth = \"100GB/s\"")
        return self

    @property
    def nodes(self) -> int:
        """Nodes in all."""
        return self.world_size // self.ranks_per_node

    @property
    def ring_link(self) -> Link | None:
        """The slowest link a ring over every rank crosses: the inter-node link across nodes, else the intra-node
        one (``None`` for a single rank)."""
        return self.link.inter_node if self.nodes > 1 else self.link.intra_node

    def describe(self) -> str:
        """``2 ranks (1 per node), gloo, inter-node 1Gbit/s, latency 50us``."""
        link = self.ring_link
        where = "inter-node" if self.nodes > 1 else "intra-node"
        text = f"{self.world_size} ranks ({self.ranks_per_node} per node), {self.backend}"
        return text + (f", {where} {link.bandwidth}, latency {link.latency}" if link is not None else "")


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
