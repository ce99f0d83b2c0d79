"""shards/checkpoints.py and shards/runs.py: the save protocol under kills, the resume policy,
run folders complete only with their manifest."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import pickle
import re
from pathlib import Path

import pytest
import torch
from conftest import Killed, KillPoints
from safetensors.torch import load_file

from shards.checkpoints import MARKER, Checkpointer, CheckpointError
from shards.manifest import ShardError
from shards.runs import (
    RunError,
    finish_run,
    load_weights,
    read_run,
    run_complete,
    save_weights,
    write_weights,
)


def _write(step: int):
    """What accelerate's save_state would write: two files whose content names the step."""

    def write(folder):
        (folder / "model.safetensors").write_bytes(b"m%d" % step)
        (folder / "random_states_0.pkl").write_bytes(b"r%d" % step)

    return write


def _save(ckpt: Checkpointer, step: int) -> None:
    tensors = {"ema.safetensors": {"w": torch.full((3,), float(step))}}
    ckpt.save(step, _write(step), {"step": step}, tensors)


def _consistent(path) -> int:
    """Every file of a checkpoint belongs to the same save; returns its step."""
    step = json.loads((path / MARKER).read_text())["step"]
    assert (path / "model.safetensors").read_bytes() == b"m%d" % step
    assert (path / "random_states_0.pkl").read_bytes() == b"r%d" % step
    assert torch.equal(load_file(path / "ema.safetensors")["w"], torch.full((3,), float(step)))
    return step


@pytest.mark.parametrize("full_disk", [False, True])
@pytest.mark.parametrize("keep", [1, 2])
def test_a_kill_at_every_point_of_a_save_leaves_a_loadable_checkpoint(
    tmp_path, monkeypatch, keep, full_disk
):
    """Kill (or fill the disk) before each file-system change of the third save: `auto` then
    loads a complete, consistent checkpoint (the third, or the second while the third was not
    yet renamed into place), and tidy leaves only complete checkpoints."""
    points = KillPoints(monkeypatch, tmp_path)
    points.full_disk = full_disk

    def saved_twice(name):
        ckpt = Checkpointer(tmp_path / name / "checkpoints", keep=keep, files=("ema.safetensors",))
        _save(ckpt, 0)
        _save(ckpt, 1)
        return ckpt

    ckpt = saved_twice("count")
    points.armed = True
    _save(ckpt, 2)
    points.armed = False
    changes = list(points.changes)
    assert any(c.startswith("rename") for c in changes) and any("rmdir" in c for c in changes)
    for k in range(len(changes)):
        ckpt = saved_twice(f"kill{k}")
        points.armed, points.kill_at, points.changes = True, k, []
        with pytest.raises(OSError if full_disk else Killed):
            _save(ckpt, 2)
        points.armed, points.kill_at = False, None
        chosen = ckpt.choose("auto")
        assert chosen is not None, changes[k]
        step = _consistent(chosen)
        assert step in (1, 2), changes[k]
        ckpt.tidy(first_free=step + 1)  # no temporary or half-removed folder survives
        left = {p.name for p in ckpt.folder.iterdir()}
        assert left == {f"checkpoint_{n}" for n in ckpt.complete()}, (changes[k], left)
        assert max(ckpt.complete()) == step and len(left) <= keep + 1
        for n, path in ckpt.complete().items():
            assert _consistent(path) == n


def test_resume_policy(tmp_path):
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=3, files=("ema.safetensors",))
    assert ckpt.choose("auto") is None
    with pytest.raises(ShardError, match="holds no complete checkpoint"):
        ckpt.choose("latest")
    for step in range(3):
        _save(ckpt, step)
    assert ckpt.choose("latest") == ckpt.choose("auto") == ckpt.folder / "checkpoint_2"
    assert ckpt.choose("") is None  # start over
    assert ckpt.choose(str(ckpt.folder / "checkpoint_0")) == ckpt.folder / "checkpoint_0"
    with pytest.raises(ShardError, match="not a checkpoint_<n> folder"):
        ckpt.choose(str(tmp_path))
    # replaying from checkpoint_0 removes the future it is about to rewrite
    ckpt.tidy(first_free=1)
    assert sorted(ckpt.complete()) == [0]
    (ckpt.folder / "checkpoint_0" / "custom_checkpoint_0.pkl").write_bytes(b"pickle")
    with pytest.raises(ShardError, match="custom_checkpoint_0.pkl"):
        ckpt.choose("auto") and ckpt.load(ckpt.choose("auto"), lambda p: None)
    ckpt.tidy(first_free=0)  # start over: nothing left
    assert list(ckpt.folder.iterdir()) == []


