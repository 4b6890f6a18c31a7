"""Benchmark: the tool on the emulated two-node cluster (``bench/cluster.py``) at each link rate.

    python -m bench.link_sweep [bench/llama-link.toml] [--rates none,4gbit,1gbit] [--rounds 24] [--json OUT]
    python -m bench.link_sweep --refit OUT.json      # report a saved run again, measuring nothing
    python -m bench.link_sweep --check-link [--ranks-per-node 2]   # the shaped link's TCP throughput at each rate
    python -m bench.link_sweep STUDY --profiles 3 [--rates 4gbit,1gbit] [--json OUT]   # the what-if alone

At each rate, on a fresh cluster (one gloo rank per node, ``torchrun --nnodes 2``):

1. ``prefetch-planner tune STUDY`` as two nodes, into a fresh SQLite study of that rate: the recorder's profile
   over the link, the simulated search, the race (FSDP2's default interleaved with the candidates) and the
   confirmation of the survivor in the job's processes;
2. an independent re-measurement of the confirmed plan against FSDP2's default in fresh processes on both nodes
   (``bench.verdicts``' re-measurement: two model instances, ``--rounds`` rounds, each pair's order drawn at random).

Then, per rate: communication over compute (the profile's all-gathers and reduce-scatters over its forward and
backward compute); each collective's recorded time over what its bytes on the wire take at the rate
([Note: Bytes on the wire]); FSDP2's default step predicted from the unshaped link's profile
(``simulate --target``, held out: that profile never saw the rate) against the default's median step in the
rate's race; the confirmed ratio with its interval; the re-measurement in fresh processes beside it.

With ``--profiles N`` the sweep checks the what-if alone, and how still it holds: ``N`` profiles of the study on the
unshaped link (``prefetch-planner profile`` as the two nodes, each in fresh processes), then at each shaped rate
FSDP2's default measured on a fresh cluster (``--rounds`` pairs of steps in fresh processes), and its step predicted
from each profile (``planner.simulation.what_if.Scenario``, as ``simulate --target``) with its band: each error
(target: within 10%), the predictions' spread over the profiles, and whether each band holds the measured median.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from bench.cluster import RATES, Cluster, rate_bits
from bench.what_if_checks import checked, largest_from_mean

MODULE = "bench.link_sweep"
TARGET_TOML = """world_size = 2
ranks_per_node = 1
backend = "gloo"
[link.inter_node]
bandwidth = "{gbit}Gbit/s"
"""


def target_toml(rate: str) -> str | None:
    """The target TOML of a shaped rate (``simulate --target``); ``None`` for the unshaped link."""
    bits = rate_bits(rate)
    return None if bits is None else TARGET_TOML.format(gbit=f"{bits / 1e9:g}")


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _tune(cluster: Cluster, study: str, work: Path) -> str:
    """``prefetch-planner tune`` as the cluster's two nodes into ``work``; returns what node 0 printed."""
    launch = cluster.torchrun(
        ["-m", "jobs.cli", "tune", study, "--storage", f"sqlite:///{work}/study.db", "--plan-out",
         str(work / "plan.json"), "--profile-out", str(work / "profile.json"), "--no-progress"],
        logs=_folder(work / "tune"), rdzv_id="tune")
    codes = launch.wait(3600)
    if any(codes):
        sys.exit(f"tune failed on the cluster ({codes}):\n{launch.output()[-6000:]}")
    return launch.output(0)


def _remeasure(cluster: Cluster, study: str, plan: Path, rounds: int, work: Path) -> dict:
    """The plan against FSDP2's default in fresh processes on both nodes: each one's step times, ms."""
    out = work / "remeasure.json"
    launch = cluster.torchrun(["-m", "bench.verdicts", study, "--part", "remeasure", "--plan", str(plan),
                               "--rounds", str(rounds), "--out", str(out)], logs=_folder(work / "remeasure"),
                              rdzv_id="remeasure")
    codes = launch.wait(3600)
    if any(codes):
        sys.exit(f"the re-measurement failed on the cluster ({codes}):\n{launch.output()[-6000:]}")
    return json.loads(out.read_text())


