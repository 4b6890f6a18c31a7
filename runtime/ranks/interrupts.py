"""Ctrl-C and SIGTERM on a rank: raised once, held back while rank 0 writes the study.

torchrun's agent forwards Ctrl-C to the ranks and follows with SIGTERM. A rank
under :func:`interrupts_raise` turns the first of them into
``KeyboardInterrupt("SIGINT"|"SIGTERM")`` and ignores the rest, so rank 0 can
record the round's trials FAIL without being interrupted again. Inside
:func:`interrupts_deferred` the first signal is held and raised on leaving
the block: a trial created RUNNING in the storage is always also known to the
stage that must fail it (``planner.study.MeasuredStage.fail_held``).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state: dict[str, Any] = {"deferred": 0, "pending": None}


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``KeyboardInterrupt(name)`` once; later ones are ignored.

    Main thread only (``signal.signal``). Restores the previous handlers on
    leaving.
    """
    def handler(signum: int, _frame: Any) -> None:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        name = signal.Signals(signum).name
        if _state["deferred"]:
            _state["pending"] = name
            return
        raise KeyboardInterrupt(name)

    previous = {sig: signal.signal(sig, handler) for sig in _SIGNALS}
    _state["pending"] = None
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a SIGINT/SIGTERM that arrives inside the block; raise it on leaving the outermost block.

    Raises:
        KeyboardInterrupt: on leaving, if a signal arrived inside (and the
            block itself raised nothing else).
    """
    _state["deferred"] += 1
    try:
        yield
    finally:
        _state["deferred"] -= 1
        if not _state["deferred"] and _state["pending"]:
            name, _state["pending"] = _state["pending"], None
            raise KeyboardInterrupt(name)
