"""A cluster's spread between launches: its calibration from unselected plans, else its device's prior.

Every verdict on a cluster floors its spread at what this module returns
([Note: The spread is floored at the cluster's bound] in
:mod:`planner.statistics.launches`), and every new study on the cluster
starts its evidence from it. The cluster is what the spread belongs to:
the device kind, the backend, the world size and the mesh
(:class:`ClusterKey`). Its calibration launches are rows of the planner's
table ``planner_calibration_launches`` in the study's storage, so studies
that share a storage share its calibrations, and a calibration interrupted
part way keeps the launches it measured.

[Note: What a calibration runs]
A calibration launch is a fresh launch of the study's ranks that measures
FSDP2's default against one other plan, in interleaved rounds, each plan on
its own model instance from its first step (``prefetch-planner
calibrate``): alternately a second copy of FSDP2's default and a plan of the
search space that no race picked (:func:`calibration_pairs`). Nothing is
selected on these launches, so each pair's ratios across launches show the
cluster's spread as a new plan meets it; each pair is one group of
:func:`planner.statistics.launches.calibrate`.
Torch-free: the tests drive it with synthetic launches.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from planner.artifacts.fingerprint import Fingerprint
from planner.artifacts.plan import Plan
from planner.artifacts.profile import Profile
from planner.statistics.launches import (
    CALIBRATION_CONFIDENCE,
    MIN_CALIBRATION_DF,
    ConfirmLaunch,
    Spread,
    calibrate,
    launch_estimate,
    prior_for,
)
from planner.storages.engine import session
from planner.storages.models import CalibrationLaunchRow
from planner.study.candidates import plan_key
from planner.study.search_space import SearchSpace

# The pair of FSDP2's default against a second copy of itself (``planner_calibration_launches.pair``).
DEFAULT_PAIR = "default"


@dataclass(frozen=True)
class ClusterKey:
    """What a spread between launches belongs to.

    Attributes:
        device_type: ``"cpu"`` or ``"cuda"``.
        backend: the process group's backend (``"gloo"``, ``"nccl"``).
        world_size: ranks.
        mesh: HSDP's ``(replicate, shard)``; ``None``: FSDP over every rank.
    """

    device_type: str
    backend: str
    world_size: int
    mesh: tuple[int, int] | None = None

    @classmethod
    def of(cls, fingerprint: Fingerprint, backend: str) -> ClusterKey:
        """The cluster a profile of ``fingerprint`` was recorded on, under ``backend``."""
        return cls(fingerprint.device_type, str(backend), fingerprint.world_size, fingerprint.mesh)

    @property
    def mesh_text(self) -> str:
        """``""`` for FSDP, else ``"2x4"``: the table's ``mesh`` column."""
        return "" if self.mesh is None else f"{self.mesh[0]}x{self.mesh[1]}"

    @property
    def text(self) -> str:
        """``cuda/nccl, 16 ranks, HSDP 2x8``."""
        layout = "FSDP" if self.mesh is None else f"HSDP {self.mesh_text}"
        return f"{self.device_type}/{self.backend}, {self.world_size} ranks, {layout}"


@dataclass(frozen=True)
class ClusterSpread:
    """The spread a cluster's verdicts start from.

    Attributes:
        key: the cluster.
        spread: the floor of every verdict on it and the evidence its new studies start from: the calibration's
            upper bound with its degrees of freedom, else the device's prior.
        calibrated: whether ``spread`` is this cluster's calibration.
        source: one line on where ``spread`` comes from.
        launches: the calibration launches it rests on (0 for a prior).
        pairs: per pair of the calibration, its launches (the pairs, by :data:`DEFAULT_PAIR` or plan key).
        last_pair: the pair of the latest calibration launch; ``None`` without one.
    """

    key: ClusterKey
    spread: Spread
    calibrated: bool
    source: str
    launches: int = 0
    pairs: tuple[tuple[str, int], ...] = ()
    last_pair: str | None = None

    @property
    def floor(self) -> float:
        """The least spread a verdict on this cluster uses (log scale)."""
        return self.spread.tau

    def line(self) -> str:
        """``spread between launches: floor 0.014 (calibrated on cuda/nccl, 8 ranks, FSDP: 12 fresh launches, ...)``."""
        return f"spread between launches: floor {self.floor:.3f} ({self.source})"


def record_calibration_launch(engine: sa.Engine, key: ClusterKey, pair: str, study: str,
                              launch: ConfirmLaunch) -> int:
    """Store one calibration launch of ``pair`` on cluster ``key``; the cluster's calibration launches now.

    Raises:
        ValueError: a launch :func:`~planner.statistics.launches.launch_estimate` refuses (too few rounds).
    """
    launch_estimate(launch.plan_ms, launch.default_ms)
    with session(engine) as s:
        s.add(CalibrationLaunchRow(device_type=key.device_type, backend=key.backend, world_size=key.world_size,
                                   mesh=key.mesh_text, pair=pair, study_name=study,
                                   launch_json=json.dumps(launch.to_json())))
        s.commit()
        return s.scalar(sa.select(sa.func.count()).select_from(CalibrationLaunchRow).where(*_matches(key)))


def calibration_launches(engine: sa.Engine, key: ClusterKey) -> dict[str, list[ConfirmLaunch]]:
    """Per pair, the calibration launches stored for cluster ``key``, oldest first; the pair of the latest launch
    last."""
    with session(engine) as s:
        rows = s.execute(sa.select(CalibrationLaunchRow.pair, CalibrationLaunchRow.launch_json)
                         .where(*_matches(key)).order_by(CalibrationLaunchRow.id)).all()
    out: dict[str, list[ConfirmLaunch]] = {}
    for pair, text in rows:
        out.setdefault(pair, []).append(ConfirmLaunch.from_json(json.loads(text)))
    if rows:  # the latest launch's pair last (dicts keep insertion order)
        out[rows[-1][0]] = out.pop(rows[-1][0])
    return out


