"""What a study claims, named before its runs: the primary endpoints, the non-inferiority
margins and the relative goal. A study's protocol file names the same three (fields
`primary_endpoints`, `margins`, `relative_goal`); these constants are the values the study
uses where none is passed in, and every function that reads them takes an `Endpoints`.

Fixed before any run: changing one after seeing results invalidates every verdict built on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pipeline.study.protocol import PROTOCOL, RelativeGoal

# (when, metric, method, reference) of each primary endpoint, every other comparison
# exploratory; the non-inferiority margins of (method − reference) in the units of
# pipeline.study.stats.SCALE (ECE points, nats, AUROC points); the relative goal. All three are
# the committed protocol's (docs/protocol.toml). "ce+posthoc" is ce + the best post-hoc
# calibrator on val (pipeline.study.config POSTHOC): csm + TS must hold against the strongest
# calibration of the baseline, not only TS.
PRIMARY_ENDPOINTS: tuple[tuple[str, str, str, str], ...] = PROTOCOL.primary_endpoints
MARGINS: dict[str, float] = dict(PROTOCOL.margins)
RELATIVE_GOAL: RelativeGoal = PROTOCOL.relative_goal


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
