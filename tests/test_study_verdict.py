"""What a reviewer asks of a study's verdict (pipeline/study/intervals.py, stats.py, report.py,
figures.py), on tiny constructed data with known answers: the generator's fits as the top unit,
the relative effect and the relative goal, leave-one-unit-out verdicts, one top unit reported
once, the primary endpoints, and the fidelity figure's marks."""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from matplotlib.figure import Figure
from scipy import stats

from core.plots import draw_guidance_cells
from pipeline.study.config import METRICS, StudyConfig
from pipeline.study.endpoints import DEFAULT, Endpoints, RelativeGoal
from pipeline.study.figures import cell_marks
from pipeline.study.intervals import (
    MixedSet,
    goal_met,
    intervals,
    mixed_sets_of,
    seed_weights,
    units_of,
)
from pipeline.study.report import report_from_json, write_report
from pipeline.study.stats import Predictions, compare, summarize
from pipeline.study.verdict_text import leave_one_out_text

VERDICT = Path(__file__).resolve().parents[1] / "docs/results/fashion-verdict/study.json"
T975 = {k: stats.t.ppf(0.975, k) for k in (1, 2, 3, 4, 5)}


def _rng(seed=0):
    return np.random.default_rng(seed)


def _no_image_noise(per_seed, n=2000):
    """Resamples of the test images that move nothing: the seeds' spread is all there is."""
    return np.tile(per_seed, (n, 1))


# ------------------------------------------------------------------ fits as the top unit

