"""`make study`'s tuning (pipeline/study/tuning.py): every train method's own grid, then the
shared weight-decay grid at its choice (the same number of configurations), chosen by val NLL,
a choice without a tried neighbour on each side extending one geometric step at a time up to a
protocol bound; on fake metrics.json files and on a tiny real grid (digits, one epoch per run,
subprocesses as in real use)."""

import json
import math
import shutil
from itertools import chain

import numpy as np
import pytest
from scipy.stats import sem

from core.config import ConfigError
from core.tree import get, leaves
from pipeline.study import tuning_plan
from pipeline.study.config import METHODS, StudyConfig, StudyError
from pipeline.study.execute import _execute, execute
from pipeline.study.plan import plan
from pipeline.study.tuning import (
    BOUNDS,
    GRIDS,
    LETTERS,
    MAX_EXTENSIONS,
    REFERENCE,
    SHARED,
    TUNE_SEED,
    WEIGHT_DECAY,
    choose,
    choose_point,
    grid_points,
    next_point,
    planned_configurations,
    reference,
    refined,
    shares_weight_decay,
    tune_run,
    tuning_group,
)
from pipeline.study.tuning_plan import tuning_report, tuning_tasks
from stages.configs import finetune as finetune_config
from stages.configs import train as train_config

ALPHA = "loss.ls.alpha"  # ls's own grid parameter, by path


def test_every_method_gets_a_grid_of_the_same_size_over_its_own_fields():
    for group, grid in GRIDS.items():
        m = METHODS[group]
        # the same number of val configurations before any extension: a train method's own 4
        # points then the shared grid's 3 others, ce's 7 on the refined shared grid; MaC-Cal 4
        assert planned_configurations(group) == (7 if m.stage == "train" else 4), group
        assert all(v > 0 for values in grid.values() for v in values)  # geometric steps
        assert all(len(set(values)) == len(values) > 1 for values in grid.values())
        if group == "ce":  # ce has no loss parameter: its weight decay, the shared grid refined
            assert grid == {WEIGHT_DECAY: (1.25e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3)}
            assert set(SHARED.values) <= set(grid[WEIGHT_DECAY])
            assert WEIGHT_DECAY in {leaf.path for leaf in leaves(train_config.Config)}
        elif m.stage == "train":  # the loss's own parameters (train's loss section), by path
            loss = next(s.split("=")[1] for s in m.sets if s.startswith("loss="))
            assert set(grid) <= set(train_config.LOSS.paths_of(loss).values()), group
        else:  # MaC-Cal's bottleneck width and its q schedule's start, by path
            maccal = finetune_config.OBJECTIVE.paths_of("maccal").values()
            assert set(grid) <= {"maccal.r", *maccal}
            assert set(grid) <= {leaf.path for leaf in leaves(finetune_config.Config)}
        assert set(grid) <= set(LETTERS)
    # every method has a grid, ce too (the primary endpoints' methods above all)
    assert {m for m in METHODS if not tuning_group(m)} == set()


def test_every_grids_reference_is_a_grid_point_and_the_untuned_default():
    """The rule falls back to REFERENCE: a point of the grid, the value the method runs with
    untuned (the configs' defaults; csm's s is annotate's sharpening, 0 in train = take it)."""
    finetune = finetune_config.Config(run="x")  # the defaults
    from pipeline.registry import resolve_stage_config

    for group, ref in REFERENCE.items():
        assert ref in grid_points(group), group
        for path, value in ref.items():
            if path.startswith("maccal."):
                assert get(finetune, path) == value, (group, path)
            elif path != "loss.csm.sharpening":
                loss = next(s for s in METHODS[group].sets if s.startswith("loss="))
                cfg = resolve_stage_config("train", "fashion-mnist", [loss])
                assert get(cfg, path) == value, (group, path)
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


def _line(group: str, param: str, nll: dict[float, float]) -> list[dict]:
    """Rows along one parameter, the others at their reference: {value: val NLL at each seed}."""
    point = reference(group)
    return [
        {"run": f"{param}={v:g}", **point, param: v, "val_nll_seeds": [n, n + 0.01, n + 0.02]}
        for v, n in nll.items()
    ]


