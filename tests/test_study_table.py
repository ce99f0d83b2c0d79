"""The verdict table (pipeline/study/table.py) on a tiny constructed study.json whose answers are
known: a relative interval that crosses the goal leaves it not met though the point is past it,
a verdict that one seed flips is fragile and names that seed, a comparison the study lacks
prints "—"; the cost line sums the sittings once each; and the verdict study's study.json
(docs/results/fashion-verdict/, written before relative intervals, leave-one-out rows and fits)
renders with "—" where it holds nothing."""

from pathlib import Path

import numpy as np
import pytest

from pipeline.study.endpoints import Endpoints, RelativeGoal
from pipeline.study.intervals import intervals, units_of
from pipeline.study.table import MISSING, cost_line, main, verdict_table

VERDICT = Path(__file__).resolve().parents[1] / "docs/results/fashion-verdict"


def _comparison(per_seed, metric, goal=None, rng=0, ref=2.0):
    """One paired comparison as study.json holds it: csm − ce on seeds 0..k-1, each seed its own
    unit, no test-image noise (the seeds' spread is all there is), ce's metric `ref` at every
    seed."""
    per_seed = np.asarray(per_seed, dtype=float)
    seeds = list(range(len(per_seed)))
    reference = np.full(len(per_seed), ref)
    out = intervals(
        per_seed, np.tile(per_seed, (2000, 1)), units_of(seeds, "csm", "ce"), np.zeros(10), 0.3,
        np.random.default_rng(rng), (reference, np.tile(reference, (2000, 1))), goal,
    )  # fmt: skip
    return {
        "metric": metric, "method": "csm", "reference": "ce", "seeds": seeds,
        "method_mean": ref + float(per_seed.mean()), "reference_mean": ref,
        "difference": float(per_seed.mean()), "relative": float(per_seed.mean()) / ref,
        "primary": True, **out,
    }  # fmt: skip


# csm − ce ECE before TS: −32 % at the point, past the 30 % goal, but the relative t interval
# (delta method, 4 df) is about [−45 %, −19 %]: the goal is not met; every seed says better
GOAL_CROSSED = [-0.4, -0.9, -0.5, -0.8, -0.6]
# csm + TS − ce + TS ECE: four seeds at −1, one at +0.9: inconclusive; without seed 4, better
ONE_SEED_FLIPS = [-1.0, -1.0, -1.0, -1.0, 0.9]
# a protocol of its own, so that the rows do not follow docs/protocol.toml's edits
ENDS = Endpoints(
    primary_endpoints=(
        ("before_ts", "ece", "csm", "ce"),
        ("after_ts", "ece", "csm", "ce"),
        ("after_ts", "nll", "csm", "ce"),
        ("after_ts", "ece", "csm", "ce+posthoc"),
    ),
    relative_goal=RelativeGoal("before_ts", "ece", "csm", "ce", 0.30),
)


def _study():
    """Two of ENDS' endpoints, one comparison the study itself marked primary (before-TS NLL),
    top-1 means."""
    top1 = {"ce": 88.0, "csm": 87.4}
    before = {
        "ece": {"ce": {"csm": _comparison(GOAL_CROSSED, "ece", goal=0.30)}},
        "nll": {"ce": {"csm": _comparison(GOAL_CROSSED, "nll", rng=2)}},
    }
    return {
        "paired": {
            "before_ts": before,
            "after_ts": {"ece": {"ce": {"csm": _comparison(ONE_SEED_FLIPS, "ece", rng=1)}}},
        },
        "summary": {
            m: {"before_ts.top1": {"mean": v, "std": 0.1, "n": 5}} for m, v in top1.items()
        },
        "records": [],
    }


def _rows(text):
    """{endpoint: its cells} of the table in `text`."""
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


HOSTS = [
    {
        "started": "2026-01-02T00:00:00Z", "wall_seconds_this_invocation": 1800.0,
        "task_seconds_this_invocation": {"c": 60.0}, "cpu_count": 2, "finished": True,
        "earlier_invocations": [{
            "started": "2026-01-01T00:00:00Z", "wall_seconds_this_invocation": 3600.0,
            "task_seconds_this_invocation": {"a": 60.0, "b": 120.0}, "cpu_count": 2,
            "finished": False,
        }],
    }
]  # fmt: skip


