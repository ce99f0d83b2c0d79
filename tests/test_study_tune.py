"""`make study`'s tuning (pipeline/study_tune.py): one grid of the same size per method, chosen
by val NLL, a choice on the grid's edge extending it once; on fake metrics.json files and on a
tiny real grid (digits, one epoch per run, subprocesses as in real use)."""

import dataclasses
import json
import shutil
from itertools import chain

import pytest

from pipeline.study import _execute, execute, plan
from pipeline.study_config import METHODS, StudyConfig
from pipeline.study_tune import (
    GRIDS,
    LETTERS,
    POINTS,
    TUNE_SEED,
    grid_points,
    step_out,
    tune_run,
    tuning_group,
    tuning_report,
    tuning_tasks,
)
from stages.configs import finetune as finetune_config
from stages.configs import train as train_config


def test_every_method_gets_a_grid_of_the_same_size_over_its_own_fields():
    for group, grid in GRIDS.items():
        m = METHODS[group]
        assert len(grid_points(group)) == POINTS, group
        assert all(v > 0 for values in grid.values() for v in values)  # geometric steps
        assert all(len(set(values)) == len(values) > 1 for values in grid.values())
        if m.stage == "train":  # the loss's own parameters (train Config, LOSS_FIELDS)
            loss = next(s.split("=")[1] for s in m.sets if s.startswith("loss="))
            own = {*train_config.LOSS_FIELDS[loss].values(), "csm_sharpening"}
            assert set(grid) <= own, group
        else:  # MaC-Cal's bottleneck width and its q schedule's start
            assert set(grid) <= {"maccal_r", *finetune_config.METHOD.fields_of("maccal").values()}
            assert set(grid) <= {f.name for f in dataclasses.fields(finetune_config.Config)}
        assert set(grid) <= set(LETTERS)
    # every method with a hyper-parameter is tuned; ce alone has none
    assert {m for m in METHODS if not tuning_group(m)} == {"ce"}


@pytest.mark.parametrize(
    ("values", "chosen", "param", "expected"),
    [
        ((0.02, 0.05, 0.1, 0.2), 0.2, "ls_alpha", 0.4),  # above the max: 0.2 * (0.2 / 0.1)
        ((0.02, 0.05, 0.1, 0.2), 0.02, "ls_alpha", 0.008),  # below: 0.02 / (0.05 / 0.02)
        ((0.02, 0.05, 0.1, 0.2), 0.05, "ls_alpha", None),  # interior: nothing
        ((1.0, 2.0, 3.0, 5.0), 5.0, "focal_gamma", 8.33),  # 3 significant digits
        ((2.3, 4.0), 2.3, "csm_sharpening", 1.32),
        ((128, 256), 128, "maccal_r", 64),  # a whole number of units
        ((128, 256), 256, "maccal_r", 512),
        ((0.7, 0.9), 0.9, "maccal_q0", 1.0),  # 1.157 is no retention probability: q_max
        ((0.9, 1.0), 1.0, "maccal_q0", None),  # already at the limit: nothing to run
        ((0.7, 0.9), 0.7, "maccal_q0", 0.544),
    ],
)
def test_a_choice_on_the_edge_steps_out_geometrically_once(values, chosen, param, expected):
    assert step_out(values, chosen, param) == expected


