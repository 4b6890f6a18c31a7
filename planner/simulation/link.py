"""Collective times from the bytes on the wire: a profile's all-gathers and reduce-scatters re-timed for a target.

A profile records its collectives on the link it ran on (loopback, one
node). To predict another cluster (``simulate --target``), each module's
collective time is rebuilt from what the collective puts on the wire, the
target's link, and a per-call overhead fitted from the profile's own
timings.

[Note: Bytes on the wire]
FSDP2 all-gathers a module's parameters as one flat buffer
(``foreach_all_gather`` -> ``all_gather_into_tensor``) and reduce-scatters its
gradients as one (``foreach_reduce`` -> ``reduce_scatter_tensor``), both over
the shard group. In a ring over ``G`` ranks (NCCL's ring algorithm, gloo's ring
all-gather) each rank sends ``(G - 1) / G`` of the buffer's bytes in ``G - 1``
steps, for the all-gather and for NCCL's reduce-scatter. An all-reduce (NCCL's
ring; gloo's ring all-reduce) is a reduce-scatter then an all-gather:
``2 (G - 1) / G`` of the bytes in ``2 (G - 1)`` steps. Gloo has no
reduce-scatter of its own: ``ProcessGroupGloo`` runs it as an all-reduce and a
slice. The ring's speed is its slowest link: across nodes, the inter-node
link's bus bandwidth per rank.

[Note: HSDP's all-reduce]
With a 2-D mesh ``(replicate, shard)`` FSDP2's ``foreach_reduce`` reduce-scatters
over the shard group, then all-reduces the reduce-scatter's output (one rank's
padded shard) over the replicate group, on the all-reduce stream after the
reduce-scatter stream (``all_reduce_stream.wait_stream(reduce_scatter_stream)``).
The simulator's reduce-scatter of a module is both in turn, on one track: on a
CPU device gloo runs them one after the other on the calling thread; on a GPU
the next module's reduce-scatter could start beside this all-reduce, but both
then share the node's links, and the model keeps them in series. The
all-reduce's per-call overhead and per-byte cost are the reduce-scatter's fit:
the same reduction over the same host or device.

[Note: Latency per ring step]
Each of a ring's steps waits for one message. NCCL charges a ring's latency as
``(nsteps - nInterSteps) * intraLat + nInterSteps * interLat`` with
``nInterSteps = nNodes - 1`` for an all-gather or reduce-scatter and
``2 (nNodes - 1)`` for an all-reduce (``tuning.cc``, ring latencies): the ring
orders a node's ranks together, so only a few of its steps cross nodes. The
target's latencies are each link's ``latency``; gloo's ring is charged alike.

[Note: The per-call overhead, fitted]
Per call and per kind of collective, the profile's time is modelled as
``t = a + s * w``: ``w`` the bytes on the wire at the profile's world size and
backend, ``a`` a per-call overhead (the launch, the Python around it) and ``s``
the recorded time per byte (the host's copies and reductions, and the recorded
link). Both are fitted per kind by non-negative least squares
(``scipy.optimize.nnls``) over the modules' calls of that kind; with a single
distinct size they cannot be told apart, and all of the time is put on the
bytes (``a = 0``).

[Note: The fit's own error]
How well ``t = a + s * w`` describes the profile's calls is judged on calls
it did not see: each call is predicted by the fit of the others (leave one
out), and the root mean square of those relative errors is the fit's error,
a fraction of a call's time. In-sample residuals would flatter a two-parameter
fit of a few calls. The band on a predicted step (``planner.simulation.band``)
moves every call of the kind by that fraction together.

[Note: A profile of one GPU]
A profile recorded on one GPU has no collective to fit. On a GPU, NCCL's
kernels copy at the device's memory bandwidth, far above any link's, and
its per-call launch is a few microseconds: the link's bandwidth and
latency time the call alone (``a = s = 0``). The copies and the launch are
left out, and the report says the collectives were not recorded. On a CPU
gloo's host work per byte is as large as the wire's, so a one-rank CPU
profile is refused.

[Note: Host work and the wire]
On the target a call takes ``a + max(s * w', w' / (e * bandwidth))``: the
host's per-byte work (copies, reductions, faulting in fresh buffers) and the
transfer proceed together, the slower sets the pace, and a link faster than
the hosts changes nothing. ``e`` is the share of the link's rate the
collective's algorithm reaches (:func:`link_efficiency`): NCCL's bus bandwidth
(what ``bandwidth`` means in a target) already includes it, and gloo's chunked
ring all-reduce reaches the rate. Gloo's ring all-gather
(``all_gather_into_tensor``) reaches less of it, and how much depends on how
the ring sits: with one of its ranks per node every step's message crosses
the link, while with several per node most steps stay within a node and the
one crossing edge carries a message in every step. ``python -m
bench.link_sweep --check-link [--ranks-per-node 2]`` measures both shares on
the emulated link against the TCP rate of the same link
(:data:`GLOO_ALL_GATHER_EFFICIENCY`, :data:`GLOO_ALL_GATHER_SHARED_NODE_EFFICIENCY`;
the runs in docs/decisions/in-step-scale-on-a-link.md). The model reads the
ranks per node of the group's own ring. Each call then adds its ring's
latency ([Note: Latency per ring step]).

[Note: The in-step scale is the hosts']
In a step a collective takes ``comm_scale`` times its isolated figure
(``planner.simulation.in_step``): FSDP2's copy-in and copy-out around it
(``foreach_all_gather``'s ``split_with_sizes_copy`` and
``foreach_all_gather_copy_out``; ``foreach_reduce``'s copy-in, division and
shard view), the page faults of their fresh buffers, and the cores shared with
the other ranks. That excess is host work per call, and the scale is solved on
the recorded link, where the hosts' work is the whole call. On a target's link
a call is ``host + link``: ``host = a + s * w'`` is the recorded hosts' work,
scaled in a step as solved; ``link = max(0, w' / (e * bandwidth) - s * w')``
plus the ring's latency is what the slower link adds, a transfer the hosts'
scale does not stretch. The re-targeted profile keeps ``link`` apart
(``ModuleProfile.all_gather_link_ms``, ``reduce_scatter_link_ms``), and the
simulator scales ``all_gather_ms - all_gather_link_ms`` alone. Scaling the
whole call would multiply a wire-bound call by a scale solved where no wire
was slow (docs/decisions/in-step-scale-on-a-link.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.profile import Profile
from planner.artifacts.target import Group, Target
from planner.errors import TargetError
from planner.simulation.resharding import collective_bytes, reshard, shard_bytes
from planner.units import count

Kind = Literal["all_gather", "reduce_scatter", "all_reduce"]


def recorded_backend(profile: Profile) -> str:
    """The backend a profile's collectives ran on: gloo on CPU, NCCL on GPU (the recorder's launch)."""
    return "gloo" if profile.fingerprint.device_type == "cpu" else "nccl"


def _all_reduce_like(kind: Kind, backend: str) -> bool:
    return kind == "all_reduce" or (kind == "reduce_scatter" and backend == "gloo")


def wire_fraction(kind: Kind, group_size: int, backend: str) -> float:
    """The fraction of a collective's buffer each rank of a group of ``group_size`` sends ([Note: Bytes on the
    wire])."""
    if group_size <= 1:
        return 0.0
    ring = (group_size - 1) / group_size
    return 2 * ring if _all_reduce_like(kind, backend) else ring


def ring_steps(kind: Kind, group_size: int, backend: str) -> int:
    """The messages a rank sends in turn in the ring ([Note: Bytes on the wire])."""
    steps = max(0, group_size - 1)
    return 2 * steps if _all_reduce_like(kind, backend) else steps


def inter_node_steps(kind: Kind, nodes: int, backend: str) -> int:
    """Of :func:`ring_steps`, those that cross nodes: ``nNodes - 1``, twice for an all-reduce ([Note: Latency per
    ring step])."""
    steps = max(0, nodes - 1)
    return 2 * steps if _all_reduce_like(kind, backend) else steps


def ring_latency_ms(kind: Kind, group: Group, backend: str) -> float:
    """A ring's latency over ``group``, ms: its steps within a node at the intra-node latency, those across nodes
    at the inter-node one ([Note: Latency per ring step])."""
    steps, inter = ring_steps(kind, group.size, backend), inter_node_steps(kind, group.nodes, backend)
    return 1e3 * ((steps - inter) * group.intra_latency_s + inter * group.inter_latency_s)


GLOO_ALL_GATHER_EFFICIENCY = 0.63  # one rank of the ring per node ([Note: Host work and the wire])
GLOO_ALL_GATHER_SHARED_NODE_EFFICIENCY = 0.87  # several ranks of the ring per node


def link_efficiency(kind: Kind, backend: str, ranks_per_node: int = 1) -> float:
    """The share of the link's rate a collective reaches on ``backend`` with ``ranks_per_node`` of its ring's ranks
    on each node ([Note: Host work and the wire])."""
    if kind != "all_gather" or backend != "gloo":
        return 1.0
    return GLOO_ALL_GATHER_EFFICIENCY if ranks_per_node <= 1 else GLOO_ALL_GATHER_SHARED_NODE_EFFICIENCY


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
        wire_bytes: the smallest and largest bytes on the wire of the calls fitted.
        loo_error: the root mean square of the leave-one-out relative errors (each call predicted by the fit of
            the others), a fraction; ``None`` with fewer than 3 calls ([Note: The fit's own error]).
    """

    kind: Kind
    overhead_ms: float
    ms_per_byte: float
    points: int
    identifiable: bool
    wire_bytes: tuple[float, float] = (0.0, 0.0)
    loo_error: float | None = None

    @property
    def bytes_per_s(self) -> float:
        """The recorded effective bandwidth, bytes per second (``inf`` when no time is per byte)."""
        return 1e3 / self.ms_per_byte if self.ms_per_byte > 0 else float("inf")

    def ms(self, wire_bytes: float, link_bytes_per_s: float | None, backend: str, kind: Kind | None = None,
           ranks_per_node: int = 1) -> float:
        """One call's time with ``wire_bytes`` on a link of ``link_bytes_per_s`` (``None``: the recorded one), ms,
        latency aside ([Note: Host work and the wire]); ``kind``: the collective timed, when not the fit's own
        (HSDP's all-reduce on the reduce-scatter's fit); ``ranks_per_node``: of its ring, on each node."""
        return self.overhead_ms + self.ms_per_byte * wire_bytes + self.link_ms(wire_bytes, link_bytes_per_s, backend,
                                                                               kind, ranks_per_node)

    def link_ms(self, wire_bytes: float, link_bytes_per_s: float | None, backend: str, kind: Kind | None = None,
                ranks_per_node: int = 1) -> float:
        """Of :meth:`ms`, what the link adds beyond the hosts' recorded work, ms: ``max(0, wire time - host time
        per byte)``; 0 on the recorded link ([Note: The in-step scale is the hosts'])."""
        if link_bytes_per_s is None:
            return 0.0
        share = link_efficiency(kind or self.kind, backend, ranks_per_node)
        return max(0.0, 1e3 * wire_bytes / (share * link_bytes_per_s) - self.ms_per_byte * wire_bytes)


