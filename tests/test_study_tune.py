"""`make study`'s tuning (pipeline/study/tuning.py): one grid of the same size per method, chosen
by val NLL, a choice on the grid's edge extending it once; on fake metrics.json files and on a
tiny real grid (digits, one epoch per run, subprocesses as in real use)."""

import json
import math
import shutil
from itertools import chain

import numpy as np
import pytest
from scipy.stats import sem

from core.config import ConfigError
from core.tree import leaves
from pipeline.study.config import METHODS, StudyConfig, StudyError
from pipeline.study.execute import _execute, execute
from pipeline.study.plan import plan
from pipeline.study.tuning import (
    GRIDS,
    LETTERS,
    POINTS,
    REFERENCE,
    TUNE_SEED,
    choose,
    choose_point,
    grid_points,
    step_out,
    tune_run,
    tuning_group,
)
from pipeline.study.tuning_plan import tuning_report, tuning_tasks
from stages.configs import finetune as finetune_config
from stages.configs import train as train_config


def test_every_method_gets_a_grid_of_the_same_size_over_its_own_fields():
    for group, grid in GRIDS.items():
        m = METHODS[group]
        assert len(grid_points(group)) == POINTS, group
        assert all(v > 0 for values in grid.values() for v in values)  # geometric steps
        assert all(len(set(values)) == len(values) > 1 for values in grid.values())
        if group == "ce":  # ce has no loss parameter: its weight decay
            assert set(grid) == {"weight_decay"}
        elif m.stage == "train":  # the loss's own parameters (train's loss section)
            loss = next(s.split("=")[1] for s in m.sets if s.startswith("loss="))
            own = set(train_config.LOSS.fields_of(loss).values())
            assert set(grid) <= own, group
        else:  # MaC-Cal's bottleneck width and its q schedule's start
            assert set(grid) <= {"maccal_r", *finetune_config.METHOD.fields_of("maccal").values()}
            config = finetune_config.Config  # a name its --set takes: a leaf or a flat name
            assert set(grid) <= {*(leaf.path for leaf in leaves(config)), *config.LEGACY}
        assert set(grid) <= set(LETTERS)
    # every method has a grid, ce too (the primary endpoints' methods above all)
    assert {m for m in METHODS if not tuning_group(m)} == set()


def test_every_grids_reference_is_a_grid_point_and_the_untuned_default():
    """The rule falls back to REFERENCE: a point of the grid, the value the method runs with
    untuned (the configs' defaults; csm's s is annotate's sharpening, 0 in train = take it)."""
    train = train_config.Config(run="x").to_dict()  # the defaults, by their flat names
    finetune = finetune_config.Config(run="x").to_dict()
    from pipeline.registry import resolve_stage_config

    for group, reference in REFERENCE.items():
        assert reference in grid_points(group), group
        for key, value in reference.items():
            if key in finetune and key.startswith("maccal"):
                assert finetune[key] == value, (group, key)
            elif key != "csm_sharpening":
                loss = next(s for s in METHODS[group].sets if s.startswith("loss="))
                recorded = resolve_stage_config("train", "fashion-mnist", [loss]).recorded()
                assert recorded.get(key, train.get(key)) == value, (group, key)
    assert resolve_stage_config("annotate", "fashion-mnist", []).sharpening == 4.0


def _rows(points: dict[str, list[float]], reference: str = "ref") -> list[dict]:
    return [{"run": name, "x": name, "val_nll_seeds": nlls} for name, nlls in points.items()]


@pytest.mark.parametrize(
    ("points", "chosen", "kept"),
    [
        # a clear winner: 0.02 better at every seed, the SE of its gaps is 0
        ({"ref": [0.40, 0.42, 0.41], "a": [0.38, 0.40, 0.39]}, "a", False),
        # the lowest mean, but its gaps (+0.03, -0.02, +0.02) are noise: SE 0.015 > 0.01
        ({"ref": [0.40, 0.42, 0.41], "a": [0.37, 0.44, 0.39]}, "ref", True),
        # the reference is the lowest: it stays
        ({"a": [0.45, 0.46, 0.44], "ref": [0.40, 0.42, 0.41]}, "ref", True),
        # ties of the mean: the first in grid order is the winner, and it must beat the SE
        ({"a": [0.39, 0.41, 0.40], "b": [0.39, 0.41, 0.40], "ref": [0.40, 0.42, 0.41]}, "a", False),
    ],
)
def test_the_tuning_rule_keeps_the_reference_unless_the_winner_beats_its_noise(
    points, chosen, kept
):
    result = choose_point(_rows(points), {"x": "ref"})
    assert result["chosen"]["run"] == chosen and result["kept_reference"] is kept
    winner = min(points, key=lambda k: sum(points[k]))
    gaps = np.subtract(points["ref"], points[winner])
    assert result["winner"] == winner
    assert result["advantage"] == pytest.approx(gaps.mean(), abs=1e-6)
    if winner != "ref":  # the SE against scipy's
        assert result["standard_error"] == pytest.approx(sem(gaps), abs=1e-6)
        assert kept == (gaps.mean() <= sem(gaps))


