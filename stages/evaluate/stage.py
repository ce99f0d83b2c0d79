"""evaluate's run: find the runs and their identity, measure each (before and after temperature
scaling, post-hoc calibrators, OOD and corruptions when asked), write each evaluation in one
rename, then the report (the stage is described in stages/evaluate/__init__.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.io import atomic_write_bytes, atomic_write_json
from core.launch import Processes
from core.logs import log
from core.plots import reliability_diagram
from core.version import code_version
from models.calibration import (
    calibration_metrics,
    ece,
    ensemble_logits,
    fit_temperature,
    reliability_bins,
    temperature_on_edge,
)
from models.finetuning import build_model
from models.posthoc import fit_posthoc
from models.training import collect_logits
from shards import evals
from shards.datasets import RealSplit, check_same_classes
from shards.manifest import (
    ShardError,
    is_complete,
    manifest_digest,
    remake_command,
    stage_command,
)
from shards.runs import META, RunError, damaged_fix
from shards.runs import load_model as load_run_model
from stages.common import data as datapath
from stages.configs.evaluate import Config
from stages.evaluate.metrics import corruption_metrics, ood_section, posthoc_section
from stages.evaluate.report import ENSEMBLE, left_out, write_report

RUN_STAGES = ("train", "finetune")

# ---------------------------------------------------------------- 1. runs and their identity
# A run folder is finished when its manifest (kind `run`, written last by the training loop)
# exists: the one completion rule of every output, shards.manifest.is_complete; run_digest says
# what identifies its content (the manifest pins the weights' and every other file's sha256).


def run_digest(folder: Path) -> str:
    """sha256 naming what a run is: any retraining changes it (shards.runs.Run.digest)."""
    return manifest_digest(folder)


def find_run(root: Path, name: str, stage_dir: str, preset: str = "") -> Path:
    """root/train/<name> or root/finetune/<name>: the first complete one. A missing one names
    the command that makes it, in this root (`preset`: the one evaluate runs with)."""
    candidates = [stage_dir] if stage_dir else list(RUN_STAGES)
    for stage in candidates:
        if is_complete(root / stage / name):
            return root / stage / name
    started = [root / s / name for s in candidates if (root / s / name).is_dir()]
    if started:
        remake = remake_command(started[0], preset)
        how = f"`{remake[1]}`" if remake else f"the {started[0].parent.name} command that began it"
        raise RunError(
            f"run {name!r} in {started[0]} is not complete (its training did not finish); "
            f"rerun it before evaluating it: {how}"
        )
    where = " or ".join(str(root / s / name) for s in candidates)
    elsewhere = [s for s in RUN_STAGES if s not in candidates and is_complete(root / s / name)]
    if elsewhere:  # stage_dir= pins the other folder: the run is complete there
        sets = {"run": name, "stage_dir": elsewhere[0]}
        command = stage_command("evaluate", root, preset, sets)
        raise RunError(
            f"run {name!r} is not in {where} but in {root / elsewhere[0] / name}: evaluate it "
            f"there: `{command}`"
        )
    if candidates == ["finetune"]:  # finetune writes <run>-<objective>, from a trained run
        raise RunError(
            f"run {name!r} has no fine-tuned weights in {where}; fine-tune a trained run first "
            "(finetune --set run=<trained run> objective=<objective> writes "
            "finetune/<run>-<objective>)"
        )
    remake = remake_command(root / "train" / name, preset)
    how = (
        f"`{remake[1]}`"
        if remake
        else f"train with --set out={root.parent} name={root.name} run={name}"
    )
    raise RunError(f"run {name!r} has no trained weights in {where}; train it first: {how}")


def complete_runs(root: Path) -> list[tuple[str, str]]:
    """(stage, name) of every complete run under train/ and finetune/, in report order."""
    return [
        (stage, p.name)
        for stage in RUN_STAGES
        if (root / stage).is_dir()
        for p in sorted((root / stage).iterdir())
        if p.is_dir() and is_complete(p)
    ]


def load_model(folder: Path, device: torch.device, class_names: tuple[str, ...]):
    model, meta = load_run_model(folder, build_model, device)  # linear or MaC-Cal head
    check_same_classes(f"{folder / META}", meta["class_names"], class_names, "real/test")
    return model.eval(), meta


# ---------------------------------------------------------------- 2. metrics


def panel(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    conf, pred = torch.softmax(logits.double(), dim=1).max(dim=1)
    bins = reliability_bins(conf, pred == labels)
    return {k: bins[k].tolist() for k in ("acc", "conf", "count")} | {
        "ece": 100 * ece(logits, labels)
    }


def measure(cfg: Config, folders: dict[str, Path]):
    """({name: evaluation dict}, {name: test logits}, {name: test probabilities after the best
    post-hoc calibrator}, real/test) for every run and the ensemble.
    Test, val and the OOD set are decoded into memory or streamed (`data_path`, stages/common/data.py);
    each run's logits are one in-order pass over them either way."""
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = list(folders)
    real = cfg.root / "real"
    ood = evals.ood_folders(cfg.ood)
    folders_read = [real / "test", real / "val", *ood.values()]
    path = datapath.choose_path(cfg, folders_read, torch.device("cpu"))

    def split(folder: Path) -> RealSplit:  # workers start here, before the models are loaded
        return datapath.sequential(datapath.open_split(folder, path, "cpu"), cfg.batch_size, cfg)

    test, val = split(real / "test"), split(real / "val")
    ood_splits = {name: split(folder) for name, folder in ood.items()}
    log.info("evaluate: %s", path.describe())
    try:
        return _measure(cfg, folders, names, device, test, val, ood_splits)
    finally:
        datapath.close(test, val, *ood_splits.values())


