"""evaluate: trained runs -> test metrics before/after temperature scaling, plots, report.md.

    python -m pipeline evaluate --preset digits --set run=ce
    python -m pipeline evaluate --preset digits --set runs=ce-0,ce-1,ce-2    # + deep ensemble

A run lives in train/<run>/ or finetune/<run>/ (train first; `stage_dir` pins one). Metrics are
METHODS §7 on real/test, before and after a temperature fitted on real/val (`ts_criterion`:
the val-NLL minimiser by default, or the lowest val ECE on the grid 0.1..10). Per run folder: metrics.json (section "evaluation", other sections kept),
predictions.npz (test logits + labels; numpy only, load with allow_pickle=False) and
reliability.png. Several runs also give an ensemble (mean softmax) in ensemble/<a+b+c>/.
Finally runs/<classes>/report.md is rebuilt from every evaluated run on disk.
"""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.calibration import (
    calibration_metrics,
    ece,
    ensemble_logits,
    fit_temperature,
    ood_scores,
    reliability_bins,
    temperature_on_edge,
    topk_accuracy,
)
from models.finetuning import build_model
from models.training import collect_logits
from pipeline.configs.evaluate import Config
from pipeline.plots import reliability_diagram
from pipeline.runtime import Processes, code_version, log
from shards.datasets import check_same_classes, load_real
from shards.io import atomic_write_bytes, atomic_write_json, read_json
from shards.manifest import MANIFEST, ShardError
from shards.runs import META
from shards.runs import load_model as load_run_model

ENSEMBLE = "ensemble"
STAGE_FOLDERS = ("train", "finetune", ENSEMBLE)  # report.md order

# ---------------------------------------------------------------- 1. runs and data


def find_run(root: Path, name: str, stage_dir: str) -> Path:
    """root/train/<name> or root/finetune/<name> (the first with trained weights)."""
    candidates = [stage_dir] if stage_dir else ["train", "finetune"]
    for stage in candidates:
        if (root / stage / name / META).is_file():
            return root / stage / name
    where = " or ".join(str(root / s / name) for s in candidates)
    raise ShardError(
        f"run {name!r} has no trained weights in {where}; train it first (make train RUN={name})"
    )


def load_model(folder: Path, device: torch.device, class_names: tuple[str, ...]):
    model, meta = load_run_model(folder, build_model, device)  # linear or MaC-Cal head
    check_same_classes(f"{folder / META}", meta["class_names"], class_names, "real/test")
    return model.eval(), meta


def ood_folder(path: str) -> Path:
    """A split folder, a real/ root or a runs/<name>/ root -> the split folder to score."""
    p = Path(path)
    for candidate in (p, p / "test", p / "real" / "test"):
        if (candidate / MANIFEST).is_file():
            return candidate
    raise ShardError(
        f"ood={path}: no prepared split there (looked for {MANIFEST} in ., test/, real/test/)"
    )