def test_the_main_process_chooses_the_checkpoint_for_every_rank(tmp_path):
    """On a shared filesystem another node may list a stale folder (no checkpoint_3 yet):
    with `share` (a broadcast) every rank resumes from the main process's choice, and the
    main process's one-line error is every rank's error (none waits for an answer)."""
    main_view, stale_view = tmp_path / "main", tmp_path / "stale"
    for n in (2, 3):
        _save(Checkpointer(main_view, keep=5, files=("ema.safetensors",)), n)
    _save(Checkpointer(stale_view, keep=5, files=("ema.safetensors",)), 2)
    sent = []

    def broadcast(value):  # rank 0 sends, the other rank receives what it sent
        if value is not None:
            sent.append(value)
        return sent[-1]

    ours = ("ema.safetensors",)
    ranks = [Checkpointer(view, keep=5, files=ours, is_main=main, share=broadcast)
             for view, main in ((main_view, True), (stale_view, False))]  # fmt: skip
    assert [r.choose("auto") for r in ranks] == [main_view / "checkpoint_3"] * 2
    assert (
        Checkpointer(stale_view, keep=5, files=ours).choose("auto") == stale_view / "checkpoint_2"
    )
    assert [r.choose("") for r in ranks] == [None, None]
    (main_view / "checkpoint_2").rename(tmp_path / "elsewhere")
    (main_view / "checkpoint_3").rename(tmp_path / "elsewhere3")
    for rank in ranks:
        with pytest.raises(ShardError, match=f"checkpoint.resume=latest: {main_view / ''}"):
            rank.choose("latest")


def test_a_run_is_complete_only_with_its_manifest(tmp_path):
    state = {"w": torch.arange(4.0)}
    meta = {"arch": {"arch": "x"}, "class_names": ["a", "b"], "image_size": 8, "normalize": {}}
    write_weights(tmp_path / "run", state, meta)
    with pytest.raises(ShardError, match="is incomplete: it has no manifest.json"):
        read_run(tmp_path / "run")
    assert not run_complete(tmp_path / "run", {})
    (tmp_path / "run" / "curves.png").write_bytes(b"png")
    manifest = finish_run(tmp_path / "run", ["a", "b"], {"real/train": "d1"}, "v")
    assert manifest.kind == "run" and manifest.upstream == {"real/train": "d1"}
    assert set(manifest.info["files"]) == {"model.safetensors", "model.json", "curves.png"}
    run = read_run(tmp_path / "run")
    assert torch.equal(run.state_dict()["w"], state["w"]) and run.meta["image_size"] == 8
    assert run_complete(tmp_path / "run", {"real/train": "d1"})
    with pytest.raises(ShardError, match=r"made from other inputs \(real/train changed"):
        run_complete(tmp_path / "run", {"real/train": "d2"})
    # weights changed after the run finished: refused by their sha256
    write_weights(tmp_path / "run", {"w": torch.zeros(4)}, meta)
    with pytest.raises(ShardError, match="sha256 differs from the run's manifest"):
        load_weights(tmp_path / "run")
    save_weights(tmp_path / "made", state, meta)  # weights + model.json + manifest in one call
    assert read_run(tmp_path / "made").manifest.upstream == {}
    with pytest.raises(ShardError, match="has no trained weights"):
        read_run(tmp_path / "nothing")


# ---------------------------------------------------------------- the sha256 record (issue 24)