# 3 fits x 2 mixed sets x 2 seeds: seed k on fit k // 4, set (k // 2) % 2 of that fit
SEEDS = list(range(12))
FIT_EFFECT = np.array([-1.0, 0.0, 1.5])  # the fit's draw dominates
SMALL = np.array([0.01, -0.02, 0.03, 0.0, -0.01, 0.02, 0.0, 0.01, -0.03, 0.02, 0.01, -0.01])
PER_SEED = FIT_EFFECT[np.array(SEEDS) // 4] + SMALL


def _records(with_fit: bool):
    csm = [
        {"method": "csm", "seed": s, "mixed_set": (s // 2) % 2 if with_fit else s // 2}
        | ({"fit": s // 4} if with_fit else {})
        for s in SEEDS
    ]
    return csm + [{"method": "ce", "seed": s, "mixed_set": None} for s in SEEDS]


def test_the_fits_are_the_top_unit_and_the_t_has_fits_minus_one_df():
    mixed = mixed_sets_of(_records(with_fit=True))
    assert mixed["csm"][5] == MixedSet(1, 0) and "ce" not in mixed
    units = units_of(SEEDS, "csm", "ce", mixed)
    assert units.level == "fit"
    assert units.groups == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11))
    assert units.sets == (((0, 1), (2, 3)), ((4, 5), (6, 7)), ((8, 9), (10, 11)))
    r = intervals(PER_SEED, _no_image_noise(PER_SEED), units, np.zeros(10), 0.3, _rng())
    assert r["t"]["df"] == 2 and r["t"]["units"] == 3
    # equal fits: the t-test on the three fit means
    means = PER_SEED.reshape(3, 4).mean(axis=1)
    half = T975[2] * means.std(ddof=1) / np.sqrt(3)
    assert r["ci95_t"] == pytest.approx([PER_SEED.mean() - half, PER_SEED.mean() + half])
    assert r["units"]["level"] == "fit" and r["units"]["sets"][2] == [[8, 9], [10, 11]]


def test_ignoring_the_fits_gives_an_interval_too_narrow_for_their_variance():
    """The same seeds, their records without `fit` (every set fit 0's): 6 mixed sets, df 5,
    and an interval that does not carry the fits' spread; with the fits it is wider, t and
    percentile alike."""
    with_fits = units_of(SEEDS, "csm", "ce", mixed_sets_of(_records(with_fit=True)))
    without = units_of(SEEDS, "csm", "ce", mixed_sets_of(_records(with_fit=False)))
    assert without.level == "mixed_set" and len(without.groups) == 6
    a = intervals(PER_SEED, _no_image_noise(PER_SEED), with_fits, np.zeros(10), 0.3, _rng(1))
    b = intervals(PER_SEED, _no_image_noise(PER_SEED), without, np.zeros(10), 0.3, _rng(1))
    assert b["t"]["df"] == 5

    def width(ci):
        return ci[1] - ci[0]

    assert width(a["ci95_t"]) > 2 * width(b["ci95_t"])
    assert width(a["ci95_percentile"]) > 1.2 * width(b["ci95_percentile"])


def test_a_resample_draws_fits_then_their_sets_then_their_seeds():
    units = units_of(SEEDS, "csm", "ce", mixed_sets_of(_records(with_fit=True)))
    w = seed_weights(units, 3000, _rng(2))
    assert np.all(w.sum(axis=1) == 12)  # 3 fits, each 2 sets, each 2 seeds
    per_fit = np.stack([w[:, list(g)].sum(axis=1) for g in units.groups], axis=1)
    assert np.all(per_fit % 4 == 0) and np.all(per_fit.sum(axis=1) == 12)
    per_set = np.stack([w[:, list(s)].sum(axis=1) for sets in units.sets for s in sets], axis=1)
    assert np.all(per_set % 2 == 0)
    # within a drawn fit its two sets are drawn apart: some resamples take one set twice
    first = per_set[:, :2][per_fit[:, 0] == 4]
    assert (first == [4, 0]).all(axis=1).any() and (first == [2, 2]).all(axis=1).any()


# ------------------------------------------------------------------ relative effect and goal

REF = np.array([2.0, 2.0, 2.0, 2.0])
DIFF = np.array([-1.0, -1.1, -0.9, -1.0])  # -50 % of the reference


def test_the_relative_effect_has_its_own_intervals_and_the_goal_needs_all_of_them():
    units = units_of([0, 1, 2, 3], "csm", "ce")
    ref = (REF, _no_image_noise(REF))
    r = intervals(DIFF, _no_image_noise(DIFF), units, np.zeros(10), 0.3, _rng(3), ref, 0.30)
    # delta method: z = (d − R b) / B̄ = [0, −0.05, 0.05, 0], t with 3 df around R = −0.5
    z = (DIFF + 0.5 * REF) / 2.0
    half = T975[3] * z.std(ddof=1) / 2
    assert r["relative_ci95_t"] == pytest.approx([-0.5 - half, -0.5 + half])
    assert r["relative_ci95"] == r["relative_ci95_t"]
    lo, hi = r["relative_ci95_percentile"]
    assert -0.55 <= lo <= hi <= -0.45  # ratios of means of the seeds' own ratios' range
    assert r["relative_goal"] == {"below": 0.30, "met": True, "fragile": False}
    # the point estimate, −50 %, is past −45 %; the interval's upper end (−43.5 %) is not
    strict = intervals(DIFF, _no_image_noise(DIFF), units, np.zeros(10), 0.3, _rng(3), ref, 0.45)
    assert -0.5 + half > -0.45 and strict["relative_goal"]["met"] is False
    assert not goal_met({"ci95_t": None, "ci95_percentile": [-0.9, -0.8]}, 0.3)


def test_the_relative_goal_is_the_protocols_comparison_only():
    g = _rng(4)
    labels = g.integers(0, 3, 300)
    runs = {
        m: {s: Predictions.from_logits(g.normal(size=(300, 3)) * k, labels) for s in range(3)}
        for m, k in (("ce", 4.0), ("csm", 1.0), ("ls", 1.0))
    }
    goal = RelativeGoal("before_ts", "ece", "csm", "ce", 0.10)
    ends = Endpoints(relative_goal=goal)
    out = compare(runs, [("csm", "ce"), ("ls", "ce")], 200, lambda *k: _rng(5), ["ece"],
                  when="before_ts", endpoints=ends)  # fmt: skip
    csm, ls = out["ece"]["ce"]["csm"], out["ece"]["ce"]["ls"]
    assert "relative_goal" in csm and "relative_goal" not in ls
    assert "relative_ci95_t" in ls  # every comparison has its relative intervals
    rel = (csm["method_mean"] - csm["reference_mean"]) / csm["reference_mean"]
    assert csm["relative"] == pytest.approx(rel)
    assert csm["relative_goal"]["met"] == (
        csm["relative_ci95_t"][1] < -0.10 and csm["relative_ci95_percentile"][1] < -0.10
    )


def test_the_primary_endpoints_include_debiased_ece_and_the_best_posthoc_baseline():
    for endpoint in (
        ("after_ts", "debiased_ece", "csm", "ce"),
        ("after_ts", "ece", "csm", "ce+posthoc"),
        ("after_ts", "nll", "csm", "ce+posthoc"),
    ):
        assert DEFAULT.is_primary(*endpoint)
    assert not DEFAULT.is_primary("before_ts", "nll", "csm", "ce+posthoc")
    assert DEFAULT.goal_for("before_ts", "ece", "csm", "ce").below == 0.30
    assert DEFAULT.goal_for("after_ts", "ece", "csm", "ce") is None


# ------------------------------------------------------------------ leave one unit out


def test_a_verdict_that_one_seed_flips_is_fragile():
    """Four seeds clearly better and one far worse: the interval reaches past the margin
    (inconclusive); without seed 4 every seed says −1 (better). Only seed 4 flips it."""
    per_seed = np.array([-1.0, -1.0, -1.0, -1.0, 0.9])
    units = units_of([0, 1, 2, 3, 4], "a", "b")
    r = intervals(per_seed, _no_image_noise(per_seed), units, np.zeros(10), 0.3, _rng(6))
    assert r["verdict"] == "inconclusive" and r["fragile"]
    rows = {row["dropped"]: row for row in r["leave_one_out"]}
    assert list(rows) == [f"seed {s}" for s in range(5)]
    assert rows["seed 4"]["verdict"] == "better" and rows["seed 4"]["ci95_t"] == [-1.0, -1.0]
    assert rows["seed 4"]["difference"] == -1.0
    assert all(rows[f"seed {s}"]["verdict"] == "inconclusive" for s in range(4))
    assert leave_one_out_text(r) == "**fragile**: without seed 4: better"


def test_a_verdict_no_unit_flips_is_stable_and_fits_are_dropped_whole():
    per_seed = np.array([-1.0, -1.05, -0.95, -1.02, -0.98])
    units = units_of([0, 1, 2, 3, 4], "a", "b")
    r = intervals(per_seed, _no_image_noise(per_seed), units, np.zeros(10), 0.3, _rng(7))
    assert r["verdict"] == "better" and not r["fragile"]
    assert leave_one_out_text(r) == "stable (5 left out in turn)"
    fits = units_of(SEEDS, "csm", "ce", mixed_sets_of(_records(with_fit=True)))
    r = intervals(PER_SEED, _no_image_noise(PER_SEED), fits, np.zeros(10), 0.3, _rng(8))
    assert [row["dropped"] for row in r["leave_one_out"]] == ["fit 0", "fit 1", "fit 2"]
    without_fit_2 = r["leave_one_out"][2]
    assert without_fit_2["difference"] == pytest.approx(PER_SEED[:8].mean())
    # two fits left: t with 1 df on their means
    means = PER_SEED[:8].reshape(2, 4).mean(axis=1)
    half = T975[1] * means.std(ddof=1) / np.sqrt(2)
    assert without_fit_2["ci95_t"] == pytest.approx([means.mean() - half, means.mean() + half])


# ------------------------------------------------------------------ one top unit


def _toy_study(tmp_path, mixed_sets):
    """A 3-seed study of ce and csm, csm's seeds on `mixed_sets` mixed sets of one fit, its
    report.md."""
    g = _rng(9)
    labels = g.integers(0, 3, 300)
    preds = {
        m: {s: Predictions.from_logits(g.normal(size=(300, 3)) * k, labels) for s in range(3)}
        for m, k in (("ce", 4.0), ("csm", 1.0))
    }
    records = []
    for m in ("ce", "csm"):
        for s in range(3):
            metrics = {k: float(g.uniform(0.1, 0.9)) for k in METRICS}
            records.append({
                "method": m, "seed": s, "mixed_set": s % mixed_sets if m == "csm" else None,
                "run": f"train/{m}-s{s}", "labelled_train_images": 500, "temperature": 1.2,
                "temperature_on_edge": False, "before_ts": metrics, "after_ts": metrics,
            })  # fmt: skip
    paired = {
        when: compare(
            preds,
            [("csm", "ce")],
            200,
            lambda *k: _rng(10),
            when=when,
            mixed_sets=mixed_sets_of(records),
        )
        for when in ("before_ts", "after_ts")
    }
    cfg = StudyConfig(methods=("ce", "csm"), seeds=(0, 1, 2), primary_seeds=3, other_seeds=3,
                      mixed_sets=mixed_sets)  # fmt: skip
    summary = summarize(records, METRICS)
    return write_report(cfg, Path("toy"), tmp_path, records, summary, paired).read_text()


def test_one_top_unit_prints_no_t_interval_and_one_percentile_line(tmp_path):
    text = _toy_study(tmp_path, mixed_sets=1)
    assert text.count("One top unit in csm − ce") == 1
    goals = text.split("## The goals")[1].split("\n## ")[0]
    lines = [ln for ln in goals.splitlines() if "Δ" in ln]
    assert lines and all("t interval" not in ln for ln in lines)
    assert all(ln.count("percentile interval") == 1 for ln in lines), lines  # named once
    assert "percentile interval" in lines[0] and "**no**" in lines[0]


def test_three_mixed_sets_print_both_intervals_and_no_one_unit_note(tmp_path):
    text = _toy_study(tmp_path, mixed_sets=3)
    assert "One top unit" not in text
    goals = text.split("## The goals")[1].split("\n## ")[0]
    assert "t interval [" in goals and "relative t [" in goals


# ------------------------------------------------------------------ the verdict study


def test_the_verdict_studys_report_still_renders_from_its_study_json(tmp_path):
    """docs/results/fashion-verdict/study.json predates the relative intervals and
    leave-one-out rows: its report renders, with the old goal wording and "–" for them."""
    text = report_from_json(VERDICT, tmp_path).read_text()
    assert text.startswith("# Study: fashion-mnist")
    assert "(goal: >= 30 % lower, both intervals below 0)" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| before TS | **primary** | ece"))
    cells = [c.strip() for c in row.split("|")]
    assert "csm − ce" in row and cells[-2] == "–"  # no leave-one-out rows in that study.json
    assert cells[-3].endswith("%") and "[" not in cells[-3]  # the relative point estimate alone
    assert "One top unit" not in text


def test_a_report_rerendered_from_study_json_keeps_the_protocol_header_and_configurations(
    tmp_path,
):
    """report_from_json passes study.json's "protocol" and "configurations" on as the study
    does: the verdict study's study.json (written before either) with a protocol record added
    re-renders with the protocol's line under the title and nothing else changed; a protocol
    changed after the start turns every verdict exploratory; the configurations line lists the
    methods in the config's order, though study.json holds them sorted."""
    study = json.loads(VERDICT.read_text())
    assert "protocol" not in study and "configurations" not in study

    def rerendered(name: str, **keys) -> str:
        path = tmp_path / name / "study.json"
        path.parent.mkdir()
        path.write_text(json.dumps({**study, **keys}, sort_keys=True))  # as the study writes it
        return report_from_json(path, tmp_path / name).read_text()

    before = report_from_json(VERDICT, tmp_path / "before").read_text()
    title = "# Study: fashion-mnist\n\n"
    assert before.startswith(title) and "Protocol:" not in before
    protocol = {
        "file": "docs/protocol.toml", "sha256": "a" * 64, "started_sha256": "a" * 64,
        "code": "abc1234", "changed": False, "verdicts": "confirmatory",
    }  # fmt: skip
    header = "Protocol: `docs/protocol.toml` sha256 aaaaaaaaaaaa…, code abc1234 at the start."
    same = rerendered("same", protocol=protocol)
    assert same == f"{title}{header}\n\n{before.removeprefix(title)}"

    changed = {**protocol, "sha256": "b" * 64, "changed": True, "verdicts": "exploratory"}
    counts = {
        "methods": {m: {"group": m, "configurations": n}
                    for m, n in (("ce", 7), ("csm", 9), ("ls", 13), ("focal", 8))},
        "primary": ["csm", "ce"], "spread": 2, "balanced": False,
    }  # fmt: skip
    text = rerendered("changed", protocol=changed, configurations=counts)
    assert text.startswith(f"{title}Protocol: `docs/protocol.toml` sha256 bbbbbbbbbbbb…")
    assert "**The protocol changed after the study started** (sha256 aaaaaaaaaaaa… then)" in text
    assert "- these verdicts are exploratory: the protocol changed after the start" in text
    assert "| before TS | exploratory | ece | csm − ce |" in text and "| **primary** |" not in text
    assert (
        "Val configurations per method: ce 7, csm 9, ls 13, focal 8; **the primary endpoints' "
        "methods (csm, ce) did not have the same number: they differ by 2**"
    ) in text


def test_the_figure_marks_the_floor_the_kept_cells_and_the_studys_choice():
    generator = json.loads(VERDICT.read_text())["generator"]
    marks = cell_marks(generator)
    assert "the study chose w = 1.5, x̂₀ clipping on" in marks["title"]
    assert "the fit's most faithful: w = 3.5, clipping off" in marks["title"]
    fig = Figure()
    ax = fig.add_subplot()
    draw_guidance_cells(ax, marks.pop("cells"), **{k: v for k, v in marks.items() if k != "title"})
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    off, on = lines["x̂₀ clipping off"], lines["x̂₀ clipping on"]
    assert list(off.get_xdata()) == [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert list(off.get_ydata()) == [81.0, 90.5, 94.5, 97.5, 98.0, 99.5]
    assert list(on.get_ydata()) == [81.0, 90.0, 74.5, 50.5, 38.5, 34.0]
    assert list(lines["floor 90 %"].get_ydata()) == [90.0, 90.0]
    scatters = {c.get_label(): c.get_offsets().tolist() for c in ax.collections}
    assert sorted(scatters["kept"]) == [[1.5, 90.0], [1.5, 90.5], [3.5, 99.5]]
    assert scatters["the study's choice (val NLL)"] == [[1.5, 90.0]]
    assert len(ax.get_legend().get_texts()) == 5  # two lines, the floor, kept, the choice


def test_fit_generators_figure_is_fidelity_against_w_and_says_most_faithful(tmp_path, monkeypatch):
    """One check at the fit's end, both clipping settings, 6 w each: 12 cells on two lines (not
    12 dots at one step), the star at the fit's most faithful cell, no "chosen" in the title."""
    from stages.common import fidelity

    drawn = {}
    monkeypatch.setattr(fidelity, "guidance_cells", lambda cells, path, **kw: drawn.update(
        cells=cells, **kw))  # fmt: skip
    ws = ("1", "1.5", "2", "2.5", "3", "3.5")
    acc = {"off": (81, 90.5, 94.5, 97.5, 98, 99.5), "on": (81, 90, 74.5, 50.5, 38.5, 34)}
    point = {
        "step": 1875,
        "clip": {
            c: {w: {"cnn": {"accuracy": a, "per_class": {}}} for w, a in zip(ws, acc[c])}
            for c in acc
        },
        "clip_saved": "off",
    }
    point["guidance"] = point["clip"]["off"]
    judge = SimpleNamespace(name="cnn", real_test_accuracy=87.8, labelled_train_images=5000)
    check = fidelity.FidelityCheck([judge], [float(w) for w in ws], ("a",), 0, 4, True)
    check.write(tmp_path, [point], 3.5, clip_sample=False)
    assert len(drawn["cells"]) == 12 and ("on", 2.0, 74.5) in drawn["cells"]
    assert drawn["chosen"] == ("off", 3.5)
    assert "most faithful: w=3.5, clip off" in drawn["title"] and "chosen" not in drawn["title"]


def test_a_reference_mean_of_zero_in_a_resample_gives_no_percentile_ratio():
    ref = np.array([0.0, 0.0, 0.0, 2.0])  # a resample drawing seeds 0-2 only has mean 0
    r = intervals(DIFF, _no_image_noise(DIFF), units_of([0, 1, 2, 3], "a", "b"), np.zeros(10),
                  0.3, _rng(11), (ref, _no_image_noise(ref)), 0.3)  # fmt: skip
    assert r["relative_ci95_percentile"] is None and r["relative_goal"]["met"] is False
    assert r["relative_ci95_t"] is not None
