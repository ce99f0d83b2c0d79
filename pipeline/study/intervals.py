"""The intervals of a study's paired comparisons (pipeline/study/stats.py), from the differences
it measured: each seed's difference on every test image, and the same on `n` resamples of the
test images. Three intervals, each carrying the generator's fits, the mixed sets within them
and the seeds within those as the units they are, the test images beside them:

- **t (primary)**: a t-interval on the top-level units' paired differences (the fits where the
  runs come from more than one generator fit, else the mixed sets where the runs carry one,
  else the seeds), widened by the test-image variance that every unit shares (which their
  spread cannot show). Its degrees of freedom are the top units' count − 1: the fits are the
  independent draws a user repeats when fitting their own generator, and the sets and seeds
  within one fit share its draw, so they add no independent information about it. Primary
  because it stays honest with few units: its quantile pays for a variance estimated from a
  few of them (t₂ = 4.30 with 3 fits, against the bootstrap's normal-like 1.96), and a
  bootstrap's variance of a mean of K resampled units is (K − 1)/K of the unbiased one.
- **percentile**: a hierarchical bootstrap, by hand: each resample draws the top-level units
  with replacement, then each drawn fit's mixed sets with replacement, then each drawn set's
  seeds with replacement, and the test images once for every run (seeds and images are
  crossed: every run predicts the same images). scipy.stats.bootstrap resamples one level
  (`paired=True` draws one index for every sample), so only this layer is written here; on one
  level it is scipy's (tests/test_study_intervals.py).
- **BCa** of the same resamples, reported beside with its bias correction z0 flagged when
  |z0| > Z0_FLAG (the interval then runs between far-off quantiles of the resamples).

Beside the difference: the **relative** effect (method − reference) / reference's mean with its
own t (delta method, the same units and degrees of freedom) and percentile interval (the ratio on
the same resamples), and the relative goal (pipeline/study/endpoints.py) met only where both lie
below it; and **leave-one-unit-out** verdicts: each top unit dropped in turn (each seed where
there is one top unit), the intervals and verdict recomputed, a verdict that flips "fragile".

tests/test_study_intervals.py measures the coverage of each on constructed studies whose true
difference is known. A verdict names only what both the t and the percentile interval show.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np
from scipy import stats

from pipeline.study.endpoints import DEFAULT
from pipeline.study.endpoints import PRIMARY_ENDPOINTS as PRIMARY_ENDPOINTS  # the report's

LEVEL = 0.95  # two-sided level of every interval (the "ci95" fields)
PRIMARY = "t"  # the interval "ci95" holds
SECOND = "percentile"  # the interval the verdict also reads
Z0_FLAG = 0.5  # |z0| above it: the BCa interval is flagged in the report
_NORMAL = NormalDist()


def is_primary(when: str | None, metric: str, method: str, reference: str) -> bool:
    return DEFAULT.is_primary(when, metric, method, reference)


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


class MixedSet(NamedTuple):
    """The mixed set a run trained on: the generator fit it was drawn from, and its index among
    that fit's sets (records without a `fit` are fit 0)."""

    fit: Hashable
    index: Hashable


@dataclass(frozen=True)
class Units:
    """The levels of the resampling. `level`: what the top units are, "fit" (the seeds whose
    runs trace back to one generator fit), "mixed_set" (the seeds trained on one mixed set) or
    "seed" (each seed its own unit); `groups`: the positions of each top unit's seeds in the
    comparison's seed list; `sets`: with level "fit", each fit's mixed sets (their seeds'
    positions), the middle level ((): each top unit is one set). `names` name the top units and
    `seeds` the positions, for the report (leave-one-out)."""

    level: str
    groups: tuple[tuple[int, ...], ...]
    sets: tuple[tuple[tuple[int, ...], ...], ...] = ()
    names: tuple[str, ...] = field(default=(), compare=False)
    seeds: tuple[Hashable, ...] = field(default=(), compare=False)

    @property
    def size(self) -> int:
        return sum(len(g) for g in self.groups)

    def sets_of(self, j: int) -> tuple[tuple[int, ...], ...]:
        """The mixed sets (seed positions) of top unit j."""
        return self.sets[j] if self.sets else (self.groups[j],)

    def name(self, j: int) -> str:
        return self.names[j] if self.names else f"unit {j}"

    def seed_name(self, i: int) -> str:
        return f"seed {self.seeds[i]}" if self.seeds else f"seed position {i}"

    def without(self, dropped: Sequence[int]) -> Units:
        """These units without the seeds at positions `dropped` (positions renumbered; a set
        or top unit left without seeds is gone)."""
        gone = set(dropped)
        new = {old: i for i, old in enumerate(k for k in range(self.size) if k not in gone)}

        def keep(group: Sequence[int]) -> tuple[int, ...]:
            return tuple(new[k] for k in group if k in new)

        kept = [j for j, g in enumerate(self.groups) if keep(g)]
        sets = (
            tuple(tuple(s for s in (keep(s) for s in self.sets[j]) if s) for j in kept)
            if self.sets
            else ()
        )
        return Units(
            self.level,
            tuple(keep(self.groups[j]) for j in kept),
            sets,
            tuple(self.names[j] for j in kept) if self.names else (),
            tuple(s for k, s in enumerate(self.seeds) if k not in gone) if self.seeds else (),
        )


