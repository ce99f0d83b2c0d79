"""How a study's paired comparisons read in words, shared by report.md (pipeline/study/report.py)
and the verdict table (pipeline/study/table.py): each interval named once, the relative effect in
%, the verdict and each interval's own label, the leave-one-unit-out flips and "fragile", the
units, and the goals' sentences (csm vs ce) with their yes/no. One wording in one place, so the
table and the report cannot say one comparison two ways.
"""

from __future__ import annotations

from pipeline.study.config import POSTHOC
from pipeline.study.endpoints import RELATIVE_GOAL

# the labels whose interval lies below the margin: the non-inferiority goal is met
NOT_WORSE = ("better", "not worse", "worse, within the margin")
# top-1 points: csm's at least ce's − 0.5 (a goal on the means: study.json holds no top-1 interval)
TOP1_GOAL = -0.5


def mean_std_text(stats: dict[str, float], digits: int = 2) -> str:
    """ "2.31 ± 0.40": a summary's mean ± its sample std over seeds."""
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def interval_text(b: dict, digits: int = 2, key: str = "ci95") -> str:
    """ "[-1.20, +0.35]": the interval `key` of a comparison, "–" where it has none."""
    if b[key] is None:
        return "–"
    return f"[{b[key][0]:+.{digits}f}, {b[key][1]:+.{digits}f}]"


def comparison_of(paired: dict | None, when: str, metric: str, method: str, reference: str):
    """One comparison of `paired` ({when: pipeline.study.stats.compare(...)}), or None."""
    return (paired or {}).get(when, {}).get(metric, {}).get(reference, {}).get(method)


def intervals_text(r: dict, digits: int = 2) -> str:
    """The intervals a verdict reads, each named once: "t interval [..], percentile [..]", or
    the percentile one alone where there is no t interval (one top unit: the header says so)."""
    if r.get("ci95_t") is None:
        return f"percentile interval {interval_text(r, digits, 'ci95_percentile')}"
    return (
        f"t interval {interval_text(r, digits, 'ci95_t')}, "
        f"percentile {interval_text(r, digits, 'ci95_percentile')}"
    )


def _rel_cis(r: dict) -> str:
    """The relative effect's intervals in %, as intervals_text names them."""

    def pct(ci: list | None) -> str:
        return "–" if ci is None else f"[{100 * ci[0]:+.0f} %, {100 * ci[1]:+.0f} %]"

    if r.get("relative_ci95_t") is None:
        return f"percentile {pct(r.get('relative_ci95_percentile'))}"
    return f"t {pct(r['relative_ci95_t'])}, percentile {pct(r.get('relative_ci95_percentile'))}"


def flips(r: dict, key: str = "verdict") -> list[str]:
    """The leave-one-out rows of `r` whose `key` ("verdict" or "goal_met") differs from the
    full comparison's, as "without <unit>: <what it shows>"."""
    full = r["verdict"] if key == "verdict" else r["relative_goal"]["met"]

    def said(row: dict) -> str:
        if key == "verdict":
            return row["verdict"]
        return "goal met" if row.get("goal_met") else "goal not met"

    return [f"without {row['dropped']}: {said(row)}" for row in r.get("leave_one_out", [])
            if row.get(key) != full]  # fmt: skip


def _fragile(r: dict, key: str = "verdict") -> str:
    """ " — **fragile** (without seed 5: inconclusive; ...)" where leaving one unit out flips
    what `r` shows; "" where none does (or the study did not compute it)."""
    flipped = flips(r, key)
    return f" — **fragile** ({'; '.join(flipped)})" if flipped else ""


def _no_worse(label: str, r: dict, digits: int = 2) -> tuple[str, bool]:
    """A "not worse" goal: the verdict of the paired comparison `r` (what its t and percentile
    intervals both show), the upper ends below the protocol's margin
    (pipeline/study/endpoints.py)."""
    return (
        f"{label} {intervals_text(r, digits)} (goal: not worse, the upper ends below the margin "
        f"{r['margin']:g}): {r['verdict']}{_fragile(r)}",
        r["verdict"] in NOT_WORSE,
    )


def _relative_goal(b: dict, summary: dict) -> tuple[str, bool]:
    """The relative goal (csm's ECE >= 30 % below ce's): met only where the whole relative
    interval, t and percentile, lies below −30 % (pipeline.study.intervals.goal_met). A study.json
    written before the relative intervals: the point estimate and the verdict "better"."""
    ce, csm = summary["ce"], summary["csm"]
    head = (
        f"ECE {mean_std_text(csm['before_ts.ece'])} vs ce {mean_std_text(ce['before_ts.ece'])}: "
        f"{abs(100 * b['relative']):.0f} % {'lower' if b['relative'] < 0 else 'higher'}"
    )
    goal = b.get("relative_goal")
    if goal is None:
        return (
            f"{head}, ΔECE {intervals_text(b)} (goal: >= {100 * RELATIVE_GOAL.below:g} % lower, "
            "both intervals below 0)",
            -b["relative"] >= RELATIVE_GOAL.below and b["verdict"] == "better",
        )
    below = 100 * goal["below"]
    return (
        f"{head}, relative {_rel_cis(b)}; ΔECE {intervals_text(b)} (goal: >= {below:g} % "
        f"lower, the whole relative interval below −{below:g} %){_fragile(b, 'goal_met')}",
        goal["met"],
    )