@pytest.mark.parametrize(
    ("group", "param", "nll", "expected"),
    [
        (
            "ls",
            "loss.ls.alpha",
            {0.02: 0.5, 0.05: 0.4, 0.1: 0.35, 0.2: 0.3},
            0.4,
        ),  # 0.2 * (0.2 / 0.1)
        ("ls", "loss.ls.alpha", {0.02: 0.3, 0.05: 0.4, 0.1: 0.45, 0.2: 0.5}, 0.008),  # 0.02 / 2.5
        ("ls", "loss.ls.alpha", {0.02: 0.5, 0.05: 0.3, 0.1: 0.4, 0.2: 0.5}, None),  # interior
        ("ls", "loss.ls.alpha", {0.1: 0.5, 0.2: 0.4, 0.4: 0.3}, 0.5),  # 0.8 passes 0.5: the bound
        ("ls", "loss.ls.alpha", {0.2: 0.5, 0.4: 0.4, 0.5: 0.3}, None),  # on the bound: nothing
        ("focal", "loss.focal.gamma", {1.0: 0.5, 2.0: 0.4, 3.0: 0.35, 5.0: 0.3}, 8.33),  # 3 digits
        ("csm", "loss.csm.sharpening", {2.3: 0.3, 4.0: 0.4}, 1.32),
        ("ce+maccal", "maccal.r", {128: 0.3, 256: 0.4}, 64),  # a whole number of units
        ("ce+maccal", "maccal.q0", {0.7: 0.4, 0.9: 0.3}, 1.0),  # 1.157 passes q_max = 1
        ("ce+maccal", "maccal.q0", {0.9: 0.4, 1.0: 0.3}, None),  # already at the bound
        ("ce", WEIGHT_DECAY, {1e-3: 0.5, 2e-3: 0.4, 4e-3: 0.35, 8e-3: 0.3}, 0.016),
    ],
)
def test_a_choice_without_a_neighbour_steps_out_geometrically_to_a_bound(
    group, param, nll, expected
):
    rows = _line(group, param, nll)
    if param == "loss.ls.alpha" and 0.05 not in nll:  # the reference row the rule needs, worst
        rows.append(_line(group, param, {0.05: 0.9})[0])
    if (param == "maccal.q0" and 0.9 not in nll) or param == WEIGHT_DECAY:
        rows.append(_line(group, param, {REFERENCE[group][param]: 0.9})[0])
    point = next_point(group, rows, param)
    assert (None if point is None else point[param]) == expected
    if point is not None:  # the other parameters at the choice's values
        assert {k: v for k, v in point.items() if k != param} == {
            k: v for k, v in reference(group).items() if k != param
        }
    lo, hi = BOUNDS[group][param]
    assert expected is None or lo <= expected <= hi


def test_the_refined_grid_adds_the_geometric_midpoints():
    assert refined((1.0, 4.0, 16.0)) == (1.0, 2.0, 4.0, 8.0, 16.0)
    assert refined((1e-4, 1e-2)) == (1e-4, 1e-3, 1e-2)


SEEDS = (TUNE_SEED, TUNE_SEED + 1, TUNE_SEED + 2)  # StudyConfig.tune_seeds = 3


def _exts(group: str, seeds=None) -> list[str]:
    """Every extension step's run of a group, at every tuning seed."""
    params = [*GRIDS[group], *([WEIGHT_DECAY] if shares_weight_decay(group) else [])]
    return [
        tune_run(group, (p, k), seed)
        for k in range(1, MAX_EXTENSIONS + 1)
        for p in params
        for seed in seeds or SEEDS
    ]


def _shared(group: str, seeds=None) -> list[str]:
    """The shared weight-decay grid's runs of a group (its reference is in its own grid)."""
    values = [v for v in SHARED.values if v != SHARED.reference]
    return [tune_run(group, {WEIGHT_DECAY: v}, seed) for v in values for seed in seeds or SEEDS]


