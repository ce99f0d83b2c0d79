"""Every stage verifies what it reads: bad input ends in one line naming the file, never a
traceback, and nothing downstream is marked complete (issue 11).

Each case builds its bad input in tmp_path from the session's prepared digits.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shlex
import shutil
import tarfile
from pathlib import Path

import pytest
from conftest import TINY_TRAIN, snapshot
from test_train import write_mixed

import shards.writer
from core.io import sha256_file
from pipeline.cli import main
from shards.manifest import read_manifest

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("bad_input")]
TINY = TINY_TRAIN  # conftest's tiny_ce_root was trained at it


# ---------------------------------------------------------------- helpers


def one_line_error(capsys, argv: list[str], names: str, code: int = 1) -> str:
    """Run the CLI; assert exit `code`, exactly one `semix` error line naming `names`, no
    traceback. Returns the line."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("semix") and ": error: " in line]
    assert rc == code, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and names in lines[0], err
    return lines[0]


def member(shard: Path, suffix: str) -> tuple[int, int]:
    """(offset, size) of the first member ending in `suffix` inside a tar."""
    with tarfile.open(shard) as tar:
        m = next(m for m in tar.getmembers() if m.name.endswith(suffix))
        return m.offset_data, m.size


def flip(shard: Path, suffix: str, new: bytes | None = None) -> None:
    """Change one byte of a member in place (size kept): a silent bit flip on disk."""
    data = bytearray(shard.read_bytes())
    offset, _ = member(shard, suffix)
    data[offset] = new[0] if new else data[offset] ^ 0x01
    shard.write_bytes(bytes(data))


def relabel(shard: Path) -> None:
    """Change the first .cls digit to another digit: a silently wrong label."""
    offset, _ = member(shard, ".cls")
    digit = shard.read_bytes()[offset : offset + 1]
    flip(shard, ".cls", b"0" if digit != b"0" else b"1")


