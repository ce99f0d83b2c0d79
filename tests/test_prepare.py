import pickle
import shutil
import sys
import tarfile

import numpy as np
import pytest
from conftest import kill_when, shards_done, subprocess_env
from PIL import Image

from pipeline.cli import main
from pipeline.registry import run_stage
from shards.manifest import ShardError, read_manifest
from shards.reader import load_split


def _tree_bytes(root):
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_digits_splits_are_exact_disjoint_and_stratified(digits_root):
    from sklearn.datasets import load_digits

    d = load_digits()
    splits = {
        name: load_split(digits_root / "real" / name, verify=True)
        for name in ("train", "val", "test")
    }
    # sizes from the rule (no official test split): round(20 %) of every class to test, then
    # round(10 %) of what is left of every class to val (preset test_fraction / val_fraction)
    n_class = np.bincount(d.target, minlength=10)
    n_test = np.array([round(0.2 * n) for n in n_class])
    n_val = np.array([round(0.1 * n) for n in n_class - n_test])
    expected = {"test": n_test, "val": n_val, "train": n_class - n_test - n_val}
    for name, split in splits.items():
        assert np.array_equal(np.bincount(split.labels.numpy(), minlength=10), expected[name])
    indices = {n: [int(k.split("_")[1]) for k in s.keys] for n, s in splits.items()}
    assert sum(len(set(v)) for v in indices.values()) == len(set().union(*indices.values())) == 1797
    for name, split in splits.items():
        assert split.class_names == tuple("0123456789")
        assert split.images.shape[1:] == (16, 16, 3)
        for row, i in enumerate(indices[name][:50]):
            grey = np.round(d.images[i] * 255 / 16).astype(np.uint8)
            expected = np.asarray(
                Image.fromarray(np.stack([grey] * 3, -1)).resize((16, 16), Image.Resampling.BICUBIC)
            )
            assert np.array_equal(split.images[row].numpy(), expected)
            assert split.labels[row].item() == d.target[i]


def test_digits_shards_load_in_hf_datasets(digits_root):
    datasets = pytest.importorskip("datasets")
    folder = digits_root / "real" / "val"
    ds = datasets.load_dataset("webdataset", data_files={"val": str(folder / "*.tar")}, split="val")
    split = load_split(folder)
    assert len(ds) == len(split)
    for i in range(0, len(ds), 17):
        assert np.array_equal(np.asarray(ds[i]["png"].convert("RGB")), split.images[i].numpy())
        assert ds[i]["cls"] == split.labels[i].item()