def test_plan_gives_every_method_the_same_knobs_at_the_same_tuning_seeds(tmp_path):
    root = tmp_path / "digits"
    cfg = StudyConfig(
        stack=False, methods=("ce", "ls", "focal", "ce+maccal"), seeds=(0,), robustness=False
    )
    tasks = {t.name: t for t in plan(cfg, "digits", ["train.epochs=1"], root)}
    tune = {n for n in tasks if n.startswith("tune-")}
    points = {
        "ce": [
            "tune-ce-wd0p000125", "tune-ce-wd0p00025", "tune-ce-wd0p0005", "tune-ce-wd0p001",
            "tune-ce-wd0p002", "tune-ce-wd0p004", "tune-ce-wd0p008",
        ],
        "ls": ["tune-ls-a0p02", "tune-ls-a0p05", "tune-ls-a0p1", "tune-ls-a0p2"],
        "focal": ["tune-focal-g1", "tune-focal-g2", "tune-focal-g3", "tune-focal-g5"],
        "ce+maccal": [
            "tune-ce-r128-q0p7-maccal", "tune-ce-r128-q0p9-maccal",
            "tune-ce-r256-q0p7-maccal", "tune-ce-r256-q0p9-maccal",
        ],
    }  # fmt: skip
    # every point and extension at each tuning seed: the first keeps the name it always had
    runs = {g: [tune_run(g, p, seed) for p in grid_points(g) for seed in SEEDS] for g in points}
    assert tune_run("ce+maccal", {"maccal.r": 128, "maccal.q0": 0.7}, 101) == (
        "tune-ce-r128-q0p7-t101-maccal"
    )
    assert runs["ls"][:3] == ["tune-ls-a0p02", "tune-ls-a0p02-t101", "tune-ls-a0p02-t102"]
    # ls and focal then run the shared weight-decay grid; ce's grid is weight decay itself
    assert _shared("ls", [TUNE_SEED]) == [
        "tune-ls-wd0p000125",
        "tune-ls-wd0p002",
        "tune-ls-wd0p008",
    ]
    shared = {g: _shared(g) if shares_weight_decay(g) else [] for g in points}
    assert not shared["ce"] and not shared["ce+maccal"]
    exts = {g: _exts(g) for g in points}
    assert tune == set(chain(*runs.values(), *shared.values(), *exts.values()))
    # the same configurations before extensions: ce 7 values, ls and focal 4 own + 3 shared
    assert {len(points[g]) + len(shared[g]) // len(SEEDS) for g in ("ce", "ls", "focal")} == {7}
    for group, names in points.items():
        assert [tune_run(group, p) for p in grid_points(group)] == names
        for point in grid_points(group):
            for seed in SEEDS:
                stage, sets = tasks[tune_run(group, point, seed)].steps[0]
                assert f"seed={seed}" in sets and not tasks[tune_run(group, point, seed)].done
                # a grid parameter is set under its path, its key in the grid
                assert {f"{k}={v:g}" for k, v in point.items()} <= set(sets)
                assert stage == ("finetune" if group == "ce+maccal" else "train")
                if shares_weight_decay(group):  # its own grid at the reference decay
                    assert "optim.weight_decay=0.0005" in sets
        for name in shared[group]:  # the shared grid waits for the own grid, every seed
            assert set(runs[group]) <= tasks[name].after
        order = [*runs[group], *shared[group], *exts[group]]
        for i, name in enumerate(exts[group]):  # a step waits for every task before it
            before = order[: order.index(name)]
            assert set(before) - set(exts[group][i - i % len(SEEDS) :]) <= tasks[name].after
            assert tasks[name].prepare is not None
    ls_sets = tasks["tune-ls-a0p1"].steps[0][1]
    assert "loss=ls" in ls_sets and "epochs=1" in ls_sets and "run=tune-ls-a0p1" in ls_sets
    wd_sets = tasks["tune-ls-wd0p002-t101"].steps[0][1]
    assert "optim.weight_decay=0.002" in wd_sets and "seed=101" in wd_sets
    # MaC-Cal's grid fine-tunes its own copy of ce's chosen runs, so it waits for ce's tuning
    ft_sets = tasks["tune-ce-r128-q0p7-t101-maccal"].steps[0][1]
    assert "run=tune-ce-r128-q0p7-t101" in ft_sets and "objective=maccal" in ft_sets
    assert tasks["tune-ce-r128-q0p7-maccal"].after == {*runs["ce"], *exts["ce"]}
    # each study run waits for its method's tuning, and only for it
    assert tasks["ls-s0"].after == {*runs["ls"], *shared["ls"], *exts["ls"]}
    assert tasks["focal-s0"].after == {*runs["focal"], *shared["focal"], *exts["focal"]}
    assert tasks["ce-s0"].after == {*runs["ce"], *exts["ce"]}
    assert tasks["ce-s0-maccal"].after == {
        "ce-s0", *runs["ce"], *exts["ce"], *runs["ce+maccal"], *exts["ce+maccal"]
    }  # fmt: skip
    names = list(tasks)  # a group's tasks join the list just before its method's runs
    last = tune_run("ls", (WEIGHT_DECAY, MAX_EXTENSIONS), TUNE_SEED + 2)
    assert names.index(last) < names.index("ls-s0") < names.index("tune-focal-g1")
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
        for wd in GRIDS["ce"][WEIGHT_DECAY]:
            _point(root, "ce", {WEIGHT_DECAY: wd}, 0.3 if wd == 5e-4 else 0.4)
    return cfg, {t.name: t for t in plan(cfg, "digits", [], root)}


def _shared_points(root, group: str, nll: float = 0.9) -> None:
    """The shared weight-decay grid's runs of a group, each worse than its own grid's points."""
    for v in SHARED.values:
        if v != SHARED.reference:
            _point(root, group, {WEIGHT_DECAY: v}, nll)


def _values(sets) -> dict[str, float]:
    """The tuning parameters among --set values, by their paths (the grids' keys)."""
    pairs = (s.partition("=") for s in sets)
    return {k: float(v) for k, _, v in pairs if k in LETTERS}


def _run_tuning(root, tasks, group: str, nll_of) -> list[dict[str, float]]:
    """A group's tuning tasks run in plan order as the study runs them: each task's prepare
    first (None: nothing to run), then a fake train run whose val NLL is nll_of(its point) plus
    the seed's spread (0, 0.01, 0.02: paired gaps exact). Returns the points run, once each."""
    ran = []
    for t in tasks.values():
        if getattr(t, "group", "") != group:
            continue
        extra = t.prepare() if t.prepare else []
        if extra is None:
            continue
        point = {**reference(group), **_values([*t.steps[0][1], *extra])}
        make = _finetune_run if t.stage_dir == "finetune" else _train_run
        make(root, t.name, round(nll_of(point) + 0.01 * (t.seed - TUNE_SEED), 4))
        if t.seed == TUNE_SEED:
            ran.append(point)
    return ran


def _bowl(best: dict[str, float]):
    """A val NLL whose minimum is at `best`: 0.3 + the squared log distance to it."""
    return lambda p: 0.3 + sum(0.1 * math.log(p[k] / v) ** 2 for k, v in best.items())


def test_the_shared_grid_runs_at_each_methods_own_choice(tmp_path):
    """ce tunes weight decay alone on the refined shared grid; ls its α at the reference decay,
    then the shared decays at its chosen α: 7 configurations each before extensions, counted in
    study.json with them."""
    from pipeline.study.tuning_plan import configurations

    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"), ce=False)
    ce = _run_tuning(root, tasks, "ce", _bowl({WEIGHT_DECAY: 1e-3}))
    assert [p[WEIGHT_DECAY] for p in ce] == [*GRIDS["ce"][WEIGHT_DECAY]]  # interior: no step
    ls = _run_tuning(root, tasks, "ls", _bowl({ALPHA: 0.1, WEIGHT_DECAY: 2e-3}))
    # own grid at 5e-4, the shared grid's other decays at α = 0.1 (its own choice); the choice
    # (0.1, 2e-3) then needs α's neighbours at its decay: two steps, below first
    assert ls == [
        *({ALPHA: a, WEIGHT_DECAY: 5e-4} for a in GRIDS["ls"][ALPHA]),
        *({ALPHA: 0.1, WEIGHT_DECAY: v} for v in SHARED.values if v != 5e-4),
        {ALPHA: 0.05, WEIGHT_DECAY: 2e-3},
        {ALPHA: 0.2, WEIGHT_DECAY: 2e-3},
    ]
    assert tasks["tune-ls-wd0p002-t101"].prepare() == ["loss.ls.alpha=0.1"]
    assert tasks["ls-s0"].prepare() == ["loss.ls.alpha=0.1", "optim.weight_decay=0.002"]
    assert tasks["ce-s0"].prepare() == ["optim.weight_decay=0.001"]
    report = tuning_report(cfg, root, [])  # study.json's: config.json's keys, as ever
    assert report["ls"]["params"] == {"ls_alpha": [0.02, 0.05, 0.1, 0.2],
                                      "weight_decay": list(SHARED.values)}  # fmt: skip
    assert report["ls"]["chosen"] == {"ls_alpha": 0.1, "weight_decay": 2e-3}
    assert report["ls"]["interior"] == {"ls_alpha": True, "weight_decay": True}
    counts = configurations(cfg, report)
    assert counts["methods"] == {
        "ce": {"group": "ce", "configurations": 7}, "ls": {"group": "ls", "configurations": 9}
    }  # fmt: skip
    assert counts["primary"] == ["ce"] and counts["balanced"]  # ls is no primary method


def test_an_extension_reaches_an_interior_optimum_two_steps_beyond_the_grid(tmp_path):
    """focal's val NLL lowest at γ = 13.9, two geometric steps beyond its grid's 5 (5²/3 = 8.33,
    8.33²/5 = 13.9): the chain steps there, then once more (23.2, clamped to the bound 16) for
    a neighbour above, and stops with a tried neighbour on each side of both parameters."""
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "focal"))
    gamma = "loss.focal.gamma"
    ran = _run_tuning(root, tasks, "focal", _bowl({gamma: 13.9, WEIGHT_DECAY: 5e-4}))
    steps = ran[7:]  # after the 4 own points and the 3 shared decays
    assert steps == [
        {gamma: 8.33, WEIGHT_DECAY: 5e-4},  # step 1 of γ
        {gamma: 8.33, WEIGHT_DECAY: 1.25e-4},  # decay's neighbours at the new γ
        {gamma: 13.9, WEIGHT_DECAY: 5e-4},  # step 2 of γ: the minimum
        {gamma: 13.9, WEIGHT_DECAY: 1.25e-4},
        {gamma: 16.0, WEIGHT_DECAY: 5e-4},  # step 3: 23.2 passes the bound 16
        {gamma: 13.9, WEIGHT_DECAY: 2e-3},
    ]
    result = tuning_report(cfg, root, [])["focal"]  # study.json's names
    assert result["chosen"] == {"focal_gamma": 13.9, "weight_decay": 5e-4}
    assert result["interior"] == {"focal_gamma": True, "weight_decay": True}
    assert result["at_bound"] == [] and result["configurations"] == 7 + 6
    assert result["extended"] == {"focal_gamma": [8.33, 13.9, 16.0],
                                  "weight_decay": [1.25e-4, 1.25e-4, 2e-3]}  # fmt: skip
    assert tasks["focal-s0"].prepare() == ["loss.focal.gamma=13.9", "optim.weight_decay=0.0005"]
    _, again = _tasks(root, ("ce", "focal"))  # a rerun's plan: every step done
    assert all(t.done for t in again.values() if getattr(t, "group", "") == "focal")


