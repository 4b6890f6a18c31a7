"""Benchmark: :mod:`bench.fidelity` with every timed step's minor page faults counted, per rank.

    python -m bench.fault_counts [bench.fidelity's arguments: STUDY --rounds 9 --measure-only --json run.json]
    python -m bench.fault_counts --summary run.json   # after the run: per plan, its median step ms and faults

The run is ``bench.fidelity``'s, under ``python -m bench.fault_counts``; each rank also counts the process's minor
page faults (``getrusage``, every thread) across each timed step: the recorder's (``runtime.recorder._timed_step``:
the async pairs, then the default's timed steps) and the rounds' (``runtime.measure.timed_step``, plans in the
order of the run's rows). Each rank writes ``RUN.faults-rank{R}.json`` beside ``--json RUN``: a list of
``[source, step ms, faults]``, ``source`` ``"recorder"`` or ``"rounds"``. On the 2-core CPU testbed a fault costs
about 1.8 us (a fresh 64 MiB tensor: 16384 faults, 30 ms; 3 ms when it reuses the heap), and FSDP2's default step
on the checkpointed Llama takes 0.5-0.75 million of them (bench/results/NOTES.md, "Page faults, the machine,
and the floor of a 9-round run"). With 4 KiB pages the faults do set the rounds' level: "The level is the page
faults after all"; ``[launch] allocator = "jemalloc"`` takes them out.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from runtime.process_usage import process_usage

MODULE = "bench.fault_counts"


def count_faults(out: Path) -> None:
    """Wrap the recorder's and the rounds' timed steps to log ``[source, ms, faults]``; write them to ``out`` when
    the process exits."""
    import atexit

    import runtime.measure as measure
    import runtime.recorder as recorder

    log: list[list] = []
    recorded, rounds = recorder._timed_step, measure.timed_step

    def recorder_step(workload, step, device):
        f0 = process_usage().faults
        ms = recorded(workload, step, device)
        log.append(["recorder", ms[0], process_usage().faults - f0])
        return ms

    def rounds_step(workload, step):
        f0 = process_usage().faults
        ms = rounds(workload, step)
        log.append(["rounds", ms, process_usage().faults - f0])
        return ms

    recorder._timed_step, measure.timed_step = recorder_step, rounds_step
    atexit.register(lambda: out.write_text(json.dumps(log)))


def summary(run: Path) -> None:
    """Print, per rank, the recorder's timed steps (ms, faults), each plan's median step ms and faults in the rounds,
    each round's medians over plans, and how a plan's step ms follows its faults from round to round.

    Raises:
        FileNotFoundError: ``run`` or its fault files are missing.
    """
    rows = json.loads(run.read_text())["rows"]
    for path in sorted(run.parent.glob(run.name + ".faults-rank*.json")):
        log = json.loads(path.read_text())
        recorded = [(round(ms), f) for source, ms, f in log if source == "recorder"]
        rounds = [(ms, f) for source, ms, f in log if source == "rounds"]
        print(f"{path.name}: the recorder's steps (ms, faults) {recorded}")
        for i, row in enumerate(rows):
            steps = rounds[i::len(rows)]
            print(f"  {row['plan'][:44]:<44} {statistics.median(ms for ms, _ in steps):7.0f} ms "
                  f"{statistics.median(f for _, f in steps):9.0f} faults  {[f // 1000 for _, f in steps]} k")
        by_round = [rounds[k:k + len(rows)] for k in range(0, len(rounds), len(rows))]
        medians = [(round(statistics.median(m for m, _ in r)), int(statistics.median(f for _, f in r)))
                   for r in by_round]
        print(f"  each round, the median over plans (ms, faults): {medians}")
        ms, faults = [], []  # each step less its plan's mean: does a step with more faults take longer?
        for i in range(len(rows)):
            steps = rounds[i::len(rows)]
            ms += [m - statistics.fmean(m for m, _ in steps) for m, _ in steps]
            faults += [f - statistics.fmean(f for _, f in steps) for _, f in steps]
        fit = statistics.linear_regression(faults, ms)
        print(f"  within each plan, step ms against faults: correlation {statistics.correlation(faults, ms):+.2f}, "
              f"slope {fit.slope * 1e3:+.2f} us a fault")


def main() -> None:
    if sys.argv[1:2] == ["--summary"]:
        for run in sys.argv[2:]:
            summary(Path(run))
        return
    import bench.fidelity as fidelity

    if "RANK" in os.environ:  # a rank under torchrun: count beside the --json file
        run = Path(sys.argv[sys.argv.index("--json") + 1]) if "--json" in sys.argv else Path("fault-counts")
        count_faults(run.parent / f"{run.name}.faults-rank{os.environ['RANK']}.json")
    fidelity.MODULE = MODULE  # the ranks start under this module, so they count too
    fidelity.main()


if __name__ == "__main__":
    main()
