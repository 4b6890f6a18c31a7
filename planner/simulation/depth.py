"""A profile of a slice of the model (a few of its blocks) extended to the model's full depth.

[Note: Repeating measured blocks]
A transformer's blocks are copies of one module: a profile of ``n`` of them
holds every figure a block has (compute, all-gather, reduce-scatter, bytes,
activations). To predict the full model of ``depth`` blocks, block ``k``
(``k >= n``) takes the figures of measured block ``k mod n``, named as the
pattern names the blocks (``layers.*``: ``layers.k``), placed after the last
measured block in the model's module order and in both the pre- and
post-forward orders. The root and the other modules stay as recorded; the
optimizer's time, state and temporaries scale with the parameters. What the
profile measured for the whole step (its step time and peak) is of the slice,
and is dropped: the predicted figures stand on the modules alone. The
simulator's in-step parameters are those solved on the slice's own step
(``profile_params`` of the recorded profile). A block that holds nested FSDP
modules is refused: their repetition would need their own pattern.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from planner.artifacts.profile import Profile
from planner.errors import ProfileFormatError


@dataclass(frozen=True)
class DepthReport:
    """What :func:`deepen` extrapolated.

    Attributes:
        pattern: the blocks' FQN pattern.
        measured: the measured blocks' FQNs, in index order.
        depth: the blocks after.
        added: the FQNs added.
        parameter_scale: the model's parameters after over before.
    """

    pattern: str
    measured: tuple[str, ...]
    depth: int
    added: tuple[str, ...]
    parameter_scale: float

    def describe(self) -> str:
        """``layers.*: 4 measured blocks (layers.0-layers.3) repeated to 32 (28 added, each a copy of a measured
        one); parameters x6.4; the slice's measured step and peak dropped``."""
        if not self.added:
            return f"{self.pattern}: the profile already has {self.depth} blocks; nothing extrapolated"
        return (f"{self.pattern}: {len(self.measured)} measured blocks ({self.measured[0]}-{self.measured[-1]}) "
                f"repeated to {self.depth} ({len(self.added)} added, each a copy of a measured one); parameters "
                f"x{self.parameter_scale:.3g}; the slice's measured step and peak dropped")


@dataclass(frozen=True)
class Deepened:
    """A profile extended to its full depth (:func:`deepen`).

    Attributes:
        profile: the profile of the full model: simulate it with the recorded profile's parameters.
        report: what was extrapolated.
    """

    profile: Profile
    report: DepthReport


def _insert_after_last(order: tuple[str, ...], blocks: set[str], added: list[str]) -> tuple[str, ...]:
    last = max((i for i, f in enumerate(order) if f in blocks), default=len(order) - 1)
    return order[:last + 1] + tuple(added) + order[last + 1:]


def deepen(profile: Profile, depth: int, pattern: str = "layers.*") -> Deepened:
    """``profile``'s blocks repeated to ``depth`` ([Note: Repeating measured blocks]).

    Args:
        profile: a profile of a slice of the model.
        depth: the blocks of the full model.
        pattern: the blocks' FQNs with ``*`` for the block's index (``layers.*``); the FQNs may have a parent
            before it (``layers.*`` matches ``model.layers.3``).

    Raises:
        ProfileFormatError: the pattern has no ``*`` or matches no FSDP module; ``depth`` below the profile's
            blocks; a block holds nested FSDP modules (one line naming the fix).
    """
    if pattern.count("*") != 1:
        raise ProfileFormatError(f"--blocks {pattern!r}: write the blocks' FQN with one * for the block's index, "
                                 "e.g. 'layers.*'")
    regex = re.compile(r"((?:.*\.)?)" + re.escape(pattern).replace(r"\*", r"(\d+)"))
    fqns = profile.fingerprint.module_fqns
    found = [(m.group(1), int(m.group(2)), f) for f in fqns if (m := regex.fullmatch(f))]
    prefixes = sorted({p for p, _, _ in found})
    if len(prefixes) > 1:
        raise ProfileFormatError(f"--blocks {pattern!r} matches blocks under {len(prefixes)} parents "
                                 f"({', '.join(repr(p + pattern) for p in prefixes)}); give one of them in full")
    matched = sorted(((i, f) for _, i, f in found), key=lambda x: x[0])
    if not matched:
        shown = ", ".join(repr(f) for f in fqns[:6]) + (", ..." if len(fqns) > 6 else "")
        raise ProfileFormatError(f"--blocks {pattern!r} matches no FSDP module of the profile ({shown}); give the "
                                 "blocks' pattern, e.g. 'layers.*'")
    measured = [f for _, f in matched]
    if depth < len(measured):
        raise ProfileFormatError(f"--depth {depth} is below the profile's {len(measured)} blocks ({pattern}); give the "
                                 f"full model's depth, at least {len(measured)}")
    nested = [f for f in fqns if any(f.startswith(b + ".") for b in measured)]
    if nested:
        raise ProfileFormatError(f"block {nested[0].rsplit('.', 1)[0]!r} holds a nested FSDP module ({nested[0]!r}); "
                                 "a slice with nested FSDP blocks cannot be repeated: profile the full depth")
    top = matched[-1][0]
    added = [prefixes[0] + pattern.replace("*", str(top + 1 + k)) for k in range(depth - len(measured))]
    source = {new: measured[k % len(measured)] for k, new in enumerate(added)}
    modules = dict(profile.modules)
    for new, old in source.items():
        modules[new] = dataclasses.replace(profile.modules[old], fqn=new)
    fp = profile.fingerprint
    index = {f: i for i, f in enumerate(fqns)}
    new_fqns = _insert_after_last(fqns, set(measured), added)
    numels = tuple(fp.param_numels[index[source.get(f, f)]] for f in new_fqns)
    nbytes = tuple(fp.param_bytes[index[source.get(f, f)]] for f in new_fqns)
    scale = sum(numels) / max(1, sum(fp.param_numels))
    deep = dataclasses.replace(
        profile,
        fingerprint=dataclasses.replace(fp, module_fqns=new_fqns, param_numels=numels, param_bytes=nbytes),
        pre_forward_order=_insert_after_last(profile.pre_forward_order, set(measured), added),
        post_forward_order=_insert_after_last(profile.post_forward_order, set(measured), added),
        modules={f: modules[f] for f in new_fqns},
        optimizer_ms=profile.optimizer_ms * scale,
        optimizer_state_bytes=round(profile.optimizer_state_bytes * scale),
        optimizer_temp_bytes=round(profile.optimizer_temp_bytes * scale),
        measured_step_ms=None if added else profile.measured_step_ms,
        measured_peak_bytes=None if added else profile.measured_peak_bytes,
    )
    return Deepened(deep, DepthReport(pattern, tuple(measured), depth, tuple(added), scale))
