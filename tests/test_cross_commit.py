"""tests/cross_commit.py's judgement: data files must be equal, bookkeeping is only listed; a
study root rerun by a later commit must run nothing and keep every file but its bookkeeping."""

from __future__ import annotations

import json
from pathlib import Path

from cross_commit import compare, failures, is_data, judge_study, study_role, tree


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


def _study_root(out: Path) -> dict[str, str]:
    """A study's out/ as the earlier commit leaves it (one run, its evaluation, the study
    folder); tree(out) of it."""
    _write(out / "digits", {
        "train/ce-s0/config.json": b'{"loss": "ce"}', "train/ce-s0/model.safetensors": b"w",
        "eval/train/ce-s0/metrics.json": b"{}", "study/study.json": b'{"records": []}',
        "study/report.md": b"# study", "study/protocol.lock": b'{"code": null}',
        "study/ece.png": b"drawn at a", "study/logs/ce-s0.log": b"$ train",
        "study/host.json": json.dumps({"task_seconds_this_invocation": {"ce-s0": 9.0}}).encode(),
    })  # fmt: skip
    return tree(out)


def _rerun(out: Path, ran: dict[str, float]) -> None:
    """The later commit's invocation: host.json rewritten (the tasks it ran), a figure redrawn."""
    host = {"task_seconds_this_invocation": ran, "earlier_invocations": [{"ce-s0": 9.0}]}
    _write(out / "digits/study", {"host.json": json.dumps(host).encode(), "ece.png": b"at b"})


def test_a_study_rerun_with_nothing_to_run_keeps_every_file_but_bookkeeping(tmp_path, capsys):
    assert study_role("digits/study/host.json") == study_role("digits/study/logs/x.log")
    assert study_role("digits/study/host.json") == "bookkeeping"
    assert study_role("digits/study/reliability.png") == "figure"
    for kept in ("digits/study/study.json", "digits/study/report.md", "digits/train/ce-s0/x.png",
                 "digits/train/ce-s0/config.json", "digits/study/protocol.lock"):  # fmt: skip
        assert study_role(kept) == "kept"
    before = _study_root(tmp_path / "out")
    _rerun(tmp_path / "out", {})
    assert judge_study(tmp_path / "out", before, "a", "b") == 0
    text = capsys.readouterr().out
    assert "tasks b ran: 0" in text and "digits/study/study.json: equal" in text
    assert "differ: digits/study/ece.png (figure)" in text
    assert "differ: digits/study/host.json (bookkeeping)" in text
    assert "config.json files: 1, changed or gone: 0" in text


def test_a_study_rerun_fails_on_a_task_run_or_a_kept_file_changed(tmp_path, capsys):
    out = tmp_path / "out"
    before = _study_root(out)
    _rerun(out, {"ce-s0": 3.0})  # a task ran, though it changed no file
    assert judge_study(out, before, "a", "b") == 1
    assert "tasks b ran: 1 (ce-s0)" in capsys.readouterr().out
    _rerun(out, {})
    (out / "digits/train/ce-s0/config.json").write_bytes(b'{"loss": "csm"}')
    (out / "digits/study/report.md").unlink()
    assert judge_study(out, before, "a", "b") == 1
    text = capsys.readouterr().out
    assert "  differ: digits/train/ce-s0/config.json\n" in text  # no note: judged
    assert "only at a: digits/study/report.md" in text and "report.md: missing" in text
    assert "config.json files: 1, changed or gone: 1" in text
    (out / "digits/study/host.json").unlink()  # no record of the invocation: not judged as none
    before = tree(out)
    assert judge_study(out, before, "a", "b") == 1
    assert "b recorded no invocation" in capsys.readouterr().out
