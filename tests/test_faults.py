"""Faults (issue 24): a full disk, an exhausted quota or read-only media in every stage that
writes, and Ctrl-C, end in one line saying that completed work is kept; nothing is marked
complete; the same command then resumes. Damaged checkpoints, end to end (docs/faults.md).

Faults are injected in the process, through `pipeline.cli.main`: `DiskFull` makes the n-th
write whose path matches a pattern fail as the disk would (a file opened for writing, or a
rename from or to it); the native writers fail as they do (torch.save's zip writer: a
RuntimeError without errno or file; safetensors: a SafetensorError naming the os error).
"""

from __future__ import annotations

import builtins
import errno
import fnmatch
import io
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import TINY_TRAIN
from test_annotate import _train_encoder, _write_series

import shards.writer
import stages.common.epochs
from core.io import atomic_write_bytes, writing
from pipeline.cli import main
from pipeline.registry import run_stage
from shards.checkpoints import MARKER

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("faults")]

TINY = TINY_TRAIN  # conftest's tiny_ce_root was trained at it
FIT = ["steps=4", "batch_size=8", "checkpoint_every=2", "samples_per_class=1", "judge_run="]
FIT += ["sample_steps=1", "fidelity.per_class=1", "fidelity.guidance_grid=1"]  # its check: not read
GEN = ["alphas=4", "steps=6", "limit=6", "series_per_shard=2"]  # 3 shards of 2 series
ANN = ["batch_size=16", "workers=0"]
INTERRUPTED = "interrupted; completed work is kept, rerun the same command to resume"
KEPT = ("completed work is kept", "rerun the same command to resume")


# ---------------------------------------------------------------- helpers


