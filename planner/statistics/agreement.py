"""Whether a plan's re-measurement agrees with the ratio its confirmation claimed (``prefetch-planner verify``).

[Note: A claim checked against its re-measurement]
A plan's provenance carries its confirmation's total-time ratio ``c`` with a 95% interval; ``verify`` measures the
same plan against FSDP2's default again, in fresh processes started as a user's job starts, and gets ``v`` with its
own interval ([Note: Between-launch spread] in :mod:`planner.statistics.verdict`: both include the spread between
launches). The two are independent measurements of one total-time ratio, so on the log scale
``log v - log c`` is centred on 0 with variance ``se_v^2 + se_c^2``, each ``se`` read back from its interval
(``log(high / low) / (2 z)``, z the normal 97.5% quantile: the intervals' own Student-t quantiles make this a
slight over-estimate, so the test errs towards "agrees"). The claim *agrees* when the 95% interval of
``v / c`` contains 1; else the re-measurement is *above* (the plan gains less in the user's process than claimed) or
*below* it. A claim without an interval (a plan made before confirmations, FSDP2's default) is reported, not tested.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from planner.statistics.verdict import Confirmation

Z95 = 1.959963984540054  # the normal distribution's 97.5% quantile


class Agreement(enum.StrEnum):
    """How a re-measured ratio stands against the claimed one (:func:`compare_with_claim`)."""

    AGREES = "agrees with the claim"
    ABOVE = "above the claim: the plan gains less than claimed"
    BELOW = "below the claim: the plan gains more than claimed"
    NO_CLAIM = "no claim to check: the plan records no confirmed ratio"


@dataclass(frozen=True)
class ClaimCheck:
    """A re-measurement against a plan's claim.

    Attributes:
        verified: the re-measurement's ratio (plan / default total time) and its 95% interval.
        claimed: the claimed ratio, ``None`` where the plan records none.
        claimed_ci95: its 95% interval.
        ratio_of_ratios: ``verified / claimed`` and its 95% interval (``None`` without a claim).
        agreement: :class:`Agreement`.
    """

    verified: float
    verified_ci95: tuple[float, float]
    claimed: float | None
    claimed_ci95: tuple[float, float] | None
    ratio_of_ratios: tuple[float, float, float] | None
    agreement: Agreement

    @property
    def difference(self) -> float | None:
        """``verified - claimed``, in ratio points (0.05: the plan's step is 5 points of the default's slower than
        claimed); ``None`` without a claim."""
        return None if self.claimed is None else self.verified - self.claimed

    def line(self) -> str:
        """``verified 0.812 against the claimed 0.759 (+0.053; verified / claimed 1.070 [0.970, 1.180]): agrees ...``"""
        if self.claimed is None or self.ratio_of_ratios is None:
            return f"verified {self.verified:.3f}: {self.agreement}"
        r, low, high = self.ratio_of_ratios
        return (f"verified {self.verified:.3f} against the claimed {self.claimed:.3f} ({self.difference:+.3f}; "
                f"verified / claimed {r:.3f}, 95% CI [{low:.3f}, {high:.3f}]): {self.agreement}")


def _log_se(ci95: tuple[float, float]) -> float:
    low, high = ci95
    return math.log(high / low) / (2 * Z95)


def compare_with_claim(verified: Confirmation, claimed: float | None,
                       claimed_ci95: tuple[float, float] | None) -> ClaimCheck:
    """The re-measurement ``verified`` against the claimed ratio ([Note: A claim checked against its
    re-measurement]).

    Args:
        verified: the re-measurement's confirmation (``confirm_launches`` of its launches).
        claimed: the plan's recorded ratio (``Provenance.measured_ratio``); ``None``: none.
        claimed_ci95: its 95% interval (``Provenance.ratio_ci95``); ``None``: none.

    Raises:
        ValueError: an interval that is not ``0 < low <= high``.
    """
    for ci in (verified.ci95, claimed_ci95):
        if ci is not None and not 0 < ci[0] <= ci[1]:
            raise ValueError(f"a ratio's 95% interval must be 0 < low <= high, found {ci}")
    if claimed is None or claimed_ci95 is None:
        return ClaimCheck(verified.ratio, verified.ci95, claimed, claimed_ci95, None, Agreement.NO_CLAIM)
    d = math.log(verified.ratio / claimed)
    se = math.hypot(_log_se(verified.ci95), _log_se(claimed_ci95))
    low, high = math.exp(d - Z95 * se), math.exp(d + Z95 * se)
    agreement = Agreement.AGREES if low <= 1.0 <= high else Agreement.ABOVE if low > 1.0 else Agreement.BELOW
    return ClaimCheck(verified.ratio, verified.ci95, claimed, claimed_ci95, (math.exp(d), low, high), agreement)
