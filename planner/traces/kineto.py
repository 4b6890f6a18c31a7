"""A Kineto trace as ``torch.profiler`` writes it: one rank's events, typed, and what the file says of its world.

``torch.profiler.profile(...).export_chrome_trace`` and ``tensorboard_trace_handler`` write Kineto's
Chrome-trace JSON (optionally gzipped): an object with a ``traceEvents`` list of complete events (``"ph": "X"``,
``ts``/``dur`` in microseconds), instant events (``"ph": "i"``; ``[memory]`` ones with ``profile_memory=True``)
and metadata, plus ``distributedInfo`` (backend, rank, world size) and ``deviceProperties`` (the GPUs).

What is kept here (everything else in the file is ignored):

- CPU events (``cpu_op``, ``user_annotation``): name, thread, start, duration, and with ``record_shapes=True`` the
  input dims and types (an all-gather's output numel, a reduce-scatter's input numel, their dtype).
- GPU work (``kernel``, ``gpu_memcpy``, ``gpu_memset``): name, stream, start, duration, the ``correlation`` id that
  links it to the call that launched it (same id: ``cuda_runtime``, or ``cuda_driver`` for ``cuLaunchKernel``,
  which cuBLASLt uses for most of its matrix products), and NCCL's ``In msg nelems`` /
  ``Out msg nelems`` / ``dtype`` arguments.
- ``[memory]`` instant events: ``Total Allocated`` after each allocation or free, per device type.
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.artifacts.json_types import JsonObject
from planner.errors import TraceFormatError

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
CPU_CATEGORIES = frozenset({"cpu_op", "user_annotation"})
# Kineto's ``Input type`` strings (c10 scalar type names) and NCCL's ``dtype`` argument, to bytes per element.
DTYPE_BYTES = {"float": 4, "Float": 4, "double": 8, "Double": 8, "c10::Half": 2, "Half": 2, "c10::BFloat16": 2,
               "BFloat16": 2, "long int": 8, "Long": 8, "int": 4, "Int": 4, "signed char": 1, "unsigned char": 1,
               "Byte": 1, "Char": 1, "c10::Float8_e4m3fn": 1, "Float8_e4m3fn": 1}
NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")  # ncclKernel_AllReduce_RING_LL_Sum_float(...)
TORCH_DTYPE = {4: "torch.float32", 8: "torch.float64", 2: "torch.bfloat16", 1: "torch.uint8"}


@dataclass(frozen=True)
class TraceEvent:
    """One complete event (``"ph": "X"``), times in microseconds.

    Attributes:
        thread: the CPU thread id; for GPU work, ``None``.
        stream: the CUDA stream of GPU work; for CPU events, ``None``.
        correlation: GPU work and the ``cuda_runtime`` or ``cuda_driver`` call that launched it share it; ``None``
            elsewhere.
        input_dims: ``record_shapes``: each input's shape (``()`` for a non-tensor); ``()`` without shapes.
        input_types: the inputs' scalar type names, same order.
        nelems: NCCL kernels: (``In msg nelems``, ``Out msg nelems``); else ``None``.
        dtype: NCCL kernels' ``dtype`` argument; else ``None``.
    """

    name: str
    cat: str
    ts: float
    dur: float
    thread: int | str | None = None
    stream: int | None = None
    correlation: int | None = None
    input_dims: tuple[tuple[int, ...], ...] = ()
    input_types: tuple[str, ...] = ()
    nelems: tuple[int, int] | None = None
    dtype: str | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur

    def contains(self, t: float) -> bool:
        return self.ts <= t <= self.end


@dataclass(frozen=True)
class MemoryEvent:
    """A ``[memory]`` instant event: ``Total Allocated`` bytes on ``device`` right after it, at ``ts`` (us), and
    ``bytes``, the allocation (positive) or free (negative) it records (``Bytes``; 0 where the event has none)."""

    ts: float
    total_allocated: int
    device: str
    bytes: int = 0


@dataclass(frozen=True)
class KinetoTrace:
    """One rank's trace.

    Attributes:
        path: the file, as given.
        rank, world_size: from ``distributedInfo``; ``None`` when the file has none.
        backend: ``distributedInfo.backend`` (``"nccl"``, ``"gloo"``), or ``""``.
        device_type: ``"cuda"`` when the trace holds GPU work or ``deviceProperties``, else ``"cpu"``.
        cpu: CPU events, by start.
        gpu: GPU work (kernels, copies, memsets), by start.
        launches: the launching ``cuda_runtime`` or ``cuda_driver`` call's start time (us) by correlation id.
        memory: ``[memory]`` events, by time.
        base_us: ``baseTimeNanoseconds`` in us (0 when absent): ``ts + base_us`` is the host's clock, so events of
            ranks on one host, or on hosts with synchronised clocks, line up.
    """

    path: str
    rank: int | None
    world_size: int | None
    backend: str
    device_type: str
    cpu: tuple[TraceEvent, ...]
    gpu: tuple[TraceEvent, ...]
    launches: dict[int, float]
    memory: tuple[MemoryEvent, ...]
    base_us: float = 0.0

    @property
    def streams(self) -> tuple[int, ...]:
        """The CUDA streams that ran GPU work, sorted."""
        return tuple(sorted({e.stream for e in self.gpu if e.stream is not None}))

    def launched_in(self, window: TraceEvent) -> list[TraceEvent]:
        """The GPU work whose launch falls in ``window`` (a CPU event or span), by start."""
        return [k for k in self.gpu if k.correlation in self.launches and window.contains(self.launches[k.correlation])]

    def stream_clock(self, streams: set[int]) -> Callable[[float], float]:
        """``clock(t)``: when a CUDA event recorded at host time ``t`` (us) on ``streams`` completes, in us.

        That is the later of ``t`` and the end of the work launched on those streams before ``t``
        (``cudaEventRecord``: the event completes once the stream's earlier work has). Waits on other streams
        (``cudaStreamWaitEvent``) are not in a trace by default, so they are not in the clock.
        """
        work = sorted((self.launches[k.correlation], k.end) for k in self.gpu
                      if k.stream in streams and k.correlation in self.launches)
        times, ends = [w[0] for w in work], list(itertools.accumulate((w[1] for w in work), max))

        def clock(t: float) -> float:
            i = bisect.bisect_left(times, t)
            return max(t, ends[i - 1]) if i else t

        return clock

    def gpu_ms_launched_in(self, window: TraceEvent) -> float:
        """The GPU time (ms) of :meth:`launched_in`'s work."""
        return sum(k.dur for k in self.launched_in(window)) / 1e3

    def collectives(self) -> dict[str, int]:
        """NCCL kernels (GPU) or gloo work (CPU) by collective name (``AllReduce``, ``all_gather``), counted."""
        out: dict[str, int] = {}
        for e in self.gpu:
            m = NCCL_KERNEL.match(e.name)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + 1
        for e in self.cpu:
            if e.name.startswith("gloo:"):
                out[e.name[5:]] = out.get(e.name[5:], 0) + 1
        return out

    def summary(self) -> str:
        """What the trace holds, in a few words: device, world, GPU streams and kernels, collectives."""
        where = f"rank {self.rank} of {self.world_size}, {self.backend}" if self.rank is not None else "no rank info"
        parts = [f"{self.device_type}, {where}"]
        if self.gpu:
            parts.append(f"{len(self.gpu)} GPU events on streams {', '.join(map(str, self.streams))}")
        found = self.collectives()
        parts.append("collectives: " + (", ".join(f"{k} x{v}" for k, v in sorted(found.items())) or "none"))
        return "; ".join(parts)


def read_trace(path: str | Path) -> KinetoTrace:
    """Read one Kineto trace file (``.json`` or ``.json.gz``).

    Raises:
        TraceFormatError: the file cannot be read, is truncated, is not JSON, or is not a Kineto trace (no
            ``traceEvents`` list of events); the message names the file.
    """
    name = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise TraceFormatError(f"cannot read trace {name!r}: {e.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise TraceFormatError(f"trace {name!r} is a truncated or damaged gzip file ({e}); copy it again") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceFormatError(f"trace {name!r} is not JSON, or is truncated ({e}); export it again with "
                               "torch.profiler (export_chrome_trace or tensorboard_trace_handler)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceFormatError(f"{name!r} is not a Kineto trace: no 'traceEvents' list; give the JSON that "
                               "torch.profiler writes (export_chrome_trace or tensorboard_trace_handler)")
    return _parse(name, doc)


def _parse(name: str, doc: JsonObject) -> KinetoTrace:
    cpu, gpu, memory, launches = [], [], [], {}
    for e in doc["traceEvents"]:
        if not isinstance(e, dict):
            raise TraceFormatError(f"trace {name!r} has an event that is not an object: {str(e)[:60]!r}")
        ph, cat, args = e.get("ph"), e.get("cat", ""), e.get("args") or {}
        try:
            if ph == "X":
                ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
                if cat in CPU_CATEGORIES:
                    cpu.append(TraceEvent(str(e["name"]), cat, ts, dur, thread=e.get("tid"),
                                          input_dims=tuple(_shape(d) for d in args.get("Input Dims", ())),
                                          input_types=tuple(str(t) for t in args.get("Input type", ()))))
                elif cat in GPU_CATEGORIES:
                    nelems = None
                    if "In msg nelems" in args:
                        nelems = (int(args["In msg nelems"]), int(args.get("Out msg nelems", 0)))
                    gpu.append(TraceEvent(str(e["name"]), cat, ts, dur, stream=args.get("stream"),
                                          correlation=args.get("correlation"), nelems=nelems, dtype=args.get("dtype")))
                elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
                    launches[int(args["correlation"])] = ts
            elif ph == "i" and e.get("name") == "[memory]" and "Total Allocated" in args:
                device = "cuda" if args.get("Device Type") == 1 else "cpu"
                memory.append(MemoryEvent(float(e["ts"]), int(args["Total Allocated"]), device,
                                          int(args.get("Bytes", 0))))
        except (KeyError, TypeError, ValueError) as err:
            raise TraceFormatError(f"trace {name!r} has a malformed {cat or ph} event {str(e.get('name'))[:60]!r} "
                                   f"({type(err).__name__}: {err}); export it again with torch.profiler") from None
    info = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
    device_type = "cuda" if gpu or doc.get("deviceProperties") else "cpu"
    return KinetoTrace(
        path=name, rank=_int_or_none(info.get("rank")), world_size=_int_or_none(info.get("world_size")),
        backend=str(info.get("backend", "")), device_type=device_type,
        cpu=tuple(sorted(cpu, key=lambda e: (e.ts, -e.dur))), gpu=tuple(sorted(gpu, key=lambda e: e.ts)),
        launches=launches, memory=tuple(sorted(memory, key=lambda m: m.ts)),
        base_us=float(doc.get("baseTimeNanoseconds", 0) or 0) / 1e3,
    )


def _shape(dims: Any) -> tuple[int, ...]:
    """One input's shape; ``()`` for a scalar, or a list of tensors (a nested list)."""
    return tuple(int(x) for x in dims) if isinstance(dims, list) and all(isinstance(x, int) for x in dims) else ()


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | str) and str(value).lstrip("-").isdigit() else None


def trace_files(paths: list[str]) -> list[str]:
    """The trace files named: files as given; a directory gives its ``*.json`` and ``*.json.gz`` files (sorted).

    Raises:
        TraceFormatError: no path, a path that does not exist, or a directory with no trace file.
    """
    if not paths:
        raise TraceFormatError("no trace given; pass one Kineto trace per rank, or the directory that holds them")
    out = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found = sorted(str(f) for f in path.iterdir() if f.name.endswith((".json", ".json.gz")))
            if not found:
                raise TraceFormatError(f"directory {p!r} holds no trace (*.json or *.json.gz)")
            out.extend(found)
        elif not path.exists():
            raise TraceFormatError(f"cannot read trace {p!r}: No such file or directory")
        else:
            out.append(p)
    return out
