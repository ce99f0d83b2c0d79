"""generate, part 1: the plan, which series exist (docs/methods.md §1), a pure function of the config.

Every unordered pair a < b (k-way: every k-subset), walked in order and cycled until the budget
(``series_per_pair`` per pair) is used: series s takes pair s mod P, its noise seed is
derive_seed(seed, "series", s) and its K images have α_k = k/(K−1) (k-way: the points of the
simplex lattice w = n/m, models/simplex.py). Shards hold whole series, in id order. So ids, seeds,
shards and bytes never depend on the number of processes, the batch size or the resume point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from core.runtime import derive_seed, make_generator
from models.generators import MixSpec, SeriesSpec
from models.simplex import ClassTuples, class_tuples, lattice_weights
from stages.configs.generate import Config

MAX_SHARD_IMAGES = 1000  # auto shard size: small enough to resume and to spread over GPUs


class GenerationError(ValueError):
    """Series that cannot be generated cleanly (non-finite or blank images), or a missing model."""


@dataclass(frozen=True)
class Plan:
    """Which series exist, with which classes, noise and shard (a pure function of the config).

    ``pairs`` are the class tuples in walk order (pairs for k = 2), numbered rather than listed
    (models.simplex.ClassTuples: 1,000 classes cost nothing); ``alphas`` the positions of a
    series: α of class a for k = 2, the weight vector w (length k) of the lattice point for k ≥ 3.
    Everything else is arithmetic on the series id: series s is pass s // P over tuple s mod P,
    in shard s // series_per_shard.
    """

    pairs: ClassTuples
    alphas: tuple[float, ...] | tuple[tuple[float, ...], ...]
    num_series: int
    series_per_shard: int
    seed: int

    @property
    def k(self) -> int:
        return self.pairs.k

    @property
    def num_shards(self) -> int:
        return math.ceil(self.num_series / self.series_per_shard)

    def shard_series(self, shard: int) -> range:
        start = shard * self.series_per_shard
        return range(start, min(start + self.series_per_shard, self.num_series))

    def spec(self, series: int) -> SeriesSpec | MixSpec:
        """Series s: tuple s mod P (the walk cycles over the tuples), its own noise seed."""
        classes = self.pairs[series % len(self.pairs)]
        seed = derive_seed(self.seed, "series", series)
        if self.k == 2:
            return SeriesSpec(series, *classes, self.alphas, seed)
        return MixSpec(series, classes, self.alphas, seed)


def make_plan(cfg: Config, num_classes: int) -> Plan:
    k, what = (
        cfg.mixing.mix_classes,
        "pairs" if cfg.mixing.mix_classes == 2 else f"{cfg.mixing.mix_classes}-tuples",
    )
    every = class_tuples(num_classes, k)  # k = 2: every a < b in order
    if not every:
        raise GenerationError(f"{num_classes} class(es): series need at least {k} classes")
    if cfg.subset > len(every):
        raise GenerationError(
            f"{'mixing.pairs' if cfg.mixing.pairs else 'mixing.tuples'}={cfg.subset}: only {len(every)} {what} among "
            f"{num_classes} classes (0 = all)"
        )
    pairs = every
    if cfg.subset:  # a seeded subset, kept in walk order (the draw costs 8 bytes per tuple)
        pick = torch.randperm(len(every), generator=make_generator(cfg.seed, "pairs"))
        pairs = ClassTuples(num_classes, k, ranks=sorted(pick[: cfg.subset].tolist()))
    n = cfg.budget_per_tuple * len(pairs)
    if cfg.mixing.limit:
        n = min(n, cfg.mixing.limit)
    m = cfg.lattice_m
    # k = 2: α_j = j/(K−1), the 2-way grid; k >= 3: every point of the simplex lattice
    alphas = tuple(i / m for i in range(m + 1)) if k == 2 else lattice_weights(k, m)
    per_shard = cfg.shards.series_per_shard or max(
        1, min(math.ceil(n / cfg.shards.min_shards), MAX_SHARD_IMAGES // len(alphas))
    )
    return Plan(pairs, alphas, n, per_shard, cfg.seed)