def _mixed_set(value: Hashable | None) -> MixedSet | None:
    """A mixed_sets value as (fit, set): a bare set (no fit named) is one of fit 0's."""
    if value is None or isinstance(value, MixedSet):
        return value
    return MixedSet(0, value)


def units_of(
    seeds: Sequence[int],
    method: str,
    reference: str,
    mixed_sets: Mapping[str, Mapping[int, Hashable]] | None = None,
) -> Units:
    """The units of one comparison. Seed k's mixed set is the pair (method's mixed set at seed
    k, reference's at seed k), its fit the pair of their fits: csm against ce groups csm's seeds
    by their mixed set, and those by their fit; a seed with a mixed set on neither side is a
    unit of its own. The top level: the fits when the seeds come from more than one, else the
    mixed sets when any seed has one, else the seeds. `mixed_sets`: {method: {seed: mixed set}}
    (a MixedSet, or a bare set of fit 0), e.g. mixed_sets_of(records)."""
    mixed_sets = mixed_sets or {}
    fits: dict[Hashable, list[int]] = {}
    sets: dict[Hashable, list[int]] = {}
    for i, s in enumerate(seeds):
        m = _mixed_set(mixed_sets.get(method, {}).get(s))
        r = _mixed_set(mixed_sets.get(reference, {}).get(s))
        if m is None and r is None:
            fit_key = set_key = ("seed", s)
        else:
            fit_key = (m and m.fit, r and r.fit)
            set_key = (m, r)
        fits.setdefault(fit_key, []).append(i)
        sets.setdefault(set_key, []).append(i)
    mixed = [k for k in sets if k[0] != "seed"]
    if len([k for k in fits if k[0] != "seed"]) > 1:
        groups = [tuple(g) for g in fits.values()]
        inside = tuple(tuple(tuple(g) for g in sets.values() if g[0] in top) for top in groups)
        names = tuple(_fit_name(k, seeds) for k in fits)
        return Units("fit", tuple(groups), inside, names, tuple(seeds))
    level = "mixed_set" if mixed else "seed"
    names = tuple(_set_name(k, seeds) for k in sets)
    return Units(level, tuple(tuple(g) for g in sets.values()), (), names, tuple(seeds))


def _fit_name(key: Hashable, seeds: Sequence[int]) -> str:
    if key[0] == "seed":
        return f"seed {key[1]}"
    return "fit " + " / ".join(str(f) for f in dict.fromkeys(f for f in key if f is not None))


def _set_name(key: Hashable, seeds: Sequence[int]) -> str:
    if key[0] == "seed":
        return f"seed {key[1]}"
    sides = list(dict.fromkeys(k for k in key if k is not None))
    return "mixed set " + " / ".join(
        str(k.index) if k.fit == 0 else f"{k.fit}:{k.index}" for k in sides
    )


def mixed_sets_of(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, MixedSet]]:
    """{method: {seed: MixedSet(fit, mixed set)}} of the records that carry a `mixed_set`; a
    record without a `fit` (or with fit None) is fit 0's."""
    out: dict[str, dict[int, MixedSet]] = {}
    for r in records:
        if r.get("mixed_set") is not None:
            fit = 0 if r.get("fit") is None else r["fit"]
            out.setdefault(r["method"], {})[r["seed"]] = MixedSet(fit, r["mixed_set"])
    return out