@pytest.mark.parametrize(
    ("points", "chosen"),
    [
        # a diverged point first in grid order (NaN compares false both ways) never wins
        ({"nan": [math.nan, 0.1, 0.1], "ref": [0.40, 0.42, 0.41], "a": [0.38, 0.40, 0.39]}, "a"),
        ({"a": [0.38, 0.40, 0.39], "ref": [0.40, 0.42, 0.41], "inf": [0.1, math.inf, 0.1]}, "a"),
        # a diverged reference gives way to the lowest finite point, noise or not
        ({"ref": [math.nan] * 3, "a": [0.45, 0.40, 0.44], "b": [0.50, 0.50, 0.50]}, "a"),
    ],
)
def test_a_diverged_point_never_wins(points, chosen):
    result = choose_point(_rows(points), {"x": "ref"})
    assert result["chosen"]["run"] == chosen == result["winner"]


def test_a_grid_whose_every_point_diverged_is_one_line():
    with pytest.raises(StudyError, match="every point of the grid of ref diverged"):
        choose_point(_rows({"ref": [math.nan] * 3, "a": [math.inf] * 3}), {"x": "ref"})


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


SEEDS = (TUNE_SEED, TUNE_SEED + 1, TUNE_SEED + 2)  # StudyConfig.tune_seeds = 3


def test_plan_gives_every_method_the_same_grid_at_the_same_tuning_seeds(tmp_path):
    root = tmp_path / "digits"
    cfg = StudyConfig(
        stack=False, methods=("ce", "ls", "focal", "ce+maccal"), seeds=(0,), robustness=False
    )
    tasks = {t.name: t for t in plan(cfg, "digits", ["train.epochs=1"], root)}
    tune = {n for n in tasks if n.startswith("tune-")}
    points = {
        "ce": ["tune-ce-wd0p00025", "tune-ce-wd0p0005", "tune-ce-wd0p001", "tune-ce-wd0p002"],
        "ls": ["tune-ls-a0p02", "tune-ls-a0p05", "tune-ls-a0p1", "tune-ls-a0p2"],
        "focal": ["tune-focal-g1", "tune-focal-g2", "tune-focal-g3", "tune-focal-g5"],
        "ce+maccal": [
            "tune-ce-r128-q0p7-maccal", "tune-ce-r128-q0p9-maccal",
            "tune-ce-r256-q0p7-maccal", "tune-ce-r256-q0p9-maccal",
        ],
    }  # fmt: skip
    # every point and extension at each tuning seed: the first keeps the name it always had
    runs = {g: [tune_run(g, p, seed) for p in grid_points(g) for seed in SEEDS] for g in points}
    assert tune_run("ce+maccal", {"maccal_r": 128, "maccal_q0": 0.7}, 101) == (
        "tune-ce-r128-q0p7-t101-maccal"
    )
    assert [r for r in runs["ls"][:3]] == [
        "tune-ls-a0p02",
        "tune-ls-a0p02-t101",
        "tune-ls-a0p02-t102",
    ]
    exts = {g: [tune_run(g, p, seed) for p in GRIDS[g] for seed in SEEDS] for g in points}
    assert tune == set(chain(*runs.values(), *exts.values()))
    assert {len(g) for g in points.values()} == {POINTS}  # the same budget for every method
    for group, names in points.items():
        assert [tune_run(group, p) for p in grid_points(group)] == names
        for point in grid_points(group):
            for seed in SEEDS:
                stage, sets = tasks[tune_run(group, point, seed)].steps[0]
                assert f"seed={seed}" in sets and not tasks[tune_run(group, point, seed)].done
                config = {"train": train_config, "finetune": finetune_config}[stage].Config
                paths = config.LEGACY  # a grid parameter is set under its path in the tree
                assert {f"{paths.get(k, k)}={v:g}" for k, v in point.items()} <= set(sets)
                assert stage == ("finetune" if group == "ce+maccal" else "train")
        for name in exts[group]:  # an extension waits for its whole grid, every seed
            assert set(runs[group]) <= tasks[name].after and tasks[name].prepare is not None
    ls_sets = tasks["tune-ls-a0p1"].steps[0][1]
    assert "loss=ls" in ls_sets and "epochs=1" in ls_sets and "run=tune-ls-a0p1" in ls_sets
    # MaC-Cal's grid fine-tunes its own copy of ce's chosen runs, so it waits for ce's tuning
    ft_sets = tasks["tune-ce-r128-q0p7-t101-maccal"].steps[0][1]
    assert "run=tune-ce-r128-q0p7-t101" in ft_sets and "method=maccal" in ft_sets
    assert tasks["tune-ce-r128-q0p7-maccal"].after == {*runs["ce"], *exts["ce"]}
    # each study run waits for its method's grid and extensions, and only for those
    assert tasks["ls-s0"].after == {*runs["ls"], *exts["ls"]}
    assert tasks["focal-s0"].after == {*runs["focal"], *exts["focal"]}
    assert tasks["ce-s0"].after == {*runs["ce"], *exts["ce"]}
    assert tasks["ce-s0-maccal"].after == {
        "ce-s0", *runs["ce"], *exts["ce"], *runs["ce+maccal"], *exts["ce+maccal"]
    }  # fmt: skip
    names = list(tasks)  # a grid joins the list just before its method's runs
    assert names.index("tune-ls-ext-a-t102") < names.index("ls-s0") < names.index("tune-focal-g1")
    untuned = StudyConfig(
        stack=False, methods=cfg.methods, seeds=(0,), tune=False, robustness=False
    )
    assert not any(t.name.startswith("tune-") for t in plan(untuned, "digits", [], root))
    with pytest.raises(ConfigError, match="tune_seeds >= 2"):
        StudyConfig(tune_seeds=1)


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


