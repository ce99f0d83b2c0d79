"""shift and ood stages: the corrupted test split (CIFAR-C layout) and the far-OOD sets, on the
prepared digits root: same bytes twice, reruns skip and resume, one-line errors, severity ladders
that grow, and evaluate reading both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import snapshot
from PIL import Image

from core.config import ConfigError
from core.io import atomic_write_json, canonical_json, sha256_file
from models.corruptions import CORRUPTIONS, SEVERITIES, corrupt
from pipeline.cli import main
from pipeline.registry import run_stage
from shards import evals
from shards.datasets import load_real
from shards.manifest import ShardError, read_manifest
from shards.reader import load_split
from shards.writer import ShardFolder

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("shift")]


def copy_root(digits_root: Path, out: Path) -> Path:
    """A runs root of its own holding only the prepared real/ (the fixture is read-only)."""
    shutil.copytree(digits_root / "real", out / "digits" / "real")
    return out / "digits"


def shift(root: Path, *sets: str) -> Path:
    return run_stage("shift", "digits", [f"out={root.parent}", f"name={root.name}", *sets])


def ood(root: Path, *sets: str) -> Path:
    return run_stage("ood", "digits", [f"out={root.parent}", f"name={root.name}", *sets])


def files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def built(digits_root, tmp_path_factory) -> Path:
    """Every corruption of the digits test split, built once (read-only for the tests)."""
    root = copy_root(digits_root, tmp_path_factory.mktemp("shift") / "runs")
    return shift(root)


# ---------------------------------------------------------------- shift


def test_shift_writes_the_cifar_c_layout_and_the_same_bytes_in_another_root(
    built, digits_root, tmp_path
):
    clean = load_split(digits_root / "real" / "test")
    n = len(clean)
    # layout: one grey uint8 [5N, 16, 16, 1] per corruption, labels once per severity
    for name in CORRUPTIONS:
        arr = np.load(built / f"{name}.npy", allow_pickle=False)
        assert arr.dtype == np.uint8 and arr.shape == (5 * n, 16, 16, 1), name
    labels = np.load(built / "labels.npy", allow_pickle=False)
    assert labels.dtype == np.int64 and (labels == np.tile(clean.labels.numpy(), 5)).all()
    manifest = read_manifest(built)
    assert manifest.kind == "corruptions" and manifest.class_names == clean.class_names
    assert manifest.upstream == {"real/test": sha256_file(digits_root / "real/test/manifest.json")}
    assert set(manifest.info["corruptions"]) == set(CORRUPTIONS)
    recorded = manifest.info["files"]
    assert set(recorded) == {f"{c}.npy" for c in CORRUPTIONS} | {"labels.npy", "preview.png"}
    for name, rec in recorded.items():
        assert rec == {"sha256": sha256_file(built / name), "bytes": (built / name).stat().st_size}
    # the preview: corruptions x (clean + 5 severities), each tile 16 px x 5
    preview = Image.open(built / "preview.png")
    assert preview.width > 6 * 16 * 5 and preview.height > len(CORRUPTIONS) * 16 * 5
    # evaluate's reader: 3-channel views (R = G = B) of the grey arrays, in CIFAR-C order
    sets, read_labels = evals.corruption_sets(str(built))
    assert set(sets) == set(CORRUPTIONS) and (read_labels == labels).all()
    rgb = np.array(sets["contrast"][n : 2 * n])
    assert rgb.shape == (n, 16, 16, 3) and (rgb == rgb[..., :1]).all()
    # same config, another root (moved out=, other name=): every byte the same
    other = copy_root(digits_root, tmp_path / "elsewhere")
    other = other.rename(other.with_name("renamed"))
    again = shift(other)
    assert files(again) == files(built)


def test_each_corruption_changes_the_images_more_at_every_severity(built, digits_root):
    """Mean |corrupted - clean| per severity, from the arrays and the clean split: it grows."""
    clean = load_split(digits_root / "real" / "test").images.numpy()[..., :1].astype(float)
    n = len(clean)
    for name in CORRUPTIONS:
        arr = np.load(built / f"{name}.npy", allow_pickle=False).astype(float)
        change = [np.abs(arr[s * n : (s + 1) * n] - clean).mean() for s in range(5)]
        assert np.all(np.diff(change) > 0) and change[-1] > 1.0, (name, change)


def test_corruptions_do_what_their_ladders_say():
    """Independent checks of a few formulas on constant and random images."""
    grey = np.full((64, 28, 28, 1), 128, dtype=np.uint8)
    for severity in (1, 2, 3):  # sigma small enough that clipping at 0 and 1 is rare
        out = corrupt(grey, "gaussian_noise", severity, np.random.default_rng(0))
        sigma = CORRUPTIONS["gaussian_noise"].ladder[severity - 1]
        assert np.std(out / 255.0 - 128 / 255.0) == pytest.approx(sigma, rel=0.03)
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (4, 28, 28, 1), dtype=np.uint8)
    c = CORRUPTIONS["contrast"].ladder[4]
    mean = (x / 255.0).mean(axis=(1, 2), keepdims=True)
    expect = np.round(np.clip((x / 255.0 - mean) * c + mean, 0, 1) * 255).astype(np.uint8)
    assert (corrupt(x, "contrast", 5, rng) == expect).all()
    b = CORRUPTIONS["brightness"].ladder[1]
    expect = np.round(np.minimum(x / 255.0 + b, 1.0) * 255).astype(np.uint8)
    assert (corrupt(x, "brightness", 2, rng) == expect).all()  # grey: HSV value + c
    # same generator seed, same bytes; another seed, other noise
    a, b2 = (corrupt(x, "rotate", 3, np.random.default_rng(s)) for s in (7, 7))
    assert (a == b2).all()
    noisy = [corrupt(x, "shot_noise", 3, np.random.default_rng(s)) for s in (7, 8)]
    assert not (noisy[0] == noisy[1]).all()


def test_limit_keeps_the_first_test_images(digits_root, tmp_path):
    root = copy_root(digits_root, tmp_path / "runs")
    folder = shift(root, "corruptions=contrast", "limit=7")
    test = load_split(root / "real" / "test")
    arr, labels = np.load(folder / "contrast.npy"), np.load(folder / "labels.npy")
    assert arr.shape[0] == 5 * 7 and np.array_equal(labels, np.tile(test.labels[:7].numpy(), 5))
    assert read_manifest(folder).info["num_images"] == 7


def test_bad_severity_or_corruption_is_one_line():
    x = np.zeros((2, 8, 8, 1), dtype=np.uint8)
    for bad in (0, 6, 2.5, True, "3"):
        with pytest.raises(ConfigError, match=r"severity must be an integer 1\.\.5") as e:
            corrupt(x, "contrast", bad, np.random.default_rng(0))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="unknown corruption 'fog'; choose from: gaussian_noise"):
        corrupt(x, "fog", 1, np.random.default_rng(0))


def test_shift_errors_are_one_line(digits_root, tmp_path, capsys):
    # a root without real/test: the command that makes it
    code = main(["shift", "--preset", "digits", "--set", f"out={tmp_path / 'none'}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "real/test does not exist: run prepare first" in err and "prepare --preset digits" in err
    # an unknown corruption, a repeated one: exit 2 before anything is read
    root = copy_root(digits_root, tmp_path / "runs")
    for value, says in (("fog", "unknown 'fog'"), ("contrast,contrast", "repeated")):
        code = main(
            ["shift", "--preset", "digits", "--set", f"out={root.parent}", f"corruptions={value}"]
        )
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and says in err, err
    assert not (root / "shift").exists()
    # a complete folder of another config is refused, never rewritten
    shift(root, "corruptions=contrast")
    before = snapshot(root / "shift")
    with pytest.raises(ShardError, match="differs in: corruptions"):
        shift(root, "corruptions=rotate")
    # ... and so is one made from another real/test (here: its manifest reformatted)
    test_manifest = root / "real" / "test" / "manifest.json"
    test_manifest.write_bytes(canonical_json(json.loads(test_manifest.read_text()), indent=4))
    with pytest.raises(ShardError, match="made from another real/test.*remove the folder"):
        shift(root, "corruptions=contrast")
    assert snapshot(root / "shift") == before
    # a missing shift folder names the command that makes it
    with pytest.raises(
        ShardError, match=r"run shift first: `python -m pipeline shift --preset digits"
    ):
        read_manifest(tmp_path / "x" / "digits" / "shift" / "test-c")


def test_shift_rerun_skips_and_a_killed_build_resumes_to_the_same_bytes(digits_root, tmp_path):
    root = copy_root(digits_root, tmp_path / "runs")
    dest = shift(root, "corruptions=gaussian_noise,contrast,rotate")
    complete = files(dest)
    before = snapshot(dest)
    assert shift(root, "corruptions=gaussian_noise,contrast,rotate") == dest
    assert snapshot(dest) == before  # nothing written, not even a time stamp
    # what a kill leaves: no manifest or preview, one file missing, one truncated (its record
    # says another size), a temporary file half written; the complete files keep their records
    for name in ("manifest.json", "preview.png", "gaussian_noise.npy"):
        (dest / name).unlink()
    with open(dest / "rotate.npy", "r+b") as f:
        f.truncate(100)
    (dest / ".contrast.npy.tmp").write_bytes(b"half")
    kept = (dest / "contrast.npy").stat().st_mtime_ns
    shift(root, "corruptions=gaussian_noise,contrast,rotate")
    assert (dest / "contrast.npy").stat().st_mtime_ns == kept  # complete work skipped
    assert files(dest) == complete  # the leftover removed
    # killed again, then real/test changes before the rerun: nothing of the old one is kept
    (dest / "manifest.json").unlink()
    test_manifest = root / "real" / "test" / "manifest.json"
    test_manifest.write_bytes(canonical_json(json.loads(test_manifest.read_text()), indent=4))
    shift(root, "corruptions=gaussian_noise,contrast,rotate")
    assert (dest / "contrast.npy").stat().st_mtime_ns != kept
    assert read_manifest(dest).upstream == {"real/test": sha256_file(test_manifest)}
    assert all(
        json.loads(p.read_text())["upstream"] == sha256_file(test_manifest)
        for p in (dest / ".done").iterdir()
    )


# ---------------------------------------------------------------- ood


def fashion_like_root(out: Path, n: int = 12) -> Path:
    """A tiny prepared real/test of 28x28 grey images (source fashion-mnist), for the digits set."""
    rng = np.random.default_rng(3)
    images = np.repeat(rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8), 3, axis=-1)
    folder = out / "fashion-mnist" / "real" / "test"
    shards = ShardFolder(folder, "test")
    shards.write(
        0, ({"__key__": f"test_{i:07d}", "png": im, "cls": i % 10} for i, im in enumerate(images))
    )
    info = {"split": "test", "source": "fashion-mnist", "image_size": 28}
    shards.finish(1, kind="real", class_names=[f"c{k}" for k in range(10)], info=info)
    return out / "fashion-mnist"


def test_ood_noise_sets_are_prepared_splits_evaluate_reads(digits_root, tmp_path):
    root = copy_root(digits_root, tmp_path / "runs")
    ood(root, "noise_images=40", "shard_size=16")
    # a digits root: digits is its own source, so the default leaves it out
    assert sorted(p.name for p in (root / "ood").iterdir()) == ["gaussian", "uniform"]
    for name, mean, std in (("uniform", 127.5, 255 / 12**0.5), ("gaussian", 127.5, 0.25 * 255)):
        folder = evals.ood_folder(str(root / "ood" / name))  # what evaluate's ood= resolves
        assert folder == root / "ood" / name
        manifest = read_manifest(folder)
        assert manifest.kind == "ood" and manifest.num_samples == 40 and len(manifest.shards) == 3
        assert manifest.upstream == {"real/test": sha256_file(root / "real/test/manifest.json")}
        split = load_real(folder)  # evaluate's in-memory reader
        images = split.images.numpy().astype(float)
        assert images.shape == (40, 16, 16, 3) and (images == images[..., :1]).all()  # grey root
        assert images.mean() == pytest.approx(mean, abs=4) and images.std() == pytest.approx(
            std, rel=0.08
        )
    # image i is drawn from (seed, set, i): another shard size gives the same images; a rerun
    # skips every complete set
    other = ood(copy_root(digits_root, tmp_path / "other"), "noise_images=40", "shard_size=7")
    for name in ("uniform", "gaussian"):
        a, b = (load_split(r / name).images for r in (root / "ood", other))
        assert torch.equal(a, b)
    before = snapshot(root / "ood")
    ood(root, "noise_images=40", "shard_size=16")
    assert snapshot(root / "ood") == before


def test_ood_digits_set_is_sklearns_digits_at_the_roots_size(tmp_path, capsys):
    from sklearn.datasets import load_digits

    root = fashion_like_root(tmp_path / "runs")
    ood(root, "sets=digits")
    split = load_real(evals.ood_folder(str(root / "ood" / "digits")))
    digits = load_digits()
    assert split.images.shape == (len(digits.images), 28, 28, 3)
    assert split.class_names == tuple(str(k) for k in range(10))
    assert (split.labels.numpy() == digits.target).all()
    for i in (0, 1000):  # an independent resize of the same source image
        grey = np.round(digits.images[i] * (255.0 / 16.0)).astype(np.uint8)
        rgb = Image.fromarray(np.repeat(grey[..., None], 3, axis=-1))
        expect = np.asarray(rgb.resize((28, 28), Image.Resampling.BICUBIC))
        assert (split.images[i].numpy() == expect).all()
    # on a digits root the digits set is refused in one line
    code = main(["ood", "--preset", "digits", "--set", f"out={tmp_path / 'd'}", "sets=digits"])
    assert code == 1 and "run prepare first" in capsys.readouterr().err  # no root yet
    shutil.copytree(root / "real", tmp_path / "d" / "digits" / "real")
    manifest = tmp_path / "d" / "digits" / "real" / "test" / "manifest.json"
    data = json.loads(manifest.read_text())
    atomic_write_json(manifest, {**data, "info": {**data["info"], "source": "digits"}})
    code = main(["ood", "--preset", "digits", "--set", f"out={tmp_path / 'd'}", "sets=digits"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "not out-of-distribution" in err, err


# ---------------------------------------------------------------- evaluate reads both


def test_evaluate_scores_the_shift_and_ood_sets(digits_root, tmp_path):
    from test_evaluate import save_run

    from models.classifiers import build_classifier

    root = copy_root(digits_root, tmp_path / "runs")
    torch.manual_seed(0)
    names = list(read_manifest(root / "real" / "test").class_names)
    save_run(root / "train" / "r", build_classifier("digits-cnn", 10, 3), names)
    corr = shift(root, "corruptions=impulse_noise,pixelate")
    sets = ood(root, "sets=uniform,gaussian", "noise_images=30")
    both = f"ood={sets / 'uniform'},{sets / 'gaussian'}"
    run_stage("evaluate", "digits", [f"out={root.parent}", "run=r", both, f"corruptions={corr}"])
    ev = json.loads((root / "eval" / "train" / "r" / "metrics.json").read_text())["evaluation"]
    for key in ("before_ts", "after_ts"):
        assert set(ev["corruptions"][key]) == {"impulse_noise", "pixelate", "mean"}
        assert set(ev["corruptions"][key]["pixelate"]) == {str(s) for s in SEVERITIES}
        for name in ("uniform", "gaussian"):  # every set scored, each under its own name
            assert {"msp_auroc", "msp_fpr95", "entropy_auroc"} <= set(ev["ood"][name][key])
    upstream = read_manifest(root / "eval" / "train" / "r").upstream
    for name in ("uniform", "gaussian"):
        assert upstream[f"ood/{name}"] == sha256_file(sets / name / "manifest.json")
    assert upstream["corruptions"] == evals.corruptions_digest(str(corr))
