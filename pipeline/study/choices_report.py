"""The sections of report.md on what the study chose on the val split: every method's
hyper-parameters per grid with the rule's choice, the number of val configurations each method
had, and the generator's sampler cell (pipeline/study/tuning.py, tuning_plan.py, cells.py hold
the choices; pipeline/study/report.py places these sections).
"""

from __future__ import annotations

import math

from core.tables import table


def tuning_section(tuning: dict) -> list[str]:
    """Every method's own hyper-parameters per grid, chosen on val by the rule (train runs at
    their best-val-accuracy epoch, fine-tuning runs at their last)."""
    seeds = sorted({s for result in tuning.values() for s in result.get("seeds", [])})
    lines = [
        "## Every method's hyper-parameters, chosen on the val split",
        "",
        "Every train method searches its own grid (docs/protocol.toml) at the reference weight "
        "decay, then the shared weight-decay grid at its own choice (ce, with no parameter of its "
        "own, the shared grid refined by its midpoints: as many configurations); every point a "
        f"run at each tuning seed ({', '.join(map(str, seeds))}; no study seed), its scores the "
        "means over them. Then each parameter extends one geometric step at a time (ext) until "
        "the choice has a tried neighbour on each side or sits on a bound of the protocol (at "
        "bound), at most the protocol's number of steps. The point of the lowest mean val NLL is chosen only when its advantage over the "
        "grid's reference point (ref), the mean of their paired per-seed differences, exceeds "
        "that mean's standard error; else the reference stays. A point whose val NLL is not "
        "finite (diverged) never wins. The test split is not read.",
        "",
    ]
    rows, rules = [], []
    for group, result in tuning.items():
        reference = result.get("reference")
        for r in result["grid"]:
            values = ", ".join(f"{k} = {r[k]:g}" for k in result["chosen"] if r.get(k) is not None)
            chosen = r["run"] == result["chosen_run"]
            bound = [p for p in result.get("at_bound", []) if chosen]
            notes = {
                "**chosen**": chosen,
                f"at bound ({', '.join(bound)})": bool(bound),
                "ref": bool(reference) and all(r.get(k) == v for k, v in reference.items()),
                "ext": bool(r.get("extension")),
                "diverged": not math.isfinite(r["val_nll"]),
            }
            scores = (f"{r['val_acc']:.2f}", f"{r['val_ece']:.2f}", f"{r['val_nll']:.4f}")
            rows.append([group, r["run"], values, *scores, ", ".join(n for n in notes if notes[n])])
        if rule := result.get("rule"):
            gap, se = rule["advantage"], rule["standard_error"]
            rules.append([
                group, rule["winner"], "–" if gap is None else f"{gap:+.4f}",
                "–" if se is None else f"{se:.4f}",
                "the reference" if rule["kept_reference"] else result["chosen_run"],
            ])  # fmt: skip
    headings = ("grid", "run", "values", "val top-1", "val ECE", "val NLL", "")
    rule_headings = ("grid", "lowest mean val NLL", "advantage over ref", "standard error",
                     "chosen")  # fmt: skip
    return [
        *lines,
        *table(headings, rows),
        "",
        *((*table(rule_headings, rules), "") if rules else ()),
    ]


def generator_section(result: dict) -> list[str]:
    """The generator's sampler cells: every one the fit judged, the kept ones' csm val scores,
    the choice."""
    scores = {(r["guidance"], r["clip"]): r for r in result["grid"]}
    rows = []
    for c in result["cells"]:
        r = scores.get((c["guidance"], c["clip"]))
        chosen = {"guidance": c["guidance"], "clip": c["clip"]} == result["chosen"]
        fit = {"guidance": c["guidance"], "clip": c["clip"]} == result["reference"]
        note = ", ".join([*(["**chosen**"] if chosen else []), *(["the fit's"] if fit else [])])
        vals = (
            [f"{r['val_acc']:.2f}", f"{r['val_ece']:.2f}", f"{r['val_nll']:.4f}"]
            if r
            else ["–"] * 3
        )
        rows.append(
            [f"{c['guidance']:g}", c["clip"] or "saved", f"{c['fidelity']:.1f}", *vals, note]
        )
    rule = result["rule"]
    se = rule["standard_error"]
    return [
        "## The generator's sampler cell, chosen on the val split",
        "",
        f"Each cell's endpoint fidelity is the share of pure-class images the fit's judge "
        f"(`{result['judge']}`) takes for their class; the cells at or above "
        f"{result['fidelity_floor']:g} % (at most {result['max_cells']}) each drew a full mixed "
        f"set, and csm at its grid's reference point trained on it at the tuning seeds "
        f"{', '.join(map(str, result['seeds']))}. Lowest mean val NLL wins if its advantage over "
        f"the fit's cell exceeds its standard error (here {rule['advantage']:+.4f} vs "
        f"{'–' if se is None else f'{se:.4f}'}).",
        "",
        *table(("w", "x̂₀ clipping", "fidelity %", "val top-1", "val ECE", "val NLL", ""), rows),
        "",
    ]


def configurations_paragraph(counts: dict) -> list[str]:
    """Each tuned method's number of val configurations, and whether the primary endpoints'
    methods had the same number (within one)."""
    parts = [f"{m} {c['configurations']}" for m, c in counts["methods"].items()]
    primary = ", ".join(counts["primary"])
    said = (
        f"the primary endpoints' methods ({primary}) had the same number within one"
        if counts["balanced"]
        else f"**the primary endpoints' methods ({primary}) did not have the same number: they "
        f"differ by {counts['spread']}** (extensions differ per method)"
    )
    return [
        f"Val configurations per method: {', '.join(parts)}; {said}. The csm family also chose "
        "its generator cell among the cells below, a knob ce has no counterpart of.",
        "",
    ]