def _measure(
    cfg: Config,
    folders: dict[str, Path],
    names: list[str],
    device: torch.device,
    test: RealSplit,
    val: RealSplit,
    ood_splits: dict[str, RealSplit],
):
    check_same_classes("real/val", val.class_names, test.class_names, "real/test")
    models = {n: load_model(folders[n], device, test.class_names) for n in names}
    ens_name = cfg.ensemble_name or "+".join(names)

    def logits_of(images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every run's logits for these images, plus the ensemble's when there are several."""
        out = {
            n: collect_logits(
                m,
                images,
                meta["normalize"]["mean"],
                meta["normalize"]["std"],
                batch_size=cfg.batch_size,
                device=device,
                image_size=meta["image_size"],
            )
            for n, (m, meta) in models.items()
        }
        if len(names) > 1:
            out[ens_name] = ensemble_logits([out[n] for n in names])
        return out

    # 2. Logits, temperature on val, metrics on test before and after.
    log.info(
        "evaluate %s on %d test / %d val images (%s)", ", ".join(names), len(test), len(val), device
    )
    test_logits, val_logits = logits_of(test.images), logits_of(val.images)
    for n in names:  # a NaN would pass through every metric into report.md
        for split_name, lg in (("test", test_logits[n]), ("val", val_logits[n])):
            if not torch.isfinite(lg).all():
                raise RunError(
                    f"run {n!r} ({folders[n]}) gives non-finite logits on real/{split_name}: "
                    f"its weights overflow; {damaged_fix(folders[n])} with a smaller lr"
                )
    temps = {
        n: fit_temperature(val_logits[n], val.labels, criterion=cfg.ts_criterion)
        for n in test_logits
    }
    for n, t in temps.items():
        if temperature_on_edge(t, cfg.ts_criterion):
            log.warning(
                "evaluate %s: T = %.3g is on the edge of the %s search range: the temperature "
                "fit is degenerate, read the after-TS numbers with care",
                *(n, t, cfg.ts_criterion),
            )
    # 3. Every post-hoc calibrator fitted on val (models/posthoc.py), applied to test.
    posthoc = {n: fit_posthoc(val_logits[n], val.labels) for n in test_logits}
    results, best_probs = {}, {}
    for n, lg in test_logits.items():
        t = temps[n]
        meta = models[n][1] if n in models else {}
        test_probs = posthoc[n].probs(lg)
        best_probs[n] = test_probs[posthoc[n].best]
        results[n] = {
            "run": n,
            "stage": folders[n].parent.name if n in folders else ENSEMBLE,
            "loss": meta.get("loss", meta.get("method", "")) if n in models else "ensemble",
            "temperature": t,
            "ts_criterion": cfg.ts_criterion,
            "temperature_on_edge": temperature_on_edge(t, cfg.ts_criterion),
            "before_ts": calibration_metrics(lg, test.labels),
            "after_ts": calibration_metrics(lg / t, test.labels),
            "posthoc": posthoc_section(posthoc[n], test_probs, test.labels),
            "code_version": code_version(),
        }
    # 4. Optional OOD sets and corruptions; their logits are kept for paired statistics.
    arrays: dict[str, dict[str, np.ndarray]] = {n: {} for n in results}
    if cfg.corruptions:
        sets, labels = evals.corruption_sets(cfg.corruptions)
        shift, arrays = corruption_metrics(sets, labels, logits_of, temps, posthoc)
        for n, c in shift.items():
            results[n]["corruptions"] = c
    for set_name, ood_split in ood_splits.items():
        ood_logits = logits_of(ood_split.images)
        for n, r in results.items():
            r.setdefault("ood", {})[set_name] = ood_section(
                test_logits[n], ood_logits[n], temps[n], n in models
            )
            arrays[n][evals.ood_logits_key(set_name)] = ood_logits[n].float().numpy()
    return results, test_logits, best_probs, test, arrays


# ---------------------------------------------------------------- 3. evaluation folders


def data_upstream(cfg: Config) -> dict[str, str]:
    """Digests of the data every evaluation of this call reads (split roles as keys)."""
    real = cfg.root / "real"
    upstream = {
        "real/test": manifest_digest(real / "test"),
        "real/val": manifest_digest(real / "val"),
    }
    for name, folder in evals.ood_folders(cfg.ood).items():
        upstream[f"ood/{name}"] = manifest_digest(folder)
    if cfg.corruptions:
        upstream["corruptions"] = evals.corruptions_digest(cfg.corruptions)
    return upstream


@dataclasses.dataclass(frozen=True)
class Output:
    """One evaluation folder this call is responsible for, and what it must be made from."""

    folder: Path
    stage: str
    upstream: dict[str, str]


def plan_outputs(cfg: Config, folders: dict[str, Path]) -> dict[str, Output]:
    """{run or ensemble name: Output}: one per run, plus the ensemble of several runs."""
    data = data_upstream(cfg)
    keys = {n: f"{f.parent.name}/{n}" for n, f in folders.items()}
    digests = {keys[n]: run_digest(f) for n, f in folders.items()}
    outputs = {
        n: Output(
            evals.eval_dir(cfg.root, f.parent.name, n),
            f.parent.name,
            {keys[n]: digests[keys[n]], **data},
        )
        for n, f in folders.items()
    }
    if len(folders) > 1:
        name = cfg.ensemble_name or "+".join(folders)
        outputs[name] = Output(
            evals.eval_dir(cfg.root, ENSEMBLE, name), ENSEMBLE, {**digests, **data}
        )
    return outputs


def write_evaluation(
    out: Output,
    result: dict[str, Any],
    logits: torch.Tensor,
    posthoc_probs: torch.Tensor,
    labels: torch.Tensor,
    class_names: tuple[str, ...],
    settings: dict[str, Any],
    extra: dict[str, Any],
    more_arrays: dict[str, np.ndarray],
) -> None:
    """metrics.json, predictions.npz, reliability.png, then the manifest; renamed into place.
    predictions.npz also holds the test probabilities after the best post-hoc calibrator
    (`posthoc_probs`, float32, the method in `posthoc_method`) and `more_arrays` (the
    corruptions' logits, stages/evaluate/metrics.py corruption_metrics)."""
    t = result["temperature"]
    panels = {
        "before TS": panel(logits, labels),
        f"after TS (T = {t:.2f})": panel(logits / t, labels),
    }
    with evals.building(out.folder) as tmp:
        atomic_write_json(tmp / evals.METRICS, {"evaluation": result, **extra})
        arrays = {
            "logits": logits.float().numpy(),
            "labels": labels.numpy().astype(np.int64),
            "temperature": np.float64(t),
            "class_names": np.array(class_names, dtype=str),
            "posthoc_probs": posthoc_probs.float().numpy(),
            "posthoc_method": np.array(result["posthoc"]["best"], dtype=str),
            **more_arrays,
        }
        atomic_write_bytes(tmp / evals.PREDICTIONS, evals.npz_bytes(arrays))
        reliability_diagram(panels, tmp / evals.RELIABILITY, title=result["run"])
        evals.finish(
            tmp,
            class_names=class_names,
            upstream=out.upstream,
            settings=settings,
            code_version=code_version(),
            info={"run": result["run"], "stage": out.stage},
        )


# ---------------------------------------------------------------- the stage


def check_inputs(cfg: Config) -> None:
    """Every path evaluate reads besides the runs (ood=, corruptions=) checked before any work:
    a mistyped one fails in a second, not after the whole evaluation. The corruption arrays are
    memory-mapped, so checking their shapes reads no pixels."""
    evals.ood_folders(cfg.ood)
    if cfg.corruptions:
        if not Path(cfg.corruptions).is_dir():
            raise ShardError(
                f"corruptions={cfg.corruptions}: no such folder; give a folder of "
                "<corruption>.npy arrays + labels.npy (CIFAR-C layout; the shift stage writes "
                "one per root), or leave corruptions= empty"
            )
        evals.corruption_sets(cfg.corruptions)


def run(cfg: Config) -> Path:
    # 0. Input paths first (the bare form checks them again per run: a stat each).
    check_inputs(cfg)
    report = evals.report_path(cfg.root)
    if not cfg.run and not cfg.runs:  # `make evaluate`: every complete user run, then the report
        skip = left_out(cfg)
        pairs = complete_runs(cfg.root)
        internal = sorted({name for _, name in pairs if skip(name)})
        pairs = [(stage, name) for stage, name in pairs if not skip(name)]
        if not pairs:
            found = f" (only the internal run(s) {', '.join(internal)})" if internal else ""
            raise ShardError(
                f"no trained runs under {cfg.root}/train or /finetune{found}: train one first: "
                f"`{stage_command('train', cfg.root, cfg.classes_file or cfg.preset)}`"
                + (", or evaluate them with internal_runs=1" if internal else "")
            )
        if internal:
            log.info(
                "evaluate: leaving out the internal run(s) %s (internal_runs=1 includes them)",
                ", ".join(internal),
            )
        for stage, name in pairs:
            run(dataclasses.replace(cfg, run=name, stage_dir=stage))
        return report
    procs = Processes()
    if not procs.is_main:  # evaluation is cheap and writes shared files: the main process does it
        procs.barrier()
        return report
    # 1. Runs, and the evaluations this call owes: skip those already made from the same inputs.
    names = cfg.run_names()
    folders = {
        n: find_run(cfg.root, n, cfg.stage_dir, cfg.classes_file or cfg.preset) for n in names
    }
    outputs = plan_outputs(cfg, folders)
    settings = {"ts_criterion": cfg.ts_criterion, "predictions_format": evals.PREDICTIONS_FORMAT}
    stale = [n for n, o in outputs.items() if not evals.is_current(o.folder, o.upstream, settings)]
    if not stale:
        log.info(
            "evaluate %s: up to date (same run and data digests); nothing to do", ", ".join(outputs)
        )
    else:
        # 2-4. Logits, calibrators and metrics of every run (an ensemble needs all members).
        results, test_logits, posthoc_probs, test, arrays = measure(cfg, folders)
        # 5. One folder per stale evaluation, each complete before it gets its name.
        for n in stale:
            extra = {}
            if n not in folders:
                rel = [str(folders[m].relative_to(cfg.root)) for m in names]
                extra = {"ensemble": {"members": names, "folders": rel}}
            r = results[n]
            write_evaluation(
                *(outputs[n], r, test_logits[n], posthoc_probs[n], test.labels),
                *(test.class_names, settings, extra, arrays[n]),
            )
            b, a = r["before_ts"], r["after_ts"]
            best = r["posthoc"]["best"]
            p = r["posthoc"]["after"][best]
            log.info(
                "%s: top-1 %.2f %%, NLL %.4f, ECE %.2f %% -> after TS (T = %.2f): NLL %.4f, "
                "ECE %.2f %%; best post-hoc on val: %s, NLL %.4f, ECE %.2f %% -> %s",
                *(n, b["top1"], b["nll"], b["ece"], r["temperature"], a["nll"], a["ece"]),
                *(best, p["nll"], p["ece"], outputs[n].folder),
            )
    # 6. eval/report.md from every complete evaluation of a user run (unchanged bytes are not
    #    rewritten).
    report = write_report(cfg.root, left_out(cfg))
    procs.barrier()
    return report
