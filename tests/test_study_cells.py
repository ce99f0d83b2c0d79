"""The generator's sampler cell (w, x̂₀ clipping) as a csm hyper-parameter: the cells kept by
fidelity, each one's mixed set and csm runs on val, the choice by the study's tuning rule, and
set 0 drawn at the chosen cell."""

import json
import shutil

import pytest

import pipeline.chain
from core.config import ConfigError
from core.io import atomic_write_json
from pipeline.registry import resolve_stage_config
from pipeline.study import cells
from pipeline.study.cells import Cell, choose_cell, kept_cells
from pipeline.study.config import StudyConfig
from pipeline.study.execute import execute
from pipeline.study.plan import plan
from shards.manifest import MANIFEST


def _fidelity(root, by_clip, guidance, clip):
    """A fit-generator fidelity.json whose last check has these {clip: {w: accuracy}}."""
    cell = lambda acc: {"encoder": {"accuracy": acc}, "judge": {"accuracy": 100 - acc}}  # noqa: E731
    last = {
        "step": 10,
        "clip": {c: {w: cell(a) for w, a in ws.items()} for c, ws in by_clip.items()},
    }
    judges = {"encoder": {"role": "chooses w"}, "judge": {"role": "reports only"}}
    atomic_write_json(
        root / "generator" / "fidelity.json",
        {"guidance": guidance, "clip_sample": clip, "judges": judges, "curve": [last]},
    )


# the 1,875-step Fashion-MNIST fit's last check (docs/results/fashion-fair/fit-1875)
FIT_1875 = {
    "off": {"1": 82.0, "1.5": 92.5, "2": 97.0, "2.5": 98.0, "3": 99.0, "3.5": 99.0},
    "on": {"1": 82.0, "1.5": 91.5, "2": 75.0, "2.5": 52.0, "3": 39.0, "3.5": 33.5},
}


def test_cells_below_the_floor_are_dropped_and_the_fits_cell_always_kept(tmp_path):
    _fidelity(tmp_path, FIT_1875, 3.0, False)
    kept, reference = kept_cells(tmp_path)
    assert reference == Cell(3.0, "off")
    # six cells pass 90 %; the fit's and two spread over the other five (both ends)
    assert kept == [Cell(1.5, "off"), Cell(3.0, "off"), Cell(1.5, "on")]
    _fidelity(tmp_path, {"off": {"1": 50.0, "2": 60.0}}, 2.0, False)
    assert kept_cells(tmp_path)[0] == [Cell(2.0, "off")]  # none passes: the fit's alone


def test_a_cell_beats_the_fits_only_by_more_than_its_noise(tmp_path, monkeypatch):
    _fidelity(tmp_path, {"off": {"1.5": 95.0, "3": 99.0}}, 3.0, False)
    nll = {"w1p5-off": [0.30, 0.31, 0.32], "w3-off": [0.33, 0.34, 0.35]}

    def val_score(run):
        key, _, seed = run.name.removeprefix("tune-cell-").partition("-t")
        at = int(seed) - 100 if seed else 0
        return {"val_acc": 90.0, "val_ece": 1.0, "val_nll": nll[key][at]}

    monkeypatch.setattr(cells, "val_score", val_score)
    result = choose_cell(tmp_path, (100, 101, 102))
    assert result["chosen"] == Cell(1.5, "off").values() and not result["rule"]["kept_reference"]
    nll["w1p5-off"] = [0.30, 0.36, 0.33]  # the same mean gap, noisier: the fit's cell stays
    result = choose_cell(tmp_path, (100, 101, 102))
    assert result["chosen"] == Cell(3.0, "off").values() and result["rule"]["kept_reference"]
    assert [c["kept"] for c in result["cells"]] == [True, True]


def test_one_plans_reads_of_the_cells_are_kept_only_once_their_files_are_final(
    tmp_path, monkeypatch
):
    """CellReads: the kept cells follow a rewritten fidelity.json; the chosen cell is read
    anew while a kept cell's run is incomplete, kept once they all are, read anew after
    fidelity.json is rewritten (a recheck)."""
    _fidelity(tmp_path, {"off": {"1.5": 95.0, "3": 99.0}}, 3.0, False)
    reads = cells.CellReads(tmp_path, (100, 101))
    assert reads.kept() == [Cell(1.5, "off"), Cell(3.0, "off")]
    _fidelity(tmp_path, {"off": {"1.5": 50.0, "3": 99.0}}, 3.0, False)
    assert reads.kept() == [Cell(3.0, "off")]
    _fidelity(tmp_path, {"off": {"1.5": 95.0, "3": 99.0}}, 3.0, False)
    assert reads.kept() == [Cell(1.5, "off"), Cell(3.0, "off")]
    nll = {"w1p5-off": [0.30, 0.31], "w3-off": [0.40, 0.42]}

    def val_score(run):
        key, _, seed = run.name.removeprefix("tune-cell-").partition("-t")
        return {"val_acc": 90.0, "val_ece": 1.0, "val_nll": nll[key][int(seed or 100) - 100]}

    monkeypatch.setattr(cells, "val_score", val_score)
    assert reads.chosen() == Cell(1.5, "off")
    nll["w1p5-off"] = [0.50, 0.51]  # no run complete yet: asked again, read again
    assert reads.chosen() == Cell(3.0, "off")
    for run in ("tune-cell-w1p5-off", "tune-cell-w1p5-off-t101", "tune-cell-w3-off",
                "tune-cell-w3-off-t101"):  # fmt: skip
        atomic_write_json(tmp_path / "train" / run / MANIFEST, {})
    assert reads.chosen() == Cell(3.0, "off")
    nll["w1p5-off"] = [0.30, 0.31]  # every run complete: the answer read above is final
    assert reads.chosen() == Cell(3.0, "off")
    _fidelity(tmp_path, {"off": {"1.5": 95.0, "3": 99.5}}, 3.0, False)  # a recheck's new file
    assert reads.chosen() == Cell(1.5, "off")