def run_rate(study: str, rate: str, rounds: int, work: Path) -> dict:
    """Tune and re-measure at ``rate`` on a fresh cluster; the run's figures (JSON-ready)."""
    from planner.artifacts.config import load_study_config
    from planner.artifacts.profile import Profile
    from planner.study import best_plan
    from planner.study.queries import study_trials

    work.mkdir(parents=True, exist_ok=True)
    name = load_study_config(study).name
    t0 = time.monotonic()
    with Cluster(rate) as cluster:
        printed = _tune(cluster, study, work)
        storage = f"sqlite:///{work}/study.db"
        best = best_plan(storage, name)
        [default] = [t for t in study_trials(storage, name).measured if t.is_default and t.race_ms]
        reported = best.plan if not best.keeps_baseline else best.survivor  # the confirmed candidate, if any
        figures: dict = {"rate": rate, "printed": printed, "profile": Profile.load(work / "profile.json").to_dict(),
                         "default_race_ms": default.race_ms, "confirmed": None, "remeasure": None}
        if reported is not None and reported.provenance.ratio_ci95 is not None:
            pv = reported.provenance
            figures["confirmed"] = {"trial": pv.trial, "verdict": pv.verdict, "ratio": pv.measured_ratio,
                                    "ci95": list(pv.ratio_ci95), "rounds": pv.rounds, "launches": pv.launches or 1,
                                    "plan": reported.to_dict()}
            reported.to_json(work / "reported.json")
            figures["remeasure"] = _remeasure(cluster, study, work / "reported.json", rounds, work)
    figures["seconds"] = time.monotonic() - t0
    return figures


def collective_over_wire(profile, bits_per_s: float) -> dict[str, list[float]]:
    """Each module's recorded all-gather and reduce-scatter ms over its bytes on the wire at ``bits_per_s``."""
    from planner.simulation.link import recorded_backend, wire_calls

    out: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": []}
    for _, kind, wire_bytes, ms in wire_calls(profile, profile.fingerprint.world_size, recorded_backend(profile)):
        out[kind].append(ms / (wire_bytes * 8 / bits_per_s * 1e3))
    return out


def collective_over_predicted(profile, predicted) -> dict[str, list[float]]:
    """Each module's recorded all-gather and reduce-scatter ms over the link model's prediction for it."""
    out: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": []}
    for fqn, m in profile.modules.items():
        for kind in out:
            ms, want = getattr(m, f"{kind}_ms"), getattr(predicted.modules[fqn], f"{kind}_ms")
            if ms > 0 and want > 0:
                out[kind].append(ms / want)
    return out


def _spread(values: list[float]) -> list[float]:
    return [min(values), statistics.median(values), max(values)]


