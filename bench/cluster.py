"""An emulated two-node cluster on one machine: two network namespaces joined by a veth pair, the link shaped by
``tc tbf``.

Each node is a network namespace with its own loopback and one end of the pair, named ``pp`` in both, with an
address of the cluster's own ``/30`` (used nowhere else: the namespaces see no other interface). ``tbf`` shapes each
end's egress to the rate, so each direction carries at most that many bits a second, as a node's NIC does. The
kernel here has no ``netem``, so the link adds no latency beyond the veth's own.

The ranks start as two nodes with ``torchrun --nnodes 2`` and the c10d rendezvous on node 0's address; gloo binds
to the pair (``GLOO_SOCKET_IFNAME=pp``). Everything the cluster made (namespaces, links, their processes) goes when
it closes, also after an error. Needs root and iproute2 (``ip``, ``tc``); without them :func:`unavailable` says why
in one line and :class:`Cluster` raises :class:`ClusterUnavailable`.

    with Cluster("1gbit") as cluster:
        cluster.torchrun(["-m", "jobs.cli", "tune", "study.toml"]).wait(timeout=600)
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The link rates the tests and the link sweep run at: ``tc``'s rate syntax, or ``none`` for an unshaped veth.
RATES = ("none", "4gbit", "1gbit")
_RATE_BITS = {"none": None, "4gbit": 4e9, "1gbit": 1e9}
INTERFACE = "pp"
RDZV_PORT = 29411
MTU = 9000  # jumbo frames, as cluster fabrics use
_SUBNET = "10.213.{}.{}"  # 10.213.N.1 and .2 on cluster N (private; only inside this cluster's namespaces)


class ClusterUnavailable(RuntimeError):
    """This machine cannot build the cluster (no root, no iproute2, namespaces refused); the message is one line."""


def unavailable() -> str | None:
    """Why this machine cannot build a cluster, in one line, or ``None`` if it can."""
    if sys.platform != "linux":
        return f"the emulated cluster needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces, tc); run as root or skip it"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the emulated cluster needs iproute2 ({', '.join(missing)} not found): apt-get install iproute2"
    return None


def rate_bits(rate: str) -> float | None:
    """A rate of :data:`RATES` in bits per second (``None``: unshaped).

    Raises:
        ValueError: not one of :data:`RATES`.
    """
    if rate not in _RATE_BITS:
        raise ValueError(f"link rate {rate!r} is not one of {', '.join(RATES)}")
    return _RATE_BITS[rate]


def tbf_burst_bytes(bits_per_s: float) -> int:
    """``tbf``'s bucket: 4 ms at the rate, and at least one 64 KiB GSO segment (the veth's largest send).

    With 1 ms TCP reached 88% of 1 Gbit/s (the bucket ran dry between timer ticks); with 4 ms and jumbo frames it
    reaches the rate (``python -m bench.link_sweep --check-link``). A larger bucket lets longer bursts pass faster
    than the rate.
    """
    return max(int(bits_per_s / 8 / 1000 * 4), 65536)


@dataclass(frozen=True)
class Node:
    """One node: a network namespace, its address on the pair."""

    namespace: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def pids(self) -> list[int]:
        """The processes in this node's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def kill(self) -> int:
        """SIGKILL every process of this node (a node lost mid-run); returns how many there were."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)


_clusters = itertools.count()


@dataclass
class Cluster:
    """Two nodes joined by a link shaped to ``rate`` (one of :data:`RATES`); a context manager.

    Raises:
        ClusterUnavailable: on ``__enter__``, the machine cannot build it (:func:`unavailable`), or ``ip`` refused.
        ValueError: ``rate`` is not one of :data:`RATES`.
    """

    rate: str = "none"
    nodes: tuple[Node, Node] = field(init=False)
    _made: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        rate_bits(self.rate)
        n = (os.getpid() + next(_clusters)) % 250 + 1
        tag = f"pp{os.getpid()}x{n}"
        self.nodes = (Node(f"{tag}-0", _SUBNET.format(n, 1)), Node(f"{tag}-1", _SUBNET.format(n, 2)))

    def __enter__(self) -> Cluster:
        reason = unavailable()
        if reason:
            raise ClusterUnavailable(reason)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ip(self, *args: str, namespace: str | None = None) -> None:
        argv = ["ip", *args] if namespace is None else ["ip", "-n", namespace, *args]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise ClusterUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip() or done.returncode}")

    def _build(self) -> None:
        ends = [f"{node.namespace[:-2][-11:]}{i}" for i, node in enumerate(self.nodes)]  # <= 15 characters
        for node in self.nodes:
            self._ip("netns", "add", node.namespace)
            self._made.append(node.namespace)
        self._ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        bits = rate_bits(self.rate)
        for node, end in zip(self.nodes, ends, strict=True):
            self._ip("link", "set", end, "netns", node.namespace)
            ns = node.namespace
            self._ip("link", "set", end, "name", INTERFACE, namespace=ns)
            self._ip("link", "set", INTERFACE, "mtu", str(MTU), namespace=ns)
            self._ip("addr", "add", f"{node.address}/30", "dev", INTERFACE, namespace=ns)
            self._ip("link", "set", INTERFACE, "up", namespace=ns)
            self._ip("link", "set", "lo", "up", namespace=ns)
            if bits is not None:
                self._tc(ns, bits)

    def _tc(self, namespace: str, bits: float) -> None:
        argv = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", INTERFACE, "root", "tbf",
                "rate", f"{int(bits)}bit", "burst", str(tbf_burst_bytes(bits)), "latency", "200ms"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise ClusterUnavailable(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")

    def close(self) -> None:
        """Kill the nodes' processes and delete the namespaces (the veth pair goes with them); idempotent."""
        for node in self.nodes:
            if node.namespace in self._made:
                node.kill()
        for namespace in self._made:
            for _ in range(50):  # a killed process may hold the namespace for a moment
                done = subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
                if done.returncode == 0 or namespace not in _namespaces():
                    break
                time.sleep(0.1)
        self._made.clear()

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The ranks' environment: this process's, one compute thread, gloo on the pair."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": INTERFACE, "PYTHONUNBUFFERED": "1",
               "TORCH_CPP_LOG_LEVEL": "ERROR"}  # c10d warns that a namespace's address has no hostname
        env.update(extra or {})
        return env

    def torchrun(self, args: Sequence[str], *, nproc_per_node: int = 1, env: dict[str, str] | None = None,
                 rdzv_id: str = "cluster", logs: Path | None = None, cwd: Path | None = None) -> Launch:
        """Start ``torchrun --nnodes 2 ... args`` on both nodes, c10d rendezvous on node 0.

        Node 0's agent hosts the rendezvous store (``is_host``: both namespaces share the machine's hostname, so
        torchrun's own test of it cannot tell them apart). ``args`` follow torchrun's options (``-m jobs.cli ...``).
        ``logs``: a folder for each node's output (``node0.log``, ``node1.log``: stdout and stderr); else inherited.
        ``env``: variables set over :meth:`env`'s.
        """
        procs = []
        for i, node in enumerate(self.nodes):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"{self.nodes[0].address}:{RDZV_PORT}", "--rdzv-id", rdzv_id,
                    "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", node.address, *args]
            out = open(logs / f"node{i}.log", "w") if logs else None  # noqa: SIM115 (the child holds it)
            procs.append(subprocess.Popen(node.command(argv), env=self.env(env), stdout=out, stderr=out, cwd=cwd,
                                          start_new_session=True))
            if out:
                out.close()
        return Launch(self, tuple(procs), logs)


@dataclass
class Launch:
    """The two nodes' torchrun processes of one :meth:`Cluster.torchrun`."""

    cluster: Cluster
    procs: tuple[subprocess.Popen, ...]
    logs: Path | None = None

    def wait(self, timeout: float) -> list[int]:
        """Each node's exit code; after ``timeout`` seconds in all, kills both nodes and raises TimeoutError."""
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                for node in self.cluster.nodes:
                    node.kill()
                for p in self.procs:
                    p.wait()
                raise TimeoutError(f"the cluster's ranks ran past {timeout:.0f} s and were killed:\n"
                                   f"{self.output()[-4000:]}") from None
        return codes

    def output(self, node: int | None = None) -> str:
        """What node ``node`` printed (``None``: both, node 0 first); empty without ``logs``."""
        if self.logs is None:
            return ""
        nodes = range(len(self.procs)) if node is None else [node]
        return "".join((self.logs / f"node{i}.log").read_text() for i in nodes)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}
