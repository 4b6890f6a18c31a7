"""The two-ranks GPU check's summary, from what its stages left in OUT (``bash bench/gpu_two_ranks.sh``).

    python3 -m bench.gpu_summary OUT     # writes OUT/summary.md and OUT/summary.json, prints the Markdown

Each section says where its figures come from; a stage that left nothing is said so, never filled in:

- the 2-rank profile (``profile.json``, the ``profile`` stage): per FSDP module, the all-gather and reduce-scatter
  times (ms; on a GPU the transfer on NCCL's clock, the wait for late ranks beside it) and bytes (unsharded and
  sharded parameter bytes);
- the ``tune`` verdict and its ratio (the study's recommendation and its job's confirmation, ``two-ranks.db``);
- FSDP2's default step, predicted against measured (the ``tune`` study's FSDP2's default trial: its simulated step
  and its race median, ms), and its peak, predicted against measured (``peak-memory.json``, the ``peak`` stage);
- how the in-loop tuner ended (the line ``docs/examples/plain_loop.py`` prints at the end, in the stage's log);
- what the watch costs a step (``watch-cost.json``, the ``watch-cost`` stage: watched / plain wall time, its
  interval within the process);
- each stage's exit status and seconds (``stages.tsv``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _profile(out: Path) -> list[dict[str, Any]] | None:
    from planner.artifacts.profile import Profile

    path = out / "profile.json"
    if not path.exists():
        return None
    profile = Profile.load(path)
    steps = profile.in_step.collective_steps if profile.in_step is not None else None
    return [{"module": fqn or "(root)", "all_gather_ms": m.all_gather_ms, "reduce_scatter_ms": m.reduce_scatter_ms,
             "unsharded_bytes": m.unsharded_bytes, "sharded_bytes": m.sharded_bytes,
             "all_gather_wait_ms": m.all_gather_wait_ms, "reduce_scatter_wait_ms": m.reduce_scatter_wait_ms,
             "traced_steps": steps}
            for fqn, m in profile.modules.items()]


def _tune(out: Path) -> dict[str, Any] | None:
    from planner.errors import StudyNotFoundError
    from planner.study.queries import best_plan

    db = out / "two-ranks.db"
    if not db.exists():
        return None
    try:
        best = best_plan(f"sqlite:///{db}", _study_name(out))
    except StudyNotFoundError:  # the job stopped before it concluded
        return None
    c = best.recommendation.confirmation
    return {"line": best.line(_study_name(out)), "verdict": str(c.verdict) if c else None,
            "ratio": c.ratio if c else None, "ci95": list(c.ci95) if c else None, "launches": c.launches if c else None}


def _default_step(out: Path) -> dict[str, Any] | None:
    from planner.study import study_trials

    db = out / "two-ranks.db"
    if not db.exists():
        return None
    trials = study_trials(f"sqlite:///{db}", _study_name(out)).measured
    default = next((r for r in trials if r.is_default and r.measured_ms is not None), None)
    if default is None:
        return None
    return {"predicted_ms": default.predicted_ms, "measured_ms": default.measured_ms,
            "error_pct": 100.0 * (default.predicted_ms - default.measured_ms) / default.measured_ms}


def _study_name(out: Path) -> str:
    return (out / "study-name").read_text().strip() if (out / "study-name").exists() else "llama-gpu-two-ranks"


def _default_peak(out: Path) -> dict[str, Any] | None:
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.simulation.parameters import simulate

    path = out / "peak-memory.json"
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    profile = Profile.from_dict(run["profile"])
    for row in run["rows"]:
        plan = Plan.from_dict(row["plan_json"])
        if plan.is_default_for(profile):
            predicted, measured = simulate(profile, plan).peak_bytes, row["measured_peak_bytes"]
            return {"predicted_bytes": predicted, "measured_bytes": measured,
                    "error_pct": 100.0 * (predicted - measured) / measured}
    return None


def _in_loop(out: Path) -> str | None:
    log = out / "stages" / "in-loop.log"
    if not log.exists():
        return None
    done = [line.strip() for line in log.read_text().splitlines() if line.startswith("phase ")]
    return done[-1] if done else "the loop printed no final phase (see stages/in-loop.log)"


def _watch_cost(out: Path) -> dict[str, Any] | None:
    path = out / "watch-cost.json"
    return json.loads(path.read_text()) if path.exists() else None


def _stages(out: Path) -> list[dict[str, Any]]:
    path = out / "stages.tsv"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        name, status, seconds, limit = line.split("\t")
        rows.append({"stage": name, "exit": status, "seconds": int(seconds), "limit_s": int(limit)})
    return rows


def summarize(out: Path) -> dict[str, Any]:
    """Every figure of the summary, ``None`` where its stage left nothing."""
    return {"profile": _profile(out), "tune": _tune(out), "default_step": _default_step(out),
            "default_peak": _default_peak(out), "in_loop": _in_loop(out), "watch_cost": _watch_cost(out),
            "stages": _stages(out),
            "machine": (out / "machine.txt").read_text().strip() if (out / "machine.txt").exists() else None}


def markdown(s: dict[str, Any]) -> str:
    """The summary as a Markdown page."""
    from planner.units import mib

    lines = ["# Two ranks on one GPU: summary", "", f"Machine: {s['machine'] or 'not recorded'}", ""]
    lines += ["## The 2-rank profile (`profile` stage)", ""]
    if s["profile"] is None:
        lines.append("No profile: the stage left no `profile.json`.")
    else:
        steps = s["profile"][0].get("traced_steps")
        clock = (f"Collectives: the transfer on its own clock (NCCL's kernel on a GPU, gloo's work on CPU) in {steps} "
                 "traced steps, the least across ranks; the wait for late ranks apart." if steps else
                 "Collectives: timed in isolation (`unshard()`, a bare reduce-scatter).")
        lines += [clock, ""]
        lines += ["| module | all-gather ms | reduce-scatter ms | unsharded MiB | sharded MiB | all-gather wait ms | "
                  "reduce-scatter wait ms |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {m['module']} | {m['all_gather_ms']:.3f} | {m['reduce_scatter_ms']:.3f} | "
                  f"{mib(m['unsharded_bytes'], 2, unit=False)} | {mib(m['sharded_bytes'], 2, unit=False)} | "
                  f"{m.get('all_gather_wait_ms', 0.0):.3f} | {m.get('reduce_scatter_wait_ms', 0.0):.3f} |"
                  for m in s["profile"]]
    lines += ["", "## `tune`", ""]
    t = s["tune"]
    lines.append("No study decided." if t is None else
                 (f"Verdict: {t['verdict']}; ratio {t['ratio']:.3f} [{t['ci95'][0]:.3f}, {t['ci95'][1]:.3f}], "
                  f"{t['launches']} launch(es)." if t["verdict"] else "No survivor: the race dropped every candidate.")
                 + f" The study: {t['line']}")
    lines += ["", "## FSDP2's default, predicted against measured", ""]
    d, p = s["default_step"], s["default_peak"]
    lines.append("Step: no measured default trial." if d is None else
                 f"Step: predicted {d['predicted_ms']:.2f} ms, measured {d['measured_ms']:.2f} ms "
                 f"({d['error_pct']:+.1f}%; the race's median, max across ranks).")
    lines.append("Peak: no peak run." if p is None else
                 f"Peak: predicted {mib(p['predicted_bytes'])}, measured {mib(p['measured_bytes'])} "
                 f"({p['error_pct']:+.1f}%).")
    w = s.get("watch_cost")
    watch = ("Watch cost: no `watch-cost.json` (the stage did not finish)." if w is None else
             f"Watch cost: watched / plain {w['ratio']:.3f} [{w['ci95'][0]:.3f}, {w['ci95'][1]:.3f}] over "
             f"{w['stretches']} stretches of {w['steps_per_stretch']} steps ({w['blocks_read']} blocks of "
             f"{w['watch_every']} read; two ranks on one GPU test the mechanism, not the speed).")
    lines += ["", "## The in-loop tuner", "", s["in_loop"] or "No in-loop stage log.", "", watch, "", "## Stages", "",
              "| stage | exit | seconds | limit s |", "|---|---|---|---|"]
    lines += [f"| {r['stage']} | {r['exit']} | {r['seconds']} | {r['limit_s']} |" for r in s["stages"]]
    total = sum(r["seconds"] for r in s["stages"])
    lines += ["", f"Stages took {total} s in all."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m bench.gpu_summary OUT", file=sys.stderr)
        return 2
    out = Path(argv[0])
    summary = summarize(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
