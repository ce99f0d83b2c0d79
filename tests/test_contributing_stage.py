"""docs/contributing.md's "Add a stage", done by a stranger: a stage (its config module and its
stage module, in tmp_path, outside the repository) registered with one `register_stage` call,
run through the CLI with SEMIX_PLUGINS, and no file of semix changed (pipeline/registry.py)."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import run_many_with_plugins, run_with_plugins, semix_sources, write_plugins

from pipeline.registry import STAGES, register_stage
from shards import manifest
from shards.reader import load_split

STAGE = "count-images"

TOY_CONFIG = '''
"""Config of `count-images`, and the one line that makes it a stage."""
from dataclasses import dataclass

from core.config import StageConfig, check_range
from pipeline.registry import register_stage
from stages.presets import stage_presets


@dataclass(frozen=True)
class Config(StageConfig):
    min_count: int = 1  # a class with fewer images than this is listed as rare

    def __post_init__(self):
        check_range("min_count", self.min_count, 0)


PRESETS = stage_presets("count-images")
register_stage("count-images", __name__, "toy_count", main_only=True, folder="counts",
               kind="class-counts")
'''

TOY_STAGE = '''
"""count-images: images per class of real/train -> runs/<classes>/counts/counts.json.

    python -m pipeline count-images --preset digits --set min_count=100
