"""The intervals of a study's paired comparisons (pipeline/study/stats.py), from the differences
it measured: each seed's difference on every test image, and the same on `n` resamples of the
test images. Three intervals, each carrying the seeds (and, for the csm family, the mixed sets)
as the units they are, the test images beside them:

- **t (primary)**: a t-interval on the top-level units' paired differences (mixed sets where
  the runs carry one, else seeds), widened by the test-image variance that every unit shares
  (which their spread cannot show). Primary because it stays honest with 5-10 units: its
  quantile pays for a variance estimated from a few of them (t₄ = 2.78 against the
  bootstrap's normal-like 1.96), and a bootstrap's variance of a mean of K resampled units is
  (K − 1)/K of the unbiased one.
- **percentile**: a hierarchical bootstrap, by hand: each resample draws the top-level units
  with replacement, then each drawn unit's seeds with replacement, and the test images once for
  every run (seeds and images are crossed: every run predicts the same images). scipy.stats
  .bootstrap resamples one level (`paired=True` draws one index for every sample), so only this
  layer is written here; on one level it is scipy's (tests/test_study_intervals.py).
- **BCa** of the same resamples, reported beside with its bias correction z0 flagged when
  |z0| > Z0_FLAG (the interval then runs between far-off quantiles of the resamples).

tests/test_study_intervals.py measures the coverage of each on constructed studies whose true
difference is known. A verdict names only what both the t and the percentile interval show.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
from scipy import stats

from pipeline.study.protocol import PROTOCOL

LEVEL = 0.95  # two-sided level of every interval (the "ci95" fields)
PRIMARY = "t"  # the interval "ci95" holds
SECOND = "percentile"  # the interval the verdict also reads
Z0_FLAG = 0.5  # |z0| above it: the BCa interval is flagged in the report
# The study's primary endpoints, named before the run in the protocol (docs/protocol.toml):
# (when, metric, method, reference). Every other comparison is exploratory.
PRIMARY_ENDPOINTS = PROTOCOL.primary_endpoints
_NORMAL = NormalDist()


def is_primary(when: str | None, metric: str, method: str, reference: str) -> bool:
    return (when, metric, method, reference) in PRIMARY_ENDPOINTS


def label(ci: Sequence[float], margin: float) -> str:
    """What the interval ci = [lo, hi] of method − reference shows, for a metric where lower
    is better (a higher-is-better quantity enters as its shortfall, e.g. 1 − AUROC), against a
    margin > 0 fixed before the run:

    - "better": hi < 0
    - "worse": lo > 0, or "worse, within the margin" when hi < margin too
    - "not worse": hi < margin (and lo <= 0)
    - "inconclusive": otherwise (the interval reaches both 0 and the margin)

    Symmetric: "better" and "worse" each need the whole interval on one side of 0; "not worse"
    (the non-inferiority claim, hi < margin) holds for "better" and "worse, within the margin".
    """
    lo, hi = ci
    if margin <= 0 or lo > hi:
        raise ValueError(f"a label needs margin > 0 and lo <= hi, got {margin}, [{lo}, {hi}]")
    if hi < 0:
        return "better"
    if lo > 0:
        return "worse, within the margin" if hi < margin else "worse"
    return "not worse" if hi < margin else "inconclusive"


def agreed(cis: Sequence[Sequence[float]], margin: float) -> str:
    """The verdict of several intervals: only what every one of them shows, i.e. the label of
    the smallest interval that contains them all. Where their labels agree, that label; where
    one says "better" and another "not worse", "not worse" (both show it); where they share no
    claim (e.g. "better" and "inconclusive", or "better" and "worse"), "inconclusive"."""
    return label([min(lo for lo, _ in cis), max(hi for _, hi in cis)], margin)


@dataclass(frozen=True)
class Units:
    """The top level of the resampling: "seed" (each seed its own unit) or "mixed_set" (the
    seeds trained on one mixed set form one unit); `groups`: the positions of each unit's
    seeds in the comparison's seed list."""

    level: str
    groups: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        return sum(len(g) for g in self.groups)


