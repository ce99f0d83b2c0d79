"""The study's rates fitted from a study's host.json: per task kind, the seconds its tasks took
inside that study over their units (estimate.py's work model), which is the rates file
estimate.py prices a plan with. The committed default (rates.json) is this on the verdict
study's own host.json (docs/results/fashion-verdict/, 2 jobs on 2 cores):

    python -m pipeline.study.rates fit HOST.json --preset P [--set ...] [--out F]

(`python -m pipeline.study.rates fit ...` is the same command) writes the file and prints the
cross-check: rates from the first sitting predicting the others' task seconds, and the
simulated wall against the measured one. It copies the machine the sittings ran on (each
sitting's core.machine record) into the file, for the estimate to compare with its own.

The verdict study ran the protocol before generator fits were units: one `generator` task
trained the judges and the encoder and fitted the generator. A study now trains those in its
`generator` task (train runs on real/, at train's rate) and fits each generator in a task of
its own (`fit-f<f>`, `fit-cells`), so a fit alone has a rate of its own, `fit`: measured where a
host ran such tasks, else derived from the old task's (derive_rates), and the plan is rebuilt
in the old task's shape to fit rates on such a host (before_fits).

Apart from estimate.py because it runs once per rates file, not once per study, and is built
on the estimate (its work model; estimate() for the cross-check): estimate.py reads the file
(load_rates) and reaches this module's `fit` only by name, so the two make no import cycle.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from core.machine import describe, same_cpu
from pipeline.study.cells import GENERATOR
from pipeline.study.config import Task
from pipeline.study.estimate import (
    EXTENSION,
    FIT0,
    FIT_CELLS,
    KINDS,
    RATES,
    REPORT,
    Work,
    estimate,
    extra_evaluate,
    generator_parts,
    hm,
    load_rates,
    task_work,
)

USAGE = "usage: python -m pipeline.study.rates fit HOST.json --preset P [--out F]"


def derive_rates(rates: dict[str, float], seed_epochs: float, steps: float) -> dict[str, str]:
    """The fit rates one shape of plan cannot measure, from the other's (in place): the generator
    task before fits = its judges' and encoder's `seed_epochs` at train's rate + a fit of
    `steps` at fit's rate, so per fit step
        fit = generator - train x seed_epochs / steps     (a host before fits: the verdict's)
        generator = fit + train x seed_epochs / steps     (a host whose fits ran alone).
    The fit then carries its cell check and its share of the slowdown beside other tasks as
    the generator task did. Returns how each derived rate was made (the rates file's record)."""
    share = rates.get("train", 0.0) * seed_epochs / steps
    formula = f"train x {seed_epochs:g} seed-epochs / {steps:g} fit steps"
    if rates.get("generator") and not rates.get("fit"):
        rates["fit"] = max(0.0, rates["generator"] - share)
        return {"fit": f"generator - {formula}"}
    if rates.get("fit") and not rates.get("generator"):
        rates["generator"] = rates["fit"] + share
        return {"generator": f"fit + {formula}"}
    return {}


def sittings(host: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every sitting of a host.json, first to last."""
    last = {k: v for k, v in host.items() if k != "earlier_invocations"}
    return [*host.get("earlier_invocations", []), last]


def host_machine(
    host: Mapping[str, Any], use: Callable[[int], bool] = lambda i: True
) -> tuple[dict[str, Any] | None, str]:
    """The machine whose seconds the sittings `use` selects (by index) measured, for the rates
    file (`fit` copies it), and a note where that is not one machine: sittings on different
    CPUs (the rates mix them; the last one's is named), or none that names one (a host.json
    from before sittings recorded their machine: the verdict's; name it by hand, as
    rates.json's `machine_note` says). Only sittings that ran tasks count."""
    ran = [s for i, s in enumerate(sittings(host)) if use(i)]
    ran = [s for s in ran if s.get("task_seconds_this_invocation")]
    named = [s["machine"] for s in ran if s.get("machine")]
    if not named:
        return None, "the host.json names no machine (its study ran before sittings did)"
    if len(named) < len(ran) or any(not same_cpu(m, named[-1]) for m in named):
        machines = "; ".join(dict.fromkeys(describe(m) for m in named))
        return named[-1], (
            f"{len(ran)} sittings, {len(named)} naming their machine ({machines}): the rates "
            "mix what they measured; `machine` is the last one's"
        )
    return named[-1], ""


def ran_before_fits(host: Mapping[str, Any]) -> bool:
    """Whether a host.json's study ran the protocol before generator fits (a `generator` task
    that fitted, no fit-f0 task): the verdict study's."""
    names = {n for s in sittings(host) for n in s.get("task_seconds_this_invocation", {})}
    return GENERATOR in names and FIT0 not in names


def before_fits(tasks: Sequence[Task]) -> list[Task]:
    """The plan as the protocol before generator fits ran it: fit 0's fit-generator step at the
    end of the `generator` task (judges, encoder, fit: one task), no cell fit (the cells drawn
    from fit 0's generator), every task that waited on either waiting on `generator`. On the
    plan of study.fits=1 study.mixed_sets=3 this is the verdict study's plan, task for task, so
    its host.json's seconds fit rates (and the plan is estimated as it ran). A plan without
    fit-f0 (no generator task) as it is."""
    by_name = {t.name: t for t in tasks}
    if GENERATOR not in by_name or FIT0 not in by_name:
        return list(tasks)
    fit0, merged = by_name[FIT0], {FIT0, FIT_CELLS}
    out = []
    for t in tasks:
        if t.name in merged:
            continue
        after = {GENERATOR if a in merged else a for a in t.after} - {t.name}
        if t.name == GENERATOR:
            t = dataclasses.replace(
                t,
                steps=[*t.steps, *fit0.steps],
                done=t.done and fit0.done,
                cores=max(t.cores, fit0.cores),  # the fit's cores: the task holds them
            )
        out.append(dataclasses.replace(t, after=after))
    return out


def fit_rates(
    measured: Mapping[str, float],
    works: Mapping[str, Work],
    extra_evals: Mapping[str, int],
    evaluate_rate: float | None = None,
) -> dict[str, float]:
    """Seconds per unit of each kind: the total measured seconds over the total units of the
    tasks that ran (a task at 0 s ran nothing: a cell not kept, an extension not needed). A
    train/finetune + evaluate task pays its evaluation at the evaluate-only tasks' rate first."""
    ran = {n: s for n, s in measured.items() if s > 0 and n in works}
    evals = [s for n, s in ran.items() if works[n].kind == "evaluate"]
    ev = evaluate_rate if evaluate_rate is not None else (sum(evals) / len(evals) if evals else 0)
    total: dict[str, list[float]] = {}
    for n, s in ran.items():
        kind = works[n].kind
        t = total.setdefault(kind, [0.0, 0.0])
        t[0] += max(0.0, s - extra_evals.get(n, 0) * ev)
        t[1] += works[n].units
    rates = {k: t[0] / t[1] for k, t in total.items() if t[1] > 0}
    if "evaluate" in rates or evals:
        rates["evaluate"] = ev
    return rates


def _fit_main(argv: Sequence[str]) -> int:
    """`python -m pipeline.study.rates fit HOST.json --preset P [--set ...] [--out F]`:
    fit rates from a study's host.json on the plan its config makes (the task names must
    match: the verdict's is `--set study.fits=1 study.mixed_sets=3`, rebuilt before_fits), print the cross-check (rates from the first sitting predicting the others'
    task seconds, and the simulated wall against the measured one), write the rates file."""
    import argparse

    from pipeline.study.plan import setup

    p = argparse.ArgumentParser(prog="python -m pipeline.study.rates fit")
    p.add_argument("host", type=Path)
    p.add_argument("--preset", required=True)  # the study's (only presets name a preset)
    p.add_argument("--set", dest="sets", nargs="*", default=[])
    p.add_argument("--report-seconds", type=float, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    host = json.loads(args.host.read_text(encoding="utf-8"))
    cfg, root, tasks = setup(args.preset, [*args.sets, "out=/nonexistent-study-root"], data=False)
    if ran_before_fits(host):  # the verdict's: its generator task fitted fit 0, no cell fit
        tasks = before_fits(tasks)
    print(cross_check(host, tasks, args.preset, cfg.jobs, root, args.report_seconds))
    rates = rates_from_host(host, tasks, args.preset, args.report_seconds)
    # the alone rates are measured alone, not in a study: kept from the committed file
    committed = load_rates(RATES)
    rates |= {k: committed[k] for k in ("alone", "alone_source") if k in committed}
    source = f"{args.host} ({cfg.jobs} jobs, {sittings(host)[-1].get('cpu_count')} cores)"
    if "machine" not in rates and committed.get("source") == source:
        # the committed file refitted from its own host.json (the verdict's names no machine):
        # the machine named by hand stays
        rates |= {k: committed[k] for k in ("machine", "machine_note") if k in committed}
    rates["source"] = source
    text = json.dumps(rates, indent=2) + "\n"
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _units(tasks: Sequence[Task], preset: str, classes: int) -> tuple[dict, dict]:
    works = {t.name: task_work(t, preset, classes, 1.0, 1.0) for t in tasks}
    return works, {t.name: extra_evaluate(t) for t in tasks}


def rates_from_host(
    host: Mapping[str, Any],
    tasks: Sequence[Task],
    preset: str,
    report_seconds: float | None,
    classes: int = 10,
    use: Callable[[int], bool] = lambda i: True,
) -> dict[str, Any]:
    """A rates file's content from the sittings `use` selects (by index): each task's seconds
    from the last selected sitting that ran it; the extension share from the plan (extension
    tasks that ran / planned); the report's seconds as given (the last sitting's wall past its
    last task: the caller reads it from that sitting's log); the machine they ran on
    (host_machine: what the estimate checks this machine against)."""
    measured: dict[str, float] = {}
    for i, s in enumerate(sittings(host)):
        if use(i):
            measured.update(s.get("task_seconds_this_invocation", {}))
    works, evals = _units(tasks, preset, classes)
    rates: dict[str, Any] = {"rates": fit_rates(measured, works, evals)}
    parts = generator_parts(tasks, preset, classes)
    derived = derive_rates(rates["rates"], *parts) if parts else {}
    ext = [n for n in works if EXTENSION in n and n in measured]
    rates["extension_share"] = (
        round(sum(measured[n] > 0 for n in ext) / len(ext), 3) if ext else 1.0
    )
    rates["rates"][REPORT] = report_seconds or 0.0
    rates["rates"] = {k: rates["rates"].get(k, 0.0) for k in KINDS}
    rates["classes"] = classes
    rates["units"] = {k: u for k, (u, _) in KINDS.items()}
    if derived:
        rates["derived"] = derived
    machine, note = host_machine(host, use)
    if machine:
        rates["machine"] = machine
    if note:
        rates["machine_note"] = note
    return rates


def cross_check(
    host: Mapping[str, Any],
    tasks: Sequence[Task],
    preset: str,
    jobs: int,
    root: Path,
    report_seconds: float | None,
) -> str:
    """How well the model predicts what it was not fitted on: rates from sitting 1 alone
    against the other sittings' task seconds, kind by kind; then the whole plan's simulated
    wall (plan order, as the study ran) from those rates and from every sitting's, against the
    measured wall summed over the sittings."""
    works, evals = _units(tasks, preset, 10)
    first = rates_from_host(host, tasks, preset, report_seconds, use=lambda i: i == 0)
    every = rates_from_host(host, tasks, preset, report_seconds)
    later: dict[str, float] = {}
    for s in sittings(host)[1:]:
        later.update(s.get("task_seconds_this_invocation", {}))
    rows, pred_total, meas_total = [], 0.0, 0.0
    for kind in KINDS:
        names = [n for n, s in later.items() if s > 0 and n in works and works[n].kind == kind]
        if not names:
            continue
        pred = sum(
            works[n].units * first["rates"][kind] + evals[n] * first["rates"]["evaluate"]
            for n in names
        )
        meas = sum(later[n] for n in names)
        pred_total, meas_total = pred_total + pred, meas_total + meas
        rows.append(f"  {kind:<12} {len(names):>4} tasks  predicted {pred / 60:7.1f} min  "
                    f"measured {meas / 60:7.1f} min  ({100 * (pred - meas) / meas:+.0f} %)")  # fmt: skip
    wall = sum(s.get("wall_seconds_this_invocation", 0.0) for s in sittings(host))
    if not rows:  # one sitting (or later ones that ran nothing): nothing to predict blind
        out = ["one sitting: no later sitting to predict from sitting 1's rates"]
    else:
        out = ["sittings 2.. predicted from sitting 1's rates (task seconds):", *rows]
        out.append(f"  total {pred_total / 60:.1f} min predicted, {meas_total / 60:.1f} measured "
                   f"({100 * (pred_total - meas_total) / meas_total:+.0f} %)")  # fmt: skip
    if not host.get("finished"):  # the plan's wall against the sittings' only once it is done
        out.append(f"unfinished study: {hm(wall)} measured so far; no whole-plan check")
        return "\n".join(out)
    for label, rates in (("sitting 1's rates", first), ("every sitting's rates", every)):
        for order in ("plan", "critical"):
            e = estimate(tasks, preset, jobs, root, rates, order)
            out.append(f"whole plan, {label}, {order} order: {hm(e.wall)} ({e.wall:.0f} s) vs "
                       f"measured {hm(wall)} ({wall:.0f} s): {100 * (e.wall - wall) / wall:+.1f} %")  # fmt: skip
    return "\n".join(out)


def main(argv: Sequence[str]) -> int:
    """The module's one command, `fit` (_fit_main): `python -m pipeline.study.rates fit ...`."""
    if list(argv[:1]) != ["fit"]:
        sys.exit(USAGE)
    return _fit_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