def test_plan_gives_every_method_the_same_grid_at_the_tuning_seed(tmp_path):
    root = tmp_path / "digits"
    cfg = StudyConfig(methods=("ce", "ls", "focal", "ce+maccal"), seeds=(0,), robustness=False)
    tasks = {t.name: t for t in plan(cfg, "digits", ["train.epochs=1"], root)}
    tune = {n for n in tasks if n.startswith("tune-")}
    grids = {
        "ls": ["tune-ls-a0p02", "tune-ls-a0p05", "tune-ls-a0p1", "tune-ls-a0p2"],
        "focal": ["tune-focal-g1", "tune-focal-g2", "tune-focal-g3", "tune-focal-g5"],
        "ce+maccal": [
            "tune-ce-r128-q0p7-maccal", "tune-ce-r128-q0p9-maccal",
            "tune-ce-r256-q0p7-maccal", "tune-ce-r256-q0p9-maccal",
        ],
    }  # fmt: skip
    extensions = {
        "ls": ["tune-ls-ext-a"],
        "focal": ["tune-focal-ext-g"],
        "ce+maccal": ["tune-ce-ext-r-maccal", "tune-ce-ext-q-maccal"],
    }
    assert tune == {"tune-ce", *chain(*grids.values()), *chain(*extensions.values())}
    assert {len(g) for g in grids.values()} == {POINTS}  # the same budget for every method
    for group, names in grids.items():
        for name, point in zip(names, grid_points(group)):
            stage, sets = tasks[name].steps[0]
            assert f"seed={TUNE_SEED}" in sets and not tasks[name].done
            assert {f"{k}={v:g}" for k, v in point.items()} <= set(sets)
            assert stage == ("finetune" if group == "ce+maccal" else "train")
        for name in extensions[group]:  # an extension waits for its whole grid
            assert set(names) <= tasks[name].after and tasks[name].prepare is not None
    ls_sets = tasks["tune-ls-a0p1"].steps[0][1]
    assert "loss=ls" in ls_sets and "epochs=1" in ls_sets and "run=tune-ls-a0p1" in ls_sets
    # MaC-Cal's grid fine-tunes its own copy of tune-ce, a ce train run at the tuning seed
    assert tasks["tune-ce"].steps[0] == (
        "train", ["epochs=1", "loss=ce", "run=tune-ce", f"seed={TUNE_SEED}"]
    )  # fmt: skip
    ft_sets = tasks["tune-ce-r128-q0p7-maccal"].steps[0][1]
    assert "run=tune-ce-r128-q0p7" in ft_sets and "method=maccal" in ft_sets
    assert tasks["tune-ce-r128-q0p7-maccal"].after == {"tune-ce"}
    # each study run waits for its method's grid and extensions, and only for those
    assert tasks["ls-s0"].after == {*grids["ls"], *extensions["ls"]}
    assert tasks["focal-s0"].after == {*grids["focal"], *extensions["focal"]}
    assert tasks["ce-s0-maccal"].after == {
        "ce-s0", "tune-ce", *grids["ce+maccal"], *extensions["ce+maccal"]
    }  # fmt: skip
    assert tasks["ce-s0"].after == {"prepare"} and tasks["ce-s0"].prepare is None
    names = list(tasks)  # a grid joins the list just before its method's runs
    assert names.index("tune-ls-ext-a") < names.index("ls-s0") < names.index("tune-focal-g1")
    untuned = StudyConfig(methods=cfg.methods, seeds=(0,), tune=False, robustness=False)
    assert not any(t.name.startswith("tune-") for t in plan(untuned, "digits", [], root))


def _train_run(root, run: str, val_nll: float) -> None:
    """A finished train run as val_score reads it: its best-val-accuracy epoch has this NLL."""
    history = [
        {"epoch": 1, "val_acc": 80.0, "val_ece": 9.0, "val_nll": 9.9},
        {"epoch": 2, "val_acc": 90.0, "val_ece": 3.0, "val_nll": val_nll},
        {"epoch": 3, "val_acc": 85.0, "val_ece": 1.0, "val_nll": 0.01},  # not the kept epoch
    ]
    folder = root / "train" / run
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(
        json.dumps({"train": {"best_val_acc": 90.0, "history": history}})
    )
    (folder / "manifest.json").write_text("{}")


def _finetune_run(root, run: str, val_nll: float) -> None:
    """A finished fine-tuning: it keeps its last epoch, whose val NLL this is."""
    history = [
        {"epoch": 1, "val_acc": 91.0, "val_ece": 2.0, "val_nll": 0.01},  # not the kept epoch
        {"epoch": 2, "val_acc": 90.0, "val_ece": 3.0, "val_nll": val_nll},
    ]
    folder = root / "finetune" / run
    folder.mkdir(parents=True)
    (folder / "metrics.json").write_text(json.dumps({"finetune": {"history": history}}))
    (folder / "manifest.json").write_text("{}")


def _tasks(root, methods):
    cfg = StudyConfig(methods=methods, seeds=(0,), robustness=False)
    return cfg, {t.name: t for t in plan(cfg, "digits", [], root)}


