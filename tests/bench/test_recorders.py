"""bench.recorders's comparison: which fields it calls equal, and a time gap against each recorder's own spread."""

import dataclasses

from bench.recorders import report
from planner.testing import synthetic_profile


def _run(tune, loop):
    return {"study": "s", "profiles": {"tune": [p.to_dict() for p in tune], "loop": [p.to_dict() for p in loop]}}


def _scaled(profile, fqn, **changes):
    return dataclasses.replace(profile, modules={**profile.modules,
                                                 fqn: dataclasses.replace(profile.modules[fqn], **changes)})


def test_the_same_profile_from_both_recorders_differs_nowhere():
    p = synthetic_profile(n_blocks=3)
    summary = report(_run([p, p], [p, p]))
    assert summary["differing"] == [] and not any(r["gap_pct"] for r in summary["rows"])
    assert all(r["within_spread"] for r in summary["rows"])


def test_a_byte_field_on_one_module_is_named(capsys):
    p = synthetic_profile(n_blocks=3)
    fqn = p.fingerprint.module_fqns[1]
    other = _scaled(p, fqn, activation_bytes=p.modules[fqn].activation_bytes + 32)
    summary = report(_run([p, p], [other, other]))
    assert summary["differing"] == ["activation_bytes"]
    assert f"{fqn}" in capsys.readouterr().out


def test_a_time_gap_is_outside_only_beyond_the_larger_spread_of_the_two_recorders():
    p = synthetic_profile(n_blocks=3)
    fqn = p.fingerprint.module_fqns[1]
    fwd = p.modules[fqn].fwd_ms
    tune = [_scaled(p, fqn, fwd_ms=fwd * 0.95), _scaled(p, fqn, fwd_ms=fwd * 1.05)]  # a 10% spread
    near = [_scaled(p, fqn, fwd_ms=fwd * 1.08)] * 2  # 8% above tune's mean
    far = [_scaled(p, fqn, fwd_ms=fwd * 1.2)] * 2
    row = next(r for r in report(_run(tune, near))["rows"] if r["figure"] == f"{fqn} fwd_ms")
    assert round(row["gap_pct"], 6) == 8.0 and round(row["tune_spread_pct"], 6) == 10.0 and row["within_spread"]
    row = next(r for r in report(_run(tune, far))["rows"] if r["figure"] == f"{fqn} fwd_ms")
    assert not row["within_spread"]
