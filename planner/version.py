"""The installed release's version, read from the package metadata (``pyproject.toml``'s ``version``, its one
source)."""

from __future__ import annotations

DISTRIBUTION = "prefetch-planner"


def version() -> str:
    """The installed ``prefetch-planner``'s version, e.g. ``"0.2.0"``.

    Raises:
        importlib.metadata.PackageNotFoundError: the package is imported from a source tree that was never
            installed (``pip install -e .`` installs it).
    """
    from importlib.metadata import version as distribution_version

    return distribution_version(DISTRIBUTION)
