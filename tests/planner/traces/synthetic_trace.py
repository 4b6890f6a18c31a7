"""A small synthetic FSDP2 GPU trace to Kineto's schema, with every figure known by hand.

The model: a root (``""``, kept unsharded after forward, as FSDP2 does for the root) around ``layers.0`` and
``layers.1`` (resharded after forward). One step, FSDP2's default plan, the stream layout FSDP2 uses: compute
and copy-out on the default stream 7, all-gathers on stream 20, reduce-scatters on stream 21. The CPU thread
(tid 1) holds FSDP2's labels and the ``cudaLaunchKernel`` calls; each kernel shares its launch's correlation id.

Times are microseconds. :data:`EXPECTED` holds the figures a parser must find, in ms and bytes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

STREAM_COMPUTE, STREAM_ALL_GATHER, STREAM_REDUCE_SCATTER = 7, 20, 21
BASE_NS = 1_790_000_000_000_000_000  # the host clock at ts 0, as Kineto writes it

EXPECTED = {
    "pre_forward_order": ("", "layers.0", "layers.1"),
    "post_forward_order": ("layers.0", "layers.1", ""),
    # compute: GPU time of the kernels launched between labels, by the module on top of the stack
    "fwd_ms": {"": 0.25, "layers.0": 0.5, "layers.1": 0.4},
    "fwd_pre_ms": {"": 0.1, "layers.0": 0.5, "layers.1": 0.4},
    "bwd_ms": {"": 0.13, "layers.0": 0.9, "layers.1": 0.95},  # layers.1: its recompute 0.15, then 0.8
    "bwd_pre_ms": {"": 0.06, "layers.0": 0.9, "layers.1": 0.95},
    # layers.1 is checkpointed: a forward op in its backward stretch launched 0.15 ms of kernels, holding 2000 B
    "recompute_ms": {"layers.1": 0.15},
    "recompute_bytes": {"layers.1": 2000},
    # the most above each module's backward start, before its first nested module's: layers.1's recompute
    "backward_peak_bytes": {"": 0, "layers.1": 2000, "layers.0": 0},
    # what the root's backward after its nested modules leaves allocated: the embedding's gradient
    "root_backward_post_bytes": 3000,
    # the NCCL kernel plus the copy-out's kernel; both calls of a layer alike
    "all_gather_ms": {"": 0.22, "layers.0": 0.33, "layers.1": 0.33},
    "reduce_scatter_ms": {"": 0.1, "layers.0": 0.25, "layers.1": 0.25},
    "unsharded_bytes": {"": 8000, "layers.0": 16000, "layers.1": 16000},
    "reshard_after_forward": {"": False, "layers.0": True, "layers.1": True},
    "step_ms": 10.0,
    "optimizer_ms": 0.2,
    "peak_bytes": 1_020_000,
    "activation_bytes": {"": 0, "layers.0": 4000, "layers.1": 0},
}


class GpuTrace:
    """Builds one rank's trace (another rank's view: ``slower`` adds microseconds to named kernels; ``shifted``
    moves a named kernel's start and end by ``(start_us, end_us)``)."""

    def __init__(self, rank: int = 0, world_size: int = 2, slower: dict[str, float] | None = None,
                 shifted: dict[str, tuple[float, float]] | None = None):
        self.rank, self.world_size = rank, world_size
        self.slower = slower or {}
        self.shifted = shifted or {}
        self.events: list[dict[str, Any]] = []
        self.correlation = 0

    def label(self, name: str, start: float, end: float) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": start,
                            "dur": end - start, "args": {}})

    def kernel(self, name: str, launch: float, start: float, dur: float, stream: int = STREAM_COMPUTE,
               **args: Any) -> None:
        self.correlation += 1
        dur += self.slower.get(name, 0.0)
        early, late = self.shifted.get(name, (0.0, 0.0))
        start, dur = start + early, dur - early + late
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                            "ts": launch, "dur": 4, "args": {"correlation": self.correlation}})
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": start,
                            "dur": dur, "args": {"stream": stream, "device": 0, "correlation": self.correlation,
                                                 **args}})

    def op(self, name: str, start: float, end: float) -> None:
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": start,
                            "dur": end - start, "args": {}})

    def memory(self, ts: float, total: int) -> None:
        self.events.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": ts,
                            "s": "t", "args": {"Total Allocated": total, "Device Type": 1, "Bytes": 0}})

    def all_gather(self, fqn: str, start: float, launch: float, at: float, nelems: int, dur: float = 300) -> None:
        self.label(f"FSDP::all_gather ({fqn})" if fqn else "FSDP::all_gather", start, start + 60)
        self.kernel(f"ncclDevKernel_AllGather_RING_LL ({fqn})", launch, at, dur, STREAM_ALL_GATHER,
                    **{"In msg nelems": nelems // 2, "Out msg nelems": nelems, "dtype": "Float",
                       "Collective name": "allgather"})

    def copy_out(self, fqn: str, start: float, at: float) -> None:
        self.label(f"FSDP::all_gather_copy_out ({fqn})" if fqn else "FSDP::all_gather_copy_out", start, start + 10)
        self.kernel("void at::native::split_with_sizes_copy_out", start + 5, at, 20 if not fqn else 30)

    def reduce_scatter(self, fqn: str, start: float, at: float, nelems: int, dur: float) -> None:
        self.label(f"FSDP::post_backward_reduce ({fqn})" if fqn else "FSDP::post_backward_reduce", start, start + 80)
        self.kernel(f"ncclDevKernel_ReduceScatter_RING_LL_Sum_float ({fqn})", start + 30, at, dur,
                    STREAM_REDUCE_SCATTER, **{"In msg nelems": nelems, "Out msg nelems": nelems // 2,
                                              "dtype": "Float", "Collective name": "reduce_scatter"})

    def build(self) -> dict[str, Any]:
        """One step of FSDP2's default plan (see the module docstring)."""
        self.label("ProfilerStep#1", 0, 10_000)
        self.memory(-5, 1_000_000)
        # forward
        self.label("FSDP::root_pre_forward", 10, 20)
        self.label("FSDP::pre_forward", 20, 100)
        self.all_gather("", 30, 40, 50, 2000, dur=200)
        self.copy_out("", 90, 260)
        self.kernel("embedding", 150, 300, 100)  # root, before its first nested module
        self.label("FSDP::pre_forward (layers.0)", 200, 300)
        self.memory(205, 1_016_000)  # layers.0's all-gather output
        self.all_gather("layers.0", 210, 220, 400, 4000)
        self.copy_out("layers.0", 280, 700)
        self.kernel("layers.0 fwd", 350, 730, 500)
        self.memory(360, 1_020_000)  # its activations
        self.label("FSDP::post_forward (layers.0)", 400, 420)
        self.memory(410, 1_004_000)  # its all-gather output freed (reshard)
        self.label("FSDP::pre_forward (layers.1)", 420, 500)
        self.all_gather("layers.1", 430, 440, 1240, 4000)
        self.copy_out("layers.1", 490, 1540)
        self.kernel("layers.1 fwd", 550, 1570, 400)
        self.label("FSDP::post_forward (layers.1)", 600, 620)
        self.kernel("norm", 650, 1970, 100)  # root, after its nested modules
        self.label("FSDP::post_forward", 700, 710)
        self.kernel("loss", 750, 2070, 50)  # still the root's forward
        # backward
        self.label("FSDP::pre_backward", 800, 900)
        self.label("FSDP::backward_prefetch for layers.1", 800, 900)
        self.all_gather("layers.1", 810, 820, 2200, 4000)
        self.kernel("head bwd", 950, 2120, 60)  # root, before its first nested module
        self.label("FSDP::pre_backward (layers.1)", 1000, 1100)
        self.copy_out("layers.1", 1000, 2500)
        self.label("FSDP::backward_prefetch for layers.0", 1020, 1100)
        self.all_gather("layers.0", 1030, 1040, 2530, 4000)
        self.op("aten::linear", 1110, 1130)  # layers.1 recomputes its forward (activation checkpointing)
        self.kernel("layers.1 recompute", 1115, 2600, 150)
        self.memory(1120, 1_006_000)  # the recomputed activations
        self.kernel("layers.1 bwd", 1150, 2830, 800)
        self.memory(1195, 1_004_000)  # used by its gradient compute, freed
        self.label("FSDP::post_backward_accumulate (layers.1)", 1200, 1210)
        self.label("FSDP::post_backward_reshard (layers.1)", 1210, 1220)
        self.reduce_scatter("layers.1", 1220, 3630, 4000, 250)
        self.label("FSDP::pre_backward (layers.0)", 1300, 1320)
        self.copy_out("layers.0", 1305, 3640)
        self.kernel("layers.0 bwd", 1350, 3670, 900)
        self.label("FSDP::post_backward_accumulate (layers.0)", 1400, 1410)
        self.label("FSDP::post_backward_reshard (layers.0)", 1410, 1420)
        self.reduce_scatter("layers.0", 1420, 4570, 4000, 250)
        self.kernel("embedding bwd", 1550, 4580, 70)  # root, after its nested modules
        self.memory(1560, 1_007_000)  # the embedding's gradient
        self.label("FSDP::root_post_backward_callback", 1600, 1700)
        self.reduce_scatter("", 1610, 4820, 2000, 100)
        self.label("Optimizer.step#AdamW.step", 1700, 1900)
        self.kernel("adamw", 1750, 4920, 200)  # the optimizer: nobody's compute
        return {"schemaVersion": 1, "baseTimeNanoseconds": BASE_NS,
                "deviceProperties": [{"id": 0, "name": "NVIDIA H100"}],
                "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": self.world_size},
                "traceEvents": self.events}


def write_traces(directory: Path, gz: bool = False, ranks: int = 2) -> list[str]:
    """One trace per rank in ``directory``. Rank 1 runs its ``layers.0 fwd`` kernel 100 us longer; starts its
    all-gathers of ``layers.0`` 200 us early and waits for rank 0 (same end); and starts those of ``layers.1``
    200 us late, finding rank 0's data there, and ends 50 us before rank 0 (gloo does that): each of these
    collectives takes 100 us from the last start to the last end."""
    paths = []
    for rank in range(ranks):
        slower = {"layers.0 fwd": 100.0} if rank == 1 else {}
        shifted = {"ncclDevKernel_AllGather_RING_LL (layers.0)": (-200.0, 0.0),
                   "ncclDevKernel_AllGather_RING_LL (layers.1)": (200.0, -50.0)} if rank == 1 else {}
        doc = GpuTrace(rank, ranks, slower, shifted).build()
        path = directory / f"rank{rank}_trace.json{'.gz' if gz else ''}"
        data = json.dumps(doc).encode()
        path.write_bytes(gzip.compress(data) if gz else data)
        paths.append(str(path))
    return paths
