"""The verdict table docs/study.md shows for a study, printed from its study.json and its
sittings' host.json, so that the page's numbers come from the files and not from hand copying:

    python -m pipeline.study.table ROOT_OR_STUDY_JSON [--host HOST_JSON ...]

ROOT_OR_STUDY_JSON: a study.json, the folder that holds one (docs/results/<study>/, a root's
study/) or a study's root (its study/study.json). --host: the host.json files whose sittings the
cost line sums (a sitting kept in two files counts once); by default the host.json beside the
study.json, where there is one.

One row per primary endpoint of the committed protocol (docs/protocol.toml, in its order; then
any other comparison the study itself marked primary) and one for top-1: the difference with
the reference's and the method's means, its t and percentile intervals, the relative effect
with its intervals, the goal (the relative goal where the protocol names one for the
comparison, else not worse than the margin), the verdict, the leave-one-unit-out column (the
units whose removal flips the verdict or the goal: "fragile", else "holds") and the units
behind the intervals (fits / mixed sets / seeds, the top level in bold). Then the cost: study
wall, task-minutes and sittings. A field the study.json does not hold (an earlier study: no
relative intervals, no leave-one-out rows, no fits) prints "—" rather than a guess.

Every comparison is worded by pipeline/study/verdict_text.py, as report.md words it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core.tables import table
from pipeline.study.config import POSTHOC
from pipeline.study.endpoints import DEFAULT, Endpoints
from pipeline.study.estimate import hm
from pipeline.study.rates import sittings
from pipeline.study.verdict_text import (
    NOT_WORSE,
    TOP1_GOAL,
    comparison_of,
    every_comparison,
    flips,
    intervals_text,
    relative_text,
    verdict_with_labels,
)

PROG = "python -m pipeline.study.table"  # as argparse names it in its own errors
MISSING = "—"  # a field the study.json does not hold
METRIC_NAMES = {"ece": "ECE", "debiased_ece": "debiased ECE", "nll": "NLL"}
TOP1_LABEL = "top-1, csm − ce (points)"
HEADINGS = (
    "endpoint", "difference (reference → method)", "95 % intervals", "relative (95 %)", "goal",
    "verdict", "leave one unit out", "units: fits / mixed sets / seeds",
)  # fmt: skip

Endpoint = tuple[str, str, str, str]  # (when, metric, method, reference)


class TableError(ValueError):
    """A path that holds no study.json or host.json the table can read."""


def study_json_path(path: Path) -> Path:
    """The study.json `path` names: the file itself, the folder holding it, or a study root's
    study/study.json."""
    for candidate in (path, path / "study.json", path / "study" / "study.json"):
        if candidate.is_file():
            return candidate
    raise TableError(
        f"no study.json at {path}: give a study.json, the folder holding it "
        "(docs/results/<study>/) or the study's root (ROOT/study/study.json)"
    )


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TableError(f"cannot read {what} {path}: {e.strerror}; check the path") from e
    except ValueError as e:
        raise TableError(f"{path} is not JSON ({e}); give the study's own {what}") from e
    if not isinstance(data, dict):
        raise TableError(f"{path} is not a {what} (a JSON object); give the study's own")
    return data


def table_endpoints(study: Mapping[str, Any], protocol: Endpoints = DEFAULT) -> list[Endpoint]:
    """The table's comparisons: the protocol's primary endpoints in its order, then any other
    the study marked primary (one a study's own protocol named), each once."""
    marked = [
        (when, r["metric"], r["method"], r["reference"])
        for when, r in every_comparison(study.get("paired"))
        if r.get("primary")
    ]
    return list(dict.fromkeys([*protocol.primary_endpoints, *marked]))


def _side(name: str, when: str, posthoc: str) -> str:
    """A method as the row names it: "csm + TS" after temperature scaling, the post-hoc
    baseline by what it is."""
    if name == POSTHOC:
        return f"ce + the best post-hoc calibrator on val{posthoc}"
    return f"{name} + TS" if when == "after_ts" else name


def _label(endpoint: Endpoint, posthoc: str) -> str:
    when, metric, method, reference = endpoint
    name = METRIC_NAMES.get(metric, metric)
    pair = f"{_side(method, when, posthoc)} − {_side(reference, when, posthoc)}"
    return f"{pair}, {name} before TS" if when == "before_ts" else f"{pair}, {name}"


def _intervals(r: dict, digits: int) -> str:
    return intervals_text(r, digits) if "ci95_percentile" in r else MISSING


def _relative_cell(r: dict) -> str:
    if r.get("relative") is None:
        return MISSING
    if "relative_ci95_percentile" not in r:  # a study.json written before relative intervals
        return f"{relative_text(r)} (the point: no interval in this study.json)"
    return relative_text(r)


def _goal_cell(r: dict, endpoint: Endpoint, protocol: Endpoints) -> str:
    """The relative goal where the study judged one for this comparison (met only where both
    relative intervals lie past it) or the protocol names one, else "not worse": the verdict's
    upper ends below the margin."""
    goal, named = r.get("relative_goal"), protocol.goal_for(*endpoint)
    if goal is not None:
        return f"≥ {100 * goal['below']:g} % below: **{'met' if goal['met'] else 'not met'}**"
    if named is not None:
        return (
            f"≥ {100 * named.below:g} % below: {MISSING} (no relative interval in this study.json)"
        )
    return f"not worse (margin {r['margin']:g}): **{'yes' if r['verdict'] in NOT_WORSE else 'no'}**"


def _loo_cell(r: dict) -> str:
    """ "holds (3 left out in turn)", or "**fragile**" and each unit whose removal flips the
    verdict or the relative goal."""
    rows = r.get("leave_one_out")
    if not rows:
        return MISSING
    flipped = flips(r) + (flips(r, "goal_met") if "relative_goal" in r else [])
    if flipped:
        return f"**fragile**: {'; '.join(flipped)}"
    return f"holds ({len(rows)} left out in turn)"


def _unit_counts(r: dict, fits_recorded: bool) -> str:
    """fits / mixed sets / seeds behind the intervals, the top level (the t interval's units)
    in bold; "—" for a level the study.json does not name (records without `fit`) or the
    comparison does not have (no mixed set on either side)."""
    units = r.get("units") or {}
    level, groups = units.get("level"), units.get("groups", [])
    fits: int | None = None
    sets: int | None = None
    if level == "fit":
        fits, sets = len(groups), sum(len(s) for s in units.get("sets", []))
    elif level == "mixed_set":
        fits, sets = (1 if fits_recorded else None), len(groups)
    cells = []
    for key, n in (("fit", fits), ("mixed_set", sets), ("seed", len(r.get("seeds", [])))):
        if n is None:
            cells.append(MISSING)
        else:
            cells.append(f"**{n}**" if key == level else str(n))
    return " / ".join(cells)


def _row(
    study: Mapping[str, Any], endpoint: Endpoint, protocol: Endpoints, posthoc: str
) -> list[str]:
    r = comparison_of(study.get("paired"), *endpoint)
    label = _label(endpoint, posthoc)
    if r is None:
        return [label, *[MISSING] * 4, "not in this study.json", MISSING, MISSING]
    if not r.get("primary"):
        label += " (exploratory in this study)"
    d = 4 if endpoint[1] == "nll" else 2
    difference = (
        f"{r['difference']:+.{d}f} ({r['reference_mean']:.{d}f} → {r['method_mean']:.{d}f})"
    )
    fits_recorded = any("fit" in rec for rec in study.get("records", []))
    return [
        label, difference, _intervals(r, d), _relative_cell(r), _goal_cell(r, endpoint, protocol),
        verdict_with_labels(r) if "labels" in r else f"**{r['verdict']}**", _loo_cell(r),
        _unit_counts(r, fits_recorded),
    ]  # fmt: skip


def _top1_row(study: Mapping[str, Any]) -> list[str]:
    """Top-1, csm − ce: the means over each one's seeds (study.json holds no interval of
    top-1), the goal at least ce's − 0.5 points."""
    summary = study.get("summary", {})
    try:
        csm, ce = summary["csm"]["before_ts.top1"], summary["ce"]["before_ts.top1"]
    except KeyError:
        return [TOP1_LABEL, *[MISSING] * 4, "not in this study.json", MISSING, MISSING]
    d = csm["mean"] - ce["mean"]
    seeds = str(csm["n"]) if csm["n"] == ce["n"] else f"{csm['n']} and {ce['n']}"
    return [
        TOP1_LABEL, f"{d:+.2f} ({ce['mean']:.2f} → {csm['mean']:.2f})",
        f"{MISSING} (the means: no interval of top-1 in study.json)", MISSING,
        f"≥ {TOP1_GOAL:g}: **{'yes' if d >= TOP1_GOAL else 'no'}**", MISSING, MISSING,
        f"{MISSING} / {MISSING} / {seeds}",
    ]  # fmt: skip


def _posthoc_names(study: Mapping[str, Any]) -> str:
    names = sorted({r["posthoc_method"] for r in study.get("records", [])
                    if r.get("method") == "ce" and r.get("posthoc_method")})  # fmt: skip
    return f" ({', '.join(names)})" if names else ""


def _protocol_line(study: Mapping[str, Any]) -> str:
    protocol = study.get("protocol")
    if not protocol:
        return f"Protocol: {MISSING} (this study.json predates the protocol's record)."
    line = f"Protocol: `{protocol['file']}` sha256 {protocol['sha256'][:12]}…"
    if protocol.get("changed"):
        return line + " **changed after the study started: every verdict is exploratory.**"
    return line + ", unchanged since the study started."


def cost_line(hosts: Sequence[Mapping[str, Any]]) -> str:
    """Study wall, task-minutes and sittings from the host.json files: every sitting that ran a
    task (a sitting kept in two files counts once; a 0-task rerun adds nothing)."""
    every = {
        (s.get("started"), s.get("wall_seconds_this_invocation")): s
        for host in hosts
        for s in sittings(host)
    }
    ran = sorted(
        (s for s in every.values() if s.get("task_seconds_this_invocation")),
        key=lambda s: str(s.get("started")),
    )
    if not ran:
        return f"Cost: {MISSING} (no host.json with a sitting that ran a task)."
    walls = [float(s.get("wall_seconds_this_invocation", 0.0)) for s in ran]
    seconds = [v for s in ran for v in s["task_seconds_this_invocation"].values()]
    cores = sorted({str(s["cpu_count"]) for s in ran if s.get("cpu_count")})
    done = "" if any(s.get("finished") for s in every.values()) else " so far (unfinished)"
    return (
        f"Cost (host.json): {hm(sum(walls))} of study wall{done} "
        f"({' + '.join(f'{w:,.0f}' for w in walls)} s) over {len(ran)} sitting"
        f"{'s' if len(ran) > 1 else ''}; {sum(seconds) / 60:,.0f} task-minutes "
        f"({len(seconds)} tasks); {' / '.join(cores) or MISSING} cores."
    )


def verdict_table(
    study: Mapping[str, Any],
    hosts: Sequence[Mapping[str, Any]] = (),
    source: str = "study.json",
    protocol: Endpoints = DEFAULT,
) -> str:
    """The markdown: a line naming the source and the protocol, the table, the cost line."""
    posthoc = _posthoc_names(study)
    rows = [_row(study, e, protocol, posthoc) for e in table_endpoints(study, protocol)]
    head = (
        f"From `{source}` (`python -m pipeline.study.table`): method − reference, paired by "
        "seed and test image, x100 except NLL; a verdict names what both the t and the "
        "percentile interval show."
    )
    lines = [head, _protocol_line(study), "", *table(HEADINGS, [*rows, _top1_row(study)]), ""]
    return "\n".join([*lines, cost_line(hosts)]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pipeline.study.table ROOT_OR_STUDY_JSON [--host HOST_JSON ...]`: the table on
    stdout; a path that holds no study.json or host.json: one line on stderr, exit 1."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("study", type=Path, help="a study.json, its folder, or the study's root")
    p.add_argument("--host", type=Path, nargs="+", action="extend", default=None,
                   help="host.json files (default: the one beside study.json)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        path = study_json_path(args.study)
        study = _read_json(path, "study.json")
        if not isinstance(study.get("paired"), dict):
            raise TableError(
                f"{path} has no paired comparisons: give a finished study's study.json"
            )
        beside = path.parent / "host.json"
        host_paths = args.host if args.host is not None else [beside] if beside.is_file() else []
        hosts = [_read_json(h, "host.json") for h in host_paths]
    except TableError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(verdict_table(study, hosts, str(path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
