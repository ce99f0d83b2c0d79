"""What a study claims, named before its runs: the primary endpoints, the non-inferiority
margins and the relative goal. A study's protocol file names the same three (fields
`primary_endpoints`, `margins`, `relative_goal`); these constants are the values the study
uses where none is passed in, and every function that reads them takes an `Endpoints`.

Fixed before any run: changing one after seeing results invalidates every verdict built on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# (when, metric, method, reference) of each primary endpoint; every other comparison is
# exploratory. "ce+posthoc" is ce + the best post-hoc calibrator on val (pipeline.study.config
# POSTHOC): csm + TS must hold against the strongest calibration of the baseline, not only TS.
PRIMARY_ENDPOINTS: tuple[tuple[str, str, str, str], ...] = (
    ("before_ts", "ece", "csm", "ce"),
    ("after_ts", "ece", "csm", "ce"),
    ("after_ts", "debiased_ece", "csm", "ce"),
    ("after_ts", "nll", "csm", "ce"),
    ("after_ts", "ece", "csm", "ce+posthoc"),
    ("after_ts", "nll", "csm", "ce+posthoc"),
    ("before_ts", "ece", "csm3", "csm"),
)
# Non-inferiority margins of (method − reference), in the units of pipeline.study.stats.SCALE
# (ECE points, nats, AUROC points). auroc_shortfall's, one AUROC point, was fixed on 2026-11-26
# before any OOD interval was computed.
MARGINS: dict[str, float] = {
    "ece": 0.3,
    "debiased_ece": 0.3,
    "nll": 0.005,
    "auroc_shortfall": 1.0,
}


@dataclass(frozen=True)
class RelativeGoal:
    """ "method's metric at least `below` (a fraction) below reference's": met only where the
    whole relative interval ((method − reference) / reference's mean) lies below −below."""

    when: str
    metric: str
    method: str
    reference: str
    below: float

    def applies(self, when: str | None, metric: str, method: str, reference: str) -> bool:
        return (when, metric, method, reference) == (
            self.when,
            self.metric,
            self.method,
            self.reference,
        )

    def text(self) -> str:
        return f"{self.method}'s {self.metric} >= {100 * self.below:g} % below {self.reference}'s"


# the paper's claim: csm's ECE (before TS) at least 30 % below ce's
RELATIVE_GOAL = RelativeGoal("before_ts", "ece", "csm", "ce", 0.30)


@dataclass(frozen=True)
class Endpoints:
    """The three things a protocol fixes for the statistics."""

    primary_endpoints: tuple[tuple[str, str, str, str], ...] = PRIMARY_ENDPOINTS
    margins: Mapping[str, float] = field(default_factory=lambda: dict(MARGINS))
    relative_goal: RelativeGoal | None = RELATIVE_GOAL

    def is_primary(self, when: str | None, metric: str, method: str, reference: str) -> bool:
        return (when, metric, method, reference) in self.primary_endpoints

    def goal_for(
        self, when: str | None, metric: str, method: str, reference: str
    ) -> RelativeGoal | None:
        """The relative goal when it is this comparison's, else None."""
        goal = self.relative_goal
        return goal if goal is not None and goal.applies(when, metric, method, reference) else None


DEFAULT = Endpoints()
