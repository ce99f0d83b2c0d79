"""tests/cross_commit.py's judgement: data files must be equal, bookkeeping is only listed."""

from __future__ import annotations

from pathlib import Path

from cross_commit import compare, failures, is_data, tree


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_data_files_decide_and_bookkeeping_is_listed(tmp_path):
    common = {"mixed/mixed-000000.tar": b"shard", "generator/unet/w.safetensors": b"w"}
    a = tree(_write(tmp_path / "a", common | {"mixed/manifest.json": b"commit a"}))
    b = tree(_write(tmp_path / "b", common | {"mixed/manifest.json": b"commit b"}))
    groups = compare(a, b)
    assert groups["differ"] == ["mixed/manifest.json"] and len(groups["same"]) == 2
    assert failures(groups) == []
    c = tree(_write(tmp_path / "c", common | {"mixed/mixed-000000.tar": b"other"}))
    d = tree(_write(tmp_path / "d", {"mixed/mixed-000000.tar": b"shard", "x/preview.png": b""}))
    assert failures(compare(a, c)) == ["mixed/mixed-000000.tar"]
    assert failures(compare(a, d)) == ["generator/unet/w.safetensors", "x/preview.png"]
    assert is_data("mixed/prototypes.json") and not is_data("train/encoder/host.json")
