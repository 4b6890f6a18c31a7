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
Per call and per kind of collective, the profile's time is modelled as
``t = a + s * w``: ``w`` the bytes on the wire at the profile's world size and
backend, ``a`` a per-call overhead (the launch, the Python around it) and ``s``
the recorded time per byte (the host's copies and reductions, and the recorded
link). Both are fitted per kind by non-negative least squares
(``scipy.optimize.nnls``) over the modules' calls of that kind; with a single
distinct size they cannot be told apart, and all of the time is put on the
bytes (``a = 0``).

[Note: Host work and the wire]
On the target a call takes ``a + max(s * w', w' / (e * bandwidth))``: the
host's per-byte work (copies, reductions, faulting in fresh buffers) and the
transfer proceed together, the slower sets the pace, and a link faster than
the hosts changes nothing. ``e`` is the share of the link's rate the
collective's algorithm reaches (:func:`link_efficiency`): NCCL's bus bandwidth
(what ``bandwidth`` means in a target) already includes it, and gloo's chunked
ring all-reduce reaches the rate; gloo's all-gather reaches 63% of it, as
``python -m bench.link_sweep --check-link`` measures (``all_gather_into_tensor``
of a 6.4 MB shard against the TCP rate of the same link). Each call then adds
``steps * latency`` (the ring's messages in turn).
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


GLOO_ALL_GATHER_EFFICIENCY = 0.63  # [Note: Host work and the wire]


def link_efficiency(kind: Kind, backend: str) -> float:
    """The share of the link's rate a collective reaches on ``backend`` ([Note: Host work and the wire])."""
    return GLOO_ALL_GATHER_EFFICIENCY if kind == "all_gather" and backend == "gloo" else 1.0


@dataclass(frozen=True)
class LinkFit:
    """One kind of the profile's collectives as ``t = overhead + ms_per_byte * wire bytes``
    ([Note: The per-call overhead, fitted]).

    Attributes:
        kind: ``"all_gather"`` or ``"reduce_scatter"``.
        overhead_ms: per call, ms.
        ms_per_byte: the recorded time per byte on the wire (host work and the recorded link), ms.
        points: the calls fitted (one per module with bytes on the wire).
        identifiable: more than one distinct size: overhead and per-byte time told apart.
    """

    kind: Kind
    overhead_ms: float
    ms_per_byte: float
    points: int
    identifiable: bool

    @property
    def bytes_per_s(self) -> float:
        """The recorded effective bandwidth, bytes per second (``inf`` when no time is per byte)."""
        return 1e3 / self.ms_per_byte if self.ms_per_byte > 0 else float("inf")

    def ms(self, wire_bytes: float, link_bytes_per_s: float | None, backend: str) -> float:
        """One call's time with ``wire_bytes`` on a link of ``link_bytes_per_s`` (``None``: the recorded one), ms,
        latency aside ([Note: Host work and the wire])."""
        host = self.ms_per_byte * wire_bytes
        if link_bytes_per_s is None:
            return self.overhead_ms + host
        return self.overhead_ms + max(host, 1e3 * wire_bytes / (link_efficiency(self.kind, backend) * link_bytes_per_s))


def wire_calls(profile: Profile, world_size: int, backend: str) -> list[tuple[str, Kind, float, float]]:
    """``(fqn, kind, wire bytes, recorded ms)`` per module and collective with bytes on the wire at ``world_size``
    on ``backend`` ([Note: Bytes on the wire])."""
    out = []
    for fqn, m in profile.modules.items():
        for kind, nbytes, t in (("all_gather", m.unsharded_bytes, m.all_gather_ms),
                                ("reduce_scatter", m.grad_bytes // max(1, m.calls), m.reduce_scatter_ms)):
            w = wire_fraction(kind, world_size, backend) * nbytes
            if w > 0 and t > 0:
                out.append((fqn, kind, w, t))
    return out


def _fit(kind: Kind, w: np.ndarray, t: np.ndarray) -> LinkFit:
    from scipy.optimize import nnls

    identifiable = len(np.unique(w)) > 1
    if identifiable:
        (a, s), _ = nnls(np.column_stack([np.ones_like(w), w]), t)
    else:
        a, s = 0.0, float(t.sum() / w.sum())
    return LinkFit(kind, float(a), float(s), len(w), identifiable)


def fit_link(profile: Profile) -> dict[Kind, LinkFit]:
    """Fit each kind's per-call overhead and recorded time per byte to the profile's collectives.

    A kind with no call of its own (a profile without reduce-scatters) takes the fit of both kinds together.

    Raises:
        TargetError: the profile has no collective with bytes on the wire (world size 1): nothing to re-time from.
    """
    calls = wire_calls(profile, profile.fingerprint.world_size, recorded_backend(profile))
    if not calls:
        raise TargetError("the profile has no collective with bytes on the wire (recorded at world size "
                          f"{profile.fingerprint.world_size}); record it on 2 ranks or more to predict a link")
    fits = {}
    for kind in ("all_gather", "reduce_scatter"):
        mine = [c for c in calls if c[1] == kind] or calls
        fits[kind] = _fit(kind, np.array([c[2] for c in mine]), np.array([c[3] for c in mine]))
    return fits


def retarget(profile: Profile, target: Target) -> tuple[Profile, dict[Kind, LinkFit]]:
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
    fits = fit_link(profile)
    link = target.ring_link
    bandwidth = None if link is None else link.bytes_per_s
    latency_ms = 0.0 if link is None else 1e3 * link.latency_s
    modules = dict(profile.modules)
    for fqn, m in profile.modules.items():
        times = {}
        for kind, nbytes in (("all_gather", m.unsharded_bytes), ("reduce_scatter", m.grad_bytes // max(1, m.calls))):
            w = wire_fraction(kind, target.world_size, target.backend) * nbytes
            if w > 0:
                times[f"{kind}_ms"] = (fits[kind].ms(w, bandwidth, target.backend)
                                       + latency_ms * ring_steps(kind, target.world_size, target.backend))
        modules[fqn] = dataclasses.replace(m, **times)
    return dataclasses.replace(profile, modules=modules), fits
