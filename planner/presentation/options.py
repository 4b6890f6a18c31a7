"""What every ``prefetch-planner`` command shares: ``-h``, the group that turns a :class:`PlannerError` into one line
and exit 2, and the what-if options of ``simulate`` and ``tune``."""

from __future__ import annotations

import sys

import click

from planner.errors import PlannerError

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}


class PlannerGroup(click.Group):
    """A click group that turns :class:`PlannerError` into ``error: ...`` and exit 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PlannerError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)



def what_if_options(command):
    """The :class:`planner.simulation.what_if.WhatIf` options, added to a click command (its function takes them
    as keyword arguments)."""
    options = [
        click.option("--target", help="Predict for this cluster: a preset's name (`presets` lists them, e.g. "
                                      "h100-ib400) or a target TOML (world size, ranks per node, backend, links)."),
        click.option("--world-size", type=int, help="With --target: the world size (replaces the target's)."),
        click.option("--mesh", help="With --target: HSDP's mesh, REPLICATExSHARD (e.g. 8x8; replaces the target's)."),
        click.option("--depth", type=int, help="Repeat the profile's blocks to this many (a profile of a slice of "
                                                "the model, extended to its full depth)."),
        click.option("--blocks", default="layers.*", show_default=True, help="With --depth: the blocks' FQN "
                                                                             "pattern, * for the block's index."),
    ]
    for option in reversed(options):
        command = option(command)
    return command