def stored_clusters(engine: sa.Engine) -> list[ClusterSpread]:
    """The spread of every cluster with calibration launches in this storage."""
    row = CalibrationLaunchRow
    with session(engine) as s:
        keys = s.execute(sa.select(row.device_type, row.backend, row.world_size, row.mesh).distinct()).all()
    out = []
    for device, backend, world, mesh in keys:
        parsed = tuple(int(x) for x in mesh.split("x")) if mesh else None
        out.append(cluster_spread(engine, ClusterKey(device, backend, world, parsed)))
    return out


def _matches(key: ClusterKey) -> list:
    row = CalibrationLaunchRow
    return [row.device_type == key.device_type, row.backend == key.backend, row.world_size == key.world_size,
            row.mesh == key.mesh_text]


def spread_of(key: ClusterKey, groups: dict[str, Sequence[ConfirmLaunch]]) -> ClusterSpread:
    """The cluster's spread from its calibration launches ``groups`` (per pair), else its device's prior while
    they carry fewer than :data:`~planner.statistics.launches.MIN_CALIBRATION_DF` degrees of freedom."""
    estimates = [[launch_estimate(x.plan_ms, x.default_ms) for x in g] for g in groups.values()]
    launches = sum(len(g) for g in groups.values())
    pairs = tuple((pair, len(g)) for pair, g in groups.items())
    last = pairs[-1][0] if pairs else None
    df = sum(len(g) - 1 for g in estimates if len(g) >= 2)
    if df < MIN_CALIBRATION_DF:
        prior = prior_for(key.device_type)
        kind = "measured" if prior.measured else "from published repeats"
        partial = f"; {launches} calibration launch(es) so far, too few to stand" if launches else ""
        return ClusterSpread(key, prior.spread, False, f"the {key.device_type} prior ({kind}): {prior.source}"
                             f"{partial}", launches, pairs, last)
    spread = calibrate(estimates)
    return ClusterSpread(key, spread, True, f"calibrated on {key.text}: {launches} fresh launches of "
                         f"{len(groups)} unselected pairs, the {100 * CALIBRATION_CONFIDENCE:.0f}% upper bound on "
                         f"{spread.df:.0f} degrees of freedom", launches, pairs, last)


def cluster_spread(engine: sa.Engine, key: ClusterKey) -> ClusterSpread:
    """The spread of cluster ``key``: its calibration in this storage (:func:`spread_of`), else its device's prior.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the table cannot be read (a storage no planner has written).
    """
    return spread_of(key, calibration_launches(engine, key))


def stored_cluster_spread(url: str, key: ClusterKey) -> ClusterSpread:
    """The spread of cluster ``key`` in the storage at ``url``, opened read-only; the device's prior where the
    storage does not exist or holds no calibration table (nothing is written).

    Raises:
        StorageError: the storage cannot be opened.
    """
    from planner.errors import StudyNotFoundError
    from planner.storages import open_storage_read_only

    try:
        storage = open_storage_read_only(url)
    except StudyNotFoundError:  # no database yet
        return spread_of(key, {})
    try:
        return cluster_spread(storage.engine, key)
    except sa.exc.SQLAlchemyError:  # a storage no planner of this release has written
        return spread_of(key, {})
    finally:
        storage.engine.dispose()


def calibration_pairs(launches: int, unselected: Sequence[str]) -> list[str]:
    """The pair each of ``launches`` calibration launches runs against FSDP2's default ([Note: What a calibration
    runs]): alternately :data:`DEFAULT_PAIR` and the ``unselected`` plans' keys in turn; every pair gets two
    launches or more where ``launches`` allows (a pair of one launch carries no evidence).

    Raises:
        ValueError: fewer than 2 launches.
    """
    if launches < 2:
        raise ValueError(f"a calibration needs 2 or more launches, found {launches}")
    kinds = [DEFAULT_PAIR, *unselected]
    kinds = kinds[:max(1, launches // 2)]  # two launches a pair at least
    return [kinds[i % len(kinds)] for i in range(launches)]


def unselected_plans(profile: Profile, space: SearchSpace, count: int, seed: int = 0) -> list[Plan]:
    """``count`` plans of ``space`` drawn at random for ``profile`` (Optuna's random sampler, seeded), none FSDP2's
    default and no two alike: plans no race picked ([Note: What a calibration runs]). Fewer when the space has
    fewer distinct plans."""
    import optuna

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    default = Plan.default(profile).behaviour_key()
    out: list[Plan] = []
    seen = {default}
    for _ in range(20 * max(1, count)):
        if len(out) >= count:
            break
        trial = study.ask()
        plan = space.suggest(trial, profile)
        study.tell(trial, 0.0)
        if plan.behaviour_key() not in seen:
            seen.add(plan.behaviour_key())
            out.append(plan)
    return out


def calibration_plan(pair: str, default: Plan, unselected: Sequence[Plan]) -> Plan:
    """The plan a calibration launch runs against FSDP2's default for ``pair``: ``default`` itself for
    :data:`DEFAULT_PAIR`, else the unselected plan whose key it is.

    Raises:
        KeyError: ``pair`` names none of them.
    """
    if pair == DEFAULT_PAIR:
        return default
    by_key = {plan_key(p): p for p in unselected}
    return by_key[pair]