def _cifar_archive(path, variant="cifar10", n_train=12, n_test=6, seed=0):
    """A tiny archive in the official python format (pickled dicts, CHW planes)."""
    rng = np.random.default_rng(seed)
    names = [b"plane", b"car", b"bird"]

    def batch(n, key):
        return {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            key: [i % 3 for i in range(n)],
        }

    with tarfile.open(path, "w:gz") as tar:

        def add(name, obj):
            data = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(data)
            tar.addfile(info, __import__("io").BytesIO(data))

        if variant == "cifar10":
            add("batches.meta", {b"label_names": names})
            for i in range(1, 6):
                add(f"data_batch_{i}", batch(n_train // 5 + 1, b"labels"))
            add("test_batch", batch(n_test, b"labels"))
        else:
            add("meta", {b"fine_label_names": names})
            add("train", batch(n_train, b"fine_labels"))
            add("test", batch(n_test, b"fine_labels"))
    return path


@pytest.mark.parametrize("variant", ["cifar10", "cifar100"])
def test_cifar_archive(tmp_path, variant):
    archive = _cifar_archive(tmp_path / "c.tar.gz", variant)
    real = run_stage("prepare", variant, [f"out={tmp_path}", f"data_dir={archive}", "shard_size=4"])
    test = load_split(real / "test", verify=True)
    assert test.class_names == ("plane", "car", "bird") and len(test) == 6
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(("test_batch", "/test")))
        raw = pickle.loads(tar.extractfile(member).read(), encoding="bytes")
    expected = raw[b"data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    assert np.array_equal(test.images.numpy(), expected)
    train, val = load_split(real / "train"), load_split(real / "val")
    assert len(train) + len(val) == (15 if variant == "cifar10" else 12)


def test_cifar_missing_and_corrupt_archive(tmp_path, capsys):
    code = main(
        [
            "prepare",
            "--preset",
            "cifar10",
            "--set",
            f"out={tmp_path}",
            f"data_dir={tmp_path}/nope.tar.gz",
        ]
    )
    err = capsys.readouterr().err
    assert (
        code == 1
        and "cifar10 archive not found" in err
        and "data_dir=" in err
        and err.count("\n") == 1
    )
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"\x1f\x8b" + b"garbage" * 100)
    code = main(["prepare", "--preset", "cifar10", "--set", f"out={tmp_path}", f"data_dir={bad}"])
    assert code == 1 and "bad.tar.gz is corrupt" in capsys.readouterr().err
    assert not list(tmp_path.rglob("manifest.json"))


def test_cifar_archive_with_foreign_pickle_is_refused(tmp_path):
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"cos\nsystem\n(S'echo pwned'\ntR."
        for name in ["batches.meta", *[f"data_batch_{i}" for i in range(1, 6)], "test_batch"]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, __import__("io").BytesIO(data))
    with pytest.raises(
        ShardError, match="refusing to load os.system|refusing to load posix.system"
    ):
        run_stage("prepare", "cifar10", [f"out={tmp_path}", f"data_dir={archive}"])


