"""Inputs that change, break or mislead: the user's data guarded (a changed source, one class,
16-bit images, val/, hidden folders, keys the source never reads, bad environment values),
damaged outputs that never loop (a rerun checks what its manifest pins, and the printed fix
works when followed), and hints and records that tell the truth (every printed command keeps
the user's root; the precision a run computed in is on disk)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.precision import native_bf16
from pipeline.cli import main

QUOTED = re.compile(r"`(python -m pipeline [^`]*)`")
TINY = ["epochs=1", "train_limit=64", "batch_size=32"]


def error_line(capsys, argv: list[str], code: int = 1) -> str:
    """`main(argv)` fails with `code` in one line and no traceback; that line."""
    got = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("semix ")]
    assert got == code and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def quoted(line: str) -> list[list[str]]:
    """The semix arguments of each `python -m pipeline ...` a line quotes."""
    return [shlex.split(cmd)[3:] for cmd in QUOTED.findall(line)]


def resolved(capsys, args: list[str]) -> dict:
    """What a command resolves to (--print-config), with its run root as "root"."""
    assert main([*args, "--print-config"]) == 0, (args, capsys.readouterr().err)
    config = json.loads(capsys.readouterr().out)
    return config | {"root": str(Path(config["out"]) / (config["name"] or config["preset"]))}


def prepared(digits_root: Path, out: Path) -> Path:
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    return out / "digits"


# ---------------------------------------------------------------- damaged outputs never loop


def test_a_truncated_weights_file_is_named_on_rerun_and_the_fix_works(
    digits_root, tmp_path, capsys
):
    out = tmp_path / "runs"
    root = prepared(digits_root, out)
    argv = ["train", "--preset", "digits", "--set", f"out={out}", "loss=ce", *TINY]
    assert main(argv) == 0
    folder = root / "train" / "ce"
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()

    line = error_line(capsys, argv)  # never "already finished"
    assert str(weights) in line and f"remove {folder} and rerun the same command" in line

    # a reader names it too, with a command that makes the run again in the user's root
    line = error_line(capsys, ["evaluate", "--preset", "digits", "--set", f"out={out}", "run=ce"])
    assert str(weights) in line and f"remove {folder}" in line
    (command,) = quoted(line)
    assert command[0] == "train" and resolved(capsys, command)["root"] == str(root)

    shutil.rmtree(folder)  # the fix, as printed
    assert main(argv) == 0
    from shards.runs import read_run

    assert read_run(folder).state_dict()  # complete again, its weights match the manifest


def test_a_truncated_shard_is_named_on_rerun_and_the_printed_command_rebuilds_it(
    digits_root, tmp_path, capsys
):
    out = tmp_path / "runs"
    root = prepared(digits_root, out)
    shard = sorted((root / "real" / "val").glob("*.tar"))[0]
    shard.write_bytes(shard.read_bytes()[:512])
    argv = ["prepare", "--preset", "digits", "--set", f"out={out}"]

    line = error_line(capsys, argv)
    assert str(shard) in line and "truncated" in line and "remove the folder" in line
    (command,) = quoted(line)
    shutil.rmtree(shard.parent)  # the fix, as printed
    assert main(command) == 0
    from shards.manifest import verify_shards

    verify_shards(root / "real" / "val")


# ---------------------------------------------------------------- hints keep the user's root

HINTS = {
    "evaluate an untrained run": ("evaluate", ["--preset", "digits"], ["run=nope"]),
    "evaluate under name=": ("evaluate", ["--preset", "digits"], ["name=foo", "run=nope"]),
    "evaluate with a recipe": (
        "evaluate",
        ["--preset", "digits", "--recipe", "fashion-mnist"],
        ["run=nope"],
    ),
    "evaluate with no runs": ("evaluate", ["--preset", "digits"], []),
    "finetune an untrained run": ("finetune", ["--preset", "digits"], ["name=foo", "run=nope"]),
}


@pytest.mark.parametrize("case", sorted(HINTS))
def test_every_printed_command_keeps_the_users_root_and_run(case, tmp_path, capsys):
    """Each hint quotes a command that resolves (--print-config) to the user's own out= and
    name=, and to the run it was asked about."""
    stage, preset, sets = HINTS[case]
    argv = [stage, *preset, "--set", f"out={tmp_path}", *sets]
    root = resolved(capsys, argv)["root"]
    line = error_line(capsys, argv)
    assert "make train" not in line and "RUN=" not in line, line
    (command,) = quoted(line)
    assert command[0] == "train", line
    config = resolved(capsys, command)
    assert config["root"] == root, line
    if "run=nope" in sets:
        assert config["run"] == "nope", line


# ---------------------------------------------------------------- the precision on disk


NATIVE = "bf16" if native_bf16(torch.device("cpu")) else "fp32"  # what auto is on this CPU


@pytest.mark.parametrize("launcher, computed", [("", NATIVE), ("bf16", "bf16"), ("no", "fp32")])
def test_host_json_says_the_precision_the_run_computed_in(
    launcher, computed, digits_root, tmp_path, capsys, monkeypatch
):
    """config.json keeps `auto`; host.json says what it became (on this CPU: bf16 where it
    computes bf16 natively, else fp32; under accelerate launch --mixed_precision X, which sets
    ACCELERATE_MIXED_PRECISION: X)."""
    if launcher:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    out = tmp_path / "runs"
    root = prepared(digits_root, out)
    argv = ["train", "--preset", "digits", "--set", f"out={out}", "loss=ce", *TINY]
    assert main(argv) == 0, capsys.readouterr().err
    folder = root / "train" / "ce"
    assert json.loads((folder / "config.json").read_text())["precision"] == "auto"
    assert json.loads((folder / "host.json").read_text())["precision"] == computed


def test_a_precision_conflict_with_accelerate_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    """What `accelerate launch --mixed_precision fp16 -m pipeline train --set precision=fp32`
    gives semix (accelerate sets ACCELERATE_MIXED_PRECISION): one line, exit 2, no work."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    argv = ["train", "--preset", "digits", "--set", f"out={tmp_path}", "precision=fp32"]
    line = error_line(capsys, argv, code=2)
    assert "precision=fp32 conflicts with accelerate launch's mixed precision 'fp16'" in line
    assert not (tmp_path / "digits" / "train").exists()


