"""The switch that turns the tuner off without a code change: ``PREFETCH_PLANNER=off`` in the ranks' environment.

With it off, every entry point a training job calls leaves the model's plan as the user made it and logs one line:
``AutoTuner`` (and each adapter, which builds one) tunes, records and applies nothing, its ``step()`` adds nothing
to a step; ``apply_plan`` applies nothing; ``load_best_plan`` opens no storage and returns the plan that changes
nothing. The commands a user runs by hand (``tune``, ``profile``, ``simulate``, ``studies``) are not entry points of
a training job and ignore it.

[Note: The ranks agree on the switch]
A rank that tunes while another does not would hang: the tuning ranks wait in a collective the others never enter,
and ranks that apply different prefetch issue their all-gathers in different orders. ``torchrun`` hands every rank
of a node the same environment, but nodes are launched apart. ``AutoTuner`` gathers every rank's switch on its
control group before it does anything else, and turns off everywhere if any rank is off (the line names the ranks).
``apply_plan`` and ``load_best_plan`` take no collective (a user calls them where no group may be ready yet): set the
variable on every node, as the launcher sets any other.
"""

from __future__ import annotations

import os

from planner.errors import SwitchError

VARIABLE = "PREFETCH_PLANNER"
OFF = ("off", "0", "false", "no")
ON = ("on", "1", "true", "yes", "")


def switched_off(environ: dict[str, str] | None = None) -> bool:
    """Whether ``PREFETCH_PLANNER`` turns the tuner off in this process (``environ``: ``os.environ``).

    Case and surrounding blanks are ignored; unset or empty is on.

    Raises:
        SwitchError: any other value than those of :data:`OFF` and :data:`ON`.
    """
    value = (os.environ if environ is None else environ).get(VARIABLE, "").strip().lower()
    if value in OFF:
        return True
    if value in ON:
        return False
    raise SwitchError(f"{VARIABLE}={value!r} is neither on nor off; write {VARIABLE}=off to turn the tuner off "
                      f"(accepted: {', '.join(OFF)}; on: {', '.join(s for s in ON if s)} or unset)")


def off_line(entry: str, ranks: list[int] | None = None) -> str:
    """The one line an entry point logs when the switch is off; ``ranks``: the ranks whose environment turned it
    off, where not all of them did ([Note: The ranks agree on the switch])."""
    where = f" on rank(s) {', '.join(map(str, ranks))}, so on every rank" if ranks else ""
    return (f"{entry}: {VARIABLE}=off{where}: the model keeps the plan it has (nothing tuned, recorded or applied); "
            f"unset {VARIABLE} to tune")
