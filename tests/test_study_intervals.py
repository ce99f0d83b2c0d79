"""The study's intervals (pipeline/study/intervals.py) on constructed studies whose true
difference is known: their coverage with 5 and 10 seeds (and 3 mixed sets), the labels and the
verdict two intervals agree on, the z0 flag, and the hierarchical layer against scipy.stats on
the cases where both resample one level."""

import dataclasses
import functools
import json
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from pipeline.study.intervals import (
    PRIMARY_ENDPOINTS,
    Units,
    acceleration,
    agreed,
    bca,
    bias_correction,
    hierarchical_thetas,
    intervals,
    label,
    mixed_sets_of,
    seed_weights,
    t_interval,
    units_of,
)
from pipeline.study.stats import Predictions, compare, paired_difference

IMAGES = 100
# A study's per-image differences of a mean metric (NLL-like) between method and reference:
# TRUTH + mixed-set effect + seed effect + image effect (shared by every seed) + seed x image.
# Image effects have sd 1, so one seed's difference has image variance 2/IMAGES; the seed
# effect's variance is 4x that, the mixed set's too.
TRUTH = 0.1
SEED_SD = MIXED_SD = float(np.sqrt(4 * 2 / IMAGES))


def _study(g, seeds, mixed_sets=0, resamples=400):
    """One simulated study: its per-seed differences and their intervals (the study's code from
    the per-seed differences on)."""
    effect = g.normal(0, SEED_SD, seeds)
    mixed = None
    if mixed_sets:
        of = np.arange(seeds) % mixed_sets  # seed k trains on mixed set k mod M
        effect += g.normal(0, MIXED_SD, mixed_sets)[of]
        mixed = {"csm": {s: f"m{of[s]}" for s in range(seeds)}}
    x = TRUTH + effect[:, None] + g.normal(size=IMAGES) + g.normal(size=(seeds, IMAGES))
    resampled = x[:, g.integers(0, IMAGES, (resamples, IMAGES))].mean(axis=2).T
    by_image = x.mean(axis=0)
    block_thetas = (by_image.sum() - by_image) / (IMAGES - 1)  # 100 blocks: one image each
    units = units_of(list(range(seeds)), "csm", "ce", mixed)
    per_seed = x.mean(axis=1)
    return per_seed, intervals(per_seed, resampled, units, block_thetas, 0.3, g)


def _alternatives(per_seed, r):
    """Two intervals the study does not use: the paired t-test on the seeds alone (no shared
    image variance), and the t with Satterthwaite's df for the sum of the two variances."""
    ttest = stats.ttest_rel(per_seed, np.zeros(len(per_seed))).confidence_interval(0.95)
    t = r["t"]
    se2 = t["unit_variance"] + t["shared_image_variance"]
    df = se2**2 / (t["unit_variance"] ** 2 / t["df"])
    satt = stats.t.interval(0.95, df, per_seed.mean(), np.sqrt(se2))
    return {"seeds alone": (ttest.low, ttest.high), "satterthwaite": satt}


@functools.cache  # a pure function of its arguments (its RNG is seeded from them): the tests
# below ask for (10, 0) and (10, 3) twice, and the simulated studies are most of their time
def _coverage(seeds, mixed_sets=0, studies=400):
    """The share of simulated studies whose interval covers TRUTH, by interval (read-only:
    cached)."""
    g = np.random.default_rng(1000 * seeds + mixed_sets)
    hits = dict.fromkeys(("t", "percentile", "bca", "seeds alone", "satterthwaite"), 0)
    for _ in range(studies):
        per_seed, r = _study(g, seeds, mixed_sets)
        cis = {k: r[f"ci95_{k}"] for k in ("t", "percentile", "bca")}
        for key, (lo, hi) in (cis | _alternatives(per_seed, r)).items():
            hits[key] += lo <= TRUTH <= hi
    return {key: n / studies for key, n in hits.items()}


# the coverage tests share _coverage's cache: one xdist worker runs them all (make test)
COVERAGE = pytest.mark.xdist_group("study_intervals_coverage")