def replace_member(shard: Path, suffix: str, payload: bytes) -> None:
    """Rewrite the tar with the first `suffix` member replaced, then make the folder's manifest
    agree (a folder that is consistent but holds foreign bytes: the hash cannot catch it)."""
    buf = io.BytesIO()
    done = False
    with tarfile.open(shard) as src, tarfile.open(fileobj=buf, mode="w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if not done and m.name.endswith(suffix):
                data, done = payload, True
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    shard.write_bytes(buf.getvalue())
    path = shard.parent / "manifest.json"
    manifest = json.loads(path.read_text())
    for rec in manifest["shards"]:
        if rec["name"] == shard.name:
            rec.update(sha256=sha256_file(shard), bytes=shard.stat().st_size)
    path.write_text(json.dumps(manifest))


def copy_real(digits_root: Path, out: Path) -> Path:
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    return out / "digits"


# ---------------------------------------------------------------- corrupt data is refused


def test_flipped_cls_in_real_train_stops_train_and_fit_generator(digits_root, tmp_path, capsys):
    root = copy_real(digits_root, tmp_path)
    relabel(root / "real" / "train" / "train-000001.tar")
    base = ["--preset", "digits", "--set", f"out={tmp_path}"]
    line = one_line_error(capsys, ["train", *base, *TINY], "train-000001.tar")
    assert "sha256 mismatch" in line and "rerun prepare" in line
    assert not (root / "train" / "ce" / "model.json").exists()
    assert not (root / "train" / "ce" / "config.json").exists()  # refused before writing
    one_line_error(capsys, ["fit-generator", *base, "steps=1"], "train-000001.tar")
    assert not (root / "generator" / "manifest.json").exists()


def test_flipped_json_in_mixed_stops_csm_training(digits_root, tmp_path, capsys):
    root = copy_real(digits_root, tmp_path)
    mixed = write_mixed(root / "mixed", root / "real" / "train")
    flip(mixed / "mixed-000001.tar", ".json")
    argv = ["train", "--set", f"out={tmp_path}", *TINY, "run=csm", "loss=csm"]
    one_line_error(capsys, argv, "mixed-000001.tar: sha256 mismatch")
    assert not (root / "train" / "csm" / "model.json").exists()


def test_edited_num_samples_is_refused(digits_root, tmp_path, capsys):
    root = copy_real(digits_root, tmp_path)
    path = root / "real" / "val" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["num_samples"] += 1
    path.write_text(json.dumps(manifest))
    line = one_line_error(capsys, ["train", "--set", f"out={tmp_path}", *TINY], str(path))
    assert "num_samples" in line and "rerun prepare" in line
    assert not (root / "train" / "ce").exists()


def test_corrupt_png_and_pickled_cls_give_one_line(digits_root, tmp_path, capsys):
    root = copy_real(digits_root, tmp_path)
    train = root / "real" / "train" / "train-000000.tar"
    offset, size = member(train, ".png")
    data = bytearray(train.read_bytes())
    data[offset + size - 20] ^= 0xFF  # inside the image data / its CRC
    train.write_bytes(bytes(data))
    base = ["train", "--set", f"out={tmp_path}", *TINY]
    one_line_error(capsys, base, "train-000000.tar: sha256 mismatch")
    # storage trusted (no hash): the decoder still names the shard, never a bare OSError
    line = one_line_error(capsys, [*base, "verify_sha256=0"], "train-000000.tar")
    assert "png member" in line
    # a pickle in a .cls member of a consistent folder: refused, never unpickled
    shutil.copytree(digits_root / "real", tmp_path / "p" / "real")
    val = tmp_path / "p" / "real" / "val" / "val-000000.tar"
    replace_member(val, ".cls", pickle.dumps({"label": 3}))
    line = one_line_error(capsys, ["train", "--set", f"out={tmp_path}", "name=p", *TINY], str(val))
    assert "cls member" in line
    assert not (tmp_path / "p" / "train").exists()


# ---------------------------------------------------------------- manifests: what is wrong, what to do


def _command(line: str) -> list[str]:
    """The `python -m pipeline ...` command an error line quotes, as an argv for main()."""
    quoted = re.search(r"`(python -m pipeline [^`]*)`", line)
    assert quoted, line
    argv = shlex.split(quoted.group(1))
    assert argv[:3] == ["python", "-m", "pipeline"]
    return argv[3:]


def test_missing_upstream_prints_the_command_that_makes_it(tmp_path, capsys):
    line = one_line_error(capsys, ["train", "--set", f"out={tmp_path}", *TINY], "does not exist")
    assert str(tmp_path / "digits" / "real" / "train") in line and "run prepare first" in line
    argv = _command(line)
    assert argv == ["prepare", "--preset", "digits", "--set", f"out={tmp_path}"]
    assert main(argv) == 0  # the command does make it
    assert read_manifest(tmp_path / "digits" / "real" / "train").num_samples > 0


def test_incomplete_upstream_prints_the_command_that_completes_it(digits_root, tmp_path, capsys):
    root = copy_real(digits_root, tmp_path)
    (root / "real" / "val" / "manifest.json").unlink()
    line = one_line_error(capsys, ["train", "--set", f"out={tmp_path}", *TINY], "is incomplete")
    assert "rerun prepare to complete it" in line
    assert _command(line) == ["prepare", "--preset", "digits", "--set", f"out={tmp_path}"]


@pytest.mark.parametrize(
    ("split", "damage", "says"),
    [
        ("val", lambda m: "{not json", "is not JSON"),
        ("val", lambda m: json.dumps({k: v for k, v in m.items() if k != "kind"}), "lacks the key 'kind'"),
        ("train", lambda m: json.dumps(m | {"class_names": m["class_names"][:5]}), "lists 5 class names"),
    ],
    ids=["not-json", "no-kind", "fewer-class-names"],
)  # fmt: skip
def test_bad_manifest_says_what_is_wrong_and_what_to_do(
    digits_root, tmp_path, capsys, split, damage, says
):
    root = copy_real(digits_root, tmp_path)
    path = root / "real" / split / "manifest.json"
    path.write_text(damage(json.loads(path.read_text())))
    line = one_line_error(capsys, ["train", "--set", f"out={tmp_path}", *TINY], str(path))
    assert says in line and "restore" in line and "rerun prepare" in line
    assert _command(line) == ["prepare", "--preset", "digits", "--set", f"out={tmp_path}"]
    if split == "train":  # the shards use classes 0..9
        assert "class id 9" in line
    assert not (root / "train").exists()


@pytest.fixture(scope="module")
def trained(tiny_ce_root) -> Path:
    """runs/digits/ with real/ and one finished tiny train run `ce` (conftest's tiny_ce_root,
    shared with other modules): read-only, copy it."""
    return tiny_ce_root


@pytest.mark.parametrize("typed", ["optim.lr=0.5", "lr=0.5"])
def test_another_config_under_a_run_name_names_the_fields(trained, tmp_path, capsys, typed):
    """Named by the path the user types (config.json's key is the flat `lr`), either spelling."""
    shutil.copytree(trained, tmp_path / "digits")
    before = snapshot(tmp_path / "digits")
    argv = ["train", "--set", f"out={tmp_path}", *TINY, typed]  # the digits preset: 0.05
    line = one_line_error(capsys, argv, str(tmp_path / "digits" / "train" / "ce"))
    assert line.startswith("semix train: error: ")
    assert "(differs in: optim.lr): it has optim.lr=0.05, this one asks optim.lr=0.5" in line
    assert json.loads((tmp_path / "digits/train/ce/config.json").read_text())["lr"] == 0.05
    assert "choose another run=<name>" in line
    assert snapshot(tmp_path / "digits") == before


def test_flipped_cls_in_real_test_stops_evaluate(trained, tmp_path, capsys):
    root = tmp_path / "digits"
    shutil.copytree(trained, root)
    flip(root / "real" / "test" / "test-000000.tar", ".cls")
    argv = ["evaluate", "--set", f"out={tmp_path}", "run=ce"]
    one_line_error(capsys, argv, "test-000000.tar: sha256 mismatch")
    assert not (root / "eval").exists()  # no evaluation folder, no eval/report.md


def test_publish_refuses_a_mixed_sample_without_lambda_hat(digits_root, tmp_path, capsys):
    root = copy_real(digits_root, tmp_path)
    mixed = write_mixed(root / "mixed", root / "real" / "train")
    shard = mixed / "mixed-000000.tar"
    with tarfile.open(shard) as tar:
        m = next(m for m in tar.getmembers() if m.name.endswith(".json"))
        meta = json.loads(tar.extractfile(m).read())
    del meta["lambda_hat"]
    replace_member(shard, ".json", json.dumps(meta).encode())
    argv = ["publish", "--set", f"out={tmp_path}", "repo=u/d", "dry_run=1"]
    line = one_line_error(capsys, argv, str(shard))
    assert "lambda_hat" in line
    assert not (mixed / "README.md").exists()  # no card written for a bad folder


# ---------------------------------------------------------------- models and checkpoints


def _fake_generator(root: Path) -> Path:
    """generator/ as fit-generator leaves it: a random digits-tiny UNet + manifest."""
    import torch

    from models.generators import save_unet, unet_from_preset
    from shards.manifest import Manifest, manifest_digest, write_manifest
    from stages.configs.fit_generator import Config
    from stages.fit_generator.stage import WEIGHTS
    from stages.fit_generator.training import noise_scheduler

    folder = root / "generator"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = unet_from_preset("digits-tiny", num_classes=10)
    save_unet(folder, unet, noise_scheduler(Config()))
    info = {"backend": "unet", "image_size": 16, "weights_sha256": sha256_file(folder / WEIGHTS)}
    upstream = {"real": manifest_digest(root / "real" / "train")}
    write_manifest(
        folder, Manifest("generator", tuple("0123456789"), (), upstream=upstream, info=info)
    )
    return folder / WEIGHTS


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_generator_with_damaged_weights_is_refused(digits_root, tmp_path, capsys, damage):
    root = copy_real(digits_root, tmp_path)
    weights = _fake_generator(root)
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        weights.unlink()
    argv = ["generate", "--set", f"out={tmp_path}", "steps=1", "series_per_pair=1"]
    line = one_line_error(capsys, argv, str(weights))
    assert "fit-generator" in line
    assert not (root / "series").exists()


def test_encoder_weights_that_are_a_pickle_are_refused(tmp_path):
    from models.encoders import OpenCLIPEncoder

    fake = tmp_path / "weights.safetensors"
    fake.write_bytes(pickle.dumps({"w": list(range(100))}))
    with pytest.raises(ValueError, match="weights.safetensors is not a valid safetensors"):
        OpenCLIPEncoder("ViT-B-32", str(fake))


def test_run_weights_that_are_a_pickle_are_refused(trained, tmp_path, capsys):
    root = tmp_path / "digits"
    shutil.copytree(trained, root)
    weights = root / "train" / "ce" / "model.safetensors"
    weights.write_bytes(pickle.dumps({"w": 1}))
    argv = ["evaluate", "--set", f"out={tmp_path}", "run=ce"]
    line = one_line_error(capsys, argv, str(weights))
    assert "not a readable safetensors" in line
    assert not (root / "eval").exists()


class _Payload:
    """Unpickling this runs code: it creates the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_fit_generator_resume_never_unpickles_a_planted_payload(digits_root, tmp_path, capsys):
    from shards.checkpoints import Checkpointer
    from stages.fit_generator.training import EMA, STATE

    root = copy_real(digits_root, tmp_path)
    quick = ["steps=4", "batch_size=8", "checkpoint_every=2", "samples_per_class=1", "judge_run="]
    argv = ["fit-generator", "--set", f"out={tmp_path}", *quick, "sample_steps=1"]
    argv += ["fidelity.per_class=1", "fidelity.guidance_grid=1"]  # its check: not read
    saved = []
    save = Checkpointer.save

    def save_then_die(self, *args):
        save(self, *args)
        saved.append(1)
        raise KeyboardInterrupt

    mp = pytest.MonkeyPatch()
    mp.setattr(Checkpointer, "save", save_then_die)
    assert main(argv) == 130  # Ctrl-C: one line, exit 130 (tests/test_faults.py)
    assert "interrupted" in capsys.readouterr().err
    mp.undo()
    ckpt = root / "generator" / "checkpoints" / "checkpoint_0"
    assert (ckpt / STATE).is_file() and (ckpt / EMA).is_file()
    assert not list(ckpt.glob("custom_checkpoint_*"))  # semix pickles nothing itself
    marker = tmp_path / "payload-ran"
    (ckpt / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    one_line_error(capsys, argv, "custom_checkpoint_0.pkl")
    assert not marker.exists()
    assert not (root / "generator" / "manifest.json").exists()
    # resume=<folder> accepts only a complete checkpoint folder
    other = tmp_path / "elsewhere"
    other.mkdir()
    one_line_error(capsys, [*argv, f"resume={other}"], "not a checkpoint_<n> folder")
    # without the planted file the same checkpoint resumes to completion
    (ckpt / "custom_checkpoint_0.pkl").unlink()
    assert main(argv) == 0 and not marker.exists()
    assert (root / "generator" / "manifest.json").is_file()


# ---------------------------------------------------------------- paths, disks, media


def test_out_pointing_to_a_file(tmp_path, capsys):
    out = tmp_path / "file"
    out.write_text("not a folder")
    one_line_error(capsys, ["prepare", "--set", f"out={out}"], str(out), code=2)


@pytest.mark.parametrize(
    ("code", "hint"), [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only")]
)
def test_full_disk_and_read_only_media(tmp_path, capsys, monkeypatch, code, hint):
    written = []
    write_tar = shards.writer.write_tar

    def fail_on_second(path, samples):
        if written:
            raise OSError(code, os.strerror(code), str(path))
        written.append(path)
        return write_tar(path, samples)

    monkeypatch.setattr(shards.writer, "write_tar", fail_on_second)
    line = one_line_error(capsys, ["prepare", "--set", f"out={tmp_path}"], "train-000001.tar")
    assert hint in line
    assert not list(tmp_path.rglob("manifest.json"))  # nothing marked complete


def test_complete_prepare_rerun_on_read_only_copy(digits_root, tmp_path, read_only, capsys):
    root = copy_real(digits_root, tmp_path)
    before = snapshot(root)
    read_only(tmp_path)
    with pytest.raises(OSError, match="Read-only"):  # the guard works
        (root / "probe").write_text("x")
    assert main(["prepare", "--set", f"out={tmp_path}"]) == 0, capsys.readouterr().err
    assert snapshot(root) == before


def test_moved_and_relative_runs_root_resume(trained, tmp_path, read_only, monkeypatch, capsys):
    """Where runs/ lives is not part of an output's identity: a moved root (and a relative
    out=) reruns as complete, reading only."""
    moved = tmp_path / "moved" / "runs"
    shutil.copytree(trained, moved / "renamed")
    before = snapshot(moved)
    monkeypatch.chdir(tmp_path / "moved")
    read_only(moved)
    for argv in (
        ["prepare", "--set", f"out={moved}", "name=renamed"],
        ["prepare", "--set", "out=runs", "name=renamed"],  # relative
        ["train", "--set", "out=runs", "name=renamed", *TINY],
    ):
        assert main(argv) == 0, capsys.readouterr().err
    assert snapshot(moved) == before
    assert read_manifest(moved / "renamed" / "real" / "train").num_samples > 0


def test_chain_validates_every_stage_before_the_first_runs(tmp_path, capsys):
    for bad, names in (("generate.nonsense=1", "nonsense"), ("annotate.annotator=x", "annotator")):
        one_line_error(capsys, ["chain", "--set", f"out={tmp_path}", bad], names, code=2)
    one_line_error(capsys, ["chain", "--set", f"out={tmp_path}", "genrate.steps=1"], "genrate", 2)
    assert not any(tmp_path.iterdir())  # nothing ran


def test_unexpected_errors_keep_their_traceback(tmp_path, capsys, monkeypatch):
    import stages.prepare

    def boom(cfg):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(stages.prepare, "run", boom)
    assert main(["prepare", "--set", f"out={tmp_path}"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err and "please report" in err


def test_hashing_switch_skips_only_the_hash(digits_root, tmp_path):
    from shards.reader import load_split

    root = copy_real(digits_root, tmp_path)
    shard = root / "real" / "val" / "val-000000.tar"
    relabel(shard)
    with pytest.raises(ValueError, match="sha256 mismatch"):
        load_split(root / "real" / "val")
    assert len(load_split(root / "real" / "val", verify=False)) > 0  # trusted storage
    shard.write_bytes(shard.read_bytes()[:-1024])  # a size change is always caught
    with pytest.raises(ValueError, match="size"):
        load_split(root / "real" / "val", verify=False)
