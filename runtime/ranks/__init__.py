"""Ranks: starting, running and stopping the processes of a job, and what they share.

:mod:`~runtime.ranks.launch` (``torch.distributed.run``), :mod:`~runtime.ranks.rank` (a rank's lifecycle),
:mod:`~runtime.ranks.allocator` (the CPU allocator the ranks run under), :mod:`~runtime.ranks.interrupts`
(Ctrl-C and SIGTERM), :mod:`~runtime.ranks.collectives` (the protocol's collectives) and
:mod:`~runtime.ranks.torch_private` (every private torch attribute, each with why).
"""