@COVERAGE
@pytest.mark.parametrize(("seeds", "mixed_sets"), [(5, 0), (10, 0), (10, 3)])
def test_the_primary_interval_covers_the_truth_with_few_seeds(seeds, mixed_sets):
    """Seed (and mixed-set) variance 4x a seed's image variance, 400 studies: the t-interval
    covers the true difference >= 93 % of the time (95 % nominal; 0.011 binomial sd)."""
    coverage = _coverage(seeds, mixed_sets)
    assert coverage["t"] >= 0.93, coverage
    assert coverage["t"] <= 0.985, coverage  # honest, not merely wide


@COVERAGE
def test_what_the_primary_interval_does_that_the_others_do_not():
    """Resampling 3 units gives (M − 1)/M of their variance and normal-like quantiles: the
    bootstrap undercovers with 3 mixed sets. The seeds alone miss the test-image variance they
    share. A Satterthwaite df, crediting that term with more degrees of freedom than the units
    give, undercovers with 3 mixed sets."""
    mixed = _coverage(10, 3)
    assert mixed["percentile"] < 0.93 and mixed["bca"] < 0.93
    assert mixed["t"] - mixed["percentile"] > 0.03
    assert mixed["satterthwaite"] < mixed["t"] - 0.02
    assert _coverage(10, 0)["seeds alone"] < 0.9  # (10, 0): the cache key of the test above


@pytest.mark.parametrize(
    ("ci", "expected"),
    [
        ((-0.5, -0.1), "better"),
        ((-0.4, 0.0), "not worse"),  # the upper end at 0: not below 0, below the margin
        ((-0.2, 0.29), "not worse"),
        ((0.0, 0.2), "not worse"),  # the lower end at 0: not above it
        ((0.1, 0.2), "worse, within the margin"),  # worse, by less than the margin
        ((0.09, 0.85), "worse"),  # above 0, the upper end past the margin
        ((0.31, 0.6), "worse"),
        ((-0.2, 0.3), "inconclusive"),  # the upper end exactly at the margin
        ((-0.2, 0.5), "inconclusive"),  # reaches 0 and the margin
    ],
)
def test_labels_are_symmetric_around_zero(ci, expected):
    assert label(ci, 0.3) == expected


def test_a_label_refuses_a_bad_margin_or_interval():
    with pytest.raises(ValueError, match="margin > 0"):
        label((-0.1, 0.1), 0.0)
    with pytest.raises(ValueError, match="lo <= hi"):
        label((0.2, 0.1), 0.3)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((-0.5, -0.1), (-0.6, -0.2), "better"),
        ((0.1, 0.2), (0.05, 0.25), "worse, within the margin"),
        ((-0.5, -0.1), (-0.6, 0.2), "not worse"),  # better and not worse: both show not worse
        ((-0.5, -0.1), (-0.6, 0.5), "inconclusive"),  # better and inconclusive
        ((-0.5, -0.1), (0.4, 0.6), "inconclusive"),  # better and worse: nothing in common
        ((0.1, 0.2), (-0.1, 0.2), "not worse"),
        ((0.1, 0.2), (0.1, 0.5), "worse"),
    ],
)
def test_a_verdict_names_only_what_both_intervals_show(a, b, expected):
    assert agreed([a, b], 0.3) == agreed([b, a], 0.3) == expected