def wire_calls(profile: Profile, world_size: int, backend: str) -> list[tuple[str, Kind, float, float]]:
    """``(fqn, kind, wire bytes, recorded ms)`` per module and collective with bytes on the wire at ``world_size``
    on ``backend`` ([Note: Bytes on the wire])."""
    out = []
    fp = profile.fingerprint
    for fqn, m in profile.modules.items():
        nbytes = collective_bytes(m, world_size)
        for kind, t in (("all_gather", m.all_gather_ms), ("reduce_scatter", m.reduce_scatter_ms)):
            w = wire_fraction(kind, world_size, backend) * nbytes * fp.collective_scale(kind)
            if w > 0 and t > 0:
                out.append((fqn, kind, w, t))
    return out


def _coefficients(w: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    from scipy.optimize import nnls

    if len(np.unique(w)) > 1:
        (a, s), _ = nnls(np.column_stack([np.ones_like(w), w]), t)
        return float(a), float(s)
    return 0.0, float(t.sum() / w.sum())


def _loo_error(w: np.ndarray, t: np.ndarray) -> float | None:
    """[Note: The fit's own error]."""
    if len(w) < 3:
        return None
    errors = []
    for i in range(len(w)):
        keep = np.arange(len(w)) != i
        a, s = _coefficients(w[keep], t[keep])
        errors.append((t[i] - (a + s * w[i])) / t[i])
    return float(np.sqrt(np.mean(np.square(errors))))


def _fit(kind: Kind, w: np.ndarray, t: np.ndarray) -> LinkFit:
    a, s = _coefficients(w, t)
    return LinkFit(kind, a, s, len(w), len(np.unique(w)) > 1, (float(w.min()), float(w.max())), _loo_error(w, t))


def fit_link(profile: Profile) -> dict[Kind, LinkFit]:
    """Fit each kind's per-call overhead and recorded time per byte to the profile's collectives.

    A kind with no call of its own (a profile without reduce-scatters) takes the fit of both kinds together.

    A GPU profile of one rank has no collective: its fits are empty (no overhead, no time per byte), and the
    target's links time the collectives alone ([Note: A profile of one GPU]).

    Raises:
        TargetError: a CPU profile with no collective with bytes on the wire (world size 1): gloo's host cost per
            byte cannot be told from nothing; or it was recorded under HSDP, whose reduce-scatter figures hold the
            all-reduce over the replicas too.
    """
    fingerprint = profile.fingerprint
    if fingerprint.mesh is not None:
        raise TargetError(f"the profile was recorded under {fingerprint.mesh_text}: its reduce-scatter times hold the "
                          "all-reduce over the replicas, which the fit cannot tell apart; record the profile with "
                          "FSDP over the shard group's ranks (no [launch] mesh) to predict a target")
    calls = wire_calls(profile, fingerprint.shard_size, recorded_backend(profile))
    if not calls and recorded_backend(profile) == "nccl":  # [Note: A profile of one GPU]
        return {kind: LinkFit(kind, 0.0, 0.0, 0, False) for kind in ("all_gather", "reduce_scatter")}
    if not calls:
        raise TargetError("the profile has no collective with bytes on the wire (recorded at world size "
                          f"{fingerprint.world_size}); record it on 2 ranks or more to predict a link")
    fits = {}
    for kind in ("all_gather", "reduce_scatter"):
        mine = [c for c in calls if c[1] == kind] or calls
        fits[kind] = _fit(kind, np.array([c[2] for c in mine]), np.array([c[3] for c in mine]))
    return fits


@dataclass(frozen=True)
class Extrapolation:
    """How far a target lies from the profile it is predicted from.

    Attributes:
        recorded_world_size: ranks the profile was recorded on.
        world_size, nodes, replicate, shard: the target's.
        recorded_wire_bytes: median bytes on the wire per all-gather, as recorded.
        wire_bytes: median bytes on the wire per all-gather on the target's shard group.
        fitted_wire_bytes: the smallest and largest bytes on the wire per all-gather the fit saw.
        padded_exactly: every module's parameter rows were recorded: the shards are padded as FSDP2 pads; else
            each parameter's padding (at most one row) is left out.
    """

    recorded_world_size: int
    world_size: int
    nodes: int
    replicate: int
    shard: int
    recorded_wire_bytes: float
    wire_bytes: float
    fitted_wire_bytes: tuple[float, float]
    padded_exactly: bool

    @property
    def within_fit(self) -> bool:
        """The target's median all-gather puts bytes on the wire within the range the fit saw (or none at all)."""
        low, high = self.fitted_wire_bytes
        return self.wire_bytes == 0 or low <= self.wire_bytes <= high

    def describe(self) -> str:
        """One line: the world size against the recorded one, the nodes, the bytes per call against the fit's."""
        scale = self.world_size / self.recorded_world_size
        text = (f"from a profile of {count(self.recorded_world_size, 'rank')} to {self.world_size} on "
                f"{count(self.nodes, 'node')} (x{scale:g}); shards over {self.shard}"
                + (f", replicas {self.replicate}" if self.replicate > 1 else "")
                + f"; all-gather {self.wire_bytes / 1e6:.2f} MB on the wire per call, "
                f"{self.recorded_wire_bytes / 1e6:.2f} MB recorded (fitted {self.fitted_wire_bytes[0] / 1e6:.2f}-"
                f"{self.fitted_wire_bytes[1] / 1e6:.2f} MB): ")
        if self.recorded_world_size == 1:
            text = text.split("; all-gather")[0] + (f"; all-gather {self.wire_bytes / 1e6:.2f} MB on the wire per "
                                                     "call: no collective recorded (one rank), the link alone")
            return text + ("" if self.padded_exactly else "; parameter rows not recorded, padding left out")
        text += "within the fit" if self.within_fit else "outside the fit, extrapolated"
        return text + ("" if self.padded_exactly else "; parameter rows not recorded, padding left out")


@dataclass(frozen=True)
class Retargeted:
    """A profile re-timed and re-sharded for a target (:func:`retarget`).

    Attributes:
        profile: the profile as one rank of the target: simulate it with the recorded profile's parameters.
        fits: per kind, the fit the collectives were re-timed from.
        extrapolation: how far the target lies from the profile.
    """

    profile: Profile
    fits: dict[Kind, LinkFit]
    extrapolation: Extrapolation


def _call_ms(fit: LinkFit, kind: Kind, group: Group, nbytes: int, backend: str, spread_sign: int = 0
             ) -> tuple[float, float]:
    """One call over ``group``: its time and, of it, the link's share (the ring's latency included), ms."""
    w = wire_fraction(kind, group.size, backend) * nbytes
    if w <= 0:
        return 0.0, 0.0
    bandwidth = None if group.link is None else group.link.bytes_per_s_at(nbytes)
    if bandwidth is not None:  # a node's link shared by its groups' rings ([Note: A link per node, shared])
        bandwidth *= (1 + spread_sign * group.link.spread_fraction) / group.sharing
    latency, per_node = ring_latency_ms(kind, group, backend), group.size // max(group.nodes, 1)
    return (fit.ms(w, bandwidth, backend, kind, per_node) + latency,
            fit.link_ms(w, bandwidth, backend, kind, per_node) + latency)


# [Note: A what-if keeps the TP degree]
# Under FSDP + TP a module's recorded compute holds its share of the block's math and TP's own collectives inside its
# forward and backward (the all-reduces of the row-wise projections), both at the TP degree it was recorded at; a
# profile at one degree holds nothing that re-times them at another. So a target keeps the profile's degree (unset:
# the profile's) and one that names another is refused. What a target may change is FSDP's side: the world size and
# the links, over the dp group, whose ranks are the world divided by the TP degree and stride by it across the
# ranks of a node (``Target.groups``).


def keep_tensor_parallel(target: Target, fingerprint: Fingerprint) -> Target:
    """``target`` at the profile's tensor-parallel degree ([Note: A what-if keeps the TP degree]).

    Raises:
        TargetError: the target names another degree, or the profile's does not divide the target's ranks per node.
    """
    recorded = fingerprint.tensor_parallel or 1
    if target.tensor_parallel is not None and target.tensor_parallel != recorded:
        raise TargetError(f"the target's tensor_parallel = {target.tensor_parallel}, the profile's {recorded}: a TP "
                          "degree changes each module's compute and its TP collectives, which the profile holds at "
                          f"{recorded} only; record the profile at tensor_parallel = {target.tensor_parallel}")
    if target.tensor_parallel is not None or recorded == 1:
        return target
    try:
        return Target.model_validate({**target.model_dump(), "tensor_parallel": recorded})
    except ValueError as e:
        raise TargetError(f"the profile's tensor_parallel = {recorded} on this target: {e}") from None


def retarget(profile: Profile, target: Target, spread_sign: int = 0, fit_sign: int = 0,
             recorded_profile: Profile | None = None) -> Retargeted:
    """The profile as one rank of ``target``: re-sharded for its shard group ([Note: What re-sharding changes] in
    :mod:`planner.simulation.resharding`), each module's all-gather and reduce-scatter (and HSDP's all-reduce,
    [Note: HSDP's all-reduce]) re-timed for its groups' links, with what the links add beyond the hosts' work kept
    apart (``all_gather_link_ms``, ``reduce_scatter_link_ms``: [Note: The in-step scale is the hosts']).

    Compute and activations stay as recorded; simulate the result with the recorded profile's own parameters
    (``planner.simulation.parameters.profile_params(profile)``), which were solved on its link. A link given by
    an nccl-tests file is read at each call's buffer size ([Note: Reading nccl-tests]).

    Args:
        spread_sign: ``+1`` or ``-1``: every link's bandwidth at the high or low end of its stated ``spread``
            (``planner.simulation.band``); ``0``: as stated.
        fit_sign: ``+1`` or ``-1``: each fit's overhead and time per byte moved up or down by its leave-one-out
            error ([Note: The fit's own error]); ``0``: as fitted.
        recorded_profile: the profile as recorded, when ``profile`` was extended from it (``planner.simulation.depth``):
            the fit is made on its calls, not on their copies.

    Raises:
        TargetError: a target backend other than the one the profile's collectives ran on (their host cost was
            fitted on that backend: a CPU profile cannot predict NCCL), or a profile with no collective to fit; a
            target at another tensor-parallel degree than the profile's (:func:`keep_tensor_parallel`).
    """
    target = keep_tensor_parallel(target, profile.fingerprint)
    backend = recorded_backend(profile)
    if target.backend != backend:
        device = profile.fingerprint.device_type
        raise TargetError(f"target backend {target.backend!r}, but the profile's collectives ran on {backend} "
                          f"({device}): their costs cannot be re-timed for {target.backend}; record the profile on "
                          f"{'a GPU' if target.backend == 'nccl' else 'gloo'} to predict {target.backend}")
    fits = fit_link(recorded_profile or profile)
    if fit_sign:
        scale = {k: max(0.0, 1 + fit_sign * (f.loo_error or 0.0)) for k, f in fits.items()}
        fits = {k: dataclasses.replace(f, overhead_ms=f.overhead_ms * scale[k], ms_per_byte=f.ms_per_byte * scale[k])
                for k, f in fits.items()}
    shard_group, replicate_group = target.groups
    resharded = reshard(profile, target.shard, target.world_size, target.mesh)
    modules = dict(resharded.modules)
    scale = profile.fingerprint.collective_scale  # mixed precision: each collective's own dtype
    for fqn, m in resharded.modules.items():
        nbytes = collective_bytes(m, target.shard)
        all_gather = _call_ms(fits["all_gather"], "all_gather", shard_group, round(nbytes * scale("all_gather")),
                              backend, spread_sign)
        reduce_scatter = _call_ms(fits["reduce_scatter"], "reduce_scatter", shard_group,
                                  round(nbytes * scale("reduce_scatter")), backend, spread_sign)
        all_reduce = _call_ms(fits["reduce_scatter"], "all_reduce", replicate_group,
                              round(shard_bytes(m, target.shard) * scale("all_reduce")), backend, spread_sign)
        modules[fqn] = dataclasses.replace(
            m, all_gather_ms=all_gather[0], all_gather_link_ms=all_gather[1],
            reduce_scatter_ms=reduce_scatter[0] + all_reduce[0],
            reduce_scatter_link_ms=reduce_scatter[1] + all_reduce[1])
    recorded = profile.fingerprint.world_size

    def median_wire(world: int) -> float:
        sizes = [wire_fraction("all_gather", world, backend) * collective_bytes(m, world)
                 * profile.fingerprint.collective_scale("all_gather") for m in profile.modules.values()]
        return float(np.median(sizes)) if sizes else 0.0

    extrapolation = Extrapolation(recorded, target.world_size, target.nodes, target.replicate, target.shard,
                                  median_wire(profile.fingerprint.shard_size), median_wire(target.shard),
                                  fits["all_gather"].wire_bytes,
                                  all(m.parameter_rows for m in profile.modules.values() if m.unsharded_bytes))
    return Retargeted(dataclasses.replace(resharded, modules=modules), fits, extrapolation)
