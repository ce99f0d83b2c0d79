"""What to generate: one series = one shared noise (``seed``) rendered at several class mixes.

``SeriesSpec`` is CSM's 2-way series (docs/methods.md §1): K mixing ratios α of class a against class b.
``MixSpec`` is the k-way series (models/simplex.py): K weight vectors over k classes; the 2-way
spec is its case w = (α, 1 − α). Both turn into rows of (classes, weights) for the backends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeriesSpec:
    """One series: shared noise (from ``seed``) for every α; α is the weight of ``class_a``."""

    series_id: int
    class_a: int
    class_b: int
    alphas: tuple[float, ...]
    seed: int

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(classes int64 [K, 2], weights float32 [K, 2]) with w = (α, 1 − α), 1 − α in float32."""
        alpha = torch.tensor(self.alphas, dtype=torch.float32)
        classes = torch.tensor([self.class_a, self.class_b]).expand(len(alpha), 2)
        return classes, torch.stack([alpha, 1 - alpha], dim=1)


@dataclass(frozen=True)
class MixSpec:
    """One k-way series: shared noise (from ``seed``) for every weight vector of ``weights``;
    ``weights[j][i]`` is the weight of ``classes[i]`` at position j (rows sum to 1)."""

    series_id: int
    classes: tuple[int, ...]
    weights: tuple[tuple[float, ...], ...]
    seed: int

    @property
    def alphas(self) -> tuple[tuple[float, ...], ...]:  # the positions, as SeriesSpec names them
        return self.weights

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(classes int64 [K, k], weights float32 [K, k])."""
        weights = torch.tensor(self.weights, dtype=torch.float32).reshape(len(self.weights), -1)
        return torch.tensor(self.classes).expand(len(weights), len(self.classes)), weights


Spec = SeriesSpec | MixSpec
