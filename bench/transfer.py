"""Benchmark: do confirmed ratios transfer to the user's own process? Claimed against verified, across workloads.

    python -m bench.transfer [STUDY.toml ...] [--tunes 1] [--launches 3] [--rounds 24]
                             [--given STUDY.toml=PLAN.json ...] [--json out.json]

For each study (default: the reference Llama, GPT-2, and Qwen2, the model no study is tuned on):
``prefetch-planner tune`` into a fresh SQLite study, ``--tunes`` times, each writing its plan JSON; then
``prefetch-planner verify PLAN STUDY --launches --rounds`` re-measures every plan whose confirmation claims a
total-time ratio, in fresh launches started as a user's job starts ([Note: Verify as a user's job] in
``jobs.verify``). ``--given`` adds plans tuned elsewhere (the README's main job in a fresh clone) to verify without
tuning again. Prints the table of claimed against verified and the mean verified-minus-claimed difference over the
plans with its Student-t 95% interval; a plan for which ``tune`` kept FSDP2's default has no claim and is listed,
not verified. Run it alone on the machine: every figure is a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

DEFAULT_STUDIES = ("studies/llama-cpu.toml", "studies/gpt2-cpu.toml", "bench/qwen2-cpu.toml")


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """``python -m jobs.cli ARGS``, its output passed through; exits on failure."""
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True)
    print(proc.stdout, end="", flush=True)
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        sys.exit(proc.returncode)
    return proc


def tune(study: str, work: Path, index: int) -> tuple[str, float]:
    """One ``tune`` of ``study`` into a fresh SQLite study under ``work``; its plan JSON and the seconds it took."""
    name = Path(study).stem
    plan = work / f"{name}-{index}.plan.json"
    t0 = time.monotonic()
    _run(["tune", study, "--storage", f"sqlite:///{work / f'{name}-{index}.db'}", "--plan-out", str(plan),
          "--profile-out", str(work / f"{name}-{index}.profile.json"), "--no-progress"])
    return str(plan), time.monotonic() - t0


def verify(study: str, plan: str, launches: int, rounds: int, work: Path) -> dict | None:
    """``verify`` of ``plan``; its JSON figures, or ``None`` where the plan claims no total-time ratio."""
    from planner.artifacts.plan import Plan

    provenance = Plan.load(plan).provenance
    if provenance.measured_ratio is None or provenance.ratio_of != "total time":
        print(f"{plan}: no total-time claim (verdict {provenance.verdict}); not verified", flush=True)
        return None
    out = work / (Path(plan).stem + ".verify.json")
    t0 = time.monotonic()
    _run(["verify", plan, study, "--launches", str(launches), "--rounds", str(rounds), "--json", str(out)])
    figures = json.loads(out.read_text())
    figures["seconds"] = time.monotonic() - t0
    figures["trial"], figures["verdict"] = provenance.trial, provenance.verdict
    figures["claim_launches"] = provenance.launches
    return figures


def summary(rows: list[dict]) -> dict:
    """The mean verified-minus-claimed difference over ``rows`` (verified plans) with its Student-t 95% interval,
    and how many plans agree with their claim."""
    import statistics

    from scipy import stats

    diffs = [r["verified"] - r["claimed"] for r in rows]
    mean = statistics.fmean(diffs) if diffs else float("nan")
    if len(diffs) > 1:
        half = stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
        ci = (mean - half, mean + half)
    else:
        ci = (float("nan"), float("nan"))
    agree = sum(r["agreement"] == "AGREES" for r in rows)
    return {"plans": len(rows), "mean_difference": mean, "ci95": ci, "agree": agree}


def table(rows: list[dict]) -> list[str]:
    """The markdown table of claimed against verified, one row a plan."""
    lines = ["| workload | plan | claimed [95% CI] | verified, fresh user processes [95% CI] | verified - claimed | "
             "check |", "|---|---|---|---|---|---|"]
    for r in rows:
        c, v = r["claimed_ci95"], r["verified_ci95"]
        launches = ", ".join(f"{x:.3f}" for x in r["launch_ratios"])
        lines.append(f"| {r['workload']} | trial {r['trial']} ({r['source']}) | {r['claimed']:.3f} [{c[0]:.3f}, "
                     f"{c[1]:.3f}], {r['claim_launches'] or 1} launches | {r['verified']:.3f} [{v[0]:.3f}, {v[1]:.3f}]"
                     f" ({launches}) | {r['verified'] - r['claimed']:+.3f} | {r['agreement'].lower()} |")
    return lines


@click.command(help=__doc__)
@click.argument("studies", nargs=-1)
@click.option("--tunes", default=1, show_default=True, help="tune runs per study (each a fresh study)")
@click.option("--launches", default=3, show_default=True, help="verify launches per plan")
@click.option("--rounds", default=24, show_default=True, help="interleaved rounds per verify launch")
@click.option("--given", multiple=True, help="STUDY.toml=PLAN.json: a plan tuned elsewhere, verified as well")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="write the figures here")
def main(studies: tuple[str, ...], tunes: int, launches: int, rounds: int, given: tuple[str, ...],
         json_out: str | None) -> None:
    rows, kept = [], []
    with tempfile.TemporaryDirectory(prefix="transfer-") as folder:
        work = Path(folder)
        plans = [(study, plan, "given") for study, _, plan in (g.partition("=") for g in given)]
        for study in studies or (DEFAULT_STUDIES if not given else ()):
            for i in range(tunes):
                print(f"=== tune {i + 1}/{tunes}: {study}", flush=True)
                plan, seconds = tune(study, work, i)
                plans.append((study, plan, f"tune {i + 1}, {seconds / 60:.0f} min"))
        for study, plan, source in plans:
            print(f"=== verify: {plan} ({study})", flush=True)
            figures = verify(study, plan, launches, rounds, work)
            if figures is None:
                kept.append({"workload": Path(study).stem, "source": source})
                continue
            rows.append({**figures, "workload": Path(study).stem, "source": source})
    print("\n" + "\n".join(table(rows)))
    s = summary(rows)
    print(f"\nmean verified - claimed over {s['plans']} plans: {s['mean_difference']:+.3f}, 95% CI "
          f"[{s['ci95'][0]:+.3f}, {s['ci95'][1]:+.3f}]; {s['agree']} of {s['plans']} agree with their claim; "
          f"{len(kept)} tune(s) kept FSDP2's default (no claim)")
    if json_out:
        Path(json_out).write_text(json.dumps({"rows": rows, "kept_default": kept, "summary": s}, indent=1))


if __name__ == "__main__":
    main()