def test_intervals_that_disagree_give_inconclusive():
    """Three seeds that each favour the method, spread widely, no image noise: every bootstrap
    resample's mean is below 0 (percentile: better), the t with 2 degrees of freedom reaches
    past the margin (inconclusive), so the verdict is inconclusive."""
    per_seed = np.array([-1.0, -0.8, -0.2])
    units = units_of([0, 1, 2], "a", "b")
    r = intervals(per_seed, np.tile(per_seed, (500, 1)), units, np.zeros(10), 0.3, _rng())
    assert r["labels"]["percentile"] == "better" and r["labels"]["t"] == "inconclusive"
    assert r["verdict"] == "inconclusive" and r["verdict_from"] == ["t", "percentile"]
    direct = stats.ttest_rel(per_seed, np.zeros(3)).confidence_interval(0.95)
    assert r["ci95_t"] == pytest.approx([direct.low, direct.high], abs=1e-12)
    assert r["ci95"] == r["ci95_t"] and r["interval"] == "t"
    json.dumps(r)


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_z0_beyond_a_half_is_flagged():
    """Each image resample raises both seeds' differences by 0.5 ± 0.2 (a statistic biased by
    resampling, like a binned ECE): nearly every resample lies above the estimate, z0 << 0."""
    g = _rng(1)
    per_seed = np.array([0.1, 0.3])
    biased = per_seed + 0.5 + g.normal(0, 0.2, (1000, 1))
    r = intervals(per_seed, biased, units_of([0, 1], "a", "b"), np.zeros(10), 0.3, g)
    assert r["bca"]["z0"] < -1 and r["bca"]["z0_flagged"]
    centred = per_seed + g.normal(0, 0.2, (1000, 1))
    r = intervals(per_seed, centred, units_of([0, 1], "a", "b"), np.zeros(10), 0.3, g)
    assert abs(r["bca"]["z0"]) < 0.5 and not r["bca"]["z0_flagged"]


def test_one_unit_gives_no_t_interval_and_no_verdict():
    r = intervals(
        np.array([-2.0]), np.full((200, 1), -2.0), Units("seed", ((0,),)), np.zeros(5), 0.3, _rng()
    )
    assert r["ci95_t"] is None and r["interval"] == "percentile"
    assert r["ci95"] == r["ci95_percentile"] == [-2.0, -2.0] and r["verdict"] == "inconclusive"


def test_one_level_of_seeds_is_scipys_bootstrap_and_ttest():
    """No image noise: the hierarchical bootstrap resamples seeds only, as scipy.stats.bootstrap
    does. The same resamples give scipy's BCa interval exactly (its z0, its delete-one jackknife
    acceleration, its quantiles); fresh resamples agree with scipy's own within Monte Carlo
    error; the t-interval is scipy.stats.ttest_rel's."""
    g = _rng(2)
    d = g.gamma(2.0, 1.0, 7) - 1.5  # skewed: a nonzero acceleration
    units = units_of(list(range(7)), "a", "b")
    thetas = hierarchical_thetas(np.tile(d, (20_000, 1)), units, g)
    a = acceleration(d, units, np.full(10, d.mean()))  # the image blocks move nothing
    ours = bca(thetas, bias_correction(thetas, d.mean()), a)
    given = SimpleNamespace(bootstrap_distribution=thetas)
    theirs = stats.bootstrap((d,), np.mean, n_resamples=0, bootstrap_result=given, method="BCa")
    ci = theirs.confidence_interval
    assert ours == pytest.approx([ci.low, ci.high], abs=1e-12)
    assert abs(a) > 0.01
    for method in ("percentile", "BCa"):
        fresh = stats.bootstrap((d,), np.mean, n_resamples=20_000, method=method, rng=_rng(3))
        mine = intervals(d, np.tile(d, (20_000, 1)), units, np.full(10, d.mean()), 0.3, _rng(4))
        key = "ci95_percentile" if method == "percentile" else "ci95_bca"
        width = fresh.confidence_interval.high - fresh.confidence_interval.low
        low, high = fresh.confidence_interval
        assert mine[key] == pytest.approx([low, high], abs=0.03 * width)
    direct = stats.ttest_rel(d, np.zeros(7)).confidence_interval(0.95)
    assert t_interval(d, np.tile(d, (100, 1)), units)["ci"] == pytest.approx(
        [direct.low, direct.high], abs=1e-12
    )


