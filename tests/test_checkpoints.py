"""shards/checkpoints.py and shards/runs.py: the save protocol under kills, the resume policy,
run folders complete only with their manifest."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import Killed, KillPoints
from safetensors.torch import load_file

from shards.checkpoints import MARKER, Checkpointer
from shards.manifest import ShardError
from shards.runs import (
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

    ranks = [Checkpointer(view, keep=5, is_main=main, share=broadcast)
             for view, main in ((main_view, True), (stale_view, False))]  # fmt: skip
    assert [r.choose("auto") for r in ranks] == [main_view / "checkpoint_3"] * 2
    assert Checkpointer(stale_view, keep=5).choose("auto") == stale_view / "checkpoint_2"
    assert [r.choose("") for r in ranks] == [None, None]
    (main_view / "checkpoint_2").rename(tmp_path / "elsewhere")
    (main_view / "checkpoint_3").rename(tmp_path / "elsewhere3")
    for rank in ranks:
        with pytest.raises(ShardError, match=f"resume=latest: {main_view / ''}"):
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