def test_a_relative_interval_that_crosses_the_goal_leaves_it_not_met():
    rows = _rows(verdict_table(_study(), HOSTS, protocol=ENDS))
    difference, cis, relative, goal, verdict, loo, units = rows["csm − ce, ECE before TS"]
    assert difference == "-0.64 (2.00 → 1.36)"
    assert cis.startswith("t interval [") and ", percentile [" in cis
    assert relative.startswith("-32 % (t [-45 %, -19 %], percentile [")
    assert goal == "≥ 30 % below: **not met**"
    assert verdict == "**better**"
    assert loo == "holds (5 left out in turn)"  # no seed flips the verdict or the goal
    assert units == f"{MISSING} / {MISSING} / **5**"  # no mixed sets: the seeds are the units


def test_a_verdict_one_seed_flips_is_fragile_and_names_the_seed():
    rows = _rows(verdict_table(_study(), HOSTS, protocol=ENDS))
    _, _, _, goal, verdict, loo, _ = rows["csm + TS − ce + TS, ECE"]
    assert verdict.startswith("**inconclusive**")
    assert goal == "not worse (margin 0.3): **no**"
    assert loo == "**fragile**: without seed 4: better"


def test_comparisons_the_study_lacks_print_a_dash_and_top1_reads_the_means():
    text = verdict_table(_study(), HOSTS, protocol=ENDS)
    rows = _rows(text)
    # the protocol's primary endpoints in its order, the study's own primary one, top-1
    assert list(rows) == [
        "csm − ce, ECE before TS",
        "csm + TS − ce + TS, ECE",
        "csm + TS − ce + TS, NLL",
        "csm + TS − ce + the best post-hoc calibrator on val, ECE",
        "csm − ce, NLL before TS",
        "top-1, csm − ce (points)",
    ]
    assert (
        rows["csm + TS − ce + TS, NLL"]
        == [MISSING] * 4 + ["not in this study.json"] + [MISSING] * 2
    )
    top1 = rows["top-1, csm − ce (points)"]
    assert top1[0] == "-0.60 (88.00 → 87.40)" and top1[3] == "≥ -0.5: **no**"
    assert "Protocol: — (this study.json predates the protocol's record)." in text


def test_the_cost_line_sums_every_sitting_once():
    line = "1 h 30 min of study wall (3,600 + 1,800 s) over 2 sittings; 4 task-minutes (3 tasks)"
    assert line in cost_line(HOSTS)
    assert cost_line(HOSTS + HOSTS) == cost_line(HOSTS)  # the same sittings in two files
    assert cost_line([]).startswith(f"Cost: {MISSING}")
    unfinished = [{**HOSTS[0], "finished": False}]
    assert "of study wall so far (unfinished)" in cost_line(unfinished)


def test_the_verdict_studys_table_renders_from_its_folder(capsys):
    """study.json and host.json found in the folder; its numbers as report.md and docs/study.md
    give them, "—" where it holds nothing (no relative intervals, leave-one-out rows or fits)."""
    assert main([str(VERDICT)]) == 0
    text = capsys.readouterr().out
    rows = _rows(text)
    assert rows["csm − ce, ECE before TS"] == [
        "-1.11 (2.45 → 1.34)",
        "t interval [-1.85, -0.37], percentile [-1.38, -0.65]",
        "-45 % (the point: no interval in this study.json)",
        f"≥ 30 % below: {MISSING} (no relative interval in this study.json)",
        "**better**",
        MISSING,
        f"{MISSING} / **3** / 10",
    ]
    # primary now, exploratory when that study ran
    debiased = "csm + TS − ce + TS, debiased ECE (exploratory in this study)"
    assert debiased in rows
    assert rows["top-1, csm − ce (points)"][0] == "+0.22 (87.88 → 88.10)"
    assert text.rstrip().endswith(
        "Cost (host.json): 3 h 53 min of study wall (8,010 + 52 + 5,947 s) over 3 sittings; "
        "453 task-minutes (279 tasks); 2 cores."
    )


def test_a_path_without_a_study_json_is_one_line_naming_the_fix(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"python -m pipeline.study.table: error: no study.json at {tmp_path}: give"
    )
    assert err.count("\n") == 1
    (tmp_path / "study.json").write_text("{}")
    assert main([str(tmp_path)]) == 1
    assert "has no paired comparisons" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["file", "folder", "root"])
def test_the_study_json_is_found_from_the_file_its_folder_or_the_root(tmp_path, where):
    from pipeline.study.table import study_json_path

    path = tmp_path / "study" / "study.json"
    path.parent.mkdir()
    path.write_text("{}")
    given = {"file": path, "folder": path.parent, "root": tmp_path}[where]
    assert study_json_path(given) == path