@pytest.fixture
def semix_log():
    """The messages semix's logger emits during the test (warnings included)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("semix")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def _saved(tmp_path, steps, keep=3) -> Checkpointer:
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=keep, files=("ema.safetensors",))
    for step in steps:
        _save(ckpt, step)
    return ckpt


def test_the_marker_records_every_file_and_load_returns_the_state(tmp_path):
    ckpt = _saved(tmp_path, [0])
    folder = ckpt.folder / "checkpoint_0"
    marker = json.loads((folder / MARKER).read_text())
    expected = {
        p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in folder.iterdir()
        if p.name != MARKER
    }
    assert set(expected) == {"model.safetensors", "random_states_0.pkl", "ema.safetensors"}
    assert marker == {"step": 0, "files": expected}
    state, tensors = ckpt.load(ckpt.choose("auto"), lambda p: None)
    assert state == {"step": 0}  # the record is the checkpoint's, not the caller's state
    assert torch.equal(tensors["ema.safetensors"]["w"], torch.zeros(3))
    with pytest.raises(ValueError, match="file record"):
        ckpt.save(1, _write(1), {"files": {}})
    # the cheap check before any work (train's check_resume) reads no file and knows no names
    assert Checkpointer(ckpt.folder, keep=1).choose(str(folder), verify=False) == folder


def _flip(path):
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {  # what is done to checkpoint_2 -> (the file the log line names, what it says)
    "flipped RNG state": (lambda f: _flip(f / "random_states_0.pkl"), "random_states_0.pkl", "sha256 differs"),
    "truncated model": (lambda f: (f / "model.safetensors").write_bytes(b"m"), "model.safetensors", "1 bytes, the checkpoint's record says 2"),
    "removed RNG state": (lambda f: (f / "random_states_0.pkl").unlink(), "random_states_0.pkl", "missing"),
    "added optimizer": (lambda f: (f / "optimizer.bin").write_bytes(b"o"), "optimizer.bin", "not in the checkpoint's record"),
    "planted pickle": (lambda f: (f / "custom_checkpoint_0.pkl").write_bytes(b"p"), "custom_checkpoint_0.pkl", "pickled state is never loaded"),
    "garbled marker": (lambda f: (f / MARKER).write_text("{not json"), MARKER, "unreadable"),
}  # fmt: skip


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, semix_log, damage):
    """Verified as a whole before anything is read: one log line naming the file, one saying
    which checkpoint is taken instead; the damaged one is replayed (tidy removes it)."""
    ckpt = _saved(tmp_path, [0, 1, 2])
    do, name, says = DAMAGE[damage]
    damaged = ckpt.folder / "checkpoint_2"
    do(damaged)
    for resume in ("auto", "latest"):
        semix_log.clear()
        assert ckpt.choose(resume) == ckpt.folder / "checkpoint_1"
        assert len(semix_log) == 2, semix_log
        assert str(damaged / name) in semix_log[0] and says in semix_log[0]
        assert "resuming from the previous complete checkpoint" in semix_log[1]
        assert str(ckpt.folder / "checkpoint_1") in semix_log[1]
    state, tensors = ckpt.load(ckpt.choose("auto"), lambda p: None)
    assert state == {"step": 1} and torch.equal(tensors["ema.safetensors"]["w"], torch.ones(3))
    with pytest.raises(ShardError, match=re.escape(str(damaged / name))):  # named: no fallback
        ckpt.choose(str(damaged))
    ckpt.tidy(first_free=state["step"] + 1)
    assert sorted(ckpt.complete()) == [0, 1]


def test_no_intact_checkpoint_stops_in_one_line(tmp_path, semix_log):
    ckpt = _saved(tmp_path, [0, 1], keep=2)
    for n in (0, 1):
        _flip(ckpt.folder / f"checkpoint_{n}" / "random_states_0.pkl")
    with pytest.raises(ShardError) as error:
        ckpt.choose("auto")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(str(ckpt.folder / "checkpoint_1" / "random_states_0.pkl"))
    assert "holds no intact checkpoint: start over with --set checkpoint.resume= " in message
    assert len(semix_log) == 2  # one line per damaged checkpoint, no "resuming from"
    assert ckpt.choose("") is None  # resume='' starts over
    ckpt.tidy(first_free=0)
    assert list(ckpt.folder.iterdir()) == []


def test_a_checkpoint_without_a_record_loads_unverified_with_a_warning(tmp_path, semix_log):
    """Written by semix before the record existed: resumed from (the run keeps its progress),
    said once."""
    ckpt = _saved(tmp_path, [0, 1])
    marker = ckpt.folder / "checkpoint_1" / MARKER
    marker.write_text(json.dumps({"step": 1}))  # the old marker: the caller's state only
    _flip(ckpt.folder / "checkpoint_1" / "random_states_0.pkl")  # not detectable without one
    assert ckpt.choose("auto") == ckpt.folder / "checkpoint_1"
    assert len(semix_log) == 1 and "has no sha256 record" in semix_log[0]
    state, _ = ckpt.load(ckpt.folder / "checkpoint_1", lambda p: None)
    assert state == {"step": 1}


class _Payload:
    """Unpickling this runs code: it creates the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_file_that_does_not_load_is_one_line_and_never_unpickled(tmp_path):
    """A consistent record over bytes that are no loadable state (a pickle under accelerate's
    optimizer name; a truncated torch file): read with weights_only, refused in one line."""
    ran = tmp_path / "payload-ran"
    buffer = io.BytesIO()
    torch.save({"state": {}, "param_groups": []}, buffer)
    contents = {
        "pickle": (pickle.dumps(_Payload(ran)), "a pickle that is not plain tensors"),
        "truncated": (buffer.getvalue()[:100], "RuntimeError: PytorchStreamReader"),
        "empty": (b"", "EOFError"),
    }
    for name, (data, says) in contents.items():
        ckpt = Checkpointer(tmp_path / name, keep=1)
        path = ckpt.save(
            0, lambda folder, data=data: (folder / "optimizer.bin").write_bytes(data), {}
        )
        with pytest.raises(ShardError) as error:
            ckpt.load(
                ckpt.choose("auto"), lambda p: torch.load(p / "optimizer.bin", weights_only=True)
            )
        message = str(error.value)
        assert message.startswith(f"{path}: this checkpoint does not load") and says in message
        assert "\n" not in message and "--set checkpoint.resume= " in message
    assert not ran.exists()


