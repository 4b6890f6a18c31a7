"""Ctrl-C on a rank: raised once, held back while rank 0 writes the study (``runtime.ranks.interrupts``)."""

from __future__ import annotations

import os
import signal

import pytest

from runtime.ranks.interrupts import interrupts_deferred, interrupts_raise


def test_signal_raises_once_then_is_ignored():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), interrupts_raise():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10**6):  # the handler runs at the next bytecode check
                pass
            pytest.fail("SIGTERM did not raise")
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGINT)  # the agent's follow-up signal while rank 0 cleans up
            for _ in range(10**5):
                pass
            raise
    assert {sig: signal.getsignal(sig) for sig in before} == before  # handlers restored


def test_deferred_block_finishes_before_the_signal_raises():
    done = []
    with pytest.raises(KeyboardInterrupt, match="SIGINT"), interrupts_raise():
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**5):
                pass
            with interrupts_deferred():  # nested: held until the outermost block ends
                done.append("inner")
            done.append("outer")
        done.append("after")  # not reached: the held signal raises on leaving the block
    assert done == ["inner", "outer"]


def test_deferred_block_without_a_signal_raises_nothing():
    with interrupts_raise(), interrupts_deferred():
        pass