class DiskFull:
    """OSError(`code`) instead of the (`skip`+1)-th write under `root` whose path relative to
    `root` matches `pattern` (fnmatch, `*` crosses folders): a file opened for writing, or the
    source or target of a rename. Fires once; `armed = False` lets every write through."""

    def __init__(self, monkeypatch, root: Path, pattern: str, code=errno.ENOSPC, skip=0):
        self.root, self.pattern, self.code, self.skip = os.path.abspath(root), pattern, code, skip
        self.armed, self.seen, self.fired = True, 0, []
        real_open = builtins.open

        def hit(*paths) -> None:
            if not self.armed:
                return
            for path in paths:
                if isinstance(path, int):  # a file descriptor
                    continue
                path = os.path.abspath(os.fspath(path))
                rel = os.path.relpath(path, self.root)
                if rel.startswith("..") or not fnmatch.fnmatchcase(rel, self.pattern):
                    continue
                self.seen += 1
                if self.seen == self.skip + 1:
                    self.fired.append(rel)
                    raise OSError(self.code, os.strerror(self.code), path)
                return

        def open_(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+"):
                hit(file)
            return real_open(file, mode, *args, **kwargs)

        def renaming(real):
            def rename(src, dst, *args, **kwargs):
                hit(src, dst)
                return real(src, dst, *args, **kwargs)

            return rename

        monkeypatch.setattr(builtins, "open", open_)
        monkeypatch.setattr(io, "open", open_)
        monkeypatch.setattr(os, "replace", renaming(os.replace))
        monkeypatch.setattr(os, "rename", renaming(os.rename))


def fails(capsys, argv: list[str], code: int = 1) -> str:
    """Run the CLI: exit `code`, exactly one `semix` line on stderr, no traceback; the line."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("semix")]
    assert rc == code, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


def reruns(capsys, argv: list[str]) -> str:
    """The same command without the fault completes; its stderr (the log)."""
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err
    return err


def manifests(folder: Path) -> list[Path]:
    return sorted(folder.rglob("manifest.json")) if folder.exists() else []


@pytest.fixture(scope="module")
def chain(tiny_ce_root, generator_root, tmp_path_factory) -> Path:
    """runs/digits/ with everything a stage reads: real/, a tiny random generator/, a tiny
    trained run train/ce (conftest's generator_root and tiny_ce_root, copied), the annotate
    encoder train/encoder and pixel-blend series/ (the fixtures of test_annotate). Read-only:
    tests copy what they need (`copy`)."""
    root = tmp_path_factory.mktemp("faults") / "digits"
    shutil.copytree(tiny_ce_root, root)  # real/ and train/ce
    shutil.copytree(generator_root / "generator", root / "generator")
    _train_encoder(root)
    _write_series(root)
    return root


def copy(chain: Path, out: Path, *parts: str) -> Path:
    root = out / "digits"
    for part in parts:
        shutil.copytree(chain / part, root / part)
    return root


# ---------------------------------------------------------------- the writers name the file


def test_writers_name_the_file_they_were_writing(tmp_path, read_only):
    final, tmp = tmp_path / "a.json", tmp_path / ".a.json.tmp"
    # Python's f.write / flush / fsync raise without a file name
    with pytest.raises(OSError) as error, writing(final):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert (error.value.errno, error.value.filename) == (errno.ENOSPC, str(final))
    # a failure on the temporary name names the final one; another file's error is left alone
    with pytest.raises(OSError) as error, writing(final, tmp):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(tmp))
    assert (error.value.errno, error.value.filename) == (errno.EDQUOT, str(final))
    with pytest.raises(FileNotFoundError) as error, writing(final, tmp):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "in"))
    assert error.value.filename == str(tmp_path / "in")
    # safetensors words its OSErrors as text: this version's wording, from a real failure
    from safetensors.torch import save_file

    weights = tmp_path / "w.safetensors"
    with pytest.raises(FileNotFoundError) as error, writing(weights):
        save_file({"w": torch.zeros(2)}, str(tmp_path / "missing" / "w.safetensors"))
    assert error.value.filename == str(weights)
    # torch.save's zip writer keeps neither errno nor file: the file system is asked (here:
    # read-only media refuse the probe write)
    (tmp_path / "ro").mkdir()
    read_only(tmp_path / "ro")
    full = RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 1536 vs 1430")
    with pytest.raises(OSError) as error, writing(tmp_path / "ro" / "checkpoint_1"):
        raise full
    assert error.value.errno == errno.EROFS and error.value.__cause__ is full
    assert error.value.filename == str(tmp_path / "ro" / "checkpoint_1")
    assert not (tmp_path / "ro" / ".semix-write-probe").exists()
    with pytest.raises(ValueError, match="not an I/O error"), writing(final):
        raise ValueError("not an I/O error")  # everything else passes as it is


# ---------------------------------------------------------------- a full disk, every stage


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]  # stage and --set values (out= is added)
    reads: tuple[str, ...]  # the parts of `chain` the stage reads
    fault: str  # pattern (relative to runs/digits) of the write that fails
    named: str  # the path the line names (relative to runs/digits)
    output: str  # holds no manifest.json after the fault
    done: str  # exists after the rerun


CASES = {
    "prepare": Case(
        ("prepare",), (), "real/train/*train-000001.tar*", "real/train/train-000001.tar",
        "real", "real/test/manifest.json",
    ),
    "fit-generator": Case(  # the second checkpoint's marker: the first is kept
        ("fit-generator", *FIT), ("real",), "generator/checkpoints/.tmp-checkpoint_1/" + MARKER,
        "generator/checkpoints/checkpoint_1", "generator", "generator/manifest.json",
    ),
    "generate": Case(
        ("generate", *GEN), ("real", "generator"), "series/*series-000001.tar*",
        "series/series-000001.tar", "series", "series/manifest.json",
    ),
    "annotate": Case(
        ("annotate", *ANN), ("real", "train/encoder", "series"), "mixed/*mixed-000002.tar*",
        "mixed/mixed-000002.tar", "mixed", "mixed/manifest.json",
    ),
    "train": Case(  # the second epoch's checkpoint: the first is kept
        ("train", "run=disk", "epochs=2", "train_limit=64", "batch_size=32"), ("real",),
        "train/disk/checkpoints/.tmp-checkpoint_2/" + MARKER,  # checkpoint_<n>: after epoch n
        "train/disk/checkpoints/checkpoint_2", "train/disk", "train/disk/manifest.json",
    ),
    "finetune": Case(  # the final weights (safetensors, installed by a rename)
        ("finetune", "run=ce", "method=maccal", "maccal_epochs=1"), ("real", "train/ce"),
        "finetune/ce-maccal/model.safetensors", "finetune/ce-maccal/model.safetensors",
        "finetune", "finetune/ce-maccal/manifest.json",
    ),
    "evaluate": Case(  # written in the hidden work folder, never installed
        ("evaluate", "run=ce"), ("real", "train/ce"), "eval/train/*predictions.npz*",
        "eval/train/.ce.tmp/predictions.npz", "eval", "eval/train/ce/manifest.json",
    ),
}  # fmt: skip


@pytest.mark.parametrize("stage", sorted(CASES))
def test_a_full_disk_is_one_line_and_the_rerun_completes(
    chain, tmp_path, capsys, monkeypatch, stage
):
    case = CASES[stage]
    root = copy(chain, tmp_path, *case.reads)
    argv = [case.argv[0], "--set", f"out={tmp_path}", *case.argv[1:]]
    disk = DiskFull(monkeypatch, root, case.fault)
    line = fails(capsys, argv)
    assert disk.fired, "the fault was never reached"
    assert line.startswith(f"semix {stage}: error: No space left on device: {root / case.named};")
    assert "the disk is full" in line and all(k in line for k in KEPT), line
    assert manifests(root / case.output) == []  # nothing marked complete
    folder, _, n = case.named.rpartition("checkpoint_")
    previous = f"checkpoint_{int(n) - 1}" if folder else ""
    if previous:  # completed work is kept
        assert (root / case.named).with_name(previous).joinpath(MARKER).is_file()
    disk.armed = False
    log = reruns(capsys, argv)
    assert (root / case.done).is_file()
    if previous:
        assert "resumed from" in log and previous in log


@pytest.mark.parametrize(
    ("code", "says"),
    [(errno.EDQUOT, "the disk quota is exhausted"), (errno.EROFS, "the storage is read-only")],
)
def test_a_quota_or_read_only_media_is_one_line_too(tmp_path, capsys, monkeypatch, code, says):
    root = tmp_path / "digits"
    argv = ["prepare", "--set", f"out={tmp_path}"]
    disk = DiskFull(monkeypatch, root, "real/val/*val-000000.tar*", code)
    line = fails(capsys, argv)
    assert f"{os.strerror(code)}: {root / 'real/val/val-000000.tar'};" in line
    assert says in line and all(k in line for k in KEPT), line
    assert manifests(root) == [root / "real" / "train" / "manifest.json"]  # train was done
    disk.armed = False
    reruns(capsys, argv)
    assert {p.parent.name for p in manifests(root / "real")} == {"train", "val", "test"}


def test_a_full_disk_inside_torch_save_names_the_checkpoint(chain, tmp_path, capsys, monkeypatch):
    """accelerate's save_state writes the optimizer and RNG states with torch.save, whose zip
    writer reports a full disk as a RuntimeError without errno or file name."""
    root = copy(chain, tmp_path, "real")
    argv = ["fit-generator", "--set", f"out={tmp_path}", *FIT]
    real_save, real_statvfs = torch.save, os.statvfs
    fired = []

    def save(obj, f, *args, **kwargs):
        if ".tmp-checkpoint_1" in str(f):
            fired.append(str(f))
            raise RuntimeError(
                "[enforce fail at inline_container.cc:603] . unexpected pos 1536 vs 1430"
            )
        return real_save(obj, f, *args, **kwargs)

    def statvfs(path):  # the file system, asked why: no block left (once the disk is full)
        st = real_statvfs(path)
        if not fired:
            return st
        return os.statvfs_result((st.f_bsize, st.f_frsize, st.f_blocks, 0, 0, *st[5:]))

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(os, "statvfs", statvfs)
    line = fails(capsys, argv)
    assert fired
    checkpoint = root / "generator" / "checkpoints" / "checkpoint_1"
    assert line.startswith(f"semix fit-generator: error: No space left on device: {checkpoint};")
    assert all(k in line for k in KEPT)
    assert (checkpoint.with_name("checkpoint_0") / MARKER).is_file()
    assert manifests(root / "generator") == []
    monkeypatch.undo()
    assert "resumed from" in reruns(capsys, argv)
    assert (root / "generator" / "manifest.json").is_file()


def test_a_full_disk_inside_safetensors_names_the_file(chain, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as a SafetensorError whose text names the os error."""
    from safetensors import SafetensorError

    import stages.annotate.encoder

    root = copy(chain, tmp_path, "real", "train/encoder", "series")
    argv = ["annotate", "--set", f"out={tmp_path}", *ANN]

    def save_file(tensors, filename, *args, **kwargs):
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28) at "
            f'path "{filename}"'
        )

    monkeypatch.setattr(stages.annotate.encoder, "save_file", save_file)
    line = fails(capsys, argv)
    prototypes = root / "mixed" / "prototypes.safetensors"
    assert line.startswith(f"semix annotate: error: No space left on device: {prototypes};")
    assert manifests(root / "mixed") == []
    monkeypatch.undo()
    reruns(capsys, argv)
    assert (root / "mixed" / "manifest.json").is_file() and prototypes.is_file()