def test_accelerate_alone_ignores_a_damaged_rng_file_the_record_does_not(tmp_path, semix_log):
    """Why the RNG files are in the record: accelerate's load_state swallows any error loading
    them ("Could not load random states") and carries on with the current RNG state."""
    from core.accelerator import new_accelerator
    from shards.checkpoints import LOAD_KWARGS

    accelerator = new_accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=2)
    for n in (0, 1):
        ckpt.save(n, lambda folder: accelerator.save_state(str(folder)), {"n": n})
    rng = ckpt.folder / "checkpoint_1" / "random_states_0.pkl"
    assert {p.name for p in rng.parent.iterdir()} >= {"optimizer.bin", rng.name, MARKER}
    rng.write_bytes(rng.read_bytes()[: rng.stat().st_size // 2])
    accelerator.load_state(str(rng.parent), load_kwargs=LOAD_KWARGS)  # no error: silently skipped
    assert ckpt.choose("auto") == ckpt.folder / "checkpoint_0"
    assert str(rng) in semix_log[0] and "record says" in semix_log[0]
    state, _ = ckpt.load(
        ckpt.folder / "checkpoint_0",
        lambda p: accelerator.load_state(str(p), load_kwargs=LOAD_KWARGS),
    )
    assert state == {"n": 0}


def test_errors_are_named_for_what_failed(tmp_path):
    """A checkpoint that fails is a CheckpointError and a run folder a RunError, in one line;
    both are ShardErrors, so every `except ShardError` and the CLI's exit 1 still hold."""
    assert issubclass(CheckpointError, ShardError) and issubclass(RunError, ShardError)
    ckpt = Checkpointer(tmp_path / "checkpoints", keep=1, files=("ema.safetensors",))
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        ckpt.choose("latest")
    folder = tmp_path / "checkpoints" / "checkpoint_1"
    folder.mkdir(parents=True)
    with pytest.raises(CheckpointError, match="not a complete semix checkpoint"):
        ckpt.choose(str(folder))
    # an older checkpoint (no record: loaded unverified) whose tensors are no safetensors file
    (folder / MARKER).write_text(json.dumps({"step": 1}))
    (folder / "ema.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="ema.safetensors is not a readable safetensors"):
        ckpt.load(folder, lambda p: None)
    with pytest.raises(RunError, match="has no trained weights"):
        read_run(tmp_path / "run")
    from stages.evaluate import find_run  # evaluate's run lookup names the run too

    with pytest.raises(RunError, match="has no trained weights"):
        find_run(tmp_path, "ghost", "")
    (tmp_path / "train" / "half").mkdir(parents=True)
    with pytest.raises(RunError, match="'half' .* is not complete"):
        find_run(tmp_path, "half", "")
