"""Benchmark: the recorder's isolated backward, each module's unsharded gradients freed when its backward ends
(the recorder since 2026-11-25) against kept to the end of the pass (before), alternated in one process.

    python -m bench.isolated_backward [studies/llama-cpu.toml ...] [--rounds 6]

For each study, on its ranks: two FSDP2 default steps, then ``--rounds`` rounds of
:func:`runtime.recorder.compute_unsharded` (every module held unsharded at once, 3 repeats), once freeing and
once keeping, the order alternated from round to round. Each rank prints, per round, the backward summed over
its modules both ways and their ratio; then each module's median over rounds, forward and backward. The
recorder's reasoning is [Note: The isolated backward frees each module's gradients] in ``runtime/recorder.py``.
"""

from __future__ import annotations

import statistics

import click

from bench.ranks import run_studies, studies_argument

MODULE = "bench.isolated_backward"


def rank_main(study: str, rounds: int) -> None:
    """Every rank: alternate the two isolated passes and print its own figures."""
    import torch.distributed as dist

    import runtime.recorder as recorder
    from planner.artifacts.config import load_study_config
    from runtime.measure import device_type_of
    from runtime.rank import init_rank, shutdown_rank
    from runtime.torch_private import reshard_after_forward
    from runtime.workload import build_study_workload, fsdp_modules, train_step

    freeing = recorder.ComputeTimer

    class Keeping(freeing):  # the recorder before: nothing freed until the pass ends
        def __init__(self, modules, root, device="cpu", hooks_first=False, after_backward=None):
            super().__init__(modules, root, device, hooks_first, None)

    config = load_study_config(study)
    mesh = init_rank(config.launch.backend)
    workload = build_study_workload(config.workload, mesh)
    for s in range(2):
        train_step(workload, s)
    modules = fsdp_modules(workload.model)
    raf = {fqn: reshard_after_forward(m) for fqn, m in modules}
    device = device_type_of(workload)
    times: dict[str, list[dict]] = {"free": [], "keep": []}
    try:
        for r in range(rounds):
            for way in (("free", "keep") if r % 2 == 0 else ("keep", "free")):
                recorder.ComputeTimer = freeing if way == "free" else Keeping
                times[way].append(recorder.compute_unsharded(workload, 3, device, raf)["times"])
    finally:
        recorder.ComputeTimer = freeing
    rank = dist.get_rank()
    lines = []
    for r in range(rounds):
        free, keep = (sum(t["bwd_ms"] for t in times[w][r].values()) for w in ("free", "keep"))
        lines.append(f"rank {rank} round {r}: backward summed over modules, freed {free:.0f} ms, kept {keep:.0f} ms, "
                     f"ratio {free / keep:.3f}")
    for way, runs in times.items():
        for key in ("fwd_ms", "bwd_ms"):
            per = [statistics.median(t[fqn][key] for t in runs) for fqn, _ in modules]
            lines.append(f"rank {rank} {way} {key} per module (median of {rounds}): "
                         + " ".join(f"{v:.1f}" for v in per))
    print("\n".join(lines), flush=True)
    shutdown_rank()


@click.command()
@studies_argument
@click.option("--rounds", type=click.IntRange(min=1), default=6, show_default=True,
              help="rounds, each pass once, the order alternated")
def main(studies: tuple[str, ...], rounds: int) -> None:
    run_studies(MODULE, studies, lambda study: [study, "--rounds", str(rounds)], lambda study: rank_main(study, rounds))


if __name__ == "__main__":
    main()
