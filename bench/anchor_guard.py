"""Benchmark, offline: would a guard that re-times the recorder's anchor have put it nearer the level after it?

    python -m bench.anchor_guard bench/results/step-history-guard-*.json

Reads saved ``bench.step_history --json`` runs whose first block is ``alone`` with at least five rounds. The
recorder's anchor is FSDP2's default step ([Note: The default's step is timed last] in ``runtime/recorder.py``): the
median of its five timed steps, after the async pairs (five pairs, the default and its async twin in turn). On this
CPU a slow stretch of the machine can cover those twelve seconds (a process in ``bench/results/NOTES.md``, "The
anchor's level across the saved runs": the anchor 25% over every later block). Per run this prints four anchors,
registered before the runs they are judged on (NOTES.md, "A guard for the anchor, registered before its runs"):

- E0, now: the recorder's own figure (the median of its timed steps, max across ranks);
- E1, the guard: E3 where rank 0's timed steps over rank 0's synchronous pair steps (medians) lie outside
  ``[1 / GUARD, GUARD]``, else E0;
- E2: the mean of E0 and E3 (ten steps, in every recording);
- E3: the median of the default's steps right after (the first ``alone`` block, max across ranks);

each as its error against the default's level after them: the mean of the medians of the blocks after the first.
Then per anchor the RMS error and the runs within 5%, and the registered decision: E1 if it fired at least once, its
RMS is below E0's and no run is more than 3 points worse; E2 instead only if its RMS is below both and a one-sided
Wilcoxon signed-rank test of ``|E0| - |E2|`` gives p < 0.05. Measures nothing.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import click

from bench.saved_runs import read_saved

GUARD = 1.1  # the registered threshold: timed over the pairs' default, either way
ASYNC_PAIRS = 5  # runtime.recorder.ASYNC_PAIRS (tests/bench/test_anchor_guard.py checks they agree)
RETIMED = 5  # the default's steps a re-timed anchor takes
WITHIN = 0.05  # the uncalibrated target of issue 21
WORSE = 0.03  # the registered limit on how much worse the guard may make one run
ANCHORS = ("E0", "E1", "E2", "E3")


@dataclass(frozen=True)
class GuardRun:
    """One saved ``bench.step_history`` run, as the anchors read it.

    Attributes:
        name: the file's name.
        recorder_ms: the recorder's anchor, the median of its timed default steps, max across ranks, ms.
        sync_ms: rank 0's synchronous default steps in the async pairs, in order, ms.
        timed_ms: rank 0's timed default steps, in order, ms.
        after_ms: the default's steps in the first ``alone`` block (max across ranks), ms.
        target_ms: the mean of the default's medians in the blocks after the first, ms.
    """

    name: str
    recorder_ms: float
    sync_ms: tuple[float, ...]
    timed_ms: tuple[float, ...]
    after_ms: tuple[float, ...]
    target_ms: float

    @property
    def guard_ratio(self) -> float:
        """Rank 0's timed steps over its pairs' synchronous steps, medians."""
        return statistics.median(self.timed_ms) / statistics.median(self.sync_ms)

    @property
    def fired(self) -> bool:
        """Whether the guard re-times: the ratio outside ``[1 / GUARD, GUARD]``."""
        return not 1 / GUARD <= self.guard_ratio <= GUARD

    def anchors_ms(self) -> dict[str, float]:
        """E0..E3 (the module's docstring), ms."""
        retimed = statistics.median(self.after_ms[:RETIMED])
        return {"E0": self.recorder_ms, "E1": retimed if self.fired else self.recorder_ms,
                "E2": (self.recorder_ms + retimed) / 2, "E3": retimed}

    def errors(self) -> dict[str, float]:
        """Each anchor over the target, less 1."""
        return {k: v / self.target_ms - 1 for k, v in self.anchors_ms().items()}


def sync_steps(logged_ms: list[float], pairs: int = ASYNC_PAIRS) -> tuple[list[float], list[float]]:
    """Split the recorder's logged default steps into the pairs' synchronous ones and the timed ones.

    The recorder runs ``pairs`` pairs, the synchronous default first in even pairs and second in odd ones, then the
    timed steps (``runtime.recorder._default_plan_steps``).

    Raises:
        ValueError: fewer steps than the pairs and one timed step.
    """
    if len(logged_ms) < 2 * pairs + 1:
        raise ValueError(f"{len(logged_ms)} logged steps: the recorder logs {2 * pairs} pair steps, then its timed "
                         "steps")
    sync = [logged_ms[2 * s + (s % 2)] for s in range(pairs)]
    return sync, logged_ms[2 * pairs:]


def guard_run(path: str | Path) -> GuardRun:
    """One saved run (``bench.step_history --json``).

    Raises:
        ValueError: the first block is not ``alone`` with at least ``RETIMED`` steps, no block follows it, or the
            recorder's steps are too few (``KeyError``/``TypeError``: not such a run at all).
    """
    run = json.loads(Path(path).read_text())
    blocks = run["blocks"]
    if not blocks or blocks[0]["block"] != "alone" or len(blocks[0]["default_ms"]) < RETIMED or len(blocks) < 2:
        raise ValueError(f"the first block must be `alone` with {RETIMED} rounds or more, and a block must follow "
                         "it (--blocks alone:5,all:3,alone:5)")
    sync, timed = sync_steps([step[1] for step in run["recorder_steps"]])
    target = statistics.fmean(statistics.median(b["default_ms"]) for b in blocks[1:])
    return GuardRun(Path(path).name, run["recorder_default_ms"], tuple(sync), tuple(timed),
                    tuple(blocks[0]["default_ms"]), target)


def decision(runs: list[GuardRun]) -> tuple[str, dict[str, float], float]:
    """The registered decision: ``(anchor, RMS error per anchor, the Wilcoxon p of |E0| - |E2| > 0)``.

    Raises:
        ValueError: no runs.
    """
    from scipy.stats import wilcoxon

    if not runs:
        raise ValueError("no runs")
    errors = [r.errors() for r in runs]
    rms = {k: math.sqrt(statistics.fmean(e[k] ** 2 for e in errors)) for k in ANCHORS}
    gains = [abs(e["E0"]) - abs(e["E2"]) for e in errors]
    p = wilcoxon(gains, alternative="greater").pvalue if any(gains) else 1.0
    guard_ok = (any(r.fired for r in runs) and rms["E1"] < rms["E0"]
                and all(abs(e["E1"]) - abs(e["E0"]) <= WORSE for e in errors))
    if rms["E2"] < min(rms["E0"], rms["E1"]) and p < 0.05:
        return "E2", rms, p
    return ("E1" if guard_ok else "E0"), rms, p


def summary(runs: list[GuardRun]) -> list[str]:
    """The report's lines: a line a run, a line an anchor, the decision."""
    lines = [f"{'run':44} {'timed/pairs':>11} {'fired':>5} " + " ".join(f"{k:>7}" for k in ANCHORS)]
    for r in runs:
        errs = r.errors()
        lines.append(f"{r.name[:44]:44} {r.guard_ratio:11.3f} {'yes' if r.fired else 'no':>5} "
                     + " ".join(f"{100 * errs[k]:+6.1f}%" for k in ANCHORS))
    chosen, rms, p = decision(runs)
    for k in ANCHORS:
        within = sum(abs(r.errors()[k]) <= WITHIN for r in runs)
        lines.append(f"{k}: RMS error {100 * rms[k]:.1f}%, within {100 * WITHIN:.0f}% in {within} of {len(runs)}")
    lines.append(f"the guard fired in {sum(r.fired for r in runs)} of {len(runs)}; one-sided Wilcoxon p of "
                 f"|E0| - |E2| > 0: {p:.3f}; the registered decision: {chosen}")
    return lines


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
def main(runs: tuple[str, ...]) -> None:
    """The recorder's anchor against a guard that re-times it (see the module's docstring)."""
    read = read_saved(runs, guard_run, "a saved `bench.step_history --json` run that starts with an `alone` block",
                      "pass bench/results/step-history-guard-*.json")
    for line in summary(read):
        click.echo(line)


if __name__ == "__main__":
    main()
