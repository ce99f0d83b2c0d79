import io
import json
import tarfile

import numpy as np
import pytest
import torch
from conftest import snapshot

from shards.evals import EvalError, read_eval
from shards.manifest import ShardError, is_complete, manifest_digest, verify_shards
from shards.reader import iter_folder, iter_shard, load_split, stream
from shards.writer import ShardFolder, write_config


def _samples(n, offset=0, size=8):
    g = torch.Generator().manual_seed(offset)
    for i in range(offset, offset + n):
        img = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8)
        yield {
            "__key__": f"s_{i:05d}",
            "png": img,
            "cls": i % 3,
            "json": {"i": i, "soft": [0.25, 0.75]},
        }


def _write(folder, counts=(5, 4)):
    sf = ShardFolder(folder, "part")
    offset = 0
    for k, n in enumerate(counts):
        sf.write(k, _samples(n, offset))
        offset += n
    return sf.finish(len(counts), kind="mixed", class_names=["a", "b", "c"], code_version="test")


def test_roundtrip_bit_exact(tmp_path):
    manifest = _write(tmp_path)
    assert manifest.num_samples == 9 and [s.count for s in manifest.shards] == [5, 4]
    split = load_split(tmp_path, verify=True)
    expected = list(_samples(5, 0)) + list(_samples(4, 5))
    assert torch.equal(split.images, torch.stack([s["png"] for s in expected]))
    assert split.labels.tolist() == [s["cls"] for s in expected]
    assert split.keys == [s["__key__"] for s in expected]
    assert split.meta[3] == {"i": 3, "soft": [0.25, 0.75]}
    assert split.images.dtype == torch.uint8 and split.images.shape == (9, 8, 8, 3)


def test_same_samples_same_bytes(tmp_path):
    _write(tmp_path / "a")
    _write(tmp_path / "b")
    for name in ["part-000000.tar", "part-000001.tar", "manifest.json"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert manifest_digest(tmp_path / "a") == manifest_digest(tmp_path / "b")


def test_tar_headers_are_canonical(tmp_path):
    _write(tmp_path)
    with tarfile.open(tmp_path / "part-000000.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members[:3]] == ["s_00000.cls", "s_00000.json", "s_00000.png"]
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}


def test_folder_without_manifest_is_refused(tmp_path):
    sf = ShardFolder(tmp_path, "part")
    sf.write(0, _samples(3))
    with pytest.raises(ShardError, match="incomplete: it has no manifest.json"):
        load_split(tmp_path)
    with pytest.raises(ShardError, match="incomplete"):
        stream(tmp_path)


def test_checksum_mismatch_and_truncation_are_caught(tmp_path):
    _write(tmp_path)
    shard = tmp_path / "part-000001.tar"
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF  # same size, different bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match="part-000001.tar: sha256 mismatch"):
        verify_shards(tmp_path)
    shard.write_bytes(bytes(data[:1500]))
    with pytest.raises(ShardError, match="part-000001.tar: size 1500"):
        load_split(tmp_path, verify=True)
    with pytest.raises(ShardError, match="part-000001.tar"):
        load_split(tmp_path)  # unverified read still names the damaged shard


def test_pickled_member_is_never_decoded(tmp_path):
    _write(tmp_path, counts=(2,))
    shard = tmp_path / "part-000000.tar"
    buf = io.BytesIO()
    with tarfile.open(shard) as src, tarfile.open(fileobj=buf, mode="w") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m))
        evil = b"cos\nsystem\n(S'echo pwned'\ntR."
        info = tarfile.TarInfo("s_00001.pyd")
        info.size = len(evil)
        dst.addfile(info, io.BytesIO(evil))
    shard.write_bytes(buf.getvalue())
    with pytest.raises(ShardError, match="sha256 mismatch"):  # the shard changed: refused
        list(iter_folder(tmp_path))
    with pytest.raises(ShardError, match="'pyd'.*never decodes"):  # and without hashing too
        list(iter_folder(tmp_path, verify=False))


def test_resume_skips_complete_and_redoes_incomplete(tmp_path):
    sf = ShardFolder(tmp_path, "part")
    rec0 = sf.write(0, _samples(5))
    (tmp_path / "part-000001.tar").write_bytes(b"half a shard")  # killed mid-write, no record
    assert sf.done(0) == rec0 and sf.done(1) is None
    with pytest.raises(ShardError, match="part-000001.tar is not complete"):
        sf.finish(2, kind="mixed", class_names=["a"])
    assert not (tmp_path / "manifest.json").exists()


def test_streaming_splits_shards_across_workers(tmp_path):
    _write(tmp_path, counts=(3, 3, 2, 2))
    keys = [s["__key__"] for s in stream(tmp_path)]
    assert sorted(keys) == [f"s_{i:05d}" for i in range(10)]
    loader = torch.utils.data.DataLoader(stream(tmp_path), batch_size=None, num_workers=2)
    seen = [s["__key__"] for s in loader]
    assert sorted(seen) == sorted(keys)  # every sample exactly once over both workers
    shuffled = [s["__key__"] for s in stream(tmp_path, shuffle_buffer=10, seed=1)]
    assert sorted(shuffled) == sorted(keys) and shuffled != keys
    assert shuffled == [s["__key__"] for s in stream(tmp_path, shuffle_buffer=10, seed=1)]


