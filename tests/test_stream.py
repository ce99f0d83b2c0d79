"""The streaming data path: offset index, ImageStore pixels, prefetched batches, the chooser,
integrity, training equivalence with the in-memory path, and its memory peak."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import subprocess_env

from bench.bench_stream import MemoryWatch, build_module, smooth_images, train_steps, write_dataset
from core.io import sha256_file
from models.training import channel_stats, collect_logits
from shards.datapath import choose_data_path, decoded_bytes, image_size_of
from shards.datasets import load_real, load_series_table
from shards.manifest import ShardError, read_manifest
from shards.offsets import INDEX_DIR, index_path, read_index, scan_members
from shards.prefetch import PixelSource, SequentialImages, StepPlan
from shards.reader import load_split
from shards.store import ImageStore, open_real, open_series_table
from shards.writer import ShardFolder, encode_png

K = 4  # members per test series
pytestmark = pytest.mark.usefixtures("one_thread")


def write_mixed(folder: Path, real_train: Path, shards: int = 3, image_size: bool = True) -> Path:
    """A mixed/ folder of pixel blends of digits over `shards` shards: pairs (c, c+1 mod 10)
    and (c, c+3 mod 10), plus one incomplete series (dropped by both paths)."""
    split = load_split(real_train)
    names = list(split.class_names)
    first = {c: split.images[split.labels == c][:2].numpy().astype(float) for c in range(10)}
    pairs = [(c, (c + 1) % 10) for c in range(10)] + [(c, (c + 3) % 10) for c in range(10)]
    samples = []
    for sid, (a, b) in enumerate([*pairs, (0, 5)]):
        a, b = min(a, b), max(a, b)
        for k in range(K):
            if sid == len(pairs) and k == 2:
                continue  # the incomplete series
            alpha = k / (K - 1)
            lam = alpha + 0.05 * np.sin(sid + k)
            t_a = float(1 / (1 + np.exp(-4.0 * (lam - 0.5))))
            image = alpha * first[a][0] + (1 - alpha) * first[b][1]
            meta = dict(series=sid, position=k, classes=[a, b], names=[names[a], names[b]],
                        alpha=alpha, seed=sid, lambda_hat=lam, soft=[t_a, 1 - t_a])  # fmt: skip
            samples.append({"__key__": f"s{sid:07d}_{k:02d}", "png": image.round().astype(np.uint8),
                            "cls": a if t_a >= 0.5 else b, "json": meta})  # fmt: skip
    folder_w = ShardFolder(folder, "mixed")
    cuts = np.array_split(np.arange(len(samples)), shards)
    for i, cut in enumerate(cuts):
        folder_w.write(i, [samples[j] for j in cut])
    info = {"alphas": [k / (K - 1) for k in range(K)]} | ({"image_size": 16} if image_size else {})
    folder_w.finish(shards, kind="mixed", class_names=names, info=info)
    return folder


@pytest.fixture(scope="module")
def root(digits_root, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stream") / "digits"
    shutil.copytree(digits_root / "real", out / "real")
    write_mixed(out / "mixed", out / "real" / "train")
    return out


def index_sets(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randperm(n, generator=g)[:97],  # across every shard, any order
        torch.randint(0, n, (50,), generator=g),  # repeats
        torch.tensor([n - 1, 0, n - 1]),
        torch.arange(n),
        torch.randint(0, n, (3, 4), generator=g),  # any index shape
    ]


# ---------------------------------------------------------------- offsets and pixels


def test_writer_records_every_member_offset(root):
    folder = root / "real" / "train"
    manifest = read_manifest(folder)
    assert len(manifest.shards) > 3
    for rec in manifest.shards:
        members = read_index(folder, rec)
        assert members == scan_members(folder / rec.name)  # the recorded index is the tar's
        with tarfile.open(folder / rec.name) as tar:  # an independent reader agrees
            expected = [(m.name, m.offset_data, m.size) for m in tar.getmembers()]
            assert members == expected
            data = (folder / rec.name).read_bytes()
            name, offset, size = members[-1]
            assert data[offset : offset + size] == tar.extractfile(name).read()


def test_store_returns_load_split_pixels(root):
    folder = root / "real" / "train"
    split, store = load_split(folder), ImageStore.open(folder)
    assert store.shape == tuple(split.images.shape) and len(store) == len(split)
    for idx in index_sets(len(split)):
        assert torch.equal(store[idx], split.images[idx])
    assert torch.equal(store[5:300:7], split.images[5:300:7])
    assert torch.equal(store[-1], split.images[-1]) and torch.equal(store[[3]], split.images[[3]])
    assert torch.equal(store.head(40)[:], split.images[:40])
    real = open_real(folder)
    memory = load_real(folder)
    assert torch.equal(real.labels, memory.labels) and real.class_names == memory.class_names
    assert real.image_size == memory.image_size == 16


def test_a_head_reads_only_its_own_labels_and_equals_the_whole_splits_head(root, monkeypatch):
    """open_real(limit=n) (train's train_limit): the first n labels and images of the split,
    byte for byte; its label pass reads n cls members, not one per sample of the split (every
    shard is still checked at open)."""
    import shards.store as store_module

    folder = root / "real" / "train"
    memory = load_real(folder)
    n = 300  # past the first shard
    assert read_manifest(folder).shards[0].count < n
    reads: list[str] = []
    real_read = store_module.read_member

    def counted(fd, path, name, *args, **kwargs):
        reads.append(name)
        return real_read(fd, path, name, *args, **kwargs)

    monkeypatch.setattr(store_module, "read_member", counted)
    head = open_real(folder, limit=n)
    assert sum(name.endswith(".cls") for name in reads) == n
    assert torch.equal(head.labels, memory.labels[:n]) and len(head.images) == n
    assert torch.equal(head.images[:], memory.images[:n])
    assert head.class_names == memory.class_names
    # a limit past the split's end: the whole split
    assert torch.equal(open_real(folder, limit=10**6).labels, memory.labels)


def test_series_table_streamed_equals_in_memory(root):
    names = [str(c) for c in range(10)]
    memory = load_series_table(root / "mixed", names)
    streamed = open_series_table(root / "mixed", names, image_size=16)
    assert len(read_manifest(root / "mixed").shards) == 3
    assert streamed.dropped == memory.dropped == 1 and len(streamed) == len(memory) == 20
    for field in ("classes", "lambda_hat", "soft", "alpha", "series_ids"):
        assert torch.equal(getattr(streamed, field), getattr(memory, field)), field
    assert streamed.images.shape == tuple(memory.images.shape)
    g = torch.Generator().manual_seed(1)
    series, pos = (
        torch.randint(0, 20, (30, 2), generator=g),
        torch.randint(0, K, (30, 2), generator=g),
    )
    assert torch.equal(streamed.images[series, pos], memory.images[series, pos])
    assert torch.equal(streamed.images[3], memory.images[3])
    with pytest.raises(ShardError, match="mixed images are 16x16, real images 32x32"):
        open_series_table(root / "mixed", names, image_size=32)


def test_folder_without_index_is_scanned(root, tmp_path):
    """Folders written before the index (or pulled from the Hub) work; nothing is written."""
    old = tmp_path / "train"
    shutil.copytree(root / "real" / "train", old)
    shutil.rmtree(old / INDEX_DIR)
    before = sorted(p.name for p in old.iterdir())
    idx = index_sets(1295)[0]
    assert torch.equal(ImageStore.open(old)[idx], load_split(old).images[idx])
    assert sorted(p.name for p in old.iterdir()) == before  # a complete folder stays untouched


def test_index_for_other_bytes_is_ignored_and_a_wrong_offset_fails_loudly(root, tmp_path):
    folder = tmp_path / "train"
    shutil.copytree(root / "real" / "train", folder)
    rec = read_manifest(folder).shards[0]
    doc = json.loads(index_path(folder, rec.name).read_text())
    stale = dict(doc, sha256="0" * 64)  # an index of other bytes: scanned instead
    index_path(folder, rec.name).write_text(json.dumps(stale))
    assert read_index(folder, rec) is None
    assert torch.equal(ImageStore.open(folder)[:20], load_split(folder).images[:20])
    wrong = dict(doc, members=[[n, o, s] for n, o, s in doc["members"]])
    wrong["members"][1][1] = doc["members"][3][1]  # sample 0's png pointed at sample 1's
    index_path(folder, rec.name).write_text(json.dumps(wrong))
    with pytest.raises(ShardError) as err:
        ImageStore.open(folder)[0]
    assert "is not at byte" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- integrity


def corrupt(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_shard_is_refused_with_one_line(root, tmp_path):
    folder = tmp_path / "train"
    shutil.copytree(root / "real" / "train", folder)
    rec = read_manifest(folder).shards[2]
    _, offset, size = next(m for m in read_index(folder, rec) if m[0].endswith(".png"))
    corrupt(folder / rec.name, offset + size // 2)  # inside a PNG payload: same size
    with pytest.raises(ShardError) as err:
        open_real(folder)
    msg = str(err.value)
    assert "\n" not in msg and rec.name in msg and "sha256 mismatch" in msg
    # hashing off (trusted storage): opens; the damaged image fails when a step reads it,
    # also from a DataLoader worker, as one line naming the shard
    store = ImageStore.open(folder, verify=False)
    bad = int(sum(r.count for r in read_manifest(folder).shards[:2]))
    plans = [StepPlan(torch.tensor([0, 1])), StepPlan(torch.tensor([5, bad]))]
    with pytest.raises(ShardError) as err:
        list(PixelSource(store, workers=1).batches(plans))
    msg = str(err.value)
    assert "\n" not in msg and rec.name in msg and "does not decode" in msg
    # a truncated shard is refused even without hashing
    (folder / rec.name).write_bytes((folder / rec.name).read_bytes()[:-512])
    with pytest.raises(ShardError, match="size .* != .* in the manifest"):
        ImageStore.open(folder, verify=False)


def test_pickled_member_is_refused(tmp_path):
    """A shard whose manifest vouches for a pickle member (a consistently forged folder)."""
    folder = ShardFolder(tmp_path / "p", "p")
    folder.write(0, [{"__key__": "a", "png": np.zeros((4, 4, 3), np.uint8), "cls": 0}])
    folder.finish(1, kind="real", class_names=["x"])
    tar_path = tmp_path / "p" / "p-000000.tar"
    with tarfile.open(tar_path, "a") as tar:
        info = tarfile.TarInfo("a.pyd")
        info.size = 3
        tar.addfile(info, fileobj=io.BytesIO(b"\x80\x04."))
    manifest = json.loads((tmp_path / "p" / "manifest.json").read_text())
    manifest["shards"][0] |= {"sha256": sha256_file(tar_path), "bytes": tar_path.stat().st_size}
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="has a member of type 'pyd'.*never decodes other"):
        ImageStore.open(tmp_path / "p")


# ---------------------------------------------------------------- the chooser


def test_budget_below_the_estimate_chooses_stream(root):
    folders = [root / "real" / "train", root / "mixed"]
    decoded = decoded_bytes(folders[0]) + decoded_bytes(folders[1])
    assert decoded == (1295 + 83) * 16 * 16 * 3
    assert choose_data_path("auto", folders, budget_gb=decoded / 2 / 1e9).path == "stream"
    assert choose_data_path("auto", folders, budget_gb=decoded * 2 / 1e9).path == "memory"
    assert choose_data_path("auto", folders).path == "memory"  # this machine: a few MB fit
    assert choose_data_path("stream", folders).path == "stream"
    assert choose_data_path("memory", folders, budget_gb=1e-9).path == "memory"  # forced
    choice = choose_data_path("auto", folders, budget_gb=1e-6)
    assert "stream" in choice.describe() and "> budget" in choice.describe()
    with pytest.raises(ValueError, match="data_path must be one of auto, memory, stream"):
        choose_data_path("disk", folders)


def test_image_size_from_the_png_header_when_the_manifest_has_none(root, tmp_path):
    write_mixed(tmp_path / "mixed", root / "real" / "train", shards=2, image_size=False)
    assert "image_size" not in read_manifest(tmp_path / "mixed").info
    assert image_size_of(tmp_path / "mixed") == (16, 16)


# ---------------------------------------------------------------- batches and training


def test_prefetched_rank_rows_equal_the_in_memory_rows(root):
    train = load_real(root / "real" / "train")
    table = load_series_table(root / "mixed")
    s_train = open_real(root / "real" / "train")
    s_table = open_series_table(root / "mixed")
    g = torch.Generator().manual_seed(2)
    plans = [
        StepPlan(idx, torch.randint(0, 20, (len(idx), 2), generator=g), torch.randint(0, K, (len(idx), 2), generator=g))
        for idx in torch.randperm(len(train), generator=g)[:90].split(30)
    ]  # fmt: skip
    memory = list(PixelSource(train.images, table.images).batches(plans))
    for world in (1, 2, 3):
        for rank in range(world):
            source = PixelSource(s_train.images, s_table.images, rank, world, workers=2)
            for m, s in zip(memory, source.batches(plans), strict=True):
                rows = torch.arange(30)[rank::world]
                syn_rows = torch.stack([2 * rows, 2 * rows + 1], 1).flatten()
                assert torch.equal(s.real[rows], m.real[rows])
                assert torch.equal(s.syn[syn_rows], m.syn[syn_rows])
                if world > 1:  # the other ranks' rows are not decoded here
                    others = torch.ones(30, dtype=torch.bool)
                    others[rows] = False
                    assert int(s.real[others].max()) == 0


@pytest.mark.parametrize("loss", ["ce", "csm"])
def test_same_seed_same_losses_and_weights_on_both_paths(root, loss):
    csm = loss == "csm"
    memory = (
        load_real(root / "real" / "train"),
        load_series_table(root / "mixed") if csm else None,
    )
    streamed = (
        open_real(root / "real" / "train"),
        open_series_table(root / "mixed") if csm else None,
    )
    results = []
    for (train, table), workers in [(memory, 0), (streamed, 0), (streamed, 2)]:
        stats = channel_stats(train.images, 3)  # the stage's normalisation, from each path
        source = PixelSource(train.images, table.images if csm else None, workers=workers)
        module, optimizer = build_module("digits-cnn", csm, seed=3)
        losses = []
        for epoch in range(2):  # the same workers serve both epochs
            losses += train_steps(
                module, optimizer, train, table, source, stats, seed=3, epoch=epoch,
                batch_size=64, steps=3,
            )  # fmt: skip
        results.append((losses, module.state_dict()))
    (ref_losses, ref_state), *others = results
    assert len(ref_losses) == 6 and len(set(ref_losses)) == 6
    for losses, state in others:
        assert losses == ref_losses
        assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)


def test_workers_deliver_under_a_tmpdir_too_long_for_a_unix_socket(root, tmp_path):
    """Workers send numpy pixels through their pipe: torch's shared-memory tensors need an
    AF_UNIX socket under TMPDIR (at most 107 bytes), and when that fails the batch is lost in
    a feeder thread and the reader waits forever (as two torchrun nodes with their own long
    TMPDIRs did). Here the reading process has a 150-byte TMPDIR."""
    tmpdir = tmp_path / ("t" * (150 - len(str(tmp_path)) - 1))
    tmpdir.mkdir()
    code = f"""
import torch
from shards.store import open_real
from shards.prefetch import PixelSource, SequentialImages, StepPlan
train = open_real({str(root / "real" / "train")!r})
plans = [StepPlan(torch.arange(i, i + 8)) for i in (0, 8, 16)]
source = PixelSource(train.images, workers=1)
got = [px.real for px in source.batches(plans)]
assert all(torch.equal(g, train.images[p.idx]) for g, p in zip(got, plans))
ahead = SequentialImages(train.images, 64, workers=1)
assert torch.equal(ahead[0:64], train.images[0:64])
print("delivered", len(got))
"""
    env = subprocess_env() | {"TMPDIR": str(tmpdir)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0 and "delivered 3" in done.stdout, done.stderr[-2000:]


def test_statistics_and_logits_read_through_the_store(root):
    """channel_stats and collect_logits, unchanged, on a store (evaluate's real/test)."""
    folder = root / "real" / "test"
    memory, streamed = load_real(folder), open_real(folder)
    assert channel_stats(streamed.images, 3, chunk=100) == channel_stats(
        memory.images, 3, chunk=100
    )
    model, _ = build_module("digits-cnn", False, seed=0)
    mean, std = channel_stats(memory.images, 3)
    expected = collect_logits(model.model, memory.images, mean, std, batch_size=64)
    ahead = SequentialImages(streamed.images, chunk=64, workers=2)
    assert torch.equal(collect_logits(model.model, ahead, mean, std, batch_size=64), expected)
    assert torch.equal(collect_logits(model.model, ahead, mean, std, batch_size=64), expected)
    assert torch.equal(
        collect_logits(model.model, streamed.images, mean, std, batch_size=50), expected
    )


# ---------------------------------------------------------------- memory


@pytest.mark.slow
def test_train_stage_streams_a_set_four_times_its_budget_at_a_fraction_of_its_size(tmp_path):
    """The train stage on 12,800 images of 256x256 (2.5 GB decoded; real/val 128 more) with
    a 0.6 GB budget: auto chooses the streaming path, and the training process with its 2
    DataLoader workers peaks far below the decoded size (the memory path would hold it all,
    twice while loading). A one-epoch run of a small timm net, every image read. Most of the
    peak is the net itself (torch, its activations at 256 px: measured here by training it
    alone on random tensors); the data adds a few percent of the decoded size."""
    root = write_dataset(tmp_path / "big", 12_800, 10, 3, 256, per_shard=1_000, distinct=64)
    shutil.rmtree(root / "mixed")  # CE: real images only
    val = ShardFolder(root / "real" / "val", "val")
    pngs = [encode_png(im) for im in smooth_images(128, 256, 1)]
    val.write(0, [{"__key__": f"val_{i:07d}", "png": p, "cls": i % 10} for i, p in enumerate(pngs)])
    val.finish(1, kind="real", class_names=[f"c{c}" for c in range(10)], info={"image_size": 256})
    decoded = decoded_bytes(root / "real" / "train") + decoded_bytes(root / "real" / "val")
    assert decoded == (12_800 + 128) * 256 * 256 * 3
    cmd = [sys.executable, "-m", "pipeline", "train", "--preset", "imagefolder", "--set",
           f"out={tmp_path}", "name=big", "run=big", "model=timm:mobilenetv3_small_050",
           "epochs=1", "batch_size=16", "eval_batch_size=32", "crop_pad=0", "memory_budget_gb=0.6", "stream_workers=2",
           "cpu_threads=1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=subprocess_env(), stderr=subprocess.PIPE, text=True)
    with MemoryWatch(pid=proc.pid) as watch:
        _, err = proc.communicate(timeout=1500)
    assert proc.returncode == 0, err[-3000:]
    metrics = json.loads((root / "train" / "big" / "metrics.json").read_text())["train"]
    host = json.loads((root / "train" / "big" / "host.json").read_text())
    assert host["data_path"]["path"] == "stream" and metrics["finished"]
    assert host["data_path"]["decoded_bytes"] == decoded > 4 * 0.6e9
    # what the same net alone costs: its training and eval steps on random tensors
    alone = subprocess.run([sys.executable, "-c", MODEL_ALONE], env=subprocess_env(),
                           capture_output=True, text=True, check=True)  # fmt: skip
    alone_mb = float(alone.stdout.split()[-1])
    decoded_mb = decoded / 2**20
    print(f"decoded {decoded_mb:.0f} MB, peak RSS {watch.main_mb:.0f} MB, with workers "
          f"{watch.tree_mb:.0f} MB; the net alone on random tensors {alone_mb:.0f} MB")  # fmt: skip
    assert watch.main_mb < 0.6 * decoded_mb  # the net's own activations are most of it:
    # what reading 12,928 images adds to the process and its workers, a small fraction of
    # their decoded size (measured: ~80 MB each against 2,424 MB)
    assert watch.main_mb - alone_mb < decoded_mb / 10
    assert watch.tree_mb - alone_mb < decoded_mb / 10


MODEL_ALONE = """
import torch
from models.classifiers import build_classifier
import accelerate, timm  # what the stage imports
torch.set_num_threads(1)
net = build_classifier("timm:mobilenetv3_small_050", 10, 3)
opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
g = torch.Generator().manual_seed(0)
for _ in range(5):
    x, y = torch.randn(16, 3, 256, 256, generator=g), torch.randint(0, 10, (16,), generator=g)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
net.eval()
with torch.no_grad():
    for _ in range(3):
        net(torch.randn(32, 3, 256, 256, generator=g))
status = open("/proc/self/status").read().splitlines()
print(int(next(line for line in status if line.startswith("VmHWM")).split()[1]) / 1024)
"""