def report(runs: dict[str, dict]) -> list[dict]:
    """Print the sweep's table from the runs (rate -> :func:`run_rate`'s figures); the table's rows."""
    import tomllib

    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile
    from planner.artifacts.target import Target
    from planner.simulation.link import retarget
    from planner.simulation.parameters import profile_params, simulator_for
    from planner.statistics.verdict import confirm

    base = Profile.from_dict(runs["none"]["profile"]) if "none" in runs else None
    rows = []
    for rate, run in runs.items():
        profile = Profile.from_dict(run["profile"])
        compute = sum(m.fwd_ms + m.bwd_ms for m in profile.modules.values())
        comm = sum(m.all_gather_ms + m.reduce_scatter_ms for m in profile.modules.values())
        row = {"rate": rate, "comm_over_compute": comm / compute, "measured_default_ms": run["default_race_ms"],
               "predicted_default_ms": None, "error": None, "wire": None, "model": None}
        bits = rate_bits(rate)
        if bits is not None:
            row["wire"] = {k: _spread(v) for k, v in collective_over_wire(profile, bits).items() if v}
        if base is not None:
            source = base
            if bits is not None:
                source = retarget(base, Target.model_validate(tomllib.loads(target_toml(rate)))).profile
                row["model"] = {k: _spread(v) for k, v in collective_over_predicted(profile, source).items() if v}
            row["predicted_default_ms"] = simulator_for(source, profile_params(base)).run(Plan.default(base)).step_ms
            row["error"] = row["predicted_default_ms"] / run["default_race_ms"] - 1
        c, r = run["confirmed"], run["remeasure"]
        row["confirmed"], row["remeasure"] = c, None
        if r is not None:
            again = confirm(r["tuned"], r["default"], noise_pct=float("nan"))
            row["remeasure"] = {"ratio": again.ratio, "ci95": list(again.ci95), "rounds": len(r["tuned"])}
        rows.append(row)

    def spread(figures: dict | None, kind: str) -> str:
        if not figures or kind not in figures:
            return "-"
        lo, mid, hi = figures[kind]
        return f"{mid:.2f} ({lo:.2f}-{hi:.2f})"

    print("\n| link | comm / compute | all-gather: recorded / model, median (range) | recorded / wire time "
          "| reduce-scatter: recorded / model | recorded / wire time | default step: predicted from `none` "
          "| measured (race median) | error | confirmed ratio [95% CI] | re-measured, fresh processes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        pred = "-" if row["predicted_default_ms"] is None else f"{row['predicted_default_ms']:.0f} ms"
        err = "-" if row["error"] is None else f"{row['error']:+.1%}"
        if row["rate"] == "none" and row["error"] is not None:
            err += " (its own link)"
        c, r = row["confirmed"], row["remeasure"]
        conf = "no candidate confirmed" if c is None else (
            f"{c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] {c['verdict']} ({c['rounds']} rounds)")
        again = "-" if r is None else (
            f"{r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] ({r['rounds']} rounds)")
        print(f"| {row['rate']} | {row['comm_over_compute']:.2f} | {spread(row['model'], 'all_gather')} "
              f"| {spread(row['wire'], 'all_gather')} | {spread(row['model'], 'reduce_scatter')} "
              f"| {spread(row['wire'], 'reduce_scatter')} | {pred} | {row['measured_default_ms']:.0f} ms | {err} "
              f"| {conf} | {again} |")
    return rows


def what_if_runs(study: str, rates: list[str], count: int, rounds: int, work: Path) -> dict:
    """``count`` profiles on the unshaped link, then FSDP2's default measured at each rate (``--profiles``)."""
    from planner.artifacts.plan import Plan
    from planner.artifacts.profile import Profile

    profiles = []
    with Cluster("none") as cluster:
        for i in range(count):
            out = work / f"profile-{i + 1}.json"
            print(f"=== profile {i + 1}/{count} on the unshaped link", flush=True)
            launch = cluster.torchrun(["-m", "jobs.cli", "profile", study, "-o", str(out)],
                                      logs=_folder(work / f"profile-{i + 1}"), rdzv_id=f"profile{i}")
            codes = launch.wait(3600)
            if any(codes):
                sys.exit(f"the profile failed on the cluster ({codes}):\n{launch.output()[-6000:]}")
            profiles.append(Profile.load(out).to_dict())
    Plan.default(Profile.from_dict(profiles[0])).to_json(work / "default.json")
    measured = {}
    for rate in rates:
        print(f"=== {rate}: FSDP2's default, {rounds} pairs of steps in fresh processes", flush=True)
        with Cluster(rate) as cluster:
            steps = _remeasure(cluster, study, work / "default.json", rounds, _folder(work / rate))
        measured[rate] = steps["tuned"] + steps["default"]  # both instances run FSDP2's default
    return {"what_if": True, "profiles": profiles, "measured": measured}


def what_if_report(run: dict) -> list[dict]:
    """Print the what-if's table from :func:`what_if_runs`' figures; its rows."""
    import tomllib

    from planner.artifacts.profile import Profile
    from planner.artifacts.target import Target
    from planner.simulation.what_if import Scenario

    profiles = [Profile.from_dict(p) for p in run["profiles"]]
    rows = []
    print("\n| link | measured (median) | " + " | ".join(f"profile {i + 1}: predicted, error, band"
                                                         for i in range(len(profiles)))
          + " | spread (largest from the mean) | comm_scale |")
    print("|---|---|" + "---|" * len(profiles) + "---|---|")
    for rate, steps in run["measured"].items():
        target = Target.model_validate(tomllib.loads(target_toml(rate)))
        measured = statistics.median(steps)
        cells, predicted, scales = [], [], []
        for profile in profiles:
            scenario = Scenario.of(profile, target)
            band = scenario.band()
            check = checked(band.step_ms, band.low_ms, band.high_ms, measured, 0.10)
            predicted.append(band.step_ms)
            scales.append(scenario.params.comm_scale)
            cells.append(check.cell)
            rows.append({"rate": rate, "measured_ms": measured, "predicted_ms": band.step_ms, "error": check.error,
                         "band": [band.low_ms, band.high_ms], "inside": check.inside})
        print(f"| {rate} | {measured:.0f} ms | " + " | ".join(cells) + f" | {largest_from_mean(predicted):.1%} | "
              + ", ".join(f"{c:.2f}" for c in scales) + " |")
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    print(f"\n{within} of {len(rows)} predictions within 10%; {sum(r['inside'] for r in rows)} of {len(rows)} bands "
          "hold the measured median")
    return rows


def check_link(rates: list[str], ranks_per_node: int = 1) -> None:
    """Each rate's TCP throughput from node 0 to node 1 (100 MiB), and gloo's all-gather and all-reduce on it over
    ``2 * ranks_per_node`` ranks: the share of the rate each reaches, its bytes on the wire per rank
    (:func:`planner.simulation.link.wire_fraction`) over the rate ([Note: Host work and the wire] in
    ``planner/simulation/link.py``)."""
    from planner.simulation.link import wire_fraction

    world = 2 * ranks_per_node
    for rate in rates:
        with Cluster(rate) as cluster:
            node0, node1 = cluster.nodes
            part = [sys.executable, "-m", MODULE, "--address", node1.address, "--part"]
            recv = subprocess.Popen(node1.command([*part, "recv"]), stdout=subprocess.PIPE, text=True)
            time.sleep(1.0)
            subprocess.run(node0.command([*part, "send"]), check=True)
            gbit = float(recv.communicate(timeout=120)[0])
            with tempfile.TemporaryDirectory() as d:
                out = Path(d) / "collectives.json"
                launch = cluster.torchrun(["-m", MODULE, "--part", "collectives", "--address", str(out)],
                                          logs=Path(d), rdzv_id="collectives", nproc_per_node=ranks_per_node)
                if any(launch.wait(300)):
                    sys.exit(f"the collectives failed on the cluster:\n{launch.output()[-4000:]}")
                ms = json.loads(out.read_text())
            bits = rate_bits(rate) or gbit * 1e9
            shaped = "" if rate_bits(rate) is None else f" ({gbit * 1e9 / bits:.0%})"
            line = [f"{rate}, {world} ranks: TCP {gbit:.2f} Gbit/s{shaped}"]
            for kind in ("all_gather", "all_reduce"):
                wire_bytes = wire_fraction(kind, world, "gloo") * world * _SHARD
                wire_ms = wire_bytes * 8 / bits * 1e3
                line.append(f"{kind.replace('_', '-')} {ms[kind]:.1f} ms, {wire_ms / ms[kind]:.0%} of "
                            f"{'the rate' if rate_bits(rate) else 'TCP'}")
            print("; ".join(line), flush=True)


_SHARD = 6_400_000  # bytes: a block of bench/llama-link.toml's, sharded over 2 ranks


def _collectives(out: str) -> None:
    """Every rank: the median of 7 gloo ``all_gather_into_tensor`` of a :data:`_SHARD`-byte shard and 7
    ``all_reduce`` of the gathered size (world size x shard), each after a barrier; rank 0 writes them (ms)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    shard = torch.ones(_SHARD // 4)
    gathered, reduced = torch.empty(world * _SHARD // 4), torch.ones(world * _SHARD // 4)
    ms = {}
    for kind, fn in (("all_gather", lambda: dist.all_gather_into_tensor(gathered, shard)),
                     ("all_reduce", lambda: dist.all_reduce(reduced))):
        times = []
        for _ in range(7):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        ms[kind] = statistics.median(times)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(ms))
    dist.destroy_process_group()


_BULK = 100 * 2**20


def _receive(address: str) -> None:
    """Receive :data:`_BULK` bytes; print the rate in Gbit/s from the first byte to the last."""
    with socket.create_server((address, 5201)) as server:
        conn, _ = server.accept()
        got, t0 = 0, None
        while got < _BULK:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            t0 = t0 or time.perf_counter()
            got += len(chunk)
        print(got * 8 / (time.perf_counter() - t0) / 1e9)


def _send(address: str) -> None:
    with socket.create_connection((address, 5201)) as conn:
        buf = b"\0" * (1 << 20)
        for _ in range(_BULK // len(buf)):
            conn.sendall(buf)


@click.command(help=__doc__)
@click.argument("study", default="bench/llama-link.toml", type=click.Path(dir_okay=False))
@click.option("--rates", default=",".join(RATES), show_default=True, help="comma-separated link rates")
@click.option("--rounds", default=24, show_default=True, help="rounds of the independent re-measurement")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="write the runs here")
@click.option("--refit", type=click.Path(exists=True, dir_okay=False), help="report a saved --json run again")
@click.option("--check-link", "link_only", is_flag=True, help="measure each rate's TCP throughput and stop")
@click.option("--ranks-per-node", default=1, show_default=True, help="with --check-link: gloo ranks on each node")
@click.option("--profiles", "profile_count", default=0, help="check the what-if alone: record this many profiles on "
              "the unshaped link and predict FSDP2's default at each shaped rate from each (no tune)")
@click.option("--part", type=click.Choice(["send", "recv", "collectives"]), hidden=True)
@click.option("--address", hidden=True)
def main(study: str, rates: str, rounds: int, json_out: str | None, refit: str | None, link_only: bool,
         ranks_per_node: int, profile_count: int, part: str | None, address: str | None) -> None:
    chosen = [r.strip() for r in rates.split(",") if r.strip()]
    for r in chosen:
        rate_bits(r)
    if part:
        {"send": _send, "recv": _receive, "collectives": _collectives}[part](address)
        return
    if link_only:
        check_link(chosen, ranks_per_node)
        return
    if refit:
        saved = json.loads(Path(refit).read_text())
        if saved.get("what_if"):
            what_if_report(saved)
        else:
            report(saved)
        return
    if profile_count:
        with tempfile.TemporaryDirectory() as d:
            run = what_if_runs(study, [r for r in chosen if r != "none"], profile_count, rounds, Path(d))
        if json_out:
            Path(json_out).write_text(json.dumps(run, indent=1))
        what_if_report(run)
        return
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        for rate in chosen:
            print(f"=== {rate}: tune as two nodes, then a re-measurement in fresh processes", flush=True)
            runs[rate] = run_rate(study, rate, rounds, Path(d) / rate)
            print(runs[rate]["printed"], flush=True)
            if json_out:
                Path(json_out).write_text(json.dumps(runs, indent=1))
    report(runs)


if __name__ == "__main__":
    main()
