"""Fashion-MNIST: the IDX reader on files written here, the three-way source lookup (the
fashion-mnist preset's reader, stages/presets), and the real Debian files when the machine has
them."""

import gzip

import numpy as np
import pytest

import shards.sources as sources
import stages.presets.fashion_mnist as fashion_mnist
from pipeline.cli import main
from pipeline.registry import run_stage
from shards.manifest import ShardError
from shards.reader import load_split
from shards.sources import idx_source, read_idx
from stages.presets.fashion_mnist import CLASSES as FASHION_MNIST_CLASSES
from stages.presets.fashion_mnist import DEBIAN as DEBIAN_FASHION_MNIST


def write_idx(path, array: np.ndarray, gz: bool = True) -> None:
    """LeCun's IDX layout, built by hand: 0, 0, type 0x08, ndim, big-endian sizes, data."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(n).to_bytes(4, "big") for n in array.shape
    )
    data = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)


def tiny_fashion(folder, n_train=40, n_test=20, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": np.arange(n_train, dtype=np.uint8) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test, dtype=np.uint8) * 3) % 10,
    }
    folder.mkdir(parents=True, exist_ok=True)
    for stem, array in arrays.items():
        write_idx(folder / f"{stem}.gz", array)
    return arrays


def test_read_idx_gz_and_plain(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", images)
    write_idx(tmp_path / "b", images, gz=False)
    assert np.array_equal(read_idx(tmp_path / "a.gz"), images)
    assert np.array_equal(read_idx(tmp_path / "b"), images)
    labels = np.array([3, 1, 4], dtype=np.uint8)
    write_idx(tmp_path / "l", labels, gz=False)
    assert read_idx(tmp_path / "l").tolist() == [3, 1, 4]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"\x00\x00\x0d\x01" + b[4:], "not an unsigned-byte IDX"),  # float type
        (lambda b: b[:-5], "data bytes, its header says"),  # truncated
        (lambda b: gzip.compress(b, mtime=0)[:-12], "cannot read IDX file"),  # cut gzip
    ],
)
def test_read_idx_refuses_bad_files(tmp_path, damage, message):
    write_idx(tmp_path / "x", np.zeros((4, 2, 2), dtype=np.uint8), gz=False)
    (tmp_path / "x").write_bytes(damage((tmp_path / "x").read_bytes()))
    with pytest.raises(ShardError, match=message):
        read_idx(tmp_path / "x")


def test_prepare_from_data_dir_is_exact(tmp_path):
    arrays = tiny_fashion(tmp_path / "fm")
    real = run_stage("prepare", "fashion-mnist", [f"out={tmp_path}", f"data_dir={tmp_path / 'fm'}"])
    train, val = load_split(real / "train"), load_split(real / "val")
    test = load_split(real / "test")
    # stratified val: 10 % of each class, at least one (4 images per class here)
    assert (len(train), len(val), len(test)) == (30, 10, 20)
    assert train.class_names == FASHION_MNIST_CLASSES
    assert sorted(val.labels.tolist()) == list(range(10))
    # every image comes back bit-exact as grey RGB, under its source index
    source = arrays["t10k-images-idx3-ubyte"]
    for key, image, label in zip(test.keys, test.images, test.labels):
        i = int(key.split("_")[1])
        assert np.array_equal(image.numpy(), np.repeat(source[i][..., None], 3, axis=-1))
        assert label == arrays["t10k-labels-idx1-ubyte"][i]
    for key, image in zip(train.keys, train.images):
        i = int(key.split("_")[1])
        assert np.array_equal(image.numpy()[..., 0], arrays["train-images-idx3-ubyte"][i])


def test_missing_everywhere_names_all_three_ways(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(fashion_mnist, "DEBIAN", tmp_path / "nowhere")

    def offline(dataset_id, *columns):
        raise ShardError("could not load (offline)")

    monkeypatch.setattr(sources, "hf_source", offline)
    rc = main(["prepare", "--preset", "fashion-mnist", "--set", f"out={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert "data_dir=" in err[0] and "dataset-fashion-mnist" in err[0]
    assert "zalando-datasets/fashion_mnist" in err[0]
    assert not (tmp_path / "fashion-mnist" / "real" / "train" / "manifest.json").exists()


def test_a_folder_lacking_files_is_one_line(tmp_path):
    (tmp_path / "fm").mkdir()
    with pytest.raises(ShardError, match="lacks train-images-idx3-ubyte"):
        idx_source(tmp_path / "fm", FASHION_MNIST_CLASSES)


@pytest.mark.skipif(
    not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed (make fashion-mnist-data)",
)
def test_the_debian_package_is_the_full_set():
    source = idx_source(DEBIAN_FASHION_MNIST, FASHION_MNIST_CLASSES)
    train, test = source.splits["train"], source.splits["test"]
    assert (len(train), len(test)) == (60000, 10000)
    assert np.bincount(train.labels).tolist() == [6000] * 10  # balanced, as published
    assert train.get(0).shape == (28, 28, 3)