def units_of(
    seeds: Sequence[int],
    method: str,
    reference: str,
    mixed_sets: Mapping[str, Mapping[int, Hashable]] | None = None,
) -> Units:
    """The units of one comparison. Seed k's unit is the pair (method's mixed set at seed k,
    reference's mixed set at seed k): csm against ce groups csm's seeds by their mixed set; a
    seed with a mixed set on neither side is a unit of its own. `mixed_sets`: {method: {seed:
    mixed set}}, e.g. mixed_sets_of(records)."""
    mixed_sets = mixed_sets or {}
    keys = [
        (mixed_sets.get(method, {}).get(s), mixed_sets.get(reference, {}).get(s)) for s in seeds
    ]
    groups: dict[Hashable, list[int]] = {}
    for i, (s, key) in enumerate(zip(seeds, keys, strict=True)):
        groups.setdefault(("seed", s) if key == (None, None) else key, []).append(i)
    level = "seed" if all(k == (None, None) for k in keys) else "mixed_set"
    return Units(level, tuple(tuple(g) for g in groups.values()))


def mixed_sets_of(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, Hashable]]:
    """{method: {seed: mixed set}} of the records that carry a `mixed_set`."""
    out: dict[str, dict[int, Hashable]] = {}
    for r in records:
        if r.get("mixed_set") is not None:
            out.setdefault(r["method"], {})[r["seed"]] = r["mixed_set"]
    return out