def corruption_sets(path: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """CIFAR-C layout: {name: uint8 [5·N, H, W, 3] (memory-mapped)}, labels [N] or [5·N]."""
    folder = Path(path)
    if not (folder / "labels.npy").is_file():
        raise ShardError(f"corruptions={path}: no labels.npy (expected CIFAR-C layout)")
    labels = np.load(folder / "labels.npy", allow_pickle=False)
    sets = {}
    for f in sorted(folder.glob("*.npy")):
        if f.stem == "labels":
            continue
        arr = np.load(f, mmap_mode="r", allow_pickle=False)
        if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8 or arr.shape[0] % 5:
            raise ShardError(f"{f}: expected uint8 [5*N, H, W, 3], got {arr.dtype} {arr.shape}")
        if len(labels) not in (arr.shape[0], arr.shape[0] // 5):
            raise ShardError(f"{f}: {arr.shape[0]} images but {len(labels)} labels")
        sets[f.stem] = arr
    if not sets:
        raise ShardError(f"corruptions={path}: no <corruption>.npy files")
    return sets, labels


# ---------------------------------------------------------------- 2. metrics


def panel(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    conf, pred = torch.softmax(logits.double(), dim=1).max(dim=1)
    bins = reliability_bins(conf, pred == labels)
    return {k: bins[k].tolist() for k in ("acc", "conf", "count")} | {
        "ece": 100 * ece(logits, labels)
    }


def corruption_metrics(
    sets: dict[str, np.ndarray], labels: np.ndarray, logits_of: Callable, temps: dict[str, float]
) -> dict[str, dict]:
    """{entry: {before_ts|after_ts: {corruption: {severity: {ece, top1}}, "mean": {...}}}}."""
    out: dict[str, dict] = {name: {"before_ts": {}, "after_ts": {}} for name in temps}
    for corruption, arr in sets.items():
        n = arr.shape[0] // 5
        for s in range(5):
            y = torch.from_numpy(
                np.asarray(labels[s * n : (s + 1) * n] if len(labels) > n else labels)
            ).long()
            logits = logits_of(
                torch.from_numpy(np.array(arr[s * n : (s + 1) * n]))
            )  # copy out of the mmap
            for name, lg in logits.items():
                for key, t in (("before_ts", 1.0), ("after_ts", temps[name])):
                    out[name][key].setdefault(corruption, {})[str(s + 1)] = {
                        "ece": 100 * ece(lg / t, y),
                        "top1": 100 * topk_accuracy(lg, y),
                    }
    for result in out.values():
        for key in ("before_ts", "after_ts"):
            per = list(result[key].values())
            result[key]["mean"] = {
                str(s): {m: float(np.mean([p[str(s)][m] for p in per])) for m in ("ece", "top1")}
                for s in range(1, 6)
            }
    return out


# ---------------------------------------------------------------- 3. outputs


def write_outputs(
    folder: Path,
    evaluation: dict,
    test_logits: torch.Tensor,
    labels: torch.Tensor,
    class_names: tuple[str, ...],
    panels: dict,
    extra: dict | None = None,
) -> None:
    path = folder / "metrics.json"
    metrics = read_json(path) if path.is_file() else {}
    metrics["evaluation"] = evaluation
    metrics.update(extra or {})
    atomic_write_json(path, metrics)
    buf = io.BytesIO()
    np.savez(
        buf,
        logits=test_logits.float().numpy(),
        labels=labels.numpy().astype(np.int64),
        temperature=np.float64(evaluation["temperature"]),
        class_names=np.array(class_names, dtype=str),
    )
    atomic_write_bytes(folder / "predictions.npz", buf.getvalue())
    reliability_diagram(panels, folder / "reliability.png", title=evaluation["run"])


REPORT_COLUMNS = [
    ("top1", "top-1", 2),
    ("top5", "top-5", 2),
    ("nll", "NLL", 4),
    ("brier", "Brier", 4),
    ("ece", "ECE", 2),
    ("aece", "AECE", 2),
    ("mce", "MCE", 2),
    ("classwise_ece", "cw-ECE", 3),
    ("oece", "O-ECE", 2),
    ("uece", "U-ECE", 2),
]


SEED_RUN = re.compile(r"^(?P<pre>.+?)-s(?P<seed>\d+)(?P<post>-.+)?$")  # e.g. csm-s2, ce-s0-maccal
SUMMARY_COLUMNS = [
    ("top1", "before_ts"),
    ("ece", "before_ts"),
    ("nll", "before_ts"),
    ("ece", "after_ts"),
]


def seed_summary(rows: list[tuple[str, str, dict]]) -> list[str]:
    """Mean ± std (sample std) over runs that differ only in their `-s<seed>` part."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for stage, name, ev in rows:
        m = SEED_RUN.match(name)
        if m:
            groups.setdefault((stage, m["pre"] + (m["post"] or "")), []).append(ev)
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return []
    lines_ = [
        "## Mean ± std over seeds",
        "",
        "Runs named `<name>-s<seed>[-<method>]`, grouped by everything but the seed.",
        "",
        "| runs | stage | n | top-1 | ECE | NLL | ECE after TS |",
        "|---|---|---|---|---|---|---|",
    ]
    for (stage, name), evs in sorted(groups.items()):
        cells = []
        for metric, when in SUMMARY_COLUMNS:
            v = np.array([ev[when][metric] for ev in evs], dtype=float)
            digits = 3 if metric == "nll" else 2
            cells.append(f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}")
        lines_.append(f"| {name} | {stage} | {len(evs)} | " + " | ".join(cells) + " |")
    return [*lines_, ""]


def write_report(root: Path) -> Path:
    """report.md: one row per evaluated run on disk (train, finetune, ensembles), side by side."""
    rows = []
    for stage in STAGE_FOLDERS:
        for path in sorted((root / stage).glob("*/metrics.json")):
            ev = read_json(path).get("evaluation")
            if ev:
                rows.append((stage, path.parent.name, ev))
    head = "| run | stage | loss | " + " | ".join(c[1] for c in REPORT_COLUMNS)
    lines_ = [
        f"# {root.name}: evaluated runs",
        "",
        "Test split; percentages x100 except NLL and Brier. "
        "Temperature T fitted on the val split (criterion `nll`: the val-NLL minimiser in "
        "[0.05, 20]; `ece`: the lowest val ECE on 0.1..10; METHODS §7). T on the edge of its "
        "range (marked !) means a degenerate fit.",
        "",
    ]
    for key, title in (
        ("before_ts", "Before temperature scaling"),
        ("after_ts", "After temperature scaling"),
    ):
        extra = " | T |" if key == "after_ts" else " |"
        lines_ += [
            f"## {title}",
            "",
            head + extra,
            "|" + "---|" * (len(REPORT_COLUMNS) + 3 + (key == "after_ts")),
        ]
        for stage, name, ev in rows:
            cells = [f"{ev[key][c]:.{d}f}" for c, _, d in REPORT_COLUMNS]
            edge = "!" if ev.get("temperature_on_edge") else ""
            t = [f"{ev['temperature']:.2f}{edge}"] if key == "after_ts" else []
            lines_.append(
                "| " + " | ".join([name, stage, ev.get("loss", "") or "-", *cells, *t]) + " |"
            )
        lines_.append("")
    lines_ += seed_summary(rows)
    ood = [(s, n, ev) for s, n, ev in rows if "ood" in ev]
    if ood:
        lines_ += [
            "## OOD detection (ID = positive)",
            "",
            "| run | stage | OOD set | MSP AUROC | FPR95 | entropy AUROC | MSP AUROC after TS |",
            "|---|---|---|---|---|---|---|",
        ]
        for s, n, ev in ood:
            b, a = ev["ood"]["before_ts"], ev["ood"]["after_ts"]
            lines_.append(
                f"| {n} | {s} | {ev['ood']['set']} | {b['msp_auroc']:.2f} | {b['msp_fpr95']:.2f} | {b['entropy_auroc']:.2f} | {a['msp_auroc']:.2f} |"
            )
        lines_.append("")
    corr = [(s, n, ev) for s, n, ev in rows if "corruptions" in ev]
    if corr:
        lines_ += [
            "## Corruptions: mean ECE per severity (before / after TS)",
            "",
            "| run | stage | " + " | ".join(f"s{i}" for i in range(1, 6)) + " |",
            "|---|---|" + "---|" * 5,
        ]
        for s, n, ev in corr:
            b, a = ev["corruptions"]["before_ts"]["mean"], ev["corruptions"]["after_ts"]["mean"]
            lines_.append(
                f"| {n} | {s} | "
                + " | ".join(
                    f"{b[str(i)]['ece']:.2f} / {a[str(i)]['ece']:.2f}" for i in range(1, 6)
                )
                + " |"
            )
        lines_.append("")
    path = root / "report.md"
    atomic_write_bytes(path, "\n".join(lines_).encode())
    return path


# ---------------------------------------------------------------- the stage


def trained_runs(root: Path) -> list[str]:
    """Every run with final weights under train/ and finetune/, in report order."""
    names = []
    for stage in ("train", "finetune"):
        names += [p.parent.name for p in sorted((root / stage).glob(f"*/{META}"))]
    return list(dict.fromkeys(names))


def run(cfg: Config) -> Path:
    if not cfg.run and not cfg.runs:  # `make evaluate`: refresh every run, then the report
        names = trained_runs(cfg.root)
        if not names:
            raise ShardError(
                f"no trained runs under {cfg.root}/train or /finetune: run `make train` first"
            )
        report = cfg.root / "report.md"
        for name in names:
            report = run(dataclasses.replace(cfg, run=name))
        return report
    procs = Processes()
    if not procs.is_main:  # evaluation is cheap and writes shared files: the main process does it
        procs.barrier()
        return cfg.root / "report.md"
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    # 1. Runs and the real val/test splits.
    names = cfg.run_names()
    folders = {n: find_run(cfg.root, n, cfg.stage_dir) for n in names}
    test, val = load_real(cfg.root / "real" / "test"), load_real(cfg.root / "real" / "val")
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
    results = {}
    for n, lg in test_logits.items():
        t = temps[n]
        meta = models[n][1] if n in models else {}
        results[n] = {
            "run": n,
            "stage": folders[n].parent.name if n in folders else ENSEMBLE,
            "loss": meta.get("loss", meta.get("method", "")) if n in models else "ensemble",
            "temperature": t,
            "ts_criterion": cfg.ts_criterion,
            "temperature_on_edge": temperature_on_edge(t, cfg.ts_criterion),
            "before_ts": calibration_metrics(lg, test.labels),
            "after_ts": calibration_metrics(lg / t, test.labels),
            "code_version": code_version(),
        }
    # 3. Optional OOD set and corruptions.
    if cfg.ood:
        folder = ood_folder(cfg.ood)
        ood_logits = logits_of(load_real(folder).images)
        for n, r in results.items():
            t = temps[n]
            r["ood"] = {
                "set": str(
                    folder.parent.parent.name if folder.parent.name == "real" else folder.name
                ),
                "before_ts": ood_scores(test_logits[n], ood_logits[n]),
                "after_ts": ood_scores(test_logits[n] / t, ood_logits[n] / t),
            }
    if cfg.corruptions:
        sets, labels = corruption_sets(cfg.corruptions)
        for n, c in corruption_metrics(sets, labels, logits_of, temps).items():
            results[n]["corruptions"] = c
    # 4. Files per run (and ensemble), then report.md from everything evaluated so far.
    for n, r in results.items():
        lg, t = test_logits[n], temps[n]
        panels = {
            "before TS": panel(lg, test.labels),
            f"after TS (T = {t:.2f})": panel(lg / t, test.labels),
        }
        if n in folders:
            out, extra = folders[n], None
        else:
            out = cfg.root / ENSEMBLE / n
            out.mkdir(parents=True, exist_ok=True)
            extra = {
                "ensemble": {
                    "members": names,
                    "folders": [str(folders[m].relative_to(cfg.root)) for m in names],
                }
            }
        write_outputs(out, r, lg, test.labels, test.class_names, panels, extra)
        b, a = r["before_ts"], r["after_ts"]
        log.info(
            "%s: top-1 %.2f %%, NLL %.4f, ECE %.2f %% -> after TS (T = %.2f): NLL %.4f, ECE %.2f %%",
            n,
            b["top1"],
            b["nll"],
            b["ece"],
            t,
            a["nll"],
            a["ece"],
        )
    report = write_report(cfg.root)
    procs.barrier()
    return report