"""
from collections import Counter
from pathlib import Path

from core.io import atomic_write_json
from core.logs import log
from core.version import code_version
from shards.manifest import manifest_digest, read_manifest
from shards.reader import iter_folder
from shards.writer import ShardFolder, completed, write_config
from toy_count_config import Config


def run(cfg: Config) -> Path:
    real, folder = cfg.root / "real" / "train", cfg.root / "counts"
    upstream = {"real/train": manifest_digest(real)}
    if completed(folder, cfg.recorded(), upstream):
        log.info("count-images: %s is complete already", folder)
        return folder
    write_config(folder, cfg.recorded())  # first
    names = read_manifest(real).class_names
    seen = Counter(int(sample["cls"]) for sample in iter_folder(real))
    counts = {name: seen[i] for i, name in enumerate(names)}
    rare = [name for name, n in counts.items() if n < cfg.min_count]
    atomic_write_json(folder / "counts.json", {"counts": counts, "rare": rare})
    ShardFolder(folder, "counts").finish(  # last: a manifest with no shards
        0, kind="class-counts", class_names=names, upstream=upstream,
        code_version=code_version(), info={"images": sum(counts.values())},
    )
    return folder
'''


@pytest.fixture
def plugin(tmp_path) -> Path:
    return write_plugins(tmp_path / "mine", toy_count_config=TOY_CONFIG, toy_count=TOY_STAGE)


def run(plugin: Path, argv: list[str], modules: str = "toy_count_config"):
    return run_with_plugins(plugin, modules, argv)


def semix(plugin: Path, *args: str, modules: str = "toy_count_config"):
    return run(plugin, [sys.executable, "-m", "pipeline", *args], modules)


def test_a_stage_from_your_own_module_runs_through_the_cli(plugin, digits_root, tmp_path):
    before = semix_sources()
    out = tmp_path / "runs"
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    count = ["count-images", "--preset", "digits", "--set", f"out={out}", "min_count=100"]
    # 1. It runs: config.json first, counts.json, manifest.json last, like any stage's output.
    first = semix(plugin, *count)
    assert first.returncode == 0, first.stderr
    folder = out / "digits" / "counts"
    assert first.stdout.strip() == f"semix count-images: done -> {folder}"
    split = load_split(out / "digits" / "real" / "train")
    counts = json.loads((folder / "counts.json").read_text())
    by_hand = np.bincount(np.asarray(split.labels), minlength=len(split.class_names))
    assert list(counts["counts"].values()) == by_hand.tolist()
    assert counts["rare"] == [n for n, k in zip(split.class_names, by_hand) if k < 100]
    assert json.loads((folder / "config.json").read_text())["min_count"] == 100
    assert manifest.read_manifest(folder).upstream == {
        "real/train": manifest.manifest_digest(out / "digits" / "real" / "train")
    }
    # 2. A rerun finds it complete and writes nothing; another config is refused.
    # (2 and 3 in one process: calls in turn, nothing done between them)
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    again, other, listing, own, fields = run_many_with_plugins(
        plugin,
        "toy_count_config",
        [count, [*count[:-1], "min_count=5"], ["--help"], [STAGE, "--help"], [STAGE, "--fields"]],
    )
    assert again.returncode == 0 and "complete already" in again.stderr, again.stderr
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert other.returncode == 1 and "differs in: min_count" in other.stderr
    # 3. --help lists it with its docstring's purpose; its --help and --fields describe its field.
    assert "images per class of real/train" in listing.stdout
    assert "python -m pipeline count-images --preset digits --set min_count=100" in own.stdout
    fields = fields.stdout.splitlines()
    row = next(line for line in fields if line.split()[:1] == ["min_count"])
    assert row.split()[1] == "1" and "listed as rare" in row
    # 4. A damaged output names the command that rewrites it, and that command does.
    (folder / "manifest.json").write_text("{")
    damaged = semix(plugin, *count)
    line = damaged.stderr.strip().splitlines()[-1]
    assert damaged.returncode == 1 and line.startswith("semix count-images: error: "), line
    assert "is not JSON" in line and "remove the folder and rerun count-images: `" in line
    command = line.split("`")[-2]
    assert command == f"python -m pipeline count-images --preset digits --set out={out}"
    shutil.rmtree(folder)
    remade = run(plugin, [sys.executable, *shlex.split(command)[1:]])  # as printed
    assert remade.returncode == 0, remade.stderr
    assert json.loads((folder / "counts.json").read_text())["counts"] == counts["counts"]
    # 5. So does an incomplete one, to any reader (the plugin loaded, as the CLI loads it).
    (folder / "manifest.json").unlink()
    read = "from pipeline.plugins import load_plugins; load_plugins(); import sys; "
    read += "from shards.manifest import read_manifest; read_manifest(sys.argv[1])"
    incomplete = run(plugin, [sys.executable, "-c", read, str(folder)])
    assert "is incomplete: it has no manifest.json" in incomplete.stderr
    assert f"rerun count-images to complete it: `{command}`" in incomplete.stderr
    # 6. Without the plugin there is no such stage; and no file of semix changed.
    unknown = semix(plugin, *count, modules="")
    assert unknown.returncode == 2 and "unknown stage or command 'count-images'" in unknown.stderr
    assert semix_sources() == before


def test_the_built_in_stages_register_as_they_were_listed_before():
    """One table in pipeline/registry.py; shards.manifest's views are what they were by hand."""
    assert list(STAGES)[:3] == ["prepare", "fit-generator", "generate"]
    assert {s for s, spec in STAGES.items() if spec.main_only} == {
        "prepare", "publish", "pull", "convert-edm", "shift", "ood"
    }  # fmt: skip
    assert manifest.WRITTEN_BY == {
        "real": "prepare", "series": "generate", "mixed": "annotate (or pull)",
        "generator": "fit-generator", "run": "train (or finetune)", "corruptions": "shift",
        "ood": "ood",
    }  # fmt: skip
    assert manifest.FOLDER_STAGES == {
        "generator": "fit-generator", "series": "generate", "mixed": "annotate",
        "edm": "convert-edm",
    }  # fmt: skip
    assert manifest.PARENT_STAGES == {
        "real": "prepare", "train": "train", "finetune": "finetune", "shift": "shift",
        "ood": "ood",
    }  # fmt: skip
    train = STAGES["train"]
    assert (train.config, train.module) == ("stages.configs.train", "stages.train")


@pytest.mark.parametrize("name", ["train", "chain", "Count", "count images"])
def test_a_stage_name_that_is_taken_or_not_plain_is_refused(name):
    with pytest.raises(ValueError, match="taken or not a plain"):
        register_stage(name, "mine_config", "mine")
    assert "mine" not in {spec.module for spec in STAGES.values()}