def seed_weights(units: Units, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, seeds): how often each seed is drawn in each of `n` hierarchical resamples. A
    resample draws as many units as there are, with replacement; each drawn unit then draws as
    many of its seeds as it has, with replacement."""
    m = len(units.groups)
    drawn = rng.integers(0, m, (n, m))
    weights = np.zeros((n, units.size))
    for j, group in enumerate(units.groups):
        copies = (drawn == j).sum(axis=1)
        weights[:, group] = rng.multinomial(
            copies * len(group), np.full(len(group), 1 / len(group))
        )
    return weights


def t_interval(per_seed: np.ndarray, resampled: np.ndarray, units: Units) -> dict[str, Any]:
    """The t-interval of θ = the mean over seeds of their differences `per_seed`: θ ± h,

        h = sqrt(t² · unit_variance + z² · shared_image_variance)

    - unit_variance = M/(M − 1) Σ_j w_j² (ū_j − θ)², ū_j the mean difference of unit j's seeds,
      w_j their share of the seeds (= s²/K, the paired t-test's, when every seed is a unit): the
      variance of θ from the M units, their own test-image noise included; t its quantile at
      LEVEL with M − 1 degrees of freedom (scipy.stats.t);
    - shared_image_variance: the test-image variance common to every unit, which their spread
      around θ cannot show: the mean covariance between two units' differences over the
      `resampled` (n, seeds) test-image resamples (0 when negative); z its normal quantile, as
      thousands of images estimate it.

    Each variance at the quantile of its own estimate: never more degrees of freedom than the
    units give (a Satterthwaite df credits the image term with more, and undercovers with 3
    mixed sets: 0.915 in tests/test_study_intervals.py's simulation). Without the image term it
    is scipy.stats.ttest_rel's interval on the units. With one unit the seeds' variance is
    unknown: ci None.
    """
    estimate = float(per_seed.mean())
    m = len(units.groups)
    out: dict[str, Any] = {"ci": None, "df": m - 1, "units": m}
    if m < 2:
        return out | {"half_width": None, "unit_variance": None, "shared_image_variance": None}
    w = np.array([len(g) for g in units.groups]) / units.size
    means = np.array([per_seed[list(g)].mean() for g in units.groups])
    unit_var = float(m / (m - 1) * (w**2 * (means - estimate) ** 2).sum())
    by_unit = np.stack([resampled[:, list(g)].mean(axis=1) for g in units.groups], axis=1)
    cov = np.cov(by_unit, rowvar=False)
    shared = max(float((cov.sum() - np.trace(cov)) / (m * (m - 1))), 0.0)
    t, z = stats.t.ppf((1 + LEVEL) / 2, m - 1), stats.norm.ppf((1 + LEVEL) / 2)
    half = float(np.sqrt(t**2 * unit_var + z**2 * shared))
    return out | {
        "ci": [estimate - half, estimate + half],
        "half_width": half,
        "unit_variance": unit_var,
        "shared_image_variance": shared,
    }


def acceleration(per_seed: np.ndarray, units: Units, block_thetas: np.ndarray) -> float:
    """BCa's acceleration a = Σ e³ / (6 (Σ e²)^(3/2)) over the jackknife values e of both
    levels: e_g = (n − 1)/n (θ̄ − θ_(g)), θ_(g) the estimate without unit g (the mean over the
    other units' seeds) or without test-image block g (`block_thetas`, computed by the caller),
    n the level's count. The (n − 1)/n scales each level's values to its share of θ's variance
    and skewness; scipy.stats.bootstrap combines independent samples the same way (Efron &
    Tibshirani 1993, eq. 15.36). One level: Efron's a. 0 when no value differs."""
    levels = [np.asarray(block_thetas, dtype=float)]
    if len(units.groups) > 1:
        keep = np.ones((len(units.groups), units.size), dtype=bool)
        for j, group in enumerate(units.groups):
            keep[j, list(group)] = False
        levels.append(np.array([per_seed[k].mean() for k in keep]))
    e = np.concatenate([(len(t) - 1) / len(t) * (t.mean() - t) for t in levels if len(t) > 1])
    ss = float((e**2).sum())
    return float((e**3).sum() / (6.0 * ss**1.5)) if ss > 0 else 0.0


def bias_correction(thetas: np.ndarray, estimate: float) -> float:
    """BCa's z0 = Φ⁻¹(share of resamples below the estimate, ties counted half), the share
    clipped to [1/(2B), 1 − 1/(2B)] so that Φ⁻¹ stays finite."""
    b = len(thetas)
    share = (np.sum(thetas < estimate) + 0.5 * np.sum(thetas == estimate)) / b
    return _NORMAL.inv_cdf(min(max(share, 0.5 / b), 1.0 - 0.5 / b))


def bca(thetas: np.ndarray, z0: float, a: float) -> list[float]:
    """BCa interval (Efron 1987; Efron & Tibshirani 1993, eq. 14.10): the quantiles
    α_j = Φ(z0 + (z0 + z_j) / (1 − a (z0 + z_j))) of the resamples, z_j = Φ⁻¹((1 ∓ LEVEL)/2)."""
    z = [_NORMAL.inv_cdf((1.0 - LEVEL) / 2), _NORMAL.inv_cdf((1.0 + LEVEL) / 2)]
    alphas = [_NORMAL.cdf(z0 + (z0 + zj) / (1.0 - a * (z0 + zj))) for zj in z]
    return [float(q) for q in np.quantile(thetas, alphas)]


def percentile(thetas: np.ndarray) -> list[float]:
    return [float(q) for q in np.quantile(thetas, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])]


def hierarchical_thetas(
    resampled: np.ndarray, units: Units, rng: np.random.Generator
) -> np.ndarray:
    """θ* of each resample: the mean of its test-image resample's per-seed differences
    (`resampled`, (n, seeds)) over the seeds it draws (seed_weights), each as often as drawn."""
    weights = seed_weights(units, len(resampled), rng)
    return (weights * resampled).sum(axis=1) / weights.sum(axis=1)


def intervals(
    per_seed: np.ndarray,
    resampled: np.ndarray,
    units: Units,
    block_thetas: np.ndarray,
    margin: float,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Every interval of θ = mean(per_seed), their labels and the verdict (JSON-serialisable).

    `per_seed`: each seed's difference on every test image; `resampled` (n, seeds): the same on
    n test-image resamples (one draw of images for every seed); `block_thetas`: θ without each
    test-image block (the jackknife of BCa's acceleration). The verdict reads PRIMARY and
    SECOND (agreed); with one unit there is no t-interval, "ci95" holds the percentile one and
    the verdict is "inconclusive"."""
    estimate = float(per_seed.mean())
    thetas = hierarchical_thetas(resampled, units, rng)
    z0 = bias_correction(thetas, estimate)
    a = acceleration(per_seed, units, block_thetas)
    t = t_interval(per_seed, resampled, units)
    cis = {"t": t.pop("ci"), "percentile": percentile(thetas), "bca": bca(thetas, z0, a)}
    labels = {k: "inconclusive" if ci is None else label(ci, margin) for k, ci in cis.items()}
    both = [cis[PRIMARY], cis[SECOND]]
    primary = PRIMARY if cis[PRIMARY] is not None else SECOND
    return {
        "units": {"level": units.level, "groups": [list(g) for g in units.groups]},
        "ci95_t": cis["t"],
        "t": t,
        "ci95_percentile": cis["percentile"],
        "ci95_bca": cis["bca"],
        "bca": {
            "z0": z0,
            "acceleration": a,
            "blocks": len(block_thetas),
            "z0_flagged": abs(z0) > Z0_FLAG,
        },
        "interval": primary,
        "ci95": cis[primary],
        "labels": labels,
        "verdict_from": [PRIMARY, SECOND],
        "verdict": "inconclusive" if None in both else agreed(both, margin),
        "margin": margin,
    }
