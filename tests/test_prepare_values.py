"""Values that used to slip through prepare, each through the CLI: a failed prepare never blocks
the fix it names (no manifest, no claim), the splits are checked, names stay plain, a path is
one source however it is spelt, and every printed command works when pasted."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.cli import main
from shards.manifest import read_manifest

pytestmark = pytest.mark.usefixtures("one_thread")


def folders(root: Path, layout: dict[str, dict[str, int]], side: int = 8) -> Path:
    """root/<split>/<class>/<i>.png (split "" = root/<class>/), `side` x `side`, seeded."""
    rng = np.random.default_rng(0)
    for split, classes in layout.items():
        for name, n in classes.items():
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                image = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
                Image.fromarray(image).save(folder / f"{i}.png")
    return root


def prepare(out: Path, data: Path | str, *sets: str, preset: str = "imagefolder") -> list[str]:
    return ["prepare", "--preset", preset, "--set", f"out={out}", f"data_dir={data}", *sets]


def one_line_error(capsys, argv: list[str], names: str, code: int = 1) -> str:
    """Run the CLI: exit `code`, exactly one `semix ...: error:` line naming `names`, no
    traceback. Returns the line."""
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert rc == code, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and names in lines[0], err
    return lines[0]


def succeeds(capsys, argv: list[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err
    return err


def quoted_command(line: str) -> list[str]:
    """The `python -m pipeline ...` command a line quotes, as argv for main()."""
    found = re.search(r"`(python -m pipeline [^`]*)`", line)
    assert found, line
    return shlex.split(found.group(1))[3:]


def no_manifest(root: Path) -> bool:
    return not any(root.rglob("manifest.json")) if root.exists() else True


# ---------------------------------------------------------------- no manifest, no claim


def test_a_failed_prepare_never_blocks_the_fix_it_names(tmp_path, capsys):
    data = folders(tmp_path / "D", {"train": {"cat": 4, "dog": 4}, "test": {"cat": 1, "dog": 1}})
    Image.fromarray(np.zeros((1, 1, 3), dtype=np.uint8)).save(data / "train" / "cat" / "tiny.png")
    out, real = tmp_path / "R", tmp_path / "R" / "imagefolder" / "real"
    line = one_line_error(capsys, prepare(out, data, "image_size=0"), "set image_size=N")
    assert "tiny.png is 1x1" in line and no_manifest(real)
    err = succeeds(capsys, prepare(out, data, "image_size=8"))  # the fix: once refused
    assert f"{real}: replaced (it never completed (no manifest) and was made with" in err
    assert read_manifest(real / "train").info["image_size"] == 8


def test_removing_an_unreadable_image_after_a_failed_prepare_redoes_the_root(tmp_path, capsys):
    data = folders(tmp_path / "D", {"train": {"cat": 4, "dog": 4}, "test": {"cat": 1, "dog": 1}})
    (data / "train" / "dog" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\ntruncated")
    out, real = tmp_path / "R", tmp_path / "R" / "imagefolder" / "real"
    one_line_error(capsys, prepare(out, data), "cannot read image")
    assert (real / "source.json").is_file() and no_manifest(real)
    (data / "train" / "dog" / "9.png").unlink()  # what docs/faults.md says to do
    err = succeeds(capsys, prepare(out, data))
    assert "was prepared from it" not in err and "1 fewer files" in err and "replaced" in err
    assert read_manifest(real / "train").num_samples + read_manifest(real / "val").num_samples == 8


# ---------------------------------------------------------------- the splits


def test_a_class_that_train_lacks_is_named(tmp_path, capsys):
    data = folders(
        tmp_path / "D",
        {"train": {"cat": 4, "dog": 4}, "test": {"cat": 1, "dog": 1, "fox": 10}},
    )
    line = one_line_error(capsys, prepare(tmp_path / "R", data), "(fox)")
    assert f"add them to {data / 'train'} or remove them from {data / 'test'}" in line
    assert not (tmp_path / "R").exists()  # refused before anything is written


def test_a_split_without_a_class_is_refused_with_the_fix(tmp_path, capsys):
    data = folders(tmp_path / "D", {"": {"a": 2, "b": 2, "c": 2}})
    line = one_line_error(capsys, prepare(tmp_path / "R", data), "val would hold fewer than 1")
    assert "class a, b, c (train 3, val 0, test 3 in all)" in line
    assert "add images to a, b, c" in line and "needs 3 at least" in line
    assert not (tmp_path / "R").exists()
    folders(data, {"": {"a": 3, "b": 3, "c": 3}})  # the fix: a third image of every class
    succeeds(capsys, prepare(tmp_path / "R", data))
    val = read_manifest(tmp_path / "R" / "imagefolder" / "real" / "val")
    assert val.num_samples == 3


def test_no_val_fraction_names_the_field(tmp_path, capsys):
    data = folders(tmp_path / "D", {"train": {"a": 4, "b": 4}, "test": {"a": 1, "b": 1}})
    line = one_line_error(capsys, prepare(tmp_path / "R", data, "val_fraction=0"), "val would")
    assert line.endswith("set val_fraction above 0 (e.g. val_fraction=0.1)")
    succeeds(capsys, prepare(tmp_path / "R", data, "val_fraction=0.1"))


def test_a_class_without_a_test_folder_names_the_fix(tmp_path, capsys):
    data = folders(tmp_path / "D", {"train": {"cat": 4, "fox": 4}, "test": {"cat": 2}})
    line = one_line_error(capsys, prepare(tmp_path / "R", data), "has no folder for class 'fox'")
    assert f"add {data / 'test'}/fox/ with its images, or remove {data / 'train'}/fox" in line


def test_images_in_sub_folders_are_read_and_said_once(tmp_path, capsys):
    data = folders(
        tmp_path / "D", {"train": {"a": 4, "b": 4, "b/more": 2}, "test": {"a": 1, "b": 1}}
    )
    err = succeeds(capsys, prepare(tmp_path / "R", data))
    said = [line for line in err.splitlines() if "sub-folders" in line]
    assert len(said) == 1 and "2 images in sub-folders" in said[0], err
    real = tmp_path / "R" / "imagefolder" / "real"
    assert read_manifest(real / "train").num_samples + read_manifest(real / "val").num_samples == 10


def test_no_class_folders_and_a_file_as_data_dir_name_a_fix(tmp_path, capsys):
    (tmp_path / "D").mkdir()
    (tmp_path / "D" / "0.png").write_bytes(b"")
    line = one_line_error(capsys, prepare(tmp_path / "R", tmp_path / "D"), "has no class folders")
    assert "put each class's images in a folder of its own" in line
    line = one_line_error(capsys, prepare(tmp_path / "R", tmp_path / "D" / "0.png"), "is a file")
    assert "not a folder: pass the folder that holds the class folders" in line


# ---------------------------------------------------------------- names and paths


@pytest.mark.parametrize(
    "argv, field",
    [
        (["prepare", "--preset", "digits", "--set", "name=../esc"], "name='../esc'"),
        (["prepare", "--preset", "digits", "--set", "name=a/b"], "name='a/b'"),
        (["train", "--preset", "digits", "--set", "run=../x"], "run='../x'"),
        (["annotate", "--preset", "digits", "--set", "judge=.."], "judge='..'"),
        (["fit-generator", "--preset", "digits", "--set", "fidelity.judge=../j"], "judge='../j'"),
    ],
)
def test_folder_names_are_plain(tmp_path, capsys, argv, field):
    argv = [*argv, f"out={tmp_path / 'R'}"]
    line = one_line_error(capsys, argv, field, code=2)
    assert "must be a plain folder name" in line
    assert not any(tmp_path.iterdir())  # nothing written, inside the root or beside it


def test_a_relative_and_an_absolute_data_dir_are_one_source(tmp_path, capsys, monkeypatch):
    folders(tmp_path / "D", {"train": {"a": 3, "b": 3}, "test": {"a": 1, "b": 1}})
    monkeypatch.chdir(tmp_path)
    succeeds(capsys, prepare(Path("R"), "D"))
    err = succeeds(capsys, prepare(tmp_path / "R", tmp_path / "D"))
    assert "is complete already" in err


# ---------------------------------------------------------------- hints that work as printed


def test_a_recipe_roots_hint_keeps_the_recipe_and_works(tmp_path, capsys):
    data = folders(tmp_path / "D", {"train": {"a": 4, "b": 4}, "test": {"a": 1, "b": 1}})
    argv = prepare(tmp_path / "R", data)
    argv[3:3] = ["--recipe", "digits"]
    succeeds(capsys, argv)
    real = tmp_path / "R" / "imagefolder+digits" / "real"
    (real / "val" / "manifest.json").unlink()  # a prepare that did not finish
    train = ["train", "--preset", "imagefolder", "--recipe", "digits"]
    line = one_line_error(capsys, [*train, "--set", f"out={tmp_path / 'R'}"], "is incomplete")
    command = quoted_command(line)
    assert command[:6] == ["prepare", "--preset", "imagefolder", "--recipe", "digits", "--set"]
    assert f"data_dir={data}" in command
    succeeds(capsys, command)
    assert read_manifest(real / "val").num_samples == 2