def _point(root, group: str, at, nll: float, spread=(0.0, 0.01, 0.02)) -> None:
    """A point's runs at every tuning seed, val NLL nll + spread[i] at seed i: the same spread
    for every point, so paired gaps are exact and their standard error 0 (a clear choice)."""
    make = _finetune_run if METHODS[group].stage == "finetune" else _train_run
    for seed, extra in zip(SEEDS, spread):
        make(root, tune_run(group, at, seed), round(nll + extra, 4))


def _tasks(root, methods, ce: bool = True):
    """The plan's tasks; `ce`: with ce's grid run, its reference chosen (the report reads it)."""
    cfg = StudyConfig(stack=False, methods=methods, seeds=(0,), robustness=False)
    if ce and not (root / "train" / "tune-ce-wd0p0005").exists():
        for wd in GRIDS["ce"]["weight_decay"]:
            _point(root, "ce", {"weight_decay": wd}, 0.3 if wd == 5e-4 else 0.4)
    return cfg, {t.name: t for t in plan(cfg, "digits", [], root)}


def test_a_choice_on_the_edge_runs_one_step_beyond_and_is_made_again(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"))
    for alpha, nll in zip((0.02, 0.05, 0.1, 0.2), (0.50, 0.40, 0.35, 0.30)):  # best at the max
        _point(root, "ls", {"ls_alpha": alpha}, nll)
    for seed in SEEDS:  # every seed's extension runs the same stepped point
        assert tasks[tune_run("ls", "ls_alpha", seed)].prepare() == ["loss.ls.alpha=0.4"]
    # the extension is not done yet: plan says so, and a study run waits for it
    _, again = _tasks(root, ("ce", "ls"))
    assert not again["tune-ls-ext-a"].done and "tune-ls-ext-a-t102" in again["ls-s0"].after
    _point(root, "ls", "ls_alpha", 0.20)  # better still: the choice moves to it
    assert tasks["ls-s0"].prepare() == ["loss.ls.alpha=0.4"]
    result = tuning_report(cfg, root, [])["ls"]
    assert result["chosen"] == {"ls_alpha": 0.4} and result["extended"] == {"ls_alpha": 0.4}
    assert result["chosen_run"] == "tune-ls-ext-a" and len(result["grid"]) == POINTS + 1
    assert result["chosen_runs"] == [tune_run("ls", "ls_alpha", seed) for seed in SEEDS]
    assert [r["extension"] for r in result["grid"]] == [False] * POINTS + [True]
    # scored at the best-val-accuracy epoch, the mean over the seeds
    assert result["grid"][2]["val_nll_seeds"] == [0.35, 0.36, 0.37]
    assert result["grid"][2]["val_nll"] == 0.36
    assert result["reference"] == {"ls_alpha": 0.05} and result["seeds"] == list(SEEDS)
    for seed in SEEDS:
        shutil.rmtree(root / "train" / tune_run("ls", "ls_alpha", seed))
    _point(root, "ls", "ls_alpha", 0.31)  # worse: the grid's edge stays chosen
    assert tasks["ls-s0"].prepare() == ["loss.ls.alpha=0.2"]


def test_a_winner_inside_the_seeds_noise_gives_way_to_the_reference(tmp_path):
    """0.2 has the lowest mean (0.395 vs the reference 0.05's 0.40) but its gaps to it swing
    from +0.04 to -0.03: the reference is chosen, interior, so nothing extends."""
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"))
    _point(root, "ls", {"ls_alpha": 0.02}, 0.50)
    _point(root, "ls", {"ls_alpha": 0.05}, 0.40, (0.0, 0.0, 0.0))
    _point(root, "ls", {"ls_alpha": 0.1}, 0.45)
    _point(root, "ls", {"ls_alpha": 0.2}, 0.40, (-0.04, 0.03, -0.004))
    assert tasks["tune-ls-ext-a"].prepare() is None
    assert tasks["ls-s0"].prepare() == ["loss.ls.alpha=0.05"]
    result = tuning_report(cfg, root, [])["ls"]
    assert result["rule"]["winner"] == "tune-ls-a0p2" and result["rule"]["kept_reference"]
    assert result["rule"]["advantage"] < result["rule"]["standard_error"]
    assert result["chosen_run"] == "tune-ls-a0p05" and result["extended"] == {}


def test_an_interior_choice_skips_the_extension(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"))
    for alpha, nll in zip((0.02, 0.05, 0.1, 0.2), (0.50, 0.35, 0.30, 0.40)):
        _point(root, "ls", {"ls_alpha": alpha}, nll)
    ext = tasks["tune-ls-ext-a"]
    assert ext.prepare() is None  # nothing to run
    logs = tmp_path / "logs"
    logs.mkdir()
    _execute(ext, "digits", logs)  # no subprocess: the log says so, no run folder appears
    assert "nothing to run" in (logs / "tune-ls-ext-a.log").read_text()
    assert not (root / "train" / "tune-ls-ext-a").exists()
    _, again = _tasks(root, ("ce", "ls"))  # a rerun's plan knows it is done
    assert all(again[tune_run("ls", "ls_alpha", seed)].done for seed in SEEDS)
    assert tasks["ls-s0"].prepare() == ["loss.ls.alpha=0.1"]
    result = tuning_report(cfg, root, [])["ls"]
    assert result["extended"] == {} and result["chosen_run"] == "tune-ls-a0p1"


def test_two_parameters_on_edges_extend_each_at_the_others_choice(tmp_path):
    root = tmp_path / "digits"
    _, tasks = _tasks(root, ("ce", "fedlas-ls"))
    nll = {(0.05, 2.0): 0.5, (0.05, 4.0): 0.5, (0.1, 2.0): 0.3, (0.1, 4.0): 0.4}
    for p in grid_points("fedlas-ls"):
        _point(root, "fedlas-ls", p, nll[tuple(p.values())])
    assert tasks["tune-fedlas-ls-ext-a"].prepare() == [
        "loss.fedlas_ls.alpha=0.2",
        "loss.fedlas_ls.beta=2",
    ]
    assert tasks["tune-fedlas-ls-ext-b-t101"].prepare() == [
        "loss.fedlas_ls.alpha=0.1", "loss.fedlas_ls.beta=1"
    ]  # fmt: skip


def test_maccal_is_tuned_on_its_base_methods_chosen_runs_seed_by_seed(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ce+maccal"))  # ce keeps its reference, 5e-4
    for wd in GRIDS["ce"]["weight_decay"]:
        for seed in SEEDS:
            run = root / "train" / tune_run("ce", {"weight_decay": wd}, seed)
            (run / "model.safetensors").write_text(f"ce weights {wd} {seed}")
    nll = {(128, 0.7): 0.5, (128, 0.9): 0.4, (256, 0.7): 0.45, (256, 0.9): 0.3}
    for p in grid_points("ce+maccal"):
        _point(root, "ce+maccal", p, nll[tuple(p.values())])
    # (256, 0.9): both on their grid's upper edge
    assert tasks["tune-ce-ext-r-maccal"].prepare() == ["maccal.r=512", "maccal_q0=0.9"]
    assert tasks["tune-ce-ext-q-t102-maccal"].prepare() == ["maccal.r=256", "maccal_q0=1"]
    for seed, name in ((100, "tune-ce-ext-r"), (102, "tune-ce-ext-q-t102")):
        base = root / "train" / tune_run("ce", {"weight_decay": 5e-4}, seed) / "model.safetensors"
        copy = root / "train" / name / "model.safetensors"  # the chosen ce run of its seed
        assert copy.stat().st_ino == base.stat().st_ino
    _point(root, "ce+maccal", "maccal_r", 0.35)
    _point(root, "ce+maccal", "maccal_q0", 0.25)
    assert tasks["ce-s0-maccal"].prepare() == ["maccal.r=256", "maccal_q0=1"]
    assert tasks["ce-s0"].prepare() == ["optim.weight_decay=0.0005"]
    result = tuning_report(cfg, root, [])["ce+maccal"]
    assert result["base"] == [tune_run("ce", {"weight_decay": 5e-4}, seed) for seed in SEEDS]
    assert result["chosen_run"] == "tune-ce-ext-q-maccal"
    assert result["extended"] == {"maccal_r": 512, "maccal_q0": 1.0}


def test_csm_family_and_csm_maccal_take_csm_grids_choice(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "csm", "csm-ratio", "csm3", "csm+maccal"))
    tuned = tuning_tasks(cfg, root, [])
    csm = ["tune-csm-w0p5-s2p3", "tune-csm-w0p5-s4", "tune-csm-w1-s2p3", "tune-csm-w1-s4"]
    csm3 = ["tune-csm3-s3", "tune-csm3-s4", "tune-csm3-s5p4", "tune-csm3-s7p3"]
    assert [t.name for t in tuned["csm"] if t.role == "grid" and t.seed == TUNE_SEED] == csm
    assert [t.name for t in tuned["csm3"] if t.role == "grid" and t.seed == TUNE_SEED] == csm3
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
    for p, nll in zip(grid_points("csm"), (0.50, 0.31, 0.30, 0.45)):
        _point(root, "csm", p, nll)
    assert tasks["tune-csm-ext-w"].prepare() == ["loss.csm.weight=2", "loss.csm.sharpening=2.3"]
    assert tasks["tune-csm-ext-s"].prepare() == ["loss.csm.weight=1", "loss.csm.sharpening=1.32"]
    _point(root, "csm", "csm_weight", 0.40)
    _point(root, "csm", "csm_sharpening", 0.35)
    assert tasks["csm-s0"].prepare() == ["loss.csm.weight=1", "loss.csm.sharpening=2.3"]
    train_cmd = tasks["csm-s0"].commands("digits", ["loss.csm.weight=1"])[0]  # the train step's
    assert train_cmd[-1] == "loss.csm.weight=1" and "evaluate" not in train_cmd
    for p, nll in zip(grid_points("csm3"), (0.4, 0.3, 0.2, 0.25)):
        _point(root, "csm3", p, nll)
    assert tasks["tune-csm3-s4"].prepare() == ["loss.csm.weight=1"]  # csm's w, its own s
    assert tasks["tune-csm3-ext-s"].prepare() is None  # 5.4 is interior
    assert tasks["csm3-s0"].prepare() == ["loss.csm.weight=1", "loss.csm.sharpening=5.4"]
    # csm+maccal fine-tunes csm's chosen grid runs, its own grid
    for seed in SEEDS:
        run = root / "train" / tune_run("csm", {"csm_weight": 1.0, "csm_sharpening": 2.3}, seed)
        (run / "model.safetensors").write_text(f"csm weights {seed}")
    assert tasks["tune-csm-r128-q0p7-t101-maccal"].prepare() == []
    copy = root / "train" / "tune-csm-r128-q0p7-t101" / "model.safetensors"
    assert copy.read_text() == "csm weights 101"
    assert {t.name for t in tuned["csm+maccal"]} <= tasks["csm-s0-maccal"].after


def test_a_tiny_grid_runs_chooses_on_val_and_is_not_run_again(digits_root, tmp_path):
    """ls's real grid on digits, one epoch per run, at two tuning seeds: every point at each
    seed, an extension exactly where the rule's choice is on an edge, the choice by the rule,
    and a rerun's plan has nothing left to run."""
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    root = tmp_path / "digits"
    sets = [f"out={tmp_path}", "train.epochs=1", "train.milestones="]
    cfg = StudyConfig(stack=False, methods=("ce", "ls"), seeds=(0,), robustness=False, tune_seeds=2)
    tasks = plan(cfg, "digits", sets, root)
    tune = [t for t in tasks if t.name.startswith("tune-ls")]
    assert len(tune) == (4 + 1) * 2  # ls's grid + its extension, at each seed
    execute([tasks[0], *tune], "digits", 2, tmp_path / "logs")  # real/ (done) and ls's grid
    result = choose(root, tuning_tasks(cfg, root, sets)["ls"])
    grid = [r for r in result["grid"] if not r["extension"]]
    reference = next(r for r in grid if r["ls_alpha"] == REFERENCE["ls"]["ls_alpha"])
    assert choose_point(grid, REFERENCE["ls"])["chosen"]["run"] in {r["run"] for r in grid}
    for r in result["grid"]:  # every row the mean of its seeds' runs
        assert len(r["runs"]) == 2 and r["val_nll"] == pytest.approx(
            np.mean(r["val_nll_seeds"]), abs=1e-4
        )
        for run, seed in zip(r["runs"], (TUNE_SEED, TUNE_SEED + 1)):
            config = json.loads((root / "train" / run / "config.json").read_text())
            assert config["seed"] == seed and config["ls_alpha"] == r["ls_alpha"]
    grid_choice = choose_point(grid, REFERENCE["ls"])["chosen"]
    ext = step_out(GRIDS["ls"]["ls_alpha"], grid_choice["ls_alpha"], "ls_alpha")
    assert ("ls_alpha" in result["extended"]) == (ext is not None)
    assert (root / "train" / "tune-ls-ext-a" / "manifest.json").is_file() == (ext is not None)
    assert result["chosen_run"] == choose_point(result["grid"], REFERENCE["ls"])["chosen"]["run"]
    assert reference["val_nll_seeds"] and result["criterion"].startswith("mean val_nll")
    again = [t for t in plan(cfg, "digits", sets, root) if t.name.startswith("tune-ls")]
    assert all(t.done for t in again)


def test_the_report_names_each_methods_seeds_and_the_rule_behind_each_grid():
    from pipeline.study.report import _seeds_per_method, _tuning

    cfg = StudyConfig(methods=("ce", "csm", "csm3", "ls"), seeds=(0, 1, 2, 3, 4, 5))
    assert _seeds_per_method(cfg) == (
        "ce, csm x seeds 0, 1, 2, 3, 4, 5; csm3 x seeds 0, 1, 2, 3, 4; ls x seeds 0, 1, 2"
    )
    seeds = {"ref": [0.40, 0.42, 0.41], "a": [0.38, 0.40, 0.39], "nan": [math.nan] * 3}
    rows = [
        {"run": name, "x": float(i), "val_acc": 88.0, "val_ece": 2.0,
         "val_nll": float(np.mean(nlls)), "val_nll_seeds": nlls}
        for i, (name, nlls) in enumerate(seeds.items())
    ]  # fmt: skip
    rule = choose_point(rows, {"x": 0.0})
    chosen = rule.pop("chosen")
    result = {"grid": rows, "chosen": {"x": chosen["x"]}, "chosen_run": chosen["run"],
              "reference": {"x": 0.0}, "rule": rule, "seeds": [100, 101, 102]}  # fmt: skip
    text = "\n".join(_tuning({"g": result}))
    assert "each tuning seed (100, 101, 102" in text
    assert "| g | a | x = 1 | 88.00 | 2.00 | 0.3900 | **chosen** |" in text
    assert "| g | ref | x = 0 | 88.00 | 2.00 | 0.4100 | ref |" in text
    assert "| g | nan | x = 2 | 88.00 | 2.00 | nan | diverged |" in text
    assert "| g | a | +0.0200 | 0.0000 | a |" in text
