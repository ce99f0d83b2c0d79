"""Experiment tracking (`tracker=`, core/tracking.py) for train, finetune and fit-generator.

TensorBoard (pinned in requirements.txt) is read back from its event files: every epoch's
numbers at the epoch metrics.json records, fit-generator's loss, lr and fidelity points, the
resolved config as hparams; and the run's own files are the same bytes with and without a
tracker (tracking/ is a subfolder no manifest lists, `tracker` is not in config.json). wandb,
mlflow and trackio are optional: tested through their offline modes where they are installed.
A tracker whose package is missing is one line naming what to pip install.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
import yaml
from conftest import snapshot

from core.config import ConfigError
from core.tracking import hparams, parse_trackers, scalars
from pipeline.cli import main
from pipeline.registry import resolve_stage_config, run_stage
from shards.manifest import manifest_digest, read_manifest
from stages.fit_generator.training import lr_factor

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("tracking")]

TINY = ["epochs=2", "train_limit=128", "batch_size=64"]
# MaC-Cal without augmentation: the backbone's features are computed once (seconds)
MACCAL = ["method=maccal", "maccal_epochs=2", "crop_pad=0", "flip=false"]
# fit-generator's quick test recipe (tests/test_fit_generator.py) with a loss line every step and
# a fidelity point at steps 2 and 4 (linear-probe judge, w = 1 and 2)
QUICK_FIT = [
    "steps=4", "batch_size=16", "checkpoint_every=2", "samples_per_class=2", "sample_steps=2",
    "judge_run=", "fidelity_per_class=1", "guidance_grid=1,2", "fidelity_every=2", "log_every=1",
]  # fmt: skip
EPOCH_TAGS = ("loss", "lr", "train_acc", "val_acc", "val_ece", "val_nll")
TIMING = ("seconds", "images_per_s")  # wall clock: differs between any two runs


@pytest.fixture(scope="module")
def roots(digits_root, tmp_path_factory) -> tuple[Path, Path]:
    """Two runs roots with the same real/: runs there without a tracker and with one."""
    out = tmp_path_factory.mktemp("tracking")
    for side in ("plain", "tracked"):
        shutil.copytree(digits_root / "real", out / side / "digits" / "real")
    return out / "plain" / "digits", out / "tracked" / "digits"


@pytest.fixture(scope="module")
def trained(roots) -> tuple[Path, Path]:
    """The same 2-epoch train run `ce` in both roots: without a tracker, and with TensorBoard."""
    plain, tracked = roots
    return train(plain, "run=ce", *TINY), train(tracked, "run=ce", "tracker=tensorboard", *TINY)


def train(root: Path, *sets: str) -> Path:
    return run_stage("train", "digits", [f"out={root.parent}", *sets])


def history(run_dir: Path) -> list[dict]:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    [section] = metrics.values()
    return section["history"]


def event_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files of `folder`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep them all
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def per_epoch(hist: list[dict], key: str) -> list[tuple[int, float]]:
    """What the trackers should hold for `key`: metrics.json's value at metrics.json's epoch
    (TensorBoard stores float32)."""
    return [(h["epoch"], pytest.approx(h[key], rel=1e-6, abs=1e-9)) for h in hist]


def assert_same_run(plain: Path, tracked: Path, local: bool = True) -> None:
    """Two run folders made alike but for tracker=: the same files with the same bytes (all
    but host.json, the machine's facts: seconds, memory budget), and tracking/ only in the
    tracked one, unlisted by its manifest (`local`: a tracker that keeps files there; mlflow
    and trackio write to their own stores only)."""
    names = sorted(p.name for p in plain.iterdir())
    tracking = ["tracking"] if local else []
    assert sorted(p.name for p in tracked.iterdir()) == sorted([*names, *tracking])
    for name in names:
        if (plain / name).is_file() and name != "host.json":
            assert (plain / name).read_bytes() == (tracked / name).read_bytes(), name
    assert "tracker" not in json.loads((tracked / "config.json").read_text())


# ---------------------------------------------------------------- the field


def test_tracker_field_parses_and_numbers_are_flattened_for_every_tracker():
    assert parse_trackers("none") == parse_trackers("") == ()
    with pytest.raises(ConfigError, match="'tensorbored' is not a tracker"):
        parse_trackers("tensorbored")
    with pytest.raises(ConfigError, match="give none alone"):
        parse_trackers("none,tensorboard")
    stats = {"loss": 0.5, "lr": 1, "flip_rate": None, "path": "memory", "finished": True,
             "mode_share": {"+1": 0.25, "-1": 0.5, "0": 0.25}, "cnn:encoder judge": 90.0}  # fmt: skip
    assert scalars(stats) == {
        "loss": 0.5,
        "lr": 1.0,
        "mode_share/plus1": 0.25,
        "mode_share/-1": 0.5,
        "mode_share/0": 0.25,
        "cnn_encoder_judge": 90.0,
    }


@pytest.mark.parametrize("stage", ["train", "finetune", "fit-generator"])
def test_a_tracker_that_is_not_installed_is_one_line_naming_the_package(
    stage, tmp_path, monkeypatch, capsys
):
    """Checked when the config resolves, before anything runs: exit 2, one line."""
    find_spec = importlib.util.find_spec

    def without_wandb(name, *args, **kwargs):
        return None if name == "wandb" else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", without_wandb)
    argv = [stage, "--preset", "digits", "--set", f"out={tmp_path}", "run=x", "tracker=wandb"]
    if stage == "fit-generator":
        argv.remove("run=x")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tracker=wandb needs wandb" in err[0], err
    assert err[0].endswith("pip install wandb (or tracker=none)"), err
    assert main([*argv[:-1], "tracker=tensorbored"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'tensorbored' is not a tracker" in err[0], err
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------- TensorBoard


def test_train_logs_every_epoch_to_tensorboard_and_writes_the_same_run(trained):
    plain, tracked = trained
    assert_same_run(plain, tracked)
    assert not (plain / "tracking").exists()
    board = tracked / "tracking" / "tensorboard"
    logged = event_scalars(board)
    hist = history(tracked)
    assert len(hist) == 2 and "epoch" not in logged
    assert set(EPOCH_TAGS) | set(TIMING) <= set(logged)
    for key in EPOCH_TAGS:
        assert logged[key] == per_epoch(hist, key), key
    # the resolved config, as hparams (accelerate also keeps it as hparams.yml)
    [hparams] = board.glob("*/hparams.yml")
    config = yaml.safe_load(hparams.read_text())
    assert config["run"] == "ce" and config["epochs"] == 2 and config["train_limit"] == 128
    assert config["tracker"] == "tensorboard" and config["milestones"] == "[20, 26]"


def test_a_complete_tracked_run_reruns_as_a_no_op_under_any_tracker(trained):
    """tracker= is not part of the run's identity, and a complete run only reads: neither a
    rerun with the tracker nor one without writes a byte (tracking/ included)."""
    _, tracked = trained
    before = snapshot(tracked)
    for tracker in ("tensorboard", "none"):
        assert train(tracked.parents[1], "run=ce", f"tracker={tracker}", *TINY) == tracked
    assert snapshot(tracked) == before


def test_finetune_logs_every_epoch_to_tensorboard_and_writes_the_same_run(trained):
    plain_src, tracked_src = trained
    plain = run_stage("finetune", "digits", [f"out={plain_src.parents[2]}", "run=ce", *MACCAL])
    tracked = run_stage(
        "finetune",
        "digits",
        [f"out={tracked_src.parents[2]}", "run=ce", *MACCAL, "tracker=tensorboard"],
    )
    assert_same_run(plain, tracked)
    assert read_manifest(tracked).upstream["init"] == manifest_digest(tracked_src)
    logged = event_scalars(tracked / "tracking" / "tensorboard")
    hist = history(tracked)
    assert len(hist) == 2
    for key in (*EPOCH_TAGS, "q", "q_next", "train_conf"):  # MaC-Cal's own numbers too
        assert logged[key] == per_epoch(hist, key), key
    assert logged["kept/w1"] == [
        (h["epoch"], pytest.approx(h["kept"]["w1"], rel=1e-6)) for h in hist
    ]


def test_fit_generator_logs_loss_lr_and_fidelity_and_writes_the_same_folder(digits_root, tmp_path):
    folders = {}
    for side, extra in (("plain", []), ("tracked", ["tracker=tensorboard"])):
        shutil.copytree(digits_root / "real", tmp_path / side / "digits" / "real")
        folders[side] = run_stage(
            "fit-generator", "digits", [f"out={tmp_path / side}", *QUICK_FIT, *extra]
        )

    def files(folder: Path) -> dict[str, bytes]:
        return {
            p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).parts[0] != "tracking"
        }

    plain, tracked = folders["plain"], folders["tracked"]
    assert files(plain) == files(tracked)  # weights, grid, fidelity, config.json, manifest
    assert not (plain / "tracking").exists()
    logged = event_scalars(tracked / "tracking" / "tensorboard")
    # loss every step (log_every=1), with the lr that step used (warm-up, then cosine)
    cfg = resolve_stage_config("fit-generator", "digits", [f"out={tmp_path}", *QUICK_FIT])
    assert [s for s, _ in logged["loss"]] == [1, 2, 3, 4]
    assert logged["lr"] == [
        (s, pytest.approx(cfg.optim.lr * lr_factor(cfg, s - 1), rel=1e-6)) for s in (1, 2, 3, 4)
    ]
    # every fidelity point: the share of endpoints the linear probe takes for their class, per w
    curve = json.loads((tracked / "fidelity.json").read_text())["curve"]
    assert [p["step"] for p in curve] == [2, 4]
    for w in ("1", "2"):
        assert logged[f"fidelity/linear_probe/w_{w}"] == [
            (p["step"], pytest.approx(p["guidance"][w]["linear probe"]["accuracy"], rel=1e-6))
            for p in curve
        ], w


# ---------------------------------------------------------------- the optional trackers
# Each is read back from its own store, never from what semix handed it: the resolved config
# and every epoch's numbers at metrics.json's epoch; and the run beside it, trained without a
# tracker, has the same files with the same bytes.

WANDB_BLOCK = 32768  # a .wandb file's block (LevelDB's log format)


def expected_config(run_dir: Path, *sets: str) -> dict:
    """What a tracker should hold as the config of the train run `run_dir` made with `sets`,
    exactly: the resolved config, every field as core.tracking.hparams gives it (lists as JSON
    text), config.json's fields among them."""
    config = resolve_stage_config("train", "digits", [f"out={run_dir.parents[2]}", *sets])
    values = hparams(config.to_dict())
    assert hparams(json.loads((run_dir / "config.json").read_text())).items() <= values.items()
    return values


def wandb_records(path: Path) -> list:
    """The records of a wandb run file (run-<id>.wandb, what `wandb sync` uploads): a 7-byte
    header (":W&B", magic, version), then LevelDB's log format counted from the file's start:
    32 KiB blocks of chunks, each crc (4 bytes) + length (2) + type (1 full, 2 first, 3 middle,
    4 last) + bytes, a block's tail too short for a chunk header skipped; a record is a
    protobuf wandb.proto.wandb_internal_pb2.Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if WANDB_BLOCK - pos % WANDB_BLOCK < 7:
            pos += WANDB_BLOCK - pos % WANDB_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a record's last chunk
            records.append(Record.FromString(part))
            part = b""
    return records


def test_wandb_offline_gets_the_config_and_every_epoch(roots, tmp_path, monkeypatch):
    pytest.importorskip("wandb")

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's stdout and stderr alone
    for home in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(home, str(tmp_path / home.lower()))  # nothing under ~
    monkeypatch.delenv("WANDB_DIR", raising=False)
    plain = train(roots[0], "run=wandb", *TINY)
    sets = ("run=wandb", "tracker=wandb", *TINY)
    run_dir = train(roots[1], *sets)
    assert_same_run(plain, run_dir)

    [path] = (run_dir / "tracking" / "wandb").glob("offline-run-*/run-*.wandb")
    records = {}
    for record in wandb_records(path):
        records.setdefault(record.WhichOneof("record_type"), []).append(record)
    [run] = records["run"]
    assert run.run.project == "semix-digits" and run.run.display_name == "digits/train/wandb"
    config = {
        item.key: json.loads(item.value_json)
        for record in records["config"]
        for item in record.config.update
    }
    assert {k: v for k, v in config.items() if k != "_wandb"} == expected_config(run_dir, *sets)
    rows = [  # an item's name: key, or nested_key (one part: semix's names are flat)
        (r.history.step.num, {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                              for i in r.history.item})
        for r in records["history"]
    ]  # fmt: skip
    hist = history(run_dir)
    assert [step for step, _ in rows] == [h["epoch"] for h in hist] == [1, 2]
    for key in EPOCH_TAGS:
        assert [(step, row[key]) for step, row in rows] == per_epoch(hist, key), key
    [end] = records["exit"]
    assert end.exit.exit_code == 0  # closed by tracking.finish


def test_mlflow_gets_the_config_and_every_epoch(roots, tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    # a local store (MLflow >= 3 refuses a file:// store by default; SQLite is its own default)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for name in ("MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS", "MLFLOW_NESTED_RUN"):
        monkeypatch.delenv(name, raising=False)  # accelerate's MLflowTracker reads them
    plain = train(roots[0], "run=mlflow", *TINY)
    sets = ("run=mlflow", "tracker=mlflow", *TINY)
    run_dir = train(roots[1], *sets)
    assert_same_run(plain, run_dir, local=False)  # everything went to the tracking URI

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("semix-digits")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "digits/train/mlflow" and run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in expected_config(run_dir, *sets).items()}
    hist = history(run_dir)
    for key in EPOCH_TAGS:
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert got == per_epoch(hist, key), key


def test_trackio_gets_the_config_and_every_epoch_locally(roots, tmp_path, monkeypatch):
    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio is not installed (optional: the trackio extra, docs/train.md)")
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported before its TRACKIO_DIR could point into tmp_path")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio imports
    for where in ("SPACE_ID", "SERVER_URL", "DATASET_ID", "BUCKET_ID"):
        monkeypatch.delenv(f"TRACKIO_{where}", raising=False)  # local only
    plain = train(roots[0], "run=trackio", *TINY)
    sets = ("run=trackio", "tracker=trackio", *TINY)
    run_dir = train(roots[1], *sets)
    assert_same_run(plain, run_dir, local=False)  # everything went to TRACKIO_DIR
    from trackio.sqlite_storage import SQLiteStorage

    assert SQLiteStorage.get_project_db_path("semix-digits").parent == tmp_path / "trackio"
    rows = [
        r for r in SQLiteStorage.get_logs("semix-digits", "digits/train/trackio") if "val_acc" in r
    ]
    hist = history(run_dir)
    assert [r["step"] for r in rows] == [h["epoch"] for h in hist] == [1, 2]
    for key in EPOCH_TAGS:
        assert [(r["step"], r[key]) for r in rows] == per_epoch(hist, key), key
    config = SQLiteStorage.get_run_config("semix-digits", "digits/train/trackio")
    # all of it, and nothing else but trackio's own _Username, _Created, _Group (through
    # accelerate's store_init_configuration it would also hold allow_val_change=True)
    own = {k: v for k, v in config.items() if not k.startswith("_")}
    assert own == expected_config(run_dir, *sets)