def test_one_level_of_images_is_scipys_paired_bootstrap():
    """One seed: the study's resampling (pipeline/study/stats.py) draws test images only, paired
    across the two methods as scipy's paired=True does. 80 images: each jackknife block is one
    image, so BCa's acceleration is scipy's exactly."""
    g = _rng(5)
    labels = g.integers(0, 3, 80)
    base = Predictions.from_logits(g.normal(size=(80, 3)), labels)
    ref, method = g.exponential(1.0, 80), g.exponential(1.2, 80) ** 1.5
    runs = {
        "ref": {0: dataclasses.replace(base, nlls=ref)},
        "method": {0: dataclasses.replace(base, nlls=method)},
    }
    r = paired_difference(runs, "method", "ref", 20_000, _rng(6), "nll")

    def diff(x, y, axis=-1):
        return np.mean(x - y, axis=axis)

    for method_, key in (("percentile", "ci95_percentile"), ("BCa", "ci95_bca")):
        theirs = stats.bootstrap(
            (method, ref), diff, paired=True, n_resamples=20_000, method=method_, rng=_rng(7)
        ).confidence_interval
        width = theirs.high - theirs.low
        assert r[key] == pytest.approx([theirs.low, theirs.high], abs=0.03 * width)
    # the acceleration: scipy's delete-one jackknife over the 80 image pairs
    jack = np.array([np.delete(method - ref, i).mean() for i in range(80)])
    e = jack.mean() - jack
    assert r["bca"]["acceleration"] == pytest.approx((e**3).sum() / (6 * (e**2).sum() ** 1.5))
    assert r["bca"]["blocks"] == 80 and r["ci95_t"] is None


def test_two_levels_combine_their_jackknives_as_scipy_combines_two_samples():
    """θ = mean(seed effects) + mean(image effects): its acceleration from a jackknife over
    seeds and one over images equals scipy's for two independent samples, given the same
    resamples (the BCa interval then matches exactly)."""
    g = _rng(8)
    u, c = g.gamma(1.5, 1.0, 6), g.gamma(3.0, 0.1, 50)
    per_seed = u + c.mean()
    block_thetas = u.mean() + (c.sum() - c) / (len(c) - 1)
    units = units_of(list(range(6)), "a", "b")
    a = acceleration(per_seed, units, block_thetas)
    thetas = g.normal(per_seed.mean(), 0.3, 5000)

    def statistic(x, y, axis=-1):
        return np.mean(x, axis=axis) + np.mean(y, axis=axis)

    given = SimpleNamespace(bootstrap_distribution=thetas)
    ci = stats.bootstrap(
        (u, c), statistic, n_resamples=0, bootstrap_result=given, method="BCa"
    ).confidence_interval
    assert bca(thetas, bias_correction(thetas, per_seed.mean()), a) == pytest.approx(
        [ci.low, ci.high], abs=1e-12
    )