# ---------------------------------------------------------------- Ctrl-C


def test_ctrl_c_in_training_keeps_the_checkpoint_and_the_rerun_resumes(
    digits_root, tmp_path, capsys, monkeypatch
):
    """KeyboardInterrupt during the second epoch: exit 130, one line, no manifest; the rerun
    resumes from the first epoch's checkpoint and ends with the uninterrupted weights."""
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    sets = ["epochs=2", "train_limit=64", "batch_size=32"]
    whole = run_stage("train", "digits", [f"out={tmp_path}", "run=whole", *sets])
    argv = ["train", "--set", f"out={tmp_path}", "run=cut", *sets]
    validate, calls = stages.common.epochs.validate, []

    def ctrl_c_in_epoch_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return validate(*args, **kwargs)

    monkeypatch.setattr(stages.common.epochs, "validate", ctrl_c_in_epoch_two)
    assert fails(capsys, argv, code=130) == f"semix train: {INTERRUPTED}"
    cut = tmp_path / "digits" / "train" / "cut"
    assert manifests(cut) == [] and (cut / "checkpoints" / "checkpoint_1" / MARKER).is_file()
    monkeypatch.undo()
    assert "resumed from" in reruns(capsys, argv)
    assert (cut / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()


def test_ctrl_c_between_shards_then_the_rerun_ends_as_an_uninterrupted_run(
    digits_root, tmp_path, capsys, monkeypatch
):
    write, calls = shards.writer.ShardFolder.write, []

    def ctrl_c_at_the_third_shard(self, index, samples):
        calls.append(index)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return write(self, index, samples)

    monkeypatch.setattr(shards.writer.ShardFolder, "write", ctrl_c_at_the_third_shard)
    argv = ["prepare", "--set", f"out={tmp_path}"]
    assert fails(capsys, argv, code=130) == f"semix prepare: {INTERRUPTED}"
    real = tmp_path / "digits" / "real"
    assert manifests(real) == [] and len(list(real.rglob(".done/*.json"))) == 2
    monkeypatch.undo()
    reruns(capsys, argv)

    def tree(folder: Path) -> dict[str, bytes]:
        return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}  # fmt: skip

    assert tree(real) == tree(digits_root / "real")  # every byte, config and records included