# ---------------------------------------------------------------- semix's environment


@pytest.mark.parametrize(
    "name, value",
    [
        ("SEMIX_PROGRESS", "bogus"),
        ("SEMIX_DEBUG", "yes"),
        ("SEMIX_NO_PROGRESS", "true"),
        ("SEMIX_PROGRESS_EVERY", "often"),
        ("SEMIX_DIST_TIMEOUT", "-5"),
    ],
)
def test_a_value_semix_cannot_use_in_its_environment_is_one_line(
    name, value, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv(name, value)
    line = error_line(capsys, ["prepare", "--preset", "digits", "--set", f"out={tmp_path}"], 2)
    assert f"{name}={value!r} is not valid" in line
    assert not (tmp_path / "digits").exists()  # before any work


def test_the_values_semix_takes_pass_the_environment_check():
    from core.environment import check_environment

    check_environment({})
    check_environment(
        {
            "SEMIX_PROGRESS": "Log",
            "SEMIX_DEBUG": "0",
            "SEMIX_NO_PROGRESS": "1",
            "SEMIX_PROGRESS_EVERY": "2.5",
            "SEMIX_DIST_TIMEOUT": "600",
            "SEMIX_SOMETHING_ELSE": "anything",  # not semix's: a script's own
        }
    )


# ---------------------------------------------------------------- the user's data, guarded


def write_images(folder: Path, n: int, size: int = 8, mode: str = "RGB", start: int = 0) -> None:
    """n small distinct images in `folder` (PNG), numbered from `start`."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + n):
        if mode == "I;16":
            data = np.full((size, size), 1000 * (i + 1), dtype=np.uint16)
        else:
            data = np.full((size, size, 3), 10 * (i + 1) % 256, dtype=np.uint8)
        Image.fromarray(data).save(folder / f"{i:03d}.png")


def image_folder(base: Path, classes=("cat", "dog"), n: int = 6, **kwargs) -> Path:
    for name in classes:
        write_images(base / name, n, **kwargs)
    return base


def prepare(capsys, out: Path, data: Path, *sets: str, code: int = 0) -> str:
    """prepare's stderr (its log); the exit code checked."""
    argv = ["prepare", "--preset", "imagefolder", "--set", f"out={out}", f"data_dir={data}"]
    got = main([*argv, "image_size=8", *sets])
    err = capsys.readouterr().err
    assert got == code, err
    return err


def counts(real: Path) -> dict[str, int]:
    from shards.manifest import read_manifest

    return {s: read_manifest(real / s).num_samples for s in ("train", "val", "test")}


def test_a_changed_source_stops_the_rerun_in_one_line_naming_the_change(tmp_path, capsys):
    data = image_folder(tmp_path / "pets")
    out = tmp_path / "runs"
    prepare(capsys, out, data)
    real = out / "imagefolder" / "real"
    assert "source_sha256" in json.loads((real / "train" / "manifest.json").read_text())["info"]
    assert "complete already" in prepare(capsys, out, data)  # unchanged: nothing to do

    write_images(data / "cat", 3, start=6)
    argv = ["prepare", "--preset", "imagefolder", "--set", f"out={out}", f"data_dir={data}"]
    line = error_line(capsys, [*argv, "image_size=8"])
    assert "3 more files under cat/ (6 -> 9)" in line and "complete already" not in line
    assert "name=NEW" in line and f"remove {real}" in line

    prepare(capsys, out, data, "name=pets2")  # the way forward: another root
    assert sum(counts(out / "pets2" / "real").values()) == 15

    (data / "dog" / "000.png").write_bytes((data / "dog" / "001.png").read_bytes())  # same size
    line = error_line(capsys, [*argv, "image_size=8", "name=pets2"])
    assert "file contents changed under dog/" in line


def test_a_root_prepared_before_fingerprints_is_still_complete(tmp_path, capsys):
    data = image_folder(tmp_path / "pets")
    out = tmp_path / "runs"
    prepare(capsys, out, data)
    real = out / "imagefolder" / "real"
    (real / "source.json").unlink()  # as a root prepared by an earlier semix
    config = (real / "config.json").read_bytes()
    write_images(data / "cat", 2, start=6)
    assert "complete already" in prepare(capsys, out, data)
    assert (real / "config.json").read_bytes() == config


def test_one_class_is_refused_in_one_line(tmp_path, capsys):
    data = image_folder(tmp_path / "cats", classes=("cat",))
    argv = ["prepare", "--preset", "imagefolder", "--set", f"out={tmp_path}", f"data_dir={data}"]
    line = error_line(capsys, argv)
    assert "has 1 class (cat): a classifier needs 2 or more" in line


def test_16_bit_images_are_scaled_by_their_range_not_clipped(tmp_path, capsys):
    from PIL import Image

    from shards.sources import to_rgb

    image = Image.fromarray(np.full((4, 4), 32768, dtype=np.uint16))
    notes: set[str] = set()
    rgb = to_rgb(image, "x.png", notes)
    assert rgb.dtype == np.uint8 and rgb.shape == (4, 4, 3)
    assert np.all(rgb == round(32768 * 255 / 65535))  # 128, where convert("RGB") gives 255
    assert any("16-bit" in n for n in notes)

    data = image_folder(tmp_path / "depth", mode="I;16")
    err = prepare(capsys, tmp_path / "runs", data)
    assert err.count("16-bit grey images (PIL mode I;16) scaled to 8 bits") == 1


def test_a_float_image_is_refused_by_name(tmp_path, capsys):
    from PIL import Image

    data = image_folder(tmp_path / "pets")
    Image.fromarray(np.zeros((8, 8), dtype=np.float32)).save(data / "cat" / "float.tif")
    argv = ["prepare", "--preset", "imagefolder", "--set", f"out={tmp_path}", f"data_dir={data}"]
    line = error_line(capsys, [*argv, "image_size=8"])
    assert "float.tif" in line and "PIL mode F" in line


def test_a_val_folder_is_the_val_split(tmp_path, capsys):
    data = tmp_path / "pets"
    image_folder(data / "train", n=6)
    image_folder(data / "val", n=2)
    image_folder(data / "test", n=3)
    prepare(capsys, tmp_path / "runs", data)
    assert counts(tmp_path / "runs" / "imagefolder" / "real") == {"train": 12, "val": 4, "test": 6}


def test_hidden_folders_and_files_are_skipped(tmp_path, capsys):
    data = image_folder(tmp_path / "pets")
    write_images(data / ".ipynb_checkpoints", 2)  # a tool's, not a class
    write_images(data / "cat" / ".thumbs", 2)
    (data / "dog" / ".preview.png").write_bytes((data / "dog" / "000.png").read_bytes())
    prepare(capsys, tmp_path / "runs", data)
    real = tmp_path / "runs" / "imagefolder" / "real"
    assert sum(counts(real).values()) == 12
    manifest = json.loads((real / "train" / "manifest.json").read_text())
    assert manifest["class_names"] == ["cat", "dog"]


def test_a_resize_and_a_colour_change_are_said_once(tmp_path, capsys):
    data = image_folder(tmp_path / "pets", size=12)
    write_images(data / "dog", 1, start=6)
    err = prepare(capsys, tmp_path / "runs", data)
    assert err.count("images resized to 8x8 (squash; the first: ") == 1
    grey = image_folder(tmp_path / "grey", size=8)
    from PIL import Image

    Image.open(grey / "cat" / "000.png").convert("L").save(grey / "cat" / "000.png")
    err = prepare(capsys, tmp_path / "runs2", grey)
    assert err.count("images of PIL mode L converted to RGB") == 1


@pytest.mark.parametrize(
    "preset, sets, says",
    [
        ("digits", ["data_dir=/nope"], "data_dir=/nope is never read: source=digits"),
        ("imagefolder", ["data_dir=/x", "hf_dataset=a/b"], "hf_dataset=a/b is never read"),
    ],
)
def test_a_key_the_source_never_reads_is_refused(preset, sets, says, tmp_path, capsys):
    argv = ["prepare", "--preset", preset, "--set", f"out={tmp_path}", *sets]
    assert says in error_line(capsys, argv, code=2)
    assert not (tmp_path / preset).exists()


def test_fingerprints_of_an_archive_named_files_and_a_folder_say_what_changed(tmp_path):
    from shards.fingerprint import changes, fingerprint

    archive = tmp_path / "data.tar.gz"
    archive.write_bytes(b"a" * 10)
    before = fingerprint(archive)
    archive.write_bytes(b"b" * 10)
    assert changes(before, fingerprint(archive)) == ["contents changed (another sha256)"]
    archive.write_bytes(b"b" * 12)
    assert changes(before, fingerprint(archive)) == ["size changed (10 -> 12 bytes)"]

    idx = tmp_path / "idx"
    idx.mkdir()
    for name in ("train.gz", "test.gz", "notes.txt"):
        (idx / name).write_bytes(name.encode())
    named = ("test.gz", "train.gz")
    before = fingerprint(idx, names=named)
    (idx / "notes.txt").write_text("not read")  # not one of the files the reader reads
    assert changes(before, fingerprint(idx, names=named)) == []
    (idx / "test.gz").unlink()
    assert changes(before, fingerprint(idx, names=named)) == ["test.gz: removed"]

    folder = image_folder(tmp_path / "pets")
    suffixes = (".png",)
    before = fingerprint(folder, suffixes=suffixes)
    (folder / "README.md").write_text("edited")  # no image: not the data
    assert changes(before, fingerprint(folder, suffixes=suffixes)) == []
    (folder / "dog" / "000.png").unlink()
    write_images(folder / "bird", 2)
    assert changes(before, fingerprint(folder, suffixes=suffixes)) == [
        "bird/ added (2 files)",
        "1 fewer files under dog/ (6 -> 5)",
    ]


def test_a_truncated_generator_is_named_on_rerun_and_by_generate(digits_root, tmp_path, capsys):
    """fit-generator's rerun and generate name the damaged weights and the fix (the fit it
    asks for is the one tests/test_faults.py runs; here a tiny random generator stands in)."""
    import torch
    from conftest import save_generator

    from models.generators import build_unet

    out = tmp_path / "runs"
    root = prepared(digits_root, out)
    torch.manual_seed(0)
    save_generator(root, build_unet(16, num_classes=10, channels=(16, 32), attention=(False, True)))
    folder = root / "generator"
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])

    line = error_line(capsys, ["fit-generator", "--preset", "digits", "--set", f"out={out}"])
    assert str(weights) in line and f"remove {folder} and rerun the same command" in line
    line = error_line(capsys, ["generate", "--preset", "digits", "--set", f"out={out}"])
    assert str(weights) in line and f"remove {folder} and rerun fit-generator" in line
    (command,) = quoted(line)
    assert command[0] == "fit-generator" and resolved(capsys, command)["root"] == str(root)