def test_a_choice_on_the_edge_runs_one_step_beyond_and_is_made_again(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"))
    for alpha, nll in zip((0.02, 0.05, 0.1, 0.2), (0.50, 0.40, 0.35, 0.30)):  # best at the max
        _train_run(root, tune_run("ls", {"ls_alpha": alpha}), nll)
    assert tasks["tune-ls-ext-a"].prepare() == ["ls_alpha=0.4"]  # 0.2 * (0.2 / 0.1)
    # the extension is not done yet: plan says so, and a study run waits for it
    _, again = _tasks(root, ("ce", "ls"))
    assert not again["tune-ls-ext-a"].done and "tune-ls-ext-a" in again["ls-s0"].after
    _train_run(root, "tune-ls-ext-a", 0.20)  # better still: the choice moves to it
    assert tasks["ls-s0"].prepare() == ["ls_alpha=0.4"]
    result = tuning_report(cfg, root, [])["ls"]
    assert result["chosen"] == {"ls_alpha": 0.4} and result["extended"] == {"ls_alpha": 0.4}
    assert result["chosen_run"] == "tune-ls-ext-a" and len(result["grid"]) == POINTS + 1
    assert [r["extension"] for r in result["grid"]] == [False] * POINTS + [True]
    assert result["grid"][2]["val_nll"] == 0.35  # scored at the best-val-accuracy epoch
    shutil.rmtree(root / "train" / "tune-ls-ext-a")
    _train_run(root, "tune-ls-ext-a", 0.31)  # worse: the grid's edge stays chosen
    assert tasks["ls-s0"].prepare() == ["ls_alpha=0.2"]


def test_an_interior_choice_skips_the_extension(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"))
    for alpha, nll in zip((0.02, 0.05, 0.1, 0.2), (0.50, 0.30, 0.35, 0.40)):
        _train_run(root, tune_run("ls", {"ls_alpha": alpha}), nll)
    ext = tasks["tune-ls-ext-a"]
    assert ext.prepare() is None  # nothing to run
    logs = tmp_path / "logs"
    logs.mkdir()
    _execute(ext, "digits", logs)  # no subprocess: the log says so, no run folder appears
    assert "nothing to run" in (logs / "tune-ls-ext-a.log").read_text()
    assert not (root / "train" / "tune-ls-ext-a").exists()
    _, again = _tasks(root, ("ce", "ls"))  # a rerun's plan knows it is done
    assert again["tune-ls-ext-a"].done
    assert tasks["ls-s0"].prepare() == ["ls_alpha=0.05"]
    result = tuning_report(cfg, root, [])["ls"]
    assert result["extended"] == {} and result["chosen_run"] == "tune-ls-a0p05"


def test_two_parameters_on_edges_extend_each_at_the_others_choice(tmp_path):
    root = tmp_path / "digits"
    _, tasks = _tasks(root, ("ce", "fedlas-ls"))
    nll = {(0.05, 2.0): 0.5, (0.05, 4.0): 0.5, (0.1, 2.0): 0.3, (0.1, 4.0): 0.4}
    for p in grid_points("fedlas-ls"):
        _train_run(root, tune_run("fedlas-ls", p), nll[tuple(p.values())])
    assert tasks["tune-fedlas-ls-ext-a"].prepare() == ["fedlas_ls_alpha=0.2", "fedlas_ls_beta=2"]
    assert tasks["tune-fedlas-ls-ext-b"].prepare() == ["fedlas_ls_alpha=0.1", "fedlas_ls_beta=1"]


def test_maccal_is_tuned_on_its_own_base_run_by_the_last_epoch(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ce+maccal"))
    base = root / "train" / "tune-ce"
    base.mkdir(parents=True)
    (base / "model.safetensors").write_text("weights")
    nll = {(128, 0.7): 0.5, (128, 0.9): 0.4, (256, 0.7): 0.45, (256, 0.9): 0.3}
    for p in grid_points("ce+maccal"):
        _finetune_run(root, tune_run("ce+maccal", p), nll[tuple(p.values())])
    # (256, 0.9): both on their grid's upper edge
    assert tasks["tune-ce-ext-r-maccal"].prepare() == ["maccal_r=512", "maccal_q0=0.9"]
    assert tasks["tune-ce-ext-q-maccal"].prepare() == ["maccal_r=256", "maccal_q0=1"]
    copy = root / "train" / "tune-ce-ext-q"  # what that fine-tuning reads: tune-ce's weights
    assert (copy / "model.safetensors").stat().st_ino == (base / "model.safetensors").stat().st_ino
    _finetune_run(root, "tune-ce-ext-r-maccal", 0.35)
    _finetune_run(root, "tune-ce-ext-q-maccal", 0.25)
    assert tasks["ce-s0-maccal"].prepare() == ["maccal_r=256", "maccal_q0=1"]
    result = tuning_report(cfg, root, [])["ce+maccal"]
    assert result["base"] == "tune-ce" and result["chosen_run"] == "tune-ce-ext-q-maccal"
    assert result["extended"] == {"maccal_r": 512, "maccal_q0": 1.0}


def test_csm_family_and_csm_maccal_take_csm_grids_choice(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "csm", "csm-ratio", "csm3", "csm+maccal"))
    tuned = tuning_tasks(cfg, root, [])
    csm = ["tune-csm-w0p5-s2p3", "tune-csm-w0p5-s4", "tune-csm-w1-s2p3", "tune-csm-w1-s4"]
    csm3 = ["tune-csm3-s3", "tune-csm3-s4", "tune-csm3-s5p4", "tune-csm3-s7p3"]
    assert [t.name for t in tuned["csm"] if t.role == "grid"] == csm
    assert [t.name for t in tuned["csm3"] if t.role == "grid"] == csm3
    csm_all = {t.name for t in tuned["csm"]}
    for name in csm:
        sets = tasks[name].steps[0][1]
        assert tasks[name].after == {"chain"} and f"seed={TUNE_SEED}" in sets and "loss=csm" in sets
    for name in csm3:  # on the k = 3 set, after csm's grid and its extensions (its w)
        assert tasks[name].after == {"chain-k3", *csm_all}
        assert f"mixed={root.parent / 'digits-k3' / 'mixed'}" in tasks[name].steps[0][1]
    for name in ("csm-s0", "csm-ratio-s0"):
        assert csm_all <= tasks[name].after and tasks[name].extra_step == 0
    # csm's grid chooses (1, 2.3): w on its grid's max, s on its min, each steps out
    for run, nll in zip(csm, (0.50, 0.31, 0.30, 0.45)):
        _train_run(root, run, nll)
    assert tasks["tune-csm-ext-w"].prepare() == ["csm_weight=2", "csm_sharpening=2.3"]
    assert tasks["tune-csm-ext-s"].prepare() == ["csm_weight=1", "csm_sharpening=1.32"]
    _train_run(root, "tune-csm-ext-w", 0.40)
    _train_run(root, "tune-csm-ext-s", 0.35)
    assert tasks["csm-s0"].prepare() == ["csm_weight=1", "csm_sharpening=2.3"]
    train_cmd = tasks["csm-s0"].commands("digits", ["csm_weight=1"])[0]  # the train step's
    assert train_cmd[-1] == "csm_weight=1" and "evaluate" not in train_cmd
    for run, nll in zip(csm3, (0.4, 0.3, 0.2, 0.25)):
        _train_run(root, run, nll)
    assert tasks["tune-csm3-s4"].prepare() == ["csm_weight=1"]  # csm's w, its own s
    assert tasks["tune-csm3-ext-s"].prepare() is None  # 5.4 is interior
    assert tasks["csm3-s0"].prepare() == ["csm_weight=1", "csm_sharpening=5.4"]
    # csm+maccal fine-tunes csm's chosen grid run, its own grid
    (root / "train" / "tune-csm-w1-s2p3" / "model.safetensors").write_text("csm weights")
    assert tasks["tune-csm-r128-q0p7-maccal"].prepare() == []
    copy = root / "train" / "tune-csm-r128-q0p7" / "model.safetensors"
    assert copy.read_text() == "csm weights"
    assert {t.name for t in tuned["csm+maccal"]} <= tasks["csm-s0-maccal"].after


def test_a_tiny_grid_runs_chooses_on_val_and_is_not_run_again(digits_root, tmp_path):
    """ls's and ce+maccal's real grids on digits, one epoch per run: every point at the tuning
    seed, an extension exactly where the choice is on an edge, the choice is the lowest val NLL,
    and a rerun's plan has nothing left to run."""
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    root = tmp_path / "digits"
    sets = [f"out={tmp_path}", "train.epochs=1", "train.milestones=", "finetune.maccal_epochs=1"]
    cfg = StudyConfig(methods=("ce", "ls", "ce+maccal"), seeds=(0,), robustness=False)
    tune = [t for t in plan(cfg, "digits", sets, root) if t.name.startswith("tune-")]
    assert len(tune) == 1 + 4 + 1 + 4 + 2  # tune-ce, ls's grid + ext, MaC-Cal's grid + exts
    execute(tune, "digits", 2, tmp_path / "logs")
    report = tuning_report(cfg, root, sets)
    for group, stage in (("ls", "train"), ("ce+maccal", "finetune")):
        result = report[group]
        best = min(result["grid"], key=lambda r: r["val_nll"])
        assert result["chosen_run"] == best["run"]
        grid_best = min(
            (r for r in result["grid"] if not r["extension"]), key=lambda r: r["val_nll"]
        )
        for param, values in GRIDS[group].items():
            ext = step_out(values, grid_best[param], param)
            assert (param in result["extended"]) == (ext is not None)
            run = root / stage / tune_run(group, param)
            assert (run / "manifest.json").is_file() == (ext is not None)
            if ext is not None:  # the run was made with the stepped value at the tuning seed
                config = json.loads((run / "config.json").read_text())
                assert config[param] == ext and config["seed"] == TUNE_SEED
        for r in result["grid"]:
            config = json.loads((root / stage / r["run"] / "config.json").read_text())
            assert config["seed"] == TUNE_SEED
            assert all(config[k] == r[k] for k in GRIDS[group])
    again = [t for t in plan(cfg, "digits", sets, root) if t.name.startswith("tune-")]
    assert all(t.done for t in again)