def test_an_extension_stopped_by_a_bound_is_marked_at_bound(tmp_path):
    """ls's val NLL falls with α up to the protocol's bound 0.5: 0.2 -> 0.4 -> 0.5 (0.8 clamped),
    then nothing: the choice sits on the bound, marked in study.json and the report."""
    from pipeline.study.choices_report import tuning_section

    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"))
    falls = _bowl({WEIGHT_DECAY: 5e-4})
    ran = _run_tuning(root, tasks, "ls", lambda p: falls(p) - p[ALPHA])
    assert [(p[ALPHA], p[WEIGHT_DECAY]) for p in ran[7:]] == [
        (0.4, 5e-4), (0.4, 1.25e-4),  # step 1: α, then the decay's neighbour at the new α
        (0.5, 5e-4), (0.5, 1.25e-4),  # step 2: α to the bound, decay below
        (0.5, 2e-3),  # step 3: α on its bound has nothing to try; the decay above
    ]  # fmt: skip
    assert BOUNDS["ls"][ALPHA] == (0.001, 0.5)
    result = tuning_report(cfg, root, [])["ls"]  # study.json's names, report.md's words
    assert result["chosen"] == {"ls_alpha": 0.5, "weight_decay": 5e-4}
    assert result["at_bound"] == ["ls_alpha"] and not result["interior"]["ls_alpha"]
    assert result["extended"]["ls_alpha"] == [0.4, 0.5]
    text = "\n".join(tuning_section({"ls": result}))
    assert f"| ls | {result['chosen_run']} | ls_alpha = 0.5, weight_decay = 0.0005 |" in text
    assert "**chosen**, at bound (ls_alpha), ext |" in text