def test_imagefolder_with_classes_file_and_unreadable_image(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in [("train", 6), ("test", 2)]:
        for cls in ["tulip", "rose"]:
            (tmp_path / "data" / split / cls).mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
                Image.fromarray(img).save(tmp_path / "data" / split / cls / f"{i}.png")
    classes = tmp_path / "flowers.txt"
    classes.write_text("rose\ntulip\n")
    sets = [
        f"out={tmp_path / 'runs'}",
        f"data_dir={tmp_path / 'data'}",
        "image_size=16",
        "val_fraction=0.5",
    ]
    real = run_stage("prepare", str(classes), sets)
    assert real == tmp_path / "runs" / "flowers" / "real"
    test = load_split(real / "test")
    assert test.class_names == ("rose", "tulip") and test.labels.tolist() == [0, 0, 1, 1]
    assert test.images.shape == (4, 16, 16, 3)
    assert len(load_split(real / "train")) == len(load_split(real / "val")) == 6
    (tmp_path / "data" / "train" / "rose" / "3.png").write_bytes(b"not a png")
    with pytest.raises(ShardError, match=r"cannot read image .*rose/3.png"):
        run_stage("prepare", str(classes), [*sets, "name=flowers2"])
    assert not (tmp_path / "runs" / "flowers2" / "real" / "train" / "manifest.json").exists()


def _prepare_cmd(out="runs"):
    return [
        sys.executable,
        "-m",
        "pipeline",
        "prepare",
        "--preset",
        "digits",
        "--set",
        f"out={out}",
        "shard_size=8",
    ]


def _prepare_here(cwd, monkeypatch) -> None:
    """_prepare_cmd() run in this process: the same argv through pipeline.cli.main (all
    pipeline/__main__.py runs) from the same cwd, with the same environment (prepare writes
    PNG bytes: no float math that a thread count could change)."""
    monkeypatch.chdir(cwd)
    assert main(_prepare_cmd()[3:]) == 0


def test_kill_and_rerun_is_byte_identical(tmp_path, monkeypatch):
    """The killed run is a real process; the reference and the rerun are in-process."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    env = subprocess_env()
    _prepare_here(tmp_path / "a", monkeypatch)
    # Start the same run, SIGKILL it once a few shards are complete.
    train_b = tmp_path / "b" / "runs" / "digits" / "real" / "train"
    kill_when(_prepare_cmd(), shards_done(train_b, 5), cwd=tmp_path / "b", env=env)
    real_b = tmp_path / "b" / "runs" / "digits" / "real"
    assert not (real_b / "test" / "manifest.json").exists(), "the kill came too late to test resume"
    with pytest.raises(ShardError, match="incomplete|does not exist"):
        read_manifest(real_b / "test")  # the reader refuses the half-written result
    _prepare_here(tmp_path / "b", monkeypatch)
    assert _tree_bytes(tmp_path / "a" / "runs") == _tree_bytes(tmp_path / "b" / "runs")


def test_rerun_with_other_config_is_refused(digits_root, tmp_path, capsys):
    shutil.copytree(digits_root, tmp_path / "digits")
    code = main(["prepare", "--preset", "digits", "--set", f"out={tmp_path}", "shard_size=64"])
    assert code == 1 and "different config (differs in: shard_size)" in capsys.readouterr().err


def test_tiny_imagenet_layout(tmp_path):
    root = tmp_path / "tiny-imagenet-200"
    wnids = ["n01443537", "n01629819"]
    (root / "val" / "images").mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    (root / "words.txt").write_text(
        "n01443537\tgoldfish, Carassius auratus\nn01629819\tEuropean fire salamander\n"
    )
    rng = np.random.default_rng(0)
    ann = []
    for k, w in enumerate(wnids):
        (root / "train" / w / "images").mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(
                root / "train" / w / "images" / f"{w}_{i}.JPEG"
            )
        name = f"val_{k}.JPEG"
        Image.fromarray(np.full((64, 64, 3), 40 * k, dtype=np.uint8)).save(
            root / "val" / "images" / name
        )
        ann.append(f"{name}\t{w}\t0\t0\t63\t63")
    (root / "val" / "val_annotations.txt").write_text("\n".join(ann) + "\n")
    real = run_stage(
        "prepare", "tiny-imagenet", [f"out={tmp_path}", f"data_dir={root}", "val_fraction=0.2"]
    )
    test = load_split(real / "test")
    assert test.class_names == ("goldfish", "European fire salamander")
    assert test.labels.tolist() == [0, 1] and test.images.shape == (2, 64, 64, 3)
    assert len(load_split(real / "train")) == 8 and len(load_split(real / "val")) == 2


def test_hf_datasets_from_local_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])}
    )
    for split, n in [("train", 10), ("test", 4)]:
        rows = {
            "img": [
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(n)
            ],
            "label": [i % 2 for i in range(n)],
        }
        datasets.Dataset.from_dict(rows, features=features).to_parquet(
            str(tmp_path / "hf" / f"{split}.parquet")
        )
    real = run_stage(
        "prepare", "cifar10", [f"out={tmp_path}", f"hf_dataset={tmp_path / 'hf'}", "shard_size=3"]
    )
    test = load_split(real / "test")
    assert test.class_names == ("cat", "dog") and test.labels.tolist() == [0, 1, 0, 1]
    assert len(load_split(real / "train")) + len(load_split(real / "val")) == 10


# ---------------------------------------------------------------- ImageNet-1k preset


WNIDS = ["n01440764", "n02012849", "n03126707"]  # tench and ImageNet's two "crane"s


def _imagenet(root, names_file: bool = True, val: bool = True):
    """A tiny ILSVRC-2012 folder: train/<wnid>/ 4 JPEGs each, val/<wnid>/ 2 each, all 48x32
    (w x h, ImageNet is mostly landscape): red 4-px bands left and right, a class grey between."""
    for split, n in (("train", 4), ("val", 2)) if val else (("train", 4),):
        for k, w in enumerate(WNIDS):
            (root / split / w).mkdir(parents=True)
            for i in range(n):
                image = np.full((32, 48, 3), 60 + 60 * k + i, dtype=np.uint8)
                image[:, :4] = image[:, -4:] = (255, 0, 0)
                Image.fromarray(image).save(root / split / w / f"{w}_{i}.JPEG", quality=95)
    if names_file:
        (root / "LOC_synset_mapping.txt").write_text(
            "n01440764 tench, Tinca tinca\nn02012849 crane\nn03126707 crane\n"
        )
    return root


def test_imagenet_preset_prepares_class_folders(tmp_path):
    root = _imagenet(tmp_path / "imagenet")
    sets = [f"out={tmp_path}", f"data_dir={root}", "image_size=16", "val_fraction=0.25"]
    real = run_stage("prepare", "imagenet", sets)
    train, val, test = (load_split(real / s, verify=True) for s in ("train", "val", "test"))
    # classes: sorted wnids (ImageNet-1k's index order), names from the mapping, repeats told apart
    assert test.class_names == ("tench", "crane (n02012849)", "crane (n03126707)")
    assert len(train) == 9 and len(val) == 3 and len(test) == 6  # val/ serves as test
    assert sorted(test.labels.tolist()) == [0, 0, 1, 1, 2, 2]
    assert np.bincount(val.labels.numpy()).tolist() == [1, 1, 1]
    # center-crop: the shorter side to 16 (48x32 -> 24x16), then the central 16 columns, so the
    # red side bands (2 px each after scaling) are cut away; squash would keep them
    images = test.images.numpy().astype(int)
    assert images.shape == (6, 16, 16, 3)
    assert np.abs(images[..., 0] - images[..., 1]).max() <= 12  # grey: no red left
    config = __import__("json").loads((real / "config.json").read_text())
    assert config["resize"] == "center-crop" and config["image_size"] == 16
    squashed = run_stage("prepare", "imagenet", [*sets, "name=squashed", "resize=squash"])
    edge = load_split(squashed / "test").images.numpy().astype(int)[:, :, 0]
    assert (edge[..., 0] - edge[..., 1] > 100).all()  # the red band survives a squash
    # the names file is optional: without it the wnids are the names
    bare = _imagenet(tmp_path / "bare", names_file=False, val=False)
    real = run_stage("prepare", "imagenet", [f"out={tmp_path}", "name=bare", f"data_dir={bare}",
                                             "image_size=16", "test_fraction=0.25"])  # fmt: skip
    assert load_split(real / "train").class_names == tuple(WNIDS)
    assert len(load_split(real / "test")) == 3  # no val/: test carved out of train


def test_imagenet_without_data_is_one_line(tmp_path, capsys):
    code = main(["prepare", "--preset", "imagenet", "--set", f"out={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert "ImageNet not found" in err and "train/<wnid>/*.JPEG" in err and "data_dir=" in err
    flat = _imagenet(tmp_path / "flat", val=False)
    (flat / "val").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(flat / "val" / "x.JPEG")
    code = main(["prepare", "--preset", "imagenet", "--set", f"out={tmp_path}", f"data_dir={flat}"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "val/<wnid>/" in err, err
    assert not list(tmp_path.rglob("manifest.json"))


def test_imagenet_preset_resolves_for_every_stage():
    """Config level (no data, no weights): every stage takes the preset; what it sets."""
    from pipeline.registry import STAGES, resolve_stage_config

    configs = {
        stage: resolve_stage_config(stage, "imagenet", ["run=r"] if stage == "finetune" else [])
        for stage in STAGES
    }
    assert all(c.preset == "imagenet" and c.root.name == "imagenet" for c in configs.values())
    prepare, generate = configs["prepare"], configs["generate"]
    assert (prepare.source, prepare.image_size, prepare.resize) == ("imagenet", 256, "center-crop")
    assert (generate.backend.name, generate.model) == ("dit", "facebook/DiT-XL-2-256")
    assert generate.backend.dit.class_ids == tuple(range(1000)) and generate.guidance == 1.0
    assert configs["annotate"].encoder.name == "openclip"
    assert configs["train"].model == "timm:resnet50"
    # the dataset resolution is the user's: prepare's image_size, which generate follows (0)
    assert resolve_stage_config("prepare", "imagenet", ["image_size=64"]).image_size == 64
    assert generate.image_size == 0