def test_generate_takes_the_clipping_of_a_cell_on_the_unet_only():
    cfg = resolve_stage_config("generate", "digits", ["clip_sample=on"])
    assert cfg.clip_sample == "on" and cfg.recorded()["clip_sample"] == "on"
    assert "clip_sample" not in resolve_stage_config("generate", "digits", []).recorded()
    with pytest.raises(ConfigError, match="clip_sample='x'"):
        resolve_stage_config("generate", "digits", ["clip_sample=x"])
    with pytest.raises(ConfigError, match="only the unet backend"):
        resolve_stage_config(
            "generate", "digits", ["backend=edm", "sampler=heun", "clip_sample=off", "guidance=1"]
        )


def test_the_cell_is_chosen_on_a_tiny_fit_and_set_0_drawn_at_it(
    digits_root, tmp_path, monkeypatch, tasks_in_process
):
    """digits' chain with a 2-step fit: the cells its check judged, the kept ones each drawn
    and csm-trained at 2 tuning seeds, the choice by the rule, set 0 the chosen cell's set
    (taken by link: the chain finds it complete), and a rerun's plan with nothing to do.
    Its tasks are in-process (tasks_in_process), and so is each chain's generate: the choice
    does not depend on how many processes draw a set (generate's bytes do not depend on the
    ranks; the chain's torchrun launch is tests/test_cli.py's, two-process generate
    tests/test_generate.py's)."""
    monkeypatch.setattr(cells, "FIDELITY_FLOOR", 0.0)  # a 2-step fit draws noise
    monkeypatch.setattr(pipeline.chain, "cpu_processes", lambda: 1)
    monkeypatch.setattr(cells, "MAX_CELLS", 2)
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    root = tmp_path / "digits"
    sets = [
        f"out={tmp_path}", "train.epochs=1", "train.milestones=", "fit-generator.train_steps=2",
        "fit-generator.fidelity.per_class=2", "fit-generator.preview.sample_steps=2",
        "generate.sample_steps=2", "generate.mixing.series_per_pair=1",
    ]  # fmt: skip
    cfg = StudyConfig(
        methods=("ce", "csm"), seeds=(0,), fits=1, mixed_sets=1, robustness=False, tune_seeds=2
    )
    tasks = plan(cfg, "digits", sets, root)
    names = [t.name for t in tasks]
    upto = names.index("chain") + 1
    # digits' grid: w 1, 1.5, 2, no clipping; the cells on a fit of their own, before fit 0
    assert names[1:5] == ["generator", "fit-cells", "fit-f0", "chain-cell-w1"]
    execute(tasks[:upto], "digits", 1, tmp_path / "logs")
    cell_fit = root.parent / "digits-cells"
    kept, reference = kept_cells(cell_fit, 2)
    assert len(kept) == 2 and reference in kept
    skipped = next(c for c in (Cell(1.0, None), Cell(1.5, None), Cell(2.0, None)) if c not in kept)
    assert not (root.parent / f"digits-cell-{skipped.key}").exists()
    fits = [json.loads((r / "generator" / "config.json").read_text()) for r in (root, cell_fit)]
    assert fits[1]["seed"] == fits[0]["seed"] + 1000 and {**fits[1], "seed": 0} == {
        **fits[0],
        "seed": 0,
    }  # the same recipe, its own seed
    result = choose_cell(root, (100, 101), cell_fit, 2)
    for row in result["grid"]:
        for run in row["runs"]:
            config = json.loads((root / "train" / run / "config.json").read_text())
            assert config["csm_weight"] == 1.0 and config["csm_sharpening"] == 4.0
            key = Cell(row["guidance"], row["clip"]).key
            assert config["mixed"] == str(root.parent / f"digits-cell-{key}" / "mixed")
    chosen = Cell(**result["chosen"])
    series = json.loads((root / "series" / "config.json").read_text())
    assert series["guidance"] == chosen.guidance  # fit 0's set drawn at the chosen cell
    log = (tmp_path / "logs" / "chain.log").read_text()
    assert "generate.guidance=" in log
    again = plan(cfg, "digits", sets, root)
    assert all(t.done for t in again[:upto])
