"""PREFETCH_PLANNER: what reads as off, as on, and what is refused with the accepted spellings."""

import pytest

from planner.errors import PlannerError, SwitchError
from planner.switch import off_line, switched_off


@pytest.mark.parametrize("value", ["off", "OFF", " Off ", "0", "false", "no"])
def test_these_turn_the_tuner_off(value):
    assert switched_off({"PREFETCH_PLANNER": value}) is True


@pytest.mark.parametrize("value", ["on", "1", "TRUE", "yes", ""])
def test_these_and_unset_leave_it_on(value):
    assert switched_off({"PREFETCH_PLANNER": value}) is False
    assert switched_off({}) is False


def test_anything_else_is_refused_with_the_accepted_spellings():
    with pytest.raises(SwitchError, match=r"PREFETCH_PLANNER='of' is neither on nor off; write PREFETCH_PLANNER=off "
                                          r"to turn the tuner off \(accepted: off, 0, false, no; on: on, 1, true, yes "
                                          r"or unset\)"):
        switched_off({"PREFETCH_PLANNER": "of"})
    assert issubclass(SwitchError, PlannerError)  # the CLI's exit 2, a named exception in the API


def test_the_line_names_the_ranks_only_where_some_were_off():
    assert "on rank(s)" not in off_line("AutoTuner")
    assert "PREFETCH_PLANNER=off on rank(s) 1, 3, so on every rank" in off_line("AutoTuner", [1, 3])