def test_a_winner_inside_the_seeds_noise_gives_way_to_the_reference(tmp_path):
    """0.2 has the lowest mean (0.395 vs the reference 0.05's 0.40) but its gaps to it swing
    from +0.04 to -0.03: the reference is chosen, interior, so nothing extends."""
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"))
    _point(root, "ls", {ALPHA: 0.02}, 0.50)
    _point(root, "ls", {ALPHA: 0.05}, 0.40, (0.0, 0.0, 0.0))
    _point(root, "ls", {ALPHA: 0.1}, 0.45)
    _point(root, "ls", {ALPHA: 0.2}, 0.40, (-0.04, 0.03, -0.004))
    _shared_points(root, "ls")
    assert tasks["tune-ls-wd0p002"].prepare() == ["loss.ls.alpha=0.05"]
    assert tasks["tune-ls-ext-a1"].prepare() is None
    assert tasks["ls-s0"].prepare() == ["loss.ls.alpha=0.05", "optim.weight_decay=0.0005"]
    result = tuning_report(cfg, root, [])["ls"]
    assert result["rule"]["winner"] == "tune-ls-a0p2" and result["rule"]["kept_reference"]
    assert result["rule"]["advantage"] < result["rule"]["standard_error"]
    assert result["chosen_run"] == "tune-ls-a0p05" and result["extended"] == {}


