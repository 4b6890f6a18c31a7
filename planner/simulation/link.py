"""Collective times from the bytes on the wire: a profile's all-gathers and reduce-scatters re-timed for a target.

A profile records its collectives on the link it ran on (loopback, one
node). To predict another cluster (``simulate --target``), each module's
collective time is rebuilt from what the collective puts on the wire, the
target's link, and a per-call overhead fitted from the profile's own
timings.

[Note: Bytes on the wire]
FSDP2 all-gathers a module's parameters as one flat buffer
(``foreach_all_gather`` -> ``all_gather_into_tensor``) and reduce-scatters its
gradients as one (``foreach_reduce`` -> ``reduce_scatter_tensor``). In a ring
over ``W`` ranks (NCCL's ring algorithm, gloo's ring all-gather) each rank
sends ``(W - 1) / W`` of the unsharded bytes in ``W - 1`` steps, for the
all-gather and for NCCL's reduce-scatter. Gloo has no reduce-scatter of its
own: ``ProcessGroupGloo`` runs it as an all-reduce and a slice, a
reduce-scatter and an all-gather in a ring, ``2 (W - 1) / W`` of the bytes in
``2 (W - 1)`` steps. The ring's speed is its slowest link: across nodes, the
inter-node link's bus bandwidth per rank.

[Note: The per-call overhead, fitted]
Per call, the profile's time is modelled as ``t = a + s * w``: ``w`` the bytes
on the wire at the profile's world size and backend, ``a`` a per-call
overhead (the launch, the copy-in and copy-out, the Python around them) and
``s`` the recorded link's time per byte. Both are fitted by non-negative
least squares (``scipy.optimize.nnls``) over every module's all-gather and
reduce-scatter; with a single distinct size they cannot be told apart, and
all of the time is put on the bytes (``a = 0``). On the target a call takes
``a + w' * max(s, 1 / bandwidth) + steps * latency``: the recorded per-byte
cost is the floor the hosts need, and a slower link replaces it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np

from planner.artifacts.profile import Profile
from planner.artifacts.target import Target
from planner.errors import TargetError

Kind = Literal["all_gather", "reduce_scatter"]


def recorded_backend(profile: Profile) -> str:
    """The backend a profile's collectives ran on: gloo on CPU, NCCL on GPU (the recorder's launch)."""
    return "gloo" if profile.fingerprint.device_type == "cpu" else "nccl"


def wire_fraction(kind: Kind, world_size: int, backend: str) -> float:
    """The fraction of a collective's unsharded bytes each rank sends ([Note: Bytes on the wire])."""
    if world_size <= 1:
        return 0.0
    ring = (world_size - 1) / world_size
    return 2 * ring if kind == "reduce_scatter" and backend == "gloo" else ring


def ring_steps(kind: Kind, world_size: int, backend: str) -> int:
    """The messages a rank sends in turn in the ring ([Note: Bytes on the wire])."""
    steps = max(0, world_size - 1)
    return 2 * steps if kind == "reduce_scatter" and backend == "gloo" else steps


@dataclass(frozen=True)
class LinkFit:
    """The profile's collectives as ``t = overhead + ms_per_byte * wire bytes`` ([Note: The per-call overhead, ...]).

    Attributes:
        overhead_ms: per call, ms.
        ms_per_byte: the recorded link's time per byte on the wire, ms.
        points: the calls fitted (one per module and kind with bytes on the wire).
        identifiable: more than one distinct size: overhead and per-byte time told apart.
    """

    overhead_ms: float
    ms_per_byte: float
    points: int
    identifiable: bool

    @property
    def bytes_per_s(self) -> float:
        """The recorded link's effective bandwidth, bytes per second (``inf`` when no time is per byte)."""
        return 1e3 / self.ms_per_byte if self.ms_per_byte > 0 else float("inf")


def _calls(profile: Profile, world_size: int, backend: str) -> list[tuple[str, Kind, float, float]]:
    """``(fqn, kind, wire bytes, recorded ms)`` per module and collective with bytes on the wire."""
    out = []
    for fqn, m in profile.modules.items():
        for kind, nbytes, t in (("all_gather", m.unsharded_bytes, m.all_gather_ms),
                                ("reduce_scatter", m.grad_bytes // max(1, m.calls), m.reduce_scatter_ms)):
            w = wire_fraction(kind, world_size, backend) * nbytes
            if w > 0 and t > 0:
                out.append((fqn, kind, w, t))
    return out


def fit_link(profile: Profile) -> LinkFit:
    """Fit the per-call overhead and the recorded time per byte to the profile's collectives.

    Raises:
        TargetError: the profile has no collective with bytes on the wire (world size 1): nothing to re-time from.
    """
    from scipy.optimize import nnls

    calls = _calls(profile, profile.fingerprint.world_size, recorded_backend(profile))
    if not calls:
        raise TargetError("the profile has no collective with bytes on the wire (recorded at world size "
                          f"{profile.fingerprint.world_size}); record it on 2 ranks or more to predict a link")
    w = np.array([c[2] for c in calls])
    t = np.array([c[3] for c in calls])
    identifiable = len(np.unique(w)) > 1
    if identifiable:
        (a, s), _ = nnls(np.column_stack([np.ones_like(w), w]), t)
    else:
        a, s = 0.0, float(t.sum() / w.sum())
    return LinkFit(float(a), float(s), len(calls), identifiable)


def retarget(profile: Profile, target: Target) -> tuple[Profile, LinkFit]:
    """The profile with each module's all-gather and reduce-scatter re-timed for ``target``'s link and backend.

    Compute, memory and everything else stay as recorded; simulate the result with the recorded profile's own
    parameters (``planner.simulation.parameters.profile_params(profile)``), which were solved on its link.

    Raises:
        TargetError: a target of another world size (the shards, and so the memory and bytes, would change:
            record at that world size), or a profile with no collective to fit.
    """
    if target.world_size != profile.fingerprint.world_size:
        raise TargetError(f"target world_size {target.world_size}, but the profile was recorded on "
                          f"{profile.fingerprint.world_size} ranks; predicting another world size is not modelled: "
                          "record the profile at that world size")
    fit = fit_link(profile)
    link = target.ring_link
    per_byte = fit.ms_per_byte if link is None else max(fit.ms_per_byte, 1e3 / link.bytes_per_s)
    latency_ms = 0.0 if link is None else 1e3 * link.latency_s
    modules = dict(profile.modules)
    for fqn, m in profile.modules.items():
        times = {}
        for kind, nbytes in (("all_gather", m.unsharded_bytes), ("reduce_scatter", m.grad_bytes // max(1, m.calls))):
            w = wire_fraction(kind, target.world_size, target.backend) * nbytes
            if w > 0:
                times[f"{kind}_ms"] = (fit.overhead_ms + w * per_byte
                                       + latency_ms * ring_steps(kind, target.world_size, target.backend))
        modules[fqn] = dataclasses.replace(m, **times)
    return dataclasses.replace(profile, modules=modules), fit