def seed_weights(units: Units, n: int, rng: np.random.Generator) -> np.ndarray:
    """(n, seeds): how often each seed is drawn in each of `n` hierarchical resamples. A
    resample draws as many top units as there are, with replacement; each drawn fit then draws
    as many of its mixed sets as it has, with replacement (a top unit of one set draws nothing
    here: the same draws as a two-level study's); each drawn set as many of its seeds."""
    m = len(units.groups)
    drawn = rng.integers(0, m, (n, m))
    weights = np.zeros((n, units.size))
    for j in range(m):
        copies = (drawn == j).sum(axis=1)
        sets = units.sets_of(j)
        by_set = (
            [copies]
            if len(sets) == 1
            else list(rng.multinomial(copies * len(sets), np.full(len(sets), 1 / len(sets))).T)
        )
        for group, c in zip(sets, by_set, strict=True):
            weights[:, list(group)] = rng.multinomial(
                c * len(group), np.full(len(group), 1 / len(group))
            )
    return weights


def t_interval(per_seed: np.ndarray, resampled: np.ndarray, units: Units) -> dict[str, Any]:
    """The t-interval of θ = the mean over seeds of their differences `per_seed`: θ ± h,

        h = sqrt(t² · unit_variance + z² · shared_image_variance)

    - unit_variance = M/(M − 1) Σ_j w_j² (ū_j − θ)², ū_j the mean difference of top unit j's
      seeds, w_j their share of the seeds (= s²/K, the paired t-test's, when every seed is a
      unit): the variance of θ from the M top units (fits, else mixed sets, else seeds), the
      variance of everything nested in them and their own test-image noise included; t its
      quantile at LEVEL with M − 1 degrees of freedom (scipy.stats.t);
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
    return _weighted(seed_weights(units, len(resampled), rng), resampled)


def _weighted(weights: np.ndarray, resampled: np.ndarray) -> np.ndarray:
    return (weights * resampled).sum(axis=1) / weights.sum(axis=1)


def relative(
    per_seed: np.ndarray,
    resampled: np.ndarray,
    ref_per_seed: np.ndarray,
    ref_resampled: np.ndarray,
    units: Units,
    weights: np.ndarray,
) -> dict[str, Any]:
    """The relative effect R = θ / B̄ (B̄ the reference's mean over the seeds) and its intervals,
    None where B̄ is 0:

    - t: the delta method on the same units, R ± h of t_interval on the linearised values
      z_k = (d_k − R b_k) / B̄ (their mean is 0; their spread over the units and their shared
      image variance are R's), the same degrees of freedom as the difference's;
    - percentile: θ* / B̄* on the difference's own resamples (`weights`: the same draws of units,
      sets and seeds, the same test images); None where some B̄* is 0."""
    base = float(ref_per_seed.mean())
    if base == 0:
        return {"relative": None, "ci95_t": None, "ci95_percentile": None}
    r = float(per_seed.mean()) / base
    z = (per_seed - r * ref_per_seed) / base
    z_resampled = (resampled - r * ref_resampled) / base
    t = t_interval(z, z_resampled, units)
    # a resample whose reference mean is 0 (a debiased ECE clipped at 0 on few images) has no
    # ratio: no percentile interval then, rather than one between infinite quantiles
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = _weighted(weights, resampled) / _weighted(weights, ref_resampled)
    return {
        "relative": r,
        "ci95_t": None if t["ci"] is None else [r + t["ci"][0], r + t["ci"][1]],
        "ci95_percentile": percentile(ratios) if np.isfinite(ratios).all() else None,
    }


def goal_met(rel: Mapping[str, Any], below: float) -> bool:
    """A relative goal "at least `below` (a fraction) below the reference": met only where the
    whole of both relative intervals (t and percentile) lies below −below; never without a t
    interval."""
    cis = [rel.get("ci95_t"), rel.get("ci95_percentile")]
    return all(ci is not None and ci[1] < -below for ci in cis)


def _core(
    per_seed: np.ndarray,
    resampled: np.ndarray,
    units: Units,
    margin: float,
    rng: np.random.Generator,
    reference: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The t and percentile intervals of θ, their verdict and the relative effect's: what the
    full comparison and each leave-one-out one share. Returns (them, the resamples' θ*, the
    seed weights of those resamples)."""
    weights = seed_weights(units, len(resampled), rng)
    thetas = _weighted(weights, resampled)
    t = t_interval(per_seed, resampled, units)
    cis = {"t": t["ci"], "percentile": percentile(thetas)}
    both = [cis[PRIMARY], cis[SECOND]]
    out = {
        "t": t,
        "cis": cis,
        "verdict": "inconclusive" if None in both else agreed(both, margin),
        "relative": None
        if reference is None
        else relative(per_seed, resampled, *reference, units, weights),
    }
    return out, thetas, weights


def leave_one_out(
    per_seed: np.ndarray,
    resampled: np.ndarray,
    units: Units,
    margin: float,
    rng: np.random.Generator,
    reference: tuple[np.ndarray, np.ndarray] | None = None,
    goal: float | None = None,
) -> list[dict[str, Any]]:
    """The comparison again without each top unit in turn (without each seed where there is
    one top unit): its t and percentile intervals and their verdict, its relative intervals and
    whether the relative goal (`goal`, a fraction) is met. Each draws fresh resamples of the
    units that stay, on the same test-image resamples."""
    if len(units.groups) > 1:
        drops = [(units.name(j), list(g)) for j, g in enumerate(units.groups)]
    elif units.size > 1:
        drops = [(units.seed_name(i), [i]) for i in range(units.size)]
    else:
        return []
    out = []
    for name, dropped in drops:
        keep = [k for k in range(units.size) if k not in dropped]
        ref = None if reference is None else (reference[0][keep], reference[1][:, keep])
        core, _, _ = _core(per_seed[keep], resampled[:, keep], units.without(dropped), margin,
                           rng, ref)  # fmt: skip
        row: dict[str, Any] = {
            "dropped": name,
            "difference": float(per_seed[keep].mean()),
            "ci95_t": core["cis"]["t"],
            "ci95_percentile": core["cis"]["percentile"],
            "verdict": core["verdict"],
        }
        if core["relative"] is not None:
            rel = core["relative"]
            row["relative"] = {k: rel[k] for k in ("relative", "ci95_t", "ci95_percentile")}
            if goal is not None:
                row["goal_met"] = goal_met(rel, goal)
        out.append(row)
    return out


def intervals(
    per_seed: np.ndarray,
    resampled: np.ndarray,
    units: Units,
    block_thetas: np.ndarray,
    margin: float,
    rng: np.random.Generator,
    reference: tuple[np.ndarray, np.ndarray] | None = None,
    goal: float | None = None,
) -> dict[str, Any]:
    """Every interval of θ = mean(per_seed), their labels and the verdict (JSON-serialisable).

    `per_seed`: each seed's difference on every test image; `resampled` (n, seeds): the same on
    n test-image resamples (one draw of images for every seed); `block_thetas`: θ without each
    test-image block (the jackknife of BCa's acceleration). The verdict reads PRIMARY and
    SECOND (agreed); with one unit there is no t-interval, "ci95" holds the percentile one and
    the verdict is "inconclusive". `reference` (the reference's metric per seed, and on the
    same resamples): adds the relative effect with its intervals ("relative_ci95_t",
    "relative_ci95_percentile", "relative_ci95"); `goal` (a fraction, with `reference`): the
    relative goal "at least goal below", met only where both relative intervals lie below −goal.
    Always: "leave_one_out" (leave_one_out's rows) and "fragile" (a row's verdict differs from
    the full verdict), with `goal` "goal_fragile" (a row's goal_met differs)."""
    estimate = float(per_seed.mean())
    core, thetas, _ = _core(per_seed, resampled, units, margin, rng, reference)
    z0 = bias_correction(thetas, estimate)
    a = acceleration(per_seed, units, block_thetas)
    t = dict(core["t"])
    cis = {**core["cis"], "bca": bca(thetas, z0, a)}
    t.pop("ci")
    labels = {k: "inconclusive" if ci is None else label(ci, margin) for k, ci in cis.items()}
    primary = PRIMARY if cis[PRIMARY] is not None else SECOND
    out: dict[str, Any] = {
        "units": _units_json(units),
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
        "verdict": core["verdict"],
        "margin": margin,
    }
    if (rel := core["relative"]) is not None:
        out["relative_ci95_t"] = rel["ci95_t"]
        out["relative_ci95_percentile"] = rel["ci95_percentile"]
        out["relative_ci95"] = rel["ci95_t"] if primary == PRIMARY else rel["ci95_percentile"]
        if goal is not None:
            out["relative_goal"] = {"below": goal, "met": goal_met(rel, goal)}
    loo = leave_one_out(per_seed, resampled, units, margin, rng, reference, goal)
    out["leave_one_out"] = loo
    out["fragile"] = any(row["verdict"] != out["verdict"] for row in loo)
    if "relative_goal" in out:
        met = out["relative_goal"]["met"]
        out["relative_goal"]["fragile"] = any(row.get("goal_met") != met for row in loo)
    return out


def _units_json(units: Units) -> dict[str, Any]:
    """The units as study.json holds them (seed positions; paired_difference maps them to seeds)."""
    out: dict[str, Any] = {"level": units.level, "groups": [list(g) for g in units.groups]}
    if units.sets:
        out["sets"] = [[list(s) for s in sets] for sets in units.sets]
    return out