def test_mixed_sets_are_the_top_level_units():
    seeds = [0, 1, 2, 3, 4, 5, 6]
    mixed = mixed_sets_of(
        [{"method": "csm", "seed": s, "mixed_set": f"m{s % 3}"} for s in seeds]
        + [{"method": "ce", "seed": s} for s in seeds]
    )
    units = units_of(seeds, "csm", "ce", mixed)
    assert units.level == "mixed_set" and units.groups == ((0, 3, 6), (1, 4), (2, 5))
    assert units_of(seeds, "ls", "ce", mixed) == Units("seed", tuple((i,) for i in range(7)))
    # a resample draws 3 units, each drawn unit as many of its own seeds as it has
    w = seed_weights(units, 2000, _rng(9))
    per_unit = np.stack([w[:, list(grp)].sum(axis=1) for grp in units.groups], axis=1)
    assert np.all(per_unit % [3, 2, 2] == 0)
    assert np.all((per_unit // [3, 2, 2]).sum(axis=1) == 3)
    assert set(np.unique(w.sum(axis=1))) <= {6, 7, 8, 9}
    # a unit whose seeds are all drawn together: the t-interval is the t-test on unit means
    per_seed = np.array([0.1, -0.3, 0.5, 0.2, -0.1, 0.4, 0.0])
    r = t_interval(per_seed, np.tile(per_seed, (100, 1)), units)
    assert r["df"] == 2 and r["units"] == 3
    w_j = np.array([3, 2, 2]) / 7
    means = np.array([per_seed[list(grp)].mean() for grp in units.groups])
    var = 3 / 2 * (w_j**2 * (means - per_seed.mean()) ** 2).sum()
    assert r["half_width"] == pytest.approx(stats.t.ppf(0.975, 2) * np.sqrt(var))


def test_the_shared_image_variance_is_the_covariance_between_units():
    """Every seed's resampled difference moves with one shared image term (variance 0.04) and
    one of its own: the t-interval adds the shared part, which the seeds' spread cannot show."""
    g = _rng(10)
    shared, own = g.normal(0, 0.2, (5000, 1)), g.normal(0, 0.3, (5000, 4))
    per_seed = np.array([0.0, 0.1, 0.2, 0.3])
    r = t_interval(per_seed, per_seed + shared + own, units_of([0, 1, 2, 3], "a", "b"))
    assert r["shared_image_variance"] == pytest.approx(0.04, rel=0.1)
    assert r["unit_variance"] == pytest.approx(per_seed.var(ddof=1) / 4)


def test_comparisons_say_which_are_the_primary_endpoints():
    g = _rng(11)
    labels = g.integers(0, 3, 200)
    runs = {
        m: {s: Predictions.from_logits(g.normal(size=(200, 3)) * k, labels) for s in range(3)}
        for m, k in (("ce", 3.0), ("csm", 1.0), ("csm3", 1.0), ("ls", 2.0), ("ce+posthoc", 1.5))
    }
    pairs = [("csm", "ce"), ("ls", "ce"), ("csm3", "csm")]
    mixed = {"csm": {0: "m0", 1: "m1", 2: "m2"}}
    metrics = ["ece", "debiased_ece", "nll"]
    table = {
        when: compare(
            runs,
            pairs + [("csm", "ce+posthoc")] * (when == "after_ts"),
            100,
            lambda *k: _rng(),
            metrics,
            mixed_sets=mixed,
            when=when,
        )
        for when in ("before_ts", "after_ts")
    }
    flagged = {
        (when, metric, method, ref)
        for when, by_metric in table.items()
        for metric, by_ref in by_metric.items()
        for ref, by_method in by_ref.items()
        for method, r in by_method.items()
        if r["primary"]
    }
    assert flagged == set(PRIMARY_ENDPOINTS)
    r = table["before_ts"]["ece"]["ce"]["csm"]
    assert r["units"] == {"level": "mixed_set", "groups": [[0], [1], [2]]}
    assert table["before_ts"]["ece"]["ce"]["ls"]["units"]["level"] == "seed"
    assert set(r["labels"]) == {"t", "percentile", "bca"}
    json.dumps(table)


def test_the_report_puts_primary_endpoints_first_and_flags_z0():
    from pipeline.study.report import _paired

    g = _rng(12)
    per_seed = np.array([0.1, 0.3])
    units = units_of([0, 1], "a", "b")
    biased = intervals(per_seed, per_seed + 0.5 + g.normal(0, 0.2, (1000, 1)), units, [0], 0.3, g)
    spread = intervals(np.array([-1.0, -0.8, -0.2]), np.tile([-1.0, -0.8, -0.2], (500, 1)),
                       units_of([0, 1, 2], "a", "b"), np.zeros(10), 0.3, g)  # fmt: skip

    def row(r, method, primary):
        d = float(np.mean(r["ci95_t"]))
        return r | {"metric": "ece", "method": method, "reference": "ce", "difference": d,
                    "primary": primary, "resamples": 1000}  # fmt: skip

    paired = {"before_ts": {"ece": {"ce": {
        "ls": row(biased, "ls", False), "csm": row(spread, "csm", True)
    }}}}  # fmt: skip
    rows = [line for line in _paired(paired) if line.startswith("| before TS")]
    assert "csm − ce" in rows[0] and "**primary**" in rows[0] and "exploratory" in rows[1]
    assert "⚑ z0" in rows[1] and "⚑" not in rows[0]
    assert "**inconclusive** (t: inconclusive; percentile: better)" in rows[0]
    assert "2 seeds" in rows[1] and "3 seeds" in rows[0]