def goals_section(summary: dict, paired: dict) -> list[str]:
    """The study's goals for csm, each with its verdict from the paired comparisons."""
    ce, csm = summary["ce"], summary["csm"]
    b = comparison_of(paired, "before_ts", "ece", "csm", "ce")
    d_acc = csm["before_ts.top1"]["mean"] - ce["before_ts.top1"]["mean"]
    checks = [
        _relative_goal(b, summary),
        (f"top-1 {d_acc:+.2f} points (goal >= {TOP1_GOAL:g})", d_acc >= TOP1_GOAL),
        _no_worse(
            f"after TS, ECE {mean_std_text(csm['after_ts.ece'])} vs ce + TS "
            f"{mean_std_text(ce['after_ts.ece'])}, ΔECE",
            comparison_of(paired, "after_ts", "ece", "csm", "ce"),
        ),
    ]
    d = comparison_of(paired, "after_ts", "debiased_ece", "csm", "ce")
    if d and d["primary"]:
        checks.append(_no_worse(
            f"after TS, debiased ECE {d['method_mean']:.2f} vs ce + TS {d['reference_mean']:.2f} "
            "(means over the paired seeds), Δ", d,
        ))  # fmt: skip
    checks.append(
        _no_worse(
            f"after TS, NLL {mean_std_text(csm['after_ts.nll'], 4)} vs ce + TS "
            f"{mean_std_text(ce['after_ts.nll'], 4)}, ΔNLL",
            comparison_of(paired, "after_ts", "nll", "csm", "ce"),
            4,
        )
    )
    for metric, digits in (("ece", 2), ("nll", 4)):
        p = comparison_of(paired, "after_ts", metric, "csm", POSTHOC)
        if p and p["primary"]:
            name = "ECE" if metric == "ece" else "NLL"
            checks.append(_no_worse(
                f"after TS, {name} {p['method_mean']:.{digits}f} vs ce + the best post-hoc "
                f"calibrator on val {p['reference_mean']:.{digits}f}, Δ{name}", p, digits,
            ))  # fmt: skip
    k = comparison_of(paired, "before_ts", "ece", "csm3", "csm")
    if k:
        checks.append(_no_worse(f"csm3 - csm ΔECE {k['difference']:+.2f},", k))
    lines = ["## The goals (csm vs ce)", ""]
    lines += [f"- {text}: **{'yes' if ok else 'no'}**" for text, ok in checks]
    reached = all(ok for _, ok in checks)
    return [*lines, f"- **{'all reached' if reached else 'not reached'}**", ""]


WHEN = {"before_ts": "before TS", "after_ts": "after TS"}


def units_text(r: dict) -> str:
    """ "3 fits (9 mixed sets)", "5 mixed sets" or "6 seeds": the top units of a comparison."""
    n, level = len(r["units"]["groups"]), r["units"]["level"]
    if level == "fit":
        sets = sum(len(s) for s in r["units"]["sets"])
        return f"{n} fits ({sets} mixed sets)"
    return f"{n} mixed sets" if level == "mixed_set" else f"{n} seeds"


def relative_text(r: dict) -> str:
    """The relative effect and its intervals in %, "–" where the study has none."""
    if r.get("relative") is None:
        return "–"
    if "relative_ci95_percentile" not in r:
        return f"{100 * r['relative']:+.0f} %"
    return f"{100 * r['relative']:+.0f} % ({_rel_cis(r)})"


def leave_one_out_text(r: dict) -> str:
    """ "stable (3 left out in turn)", or "**fragile**" and the units whose removal flips it."""
    rows = r.get("leave_one_out")
    if not rows:
        return "–"
    flipped = flips(r)
    if flipped:
        return f"**fragile**: {'; '.join(flipped)}"
    return f"stable ({len(rows)} left out in turn)"


def verdict_with_labels(r: dict) -> str:
    """The verdict, and each interval's own label where they differ."""
    labels = [r["labels"][k] for k in r["verdict_from"]]
    if len(set(labels)) == 1:
        return f"**{r['verdict']}**"
    said = "; ".join(f"{k}: {lab}" for k, lab in zip(r["verdict_from"], labels, strict=True))
    return f"**{r['verdict']}** ({said})"


def every_comparison(paired: dict | None) -> list[tuple[str, dict]]:
    """Every (when, comparison) of `paired`, in the order computed."""
    return [
        (when, r)
        for when, by_metric in (paired or {}).items()
        for by_reference in by_metric.values()
        for by_method in by_reference.values()
        for r in by_method.values()
    ]


def single_unit_pairs(paired: dict | None) -> list[str]:
    """The comparisons with one top unit (one fit and one mixed set, e.g. study.mixed_sets=1):
    "csm − ce", each pair once."""
    pairs = [f"{r['method']} − {r['reference']}" for _, r in every_comparison(paired)
             if len(r["units"]["groups"]) == 1]  # fmt: skip
    return list(dict.fromkeys(pairs))