def test_datasets_loads_our_shards(tmp_path):
    datasets = pytest.importorskip("datasets")
    _write(tmp_path)
    ds = datasets.load_dataset(
        "webdataset", data_files={"train": str(tmp_path / "*.tar")}, split="train"
    )
    assert len(ds) == 9
    split = load_split(tmp_path)
    for i, row in enumerate(ds):
        assert np.array_equal(np.asarray(row["png"].convert("RGB")), split.images[i].numpy())
        assert row["cls"] == split.labels[i].item()
        assert row["json"]["i"] == split.meta[i]["i"]


def test_config_mismatch_refused(tmp_path):
    """A complete folder defends its config; one that never completed does not
    (tests/test_values_runs.py)."""
    folder = tmp_path / "out"
    write_config(folder, {"a": 1, "b": 2})
    (folder / "manifest.json").write_text("{}")  # complete: only its presence counts here
    first = snapshot(folder)
    write_config(folder, {"a": 1, "b": 2})  # same config: resume is fine, nothing rewritten
    assert snapshot(folder) == first
    with pytest.raises(ShardError, match=r"different config \(differs in: b\)"):
        write_config(folder, {"a": 1, "b": 3})
    assert snapshot(folder) == first  # the refused config leaves the folder as it was
    assert json.loads((folder / "config.json").read_text())["b"] == 2


def test_a_folder_that_never_completed_is_replaced_by_another_config(tmp_path, caplog):
    """No manifest, no claim: another config replaces the folder, its leftovers with it."""
    folder = tmp_path / "out"
    write_config(folder, {"a": 1, "b": 2})
    (folder / "part-000000.tar").write_bytes(b"old samples")
    (folder / "train").mkdir()
    (folder / "train" / ".x.tmp").write_bytes(b"half")
    with caplog.at_level("INFO", logger="semix"):
        write_config(folder, {"a": 1, "b": 3})
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    assert json.loads((folder / "config.json").read_text()) == {"a": 1, "b": 3}
    assert [r.getMessage() for r in caplog.records] == [
        f"{folder}: replaced (it never completed (no manifest) and was made with b=2; this run "
        "(b=3) starts it over)"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left aside


def test_paths_are_compared_resolved(tmp_path, monkeypatch):
    """data_dir=data/x and its absolute spelling are one source (recorded resolved)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "x").mkdir(parents=True)
    write_config(tmp_path / "out", {"data_dir": "data/x", "b": 2})
    recorded = json.loads((tmp_path / "out" / "config.json").read_text())
    assert recorded["data_dir"] == str((tmp_path / "data" / "x").resolve())
    (tmp_path / "out" / "manifest.json").write_text("{}")  # complete: a claim to defend
    write_config(tmp_path / "out", {"data_dir": str(tmp_path / "data" / "x"), "b": 2})
    write_config(tmp_path / "out", {"data_dir": "./data/../data/x", "b": 2})
    with pytest.raises(ShardError, match=r"differs in: data_dir"):
        write_config(tmp_path / "out", {"data_dir": "data", "b": 2})


def test_reader_falls_back_to_tarfile_for_other_tar_dialects(tmp_path):
    """Shards re-packed by other tools (pax headers, directory entries) still read the same."""
    _write(tmp_path, counts=(4,))
    shard = tmp_path / "part-000000.tar"
    expected = load_split(tmp_path)
    buf = io.BytesIO()
    with (
        tarfile.open(shard) as src,
        tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for m in src.getmembers():
            m.pax_headers = {"comment": "repacked"}
            dst.addfile(m, src.extractfile(m))
    shard.write_bytes(buf.getvalue())
    again = [s["image"] for s in iter_shard(shard)]  # the parser alone (the manifest pins bytes)
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(again, expected.images))


def test_bad_tar_header_and_missing_end_marker(tmp_path):
    _write(tmp_path, counts=(3,))
    shard = tmp_path / "part-000000.tar"
    good = shard.read_bytes()
    shard.write_bytes(good[:100] + b"X" + good[101:])  # inside the first header's name
    with pytest.raises(ShardError, match="sha256 mismatch"):
        list(iter_folder(tmp_path))
    with pytest.raises(ShardError, match="bad tar header checksum"):
        list(iter_shard(shard))  # the parser alone, as with verify_sha256=0
    end = len(good.rstrip(b"\0"))
    cut = -(-end // 512) * 512  # right after the last member, before the end marker
    shard.write_bytes(good[:cut])
    with pytest.raises(ShardError, match="no end-of-archive marker"):
        list(iter_shard(shard))


def test_png_bytes_pass_through_unchanged(tmp_path):
    from shards.reader import read_raw_shard
    from shards.writer import encode_png

    png = encode_png(np.zeros((4, 4, 3), np.uint8))
    sf = ShardFolder(tmp_path, "p")
    sf.write(0, [{"__key__": "k", "png": png, "cls": 1}])
    assert read_raw_shard(sf.path(0))[0]["png"] == png
    with pytest.raises(ValueError, match="not a PNG"):
        sf.write(1, [{"__key__": "k", "png": b"GIF89a....", "cls": 1}])


def test_a_folder_is_complete_when_its_manifest_is_there(tmp_path):
    """The one completion rule (shards.manifest.is_complete): every writer writes the manifest
    last, so its presence is what "complete" means, for shard, run and eval folders alike."""
    sf = ShardFolder(tmp_path / "p", "part")
    sf.write(0, _samples(3))
    assert not is_complete(tmp_path / "p") and not is_complete(tmp_path / "missing")
    sf.finish(1, kind="mixed", class_names=["a", "b", "c"])
    assert is_complete(tmp_path / "p")
    with pytest.raises(EvalError, match="holds a 'mixed' folder, not an evaluation"):
        read_eval(tmp_path / "p")  # complete, but not what the reader asked for