def test_an_interior_choice_skips_the_extension(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ls"))
    for alpha, nll in zip((0.02, 0.05, 0.1, 0.2), (0.50, 0.35, 0.30, 0.40)):
        _point(root, "ls", {ALPHA: alpha}, nll)
    _shared_points(root, "ls")
    ext = tasks["tune-ls-ext-a1"]
    assert ext.prepare() is None  # nothing to run
    logs = tmp_path / "logs"
    logs.mkdir()
    _execute(ext, "digits", logs)  # no subprocess: the log says so, no run folder appears
    assert "nothing to run" in (logs / "tune-ls-ext-a1.log").read_text()
    assert not (root / "train" / "tune-ls-ext-a1").exists()
    _, again = _tasks(root, ("ce", "ls"))  # a rerun's plan knows every step is done
    assert all(again[name].done for name in _exts("ls"))
    assert tasks["ls-s0"].prepare() == ["loss.ls.alpha=0.1", "optim.weight_decay=0.0005"]
    result = tuning_report(cfg, root, [])["ls"]
    assert result["extended"] == {} and result["chosen_run"] == "tune-ls-a0p1"


def test_two_parameters_on_edges_extend_each_at_the_others_choice(tmp_path):
    root = tmp_path / "digits"
    _, tasks = _tasks(root, ("ce", "fedlas-ls"))
    nll = {(0.05, 2.0): 0.5, (0.05, 4.0): 0.5, (0.1, 2.0): 0.3, (0.1, 4.0): 0.4}
    for p in grid_points("fedlas-ls"):
        _point(root, "fedlas-ls", p, nll[tuple(p.values())])
    _shared_points(root, "fedlas-ls")
    assert tasks["tune-fedlas-ls-ext-a1"].prepare() == [
        "loss.fedlas_ls.alpha=0.2", "loss.fedlas_ls.beta=2", "optim.weight_decay=0.0005"
    ]  # fmt: skip
    _point(root, "fedlas-ls", ("loss.fedlas_ls.alpha", 1), 0.6)  # worse: (0.1, 2) stays chosen
    assert tasks["tune-fedlas-ls-ext-b1-t101"].prepare() == [
        "loss.fedlas_ls.alpha=0.1", "loss.fedlas_ls.beta=1", "optim.weight_decay=0.0005"
    ]  # fmt: skip


def test_maccal_is_tuned_on_its_base_methods_chosen_runs_seed_by_seed(tmp_path):
    root = tmp_path / "digits"
    cfg, tasks = _tasks(root, ("ce", "ce+maccal"))  # ce keeps its reference, 5e-4
    for wd in GRIDS["ce"][WEIGHT_DECAY]:
        for seed in SEEDS:
            run = root / "train" / tune_run("ce", {WEIGHT_DECAY: wd}, seed)
            (run / "model.safetensors").write_text(f"ce weights {wd} {seed}")
    # lowest at (256, q0 = 1, its bound): the grid's (256, 0.9), r's step up (512) worse, q0's
    # 1.157 clamped to 1, then r's neighbours at q0 = 1 (128, 512); q0 stays on its bound
    ran = _run_tuning(root, tasks, "ce+maccal", _bowl({"maccal.r": 256, "maccal.q0": 1.0}))
    assert [(p["maccal.r"], p["maccal.q0"]) for p in ran[4:]] == [
        (512, 0.9), (256, 1.0), (128, 1.0), (512, 1.0)
    ]  # fmt: skip
    for seed, name in ((100, "tune-ce-ext-r1"), (102, "tune-ce-ext-q1-t102")):
        base = root / "train" / tune_run("ce", {WEIGHT_DECAY: 5e-4}, seed) / "model.safetensors"
        copy = root / "train" / name / "model.safetensors"  # the chosen ce run of its seed
        assert copy.stat().st_ino == base.stat().st_ino
    assert tasks["ce-s0-maccal"].prepare() == ["maccal.r=256", "maccal.q0=1"]
    assert tasks["ce-s0"].prepare() == ["optim.weight_decay=0.0005"]
    result = tuning_report(cfg, root, [])["ce+maccal"]  # study.json's names
    assert result["base"] == [tune_run("ce", {WEIGHT_DECAY: 5e-4}, seed) for seed in SEEDS]
    assert result["chosen_run"] == "tune-ce-ext-q1-maccal"
    assert result["extended"] == {"maccal_r": [512, 128, 512], "maccal_q0": [1.0]}
    assert result["at_bound"] == ["maccal_q0"] and result["interior"]["maccal_r"]


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
    # csm's val NLL lowest at (w 1, s 2.3, decay 5e-4): interior once s's step below (1.32) and
    # w's above (2) are tried
    weight, sharpening = "loss.csm.weight", "loss.csm.sharpening"
    ran = _run_tuning(root, tasks, "csm", _bowl({weight: 1.0, sharpening: 2.3, WEIGHT_DECAY: 5e-4}))
    assert {(p[weight], p[sharpening]) for p in ran[7:]} == {(2.0, 2.3), (1.0, 1.32)}
    assert tasks["csm-s0"].prepare() == [
        "loss.csm.weight=1", "loss.csm.sharpening=2.3", "optim.weight_decay=0.0005"
    ]  # fmt: skip
    train_cmd = tasks["csm-s0"].commands("digits", ["loss.csm.weight=1"])[0]  # the train step's
    assert train_cmd[-1] == "loss.csm.weight=1" and "evaluate" not in train_cmd
    assert tasks["tune-csm3-s4"].prepare() == ["loss.csm.weight=1"]  # csm's w, its own s
    ran3 = _run_tuning(root, tasks, "csm3", _bowl({sharpening: 5.4, WEIGHT_DECAY: 5e-4}))
    assert len(ran3) == 7  # 5.4 and 5e-4 interior: no step
    assert tasks["csm3-s0"].prepare() == [
        "loss.csm.weight=1", "loss.csm.sharpening=5.4", "optim.weight_decay=0.0005"
    ]  # fmt: skip
    # csm+maccal fine-tunes csm's chosen grid runs, its own grid
    for seed in SEEDS:
        run = root / "train" / tune_run("csm", {weight: 1.0, sharpening: 2.3}, seed)
        (run / "model.safetensors").write_text(f"csm weights {seed}")
    assert tasks["tune-csm-r128-q0p7-t101-maccal"].prepare() == []
    copy = root / "train" / "tune-csm-r128-q0p7-t101" / "model.safetensors"
    assert copy.read_text() == "csm weights 101"
    assert {t.name for t in tuned["csm+maccal"]} <= tasks["csm-s0-maccal"].after


def test_a_tiny_grid_runs_chooses_on_val_and_is_not_run_again(
    digits_root, tmp_path, tasks_in_process, monkeypatch
):
    """ls's real grid on digits, one epoch per run, at two tuning seeds: every point at each
    seed, an extension exactly where the rule's choice is on an edge, the choice by the rule,
    and a rerun's plan has nothing left to run. Its runs are in-process (tasks_in_process):
    the test is of the choice, not of process start. One extension step per parameter, on
    256 images: chains of steps are checked with fake runs (_bowl), and nothing here reads
    how many images a run saw."""
    monkeypatch.setattr(tuning_plan, "MAX_EXTENSIONS", 1)  # read when the plan is made
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    root = tmp_path / "digits"
    sets = [f"out={tmp_path}", "train.epochs=1", "train.milestones=", "train.train_limit=256"]
    cfg = StudyConfig(stack=False, methods=("ce", "ls"), seeds=(0,), robustness=False, tune_seeds=2)
    tasks = plan(cfg, "digits", sets, root)
    tune = [t for t in tasks if t.name.startswith("tune-ls")]
    # ls's grid, the shared decays, MAX_EXTENSIONS steps of α and of the decay, at each seed
    assert len(tune) == (4 + 3 + 2 * tuning_plan.MAX_EXTENSIONS) * 2
    execute([tasks[0], *tune], "digits", 1, tmp_path / "logs")  # real/ (done) and ls's grid
    result = choose(root, tuning_tasks(cfg, root, sets)["ls"])
    grid = [r for r in result["grid"] if not r["extension"]]
    ref = reference("ls")
    start = next(r for r in grid if all(r[k] == v for k, v in ref.items()))
    assert choose_point(grid, ref)["chosen"]["run"] in {r["run"] for r in grid}
    for r in result["grid"]:  # every row the mean of its seeds' runs
        assert len(r["runs"]) == 2 and r["val_nll"] == pytest.approx(
            np.mean(r["val_nll_seeds"]), abs=1e-4
        )
        for run, seed in zip(r["runs"], (TUNE_SEED, TUNE_SEED + 1)):
            config = json.loads((root / "train" / run / "config.json").read_text())
            assert config["seed"] == seed and config["ls_alpha"] == r[ALPHA]  # choose(): paths
            assert config["weight_decay"] == r[WEIGHT_DECAY]
    # every extension step ran where the choice before it lacked a neighbour, and only there
    steps = [r for r in result["grid"] if r["extension"]]
    for k in range(1, tuning_plan.MAX_EXTENSIONS + 1):
        for param in (ALPHA, WEIGHT_DECAY):
            name = tune_run("ls", (param, k))
            before = result["grid"][: next(
                (i for i, r in enumerate(result["grid"]) if r["run"] == name), len(result["grid"])
            )]  # fmt: skip
            ran = (root / "train" / name / "manifest.json").is_file()
            assert ran == (name in {r["run"] for r in steps})
            if not ran and before == result["grid"]:  # nothing left to try for it at the end
                assert result["interior"][param] or param in result["at_bound"]
    assert result["chosen_run"] == choose_point(result["grid"], ref)["chosen"]["run"]
    assert start["val_nll_seeds"] and result["criterion"].startswith("mean val_nll")
    again = [t for t in plan(cfg, "digits", sets, root) if t.name.startswith("tune-ls")]
    assert all(t.done for t in again)


def test_the_report_names_each_methods_seeds_and_the_rule_behind_each_grid():
    from pipeline.study.choices_report import tuning_section
    from pipeline.study.report import _seeds_per_method

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
    text = "\n".join(tuning_section({"g": result}))
    assert "each tuning seed (100, 101, 102" in text
    assert "| g | a | x = 1 | 88.00 | 2.00 | 0.3900 | **chosen** |" in text
    assert "| g | ref | x = 0 | 88.00 | 2.00 | 0.4100 | ref |" in text
    assert "| g | nan | x = 2 | 88.00 | 2.00 | nan | diverged |" in text
    assert "| g | a | +0.0200 | 0.0000 | a |" in text
