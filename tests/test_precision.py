"""One precision vocabulary and one resolver (core/precision.py) for every stage's field."""

from __future__ import annotations

import json

import pytest
import torch

import core.precision as precision
from core.config import ConfigError
from core.precision import canonical, check_precision, resolve_precision
from pipeline.registry import resolve_stage_config
from shards.checkpoints import MARKER
from stages.common.loop import PRECISION_KEY, run_precision

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def native(monkeypatch):
    """Which devices compute bf16 natively, set by the test (no GPU is needed to ask a GPU)."""
    has: dict[str, bool] = {"cpu": False, "cuda": True}
    monkeypatch.setattr(precision, "native_bf16", lambda device: has[device.type])
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    return has


@pytest.mark.parametrize(
    ("old", "word"),
    [("", "auto"), ("no", "fp32"), ("float32", "fp32"), ("bfloat16", "bf16"), ("fp16", "fp16")],
)
def test_older_spellings_mean_their_word(old, word):
    assert canonical(old) == word


@pytest.mark.parametrize(
    ("cpu_native", "cpu_bf16", "on_cpu", "gpu_native", "on_gpu"),
    [
        (False, False, "fp32", True, "bf16"),
        (True, False, "fp32", False, "fp32"),  # a CPU's bf16 counts only where the stage opts in
        (True, True, "bf16", True, "bf16"),  # fit-generator: bf16 pays on such CPUs
        (False, True, "fp32", False, "fp32"),  # never fp16 silently
    ],
)
def test_auto_is_one_rule(native, cpu_native, cpu_bf16, on_cpu, gpu_native, on_gpu):
    native.update(cpu=cpu_native, cuda=gpu_native)
    for value in ("auto", ""):
        assert resolve_precision("p", value, CPU, cpu_bf16=cpu_bf16) == on_cpu
        assert resolve_precision("p", value, GPU, cpu_bf16=cpu_bf16) == on_gpu
    assert resolve_precision("p", "bf16", CPU) == "bf16"  # a word is what it says
    assert resolve_precision("p", "no", GPU) == "fp32"


def test_accelerate_launch_sets_auto_and_refuses_a_conflict(native, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert resolve_precision("precision", "auto", GPU) == "fp16"
    assert resolve_precision("precision", "fp16", GPU) == "fp16"
    with pytest.raises(ConfigError, match="precision=bf16 conflicts with accelerate launch"):
        resolve_precision("precision", "bf16", GPU)
    # a stage that casts by itself (generate, annotate) is not accelerate's to set
    assert resolve_precision("dtype", "auto", CPU, launcher=False) == "fp32"


@pytest.mark.parametrize(
    ("stage", "field", "value"),
    [
        ("train", "precision", "auto"),
        ("finetune", "precision", "bf16"),
        ("fit-generator", "precision", "no"),
        ("fit-generator", "mixed_precision", "fp32"),  # the flat name it had
        ("annotate", "precision", "auto"),
        ("generate", "precision", "bfloat16"),
        ("generate", "dtype", "bf16"),  # the flat name it had
    ],
)
def test_every_precision_field_takes_the_vocabulary(stage, field, value):
    sets = [f"{field}={value}", *(["run=x"] if stage == "finetune" else [])]
    cfg = resolve_stage_config(stage, "digits", sets)
    assert cfg.precision == value  # recorded as given: config.json keeps its bytes
    flat = {"fit-generator": "mixed_precision", "generate": "dtype"}.get(stage, "precision")
    assert cfg.recorded()[flat] == value


@pytest.mark.parametrize(
    ("stage", "sets", "needle"),
    [
        (
            "train",
            ["precision=fp16"],
            "precision='fp16' is not one of this stage's: auto, fp32, bf16",
        ),
        ("fit-generator", ["precision=bf61"], "did you mean 'bf16'?"),
        ("generate", ["precision=half"], "precision='half' is not a precision"),
    ],
)
def test_a_bad_precision_is_one_line(stage, sets, needle):
    with pytest.raises(ConfigError) as e:
        resolve_stage_config(stage, "digits", sets)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_check_precision_takes_a_stages_subset():
    check_precision("precision", "bf16", ("auto", "fp32", "bf16"))
    with pytest.raises(ConfigError, match="not one of this stage's: auto, fp32, bf16$"):
        check_precision("precision", "fp16", ("auto", "fp32", "bf16"))
    with pytest.raises(ConfigError, match="choose one of: auto, fp32, bf16, fp16$"):
        check_precision("precision", "fp64")


def _checkpoint(run_dir, n: int, state: dict) -> None:
    folder = run_dir / "checkpoints" / f"checkpoint_{n}"
    folder.mkdir(parents=True)
    (folder / MARKER).write_text(json.dumps(state))


def test_a_resumed_auto_run_keeps_its_checkpoints_precision(tmp_path, native):
    """The classifier loop's `auto` is bf16 on a CPU that computes it natively; a run's precision
    is fixed when it starts, so an `auto` run resumed computes in what its newest checkpoint
    records (one written before the record: fp32, the CPU rule then)."""
    native["cpu"] = True
    assert resolve_precision("precision", "auto", CPU, cpu_bf16=True) == "bf16"
    run = tmp_path / "run"
    assert run_precision(run, "auto", "auto") == "auto"  # nothing to resume: auto decides
    _checkpoint(run, 1, {"loop": {}, PRECISION_KEY: "bf16"})
    assert run_precision(run, "auto", "auto") == "bf16"
    _checkpoint(run, 2, {"loop": {}, PRECISION_KEY: "fp32"})  # the newest one decides
    assert run_precision(run, "auto", "auto") == "fp32"
    assert run_precision(run, "auto", "") == "auto"  # starting over: auto decides again
    assert run_precision(run, "bf16", "auto") == "bf16"  # a named precision is the run's own
    old = tmp_path / "old"
    _checkpoint(old, 1, {"loop": {}})
    cpu_only = not torch.cuda.is_available()
    assert run_precision(old, "auto", "auto") == ("fp32" if cpu_only else "auto")


def test_a_run_records_its_precision_in_every_checkpoint(tmp_path):
    """What run_precision reads is what the loop writes: the marker of each checkpoint holds the
    precision of host.json (the one the run computes in)."""
    from pipeline.registry import run_stage

    root = tmp_path / "root"
    run_stage("prepare", "digits", [f"out={root}"])
    run_dir = run_stage("train", "digits", [f"out={root}", "epochs=1"])
    host = json.loads((run_dir / "host.json").read_text())
    saved = json.loads((run_dir / "checkpoints" / "checkpoint_1" / MARKER).read_text())
    assert saved[PRECISION_KEY] == host["precision"]
    computes = "bf16" if precision.native_bf16(CPU) else "fp32"
    assert host["precision"] == computes
