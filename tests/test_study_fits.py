"""Generator fits as the study's top unit, and faster sampler cells chosen like w and clipping:
the round robin of seeds over (fit, mixed set), the plan for three fits, fits' independence,
sampler cells judged by fit-generator's chooser, and the cell rule's cost step."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from core.config import ConfigError
from core.io import atomic_write_json
from pipeline.registry import run_stage
from pipeline.study import cells
from pipeline.study.cells import Cell, choose_cell, kept_cells
from pipeline.study.config import StudyConfig
from pipeline.study.mixed_sets import prepare_set, set_variant
from pipeline.study.plan import check_tasks, plan
from stages.fit_generator.stage import WEIGHTS

QUICK = [
    "steps=2", "batch_size=16", "checkpoint_every=2", "samples_per_class=1", "sample_steps=2",
    "judge_run=", "fidelity_per_class=1", "guidance_grid=1,2",
]  # fmt: skip


def test_seeds_go_round_robin_over_fits_then_sets():
    cfg = StudyConfig(methods=("ce", "csm"), seeds=tuple(range(7)), fits=3, mixed_sets=2)
    units = [(cfg.fit_of("csm", s), cfg.mixed_set("csm", s)) for s in cfg.seeds]
    assert units == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 0)]
    assert cfg.fit_of("ce", 3) is None and cfg.mixed_set("ce", 3) is None
    # folder names: fit 0 keeps today's, fit f adds f<f>; csm's set 0 of fit f is its own root
    assert [set_variant("", j, f) for f, j in units[:5]] == ["", "f1", "f2", "m1", "f1-m1"]
    assert set_variant("k3", 1, 2) == "k3-f2-m1" and set_variant("redraw", 0, 1) == "redraw-f1"
    with pytest.raises(ConfigError, match="fits >= 1"):
        StudyConfig(fits=0)


def test_the_plan_for_three_fits(tmp_path):
    """Three comparison fits and the cells' own fit, each its fit-generator task after the
    encoder; fit f's set waits for its fit; csm's seeds stack per fit; every config checks."""
    cfg = StudyConfig(
        methods=("ce", "csm"), seeds=(0, 1, 2, 3), robustness=False, tune=True, tune_seeds=2
    )
    assert (cfg.fits, cfg.mixed_sets) == (3, 1)
    root = tmp_path / "digits"
    tasks = {t.name: t for t in plan(cfg, "digits", [f"out={tmp_path}"], root)}
    for name in ("fit-cells", "fit-f0", "fit-f1", "fit-f2"):
        assert tasks[name].after == {"generator"} and tasks[name].steps[0][0] == "fit-generator"
    seeds = {n: [s for s in tasks[n].steps[0][1] if s.startswith(("seed=", "name="))]
             for n in ("fit-cells", "fit-f0", "fit-f1", "fit-f2")}  # fmt: skip
    assert seeds == {
        "fit-cells": ["seed=1000", "name=digits-cells"], "fit-f0": [],
        "fit-f1": ["seed=1", "name=digits-f1"], "fit-f2": ["seed=2", "name=digits-f2"],
    }  # fmt: skip
    assert tasks["chain-f1"].after == {"chain", "fit-f1"}
    assert "fit-f0" in tasks["chain"].after and "chain-cell-w1" not in tasks["chain"].after
    assert tasks["chain-cell-w1"].after == {"fit-cells"}
    stacks = {n: t.steps[0][1] for n, t in tasks.items() if n.startswith("train-csm")}
    assert sorted(stacks) == ["train-csm", "train-csm-f1", "train-csm-f2"]
    assert "seeds=0,3" in stacks["train-csm"]
    assert f"mixed={tmp_path / 'digits-f2' / 'mixed'}" in stacks["train-csm-f2"]
    assert tasks["csm-s1"].after >= {"chain-f1", "train-csm-f1"}
    check_tasks("digits", list(tasks.values()), data=False)
    # fit f's set chain: the fit's seed (so the chain's config is its fit's) and its own draw
    (root / "mixed").mkdir(parents=True)
    got = prepare_set(root, "", 0, 7, 2, 1, ["fit-generator.seed=2"])
    assert got == ["fit-generator.seed=2", "generate.seed=9"]


@pytest.fixture
def runs(digits_root, tmp_path):
    for name in ("a", "b", "c"):
        shutil.copytree(digits_root / "real", tmp_path / name / "real")
    return tmp_path


def test_fits_are_independent_and_a_fits_seed_gives_the_same_bytes(runs):
    made = {
        name: run_stage("fit-generator", "digits", [f"out={runs}", f"name={name}", *QUICK, seed])
        for name, seed in (("a", "seed=1"), ("b", "seed=2"), ("c", "seed=1"))
    }
    w = {n: load_file(f / WEIGHTS) for n, f in made.items()}
    assert (made["a"] / WEIGHTS).read_bytes() == (made["c"] / WEIGHTS).read_bytes()
    assert any(not w["a"][k].equal(w["b"][k]) for k in w["a"])


@pytest.mark.parametrize("native", [False, True])
def test_sampler_cells_are_judged_by_the_fits_chooser(runs, monkeypatch, native):
    """fidelity.samplers: each entry judged at every w like the fit's own cells; a bf16 entry
    only where the device computes bf16 natively (patched: the test does not depend on the
    CPU); the study reads them as cells naming sampler, steps and precision."""
    import core.precision

    monkeypatch.setattr(core.precision, "native_bf16", lambda device: native)
    sets = [f"out={runs}", "name=a", *QUICK, "fidelity.samplers=unipc:2,dpmsolver++:1:bf16"]
    folder = run_stage("fit-generator", "digits", sets)
    config = json.loads((folder / "config.json").read_text())
    assert config["fidelity.samplers"] == ["unipc:2", "dpmsolver++:1:bf16"]
    last = json.loads((folder / "fidelity.json").read_text())["curve"][-1]
    expected = ["unipc:2", "dpmsolver++:1:bf16"] if native else ["unipc:2"]
    assert sorted(last["samplers"]) == sorted(expected)  # json keys are written sorted
    assert sorted(last["samplers"]["unipc:2"]["guidance"]) == ["1", "2"]
    found, reference, _ = cells.fidelity(folder.parent)
    assert Cell(2.0, None, "unipc", 2) in found and reference.sampler == ""
    assert (Cell(1.0, None, "dpmsolver++", 1, "bf16") in found) == native


def test_a_cells_key_and_settings_name_its_sampler_steps_and_precision():
    cell = Cell(1.5, "on", "dpmsolver++", 12, "bf16")
    assert cell.key == "w1p5-on-dpmpp12-bf16" and Cell(1.5, "on").key == "w1p5-on"
    assert cell.sets() == [
        "generate.guidance=1.5", "generate.clip_sample=on", "generate.sampler=dpmsolver++",
        "generate.sample_steps=12", "generate.precision=bf16",
    ]  # fmt: skip
    assert Cell(2.0, None).cost(25) == 25 and cell.cost(25) == 8.0


def _fidelity(root: Path, by_sampler: dict, guidance: float) -> None:
    """fidelity.json whose last check has {entry or "": {w: accuracy}} (no clipping choice)."""
    cell = lambda acc: {"encoder": {"accuracy": acc}}  # noqa: E731
    point = lambda ws: {"guidance": {w: cell(a) for w, a in ws.items()}}  # noqa: E731
    last = {"step": 10, **point(by_sampler.pop(""))}
    last["samplers"] = {e: point(ws) for e, ws in by_sampler.items()}
    atomic_write_json(
        root / "generator" / "fidelity.json",
        {"guidance": guidance, "judges": {"encoder": {"role": "chooses w"}}, "curve": [last]},
    )


def test_the_cheapest_faithful_speed_cell_is_always_tried(tmp_path, monkeypatch):
    monkeypatch.setattr(cells, "MAX_CELLS", 3)
    _fidelity(tmp_path, {"": {"1": 95.0, "2": 99.0, "3": 96.0},
                         "unipc:12": {"1": 93.0, "2": 98.0, "3": 91.0},
                         "dpmsolver++:10": {"1": 92.0, "2": 80.0, "3": 97.0}}, 2.0)  # fmt: skip
    kept, reference = kept_cells(tmp_path, 25)
    assert reference == Cell(2.0, None)
    # dpmsolver++ 10 at w 2 is cheaper but below the floor: unipc 12 is the speed cell
    assert Cell(2.0, None, "unipc", 12) in kept and len(kept) == 3


def test_a_cheaper_cell_within_noise_of_the_rules_choice_wins(tmp_path, monkeypatch):
    _fidelity(tmp_path, {"": {"2": 99.0}, "unipc:12": {"2": 98.0}}, 2.0)
    nll = {"w2": [0.30, 0.31, 0.32], "w2-unipc12": [0.305, 0.305, 0.325]}

    def val_score(run):
        key, _, seed = run.name.removeprefix("tune-cell-").partition("-t")
        return {"val_acc": 90.0, "val_ece": 1.0, "val_nll": nll[key][int(seed or 100) - 100]}

    monkeypatch.setattr(cells, "val_score", val_score)
    result = choose_cell(tmp_path, (100, 101, 102))
    assert result["chosen"] == Cell(2.0, None, "unipc", 12).values() and result["rule"]["by_cost"]
    nll["w2-unipc12"] = [0.33, 0.34, 0.35]  # worse by more than its noise: the fit's cell stays
    result = choose_cell(tmp_path, (100, 101, 102))
    assert result["chosen"] == Cell(2.0, None).values() and not result["rule"]["by_cost"]