# ---------------------------------------------------------------- damaged checkpoints


def test_damaged_checkpoints_are_named_and_training_resumes_from_an_intact_one(
    digits_root, tmp_path, capsys, monkeypatch
):
    """A flipped byte in the newest checkpoint's RNG state: one line naming it, one naming
    the checkpoint taken instead, and the run ends with the uninterrupted weights. Every
    checkpoint damaged: one line, exit 1, nothing written; resume='' starts over."""
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    sets = ["epochs=3", "train_limit=64", "batch_size=32", "checkpoint_limit=3"]
    whole = run_stage("train", "digits", [f"out={tmp_path}", "run=whole", *sets])
    validate = stages.common.epochs.validate

    def cut(run: str) -> Path:
        """Train `run` and interrupt it in its third epoch: checkpoints 1 and 2 on disk."""
        calls = []

        def ctrl_c_in_epoch_three(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return validate(*args, **kwargs)

        monkeypatch.setattr(stages.common.epochs, "validate", ctrl_c_in_epoch_three)
        assert main(["train", "--set", f"out={tmp_path}", f"run={run}", *sets]) == 130
        monkeypatch.setattr(stages.common.epochs, "validate", validate)
        capsys.readouterr()
        folder = tmp_path / "digits" / "train" / run / "checkpoints"
        assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_1", "checkpoint_2"]
        return folder

    checkpoints = cut("flipped")
    rng = checkpoints / "checkpoint_2" / "random_states_0.pkl"
    data = bytearray(rng.read_bytes())
    data[len(data) // 2] ^= 0x01
    rng.write_bytes(bytes(data))
    log = reruns(capsys, ["train", "--set", f"out={tmp_path}", "run=flipped", *sets])
    named = [line for line in log.splitlines() if str(rng) in line]
    assert len(named) == 1 and "sha256 differs" in named[0], log
    instead = [line for line in log.splitlines() if "resuming from the previous" in line]
    assert len(instead) == 1 and str(checkpoints / "checkpoint_1") in instead[0], log
    run = checkpoints.parent
    assert (run / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()

    checkpoints = cut("ruined")
    for n in (1, 2):
        weights = checkpoints / f"checkpoint_{n}" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-8])
    argv = ["train", "--set", f"out={tmp_path}", "run=ruined", *sets]
    line = fails(capsys, argv)
    newest = checkpoints / "checkpoint_2" / "model.safetensors"
    assert line.startswith(f"semix train: error: {newest}: ") and "record says" in line
    assert "holds no intact checkpoint: start over with --set checkpoint.resume= " in line
    assert manifests(checkpoints.parent) == []
    reruns(capsys, [*argv, "resume="])  # start over
    ruined = checkpoints.parent / "model.safetensors"
    assert ruined.read_bytes() == (whole / "model.safetensors").read_bytes()


def test_writers_racing_to_one_file_never_lose_each_others_temporary_file(tmp_path):
    # the study's parallel evaluations each rebuild eval/report.md: with one shared temporary
    # name, one writer's rename took the other's file away (FileNotFoundError)
    from concurrent.futures import ThreadPoolExecutor

    path = tmp_path / "report.md"

    def write(i: int) -> None:
        for j in range(100):
            atomic_write_bytes(path, f"{i} {j}\n".encode(), shared=True)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(4)))  # re-raises a writer's error
    assert path.read_bytes().endswith(b" 99\n")
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # no temporary file left
