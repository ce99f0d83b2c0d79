"""The study's protocol (docs/protocol.toml, pipeline/study/protocol.py): the committed file is
what the study's modules read, a bad key is one line naming it, and a protocol changed after a
study started is said at the top of its report, its verdicts exploratory."""

import shutil
from pathlib import Path

import pytest
import tomllib

from core.config import ConfigError
from pipeline.study import cells, intervals, stats
from pipeline.study.config import StudyConfig
from pipeline.study.protocol import (
    COMMITTED,
    LOCK,
    PROTOCOL,
    check_same,
    load,
    lock,
    record,
    resolve,
    sha256,
)
from pipeline.study.tuning import (
    BOUNDS,
    GRIDS,
    LETTERS,
    MAX_EXTENSIONS,
    REFERENCE,
    SHARED,
    TUNE_SEED,
    WEIGHT_DECAY,
    param_path,
    recorded_names,
)

FILE = resolve(COMMITTED)


def test_the_study_reads_the_committed_protocol():
    """Every constant the study uses is the committed file's value, read here by tomllib alone."""
    raw = tomllib.loads(FILE.read_text())
    assert raw["endpoints"]["margins"] == stats.MARGINS
    assert tuple(map(tuple, raw["endpoints"]["primary"])) == intervals.PRIMARY_ENDPOINTS
    assert raw["generator"]["fidelity_floor"] == cells.FIDELITY_FLOOR
    assert raw["generator"]["max_cells"] == cells.MAX_CELLS
    assert (PROTOCOL.fits, PROTOCOL.mixed_sets_per_fit) == (
        3,
        raw["generator"]["mixed_sets_per_fit"],
    )
    goal = raw["endpoints"]["relative_goal"]
    assert PROTOCOL.relative_goal.below == goal["below"] == 0.3
    cfg = StudyConfig()
    seeds = raw["seeds"]
    assert (cfg.seeds, cfg.primary_seeds, cfg.other_seeds, cfg.tune_seeds) == (
        tuple(seeds["study"]), seeds["primary"], seeds["other"], seeds["tune"]
    )  # fmt: skip
    assert cfg.protocol == COMMITTED and seeds["tune_first"] == TUNE_SEED
    tuning = raw["tuning"]
    assert tuning["max_extensions"] == MAX_EXTENSIONS
    assert SHARED.values == tuple(tuning["weight_decay"]["values"])
    assert BOUNDS["csm"][WEIGHT_DECAY] == tuple(tuning["weight_decay"]["bounds"])
    # the protocol names a grid's parameters by config.json's keys, the study by their paths
    for group, table in tuning["grids"].items():
        if table:
            assert GRIDS[group] == {
                param_path(group, k): tuple(v["values"]) for k, v in table.items()
            }
            assert REFERENCE[group] == {
                param_path(group, k): v["reference"] for k, v in table.items()
            }
    assert GRIDS["ce"] == {WEIGHT_DECAY: (1.25e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3)}
    assert list(GRIDS["csm"]) == ["loss.csm.weight", "loss.csm.sharpening"]  # the protocol's order
    assert list(GRIDS["ce+maccal"]) == ["maccal.r", "maccal.q0"]  # finetune's paths


def test_the_study_tunes_by_path_and_records_the_protocols_names():
    """The grids are keyed by path; the run letters, and so every task name, and study.json's
    names (config.json's keys, the protocol's) are the ones every study root was written with."""
    letters = {
        name: LETTERS[param_path(group, name)]
        for group, grid in PROTOCOL.grids.items()
        for name in grid
    }
    assert letters == {
        "csm_weight": "w", "csm_sharpening": "s", "ls_alpha": "a", "focal_gamma": "g",
        "mixup_alpha": "a", "mmce_lam": "l", "fedlas_ls_alpha": "a", "fedlas_ls_beta": "b",
        "maccal_r": "r", "maccal_q0": "q",
    }  # fmt: skip
    assert LETTERS[WEIGHT_DECAY] == "wd" and WEIGHT_DECAY == "optim.weight_decay"
    for group, grid in PROTOCOL.grids.items():
        assert list(recorded_names(group, GRIDS[group])) == (list(grid) or ["weight_decay"])
    row = {"run": "tune-ls-a0p1", "loss.ls.alpha": 0.1, WEIGHT_DECAY: 5e-4, "val_nll": 0.3}
    assert recorded_names("ls", row) == {
        "run": "tune-ls-a0p1", "ls_alpha": 0.1, "weight_decay": 5e-4, "val_nll": 0.3
    }  # fmt: skip


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("max_cells = 3", 'max_cells = "three"', "generator.max_cells = 'three' is not an integer"),
        ("fits = 3", "fits = 0", "generator.fits = 0 must be >= 1"),
        ("nll = 0.005", "", "endpoints.margins.nll is missing (a primary metric)"),
        ("below = 0.30", "below = 30", "endpoints.relative_goal.below = 30 must be a fraction"),
        ("reference = 5e-4", "reference = 1e-3", "tuning.weight_decay.reference = 0.001 is not"),
        ("bounds = [1e-5, 5e-2]", "bounds = [1e-3, 5e-2]",
         "tuning.weight_decay.bounds = [0.001, 0.05] must hold every value"),
        ('search = "coordinate"', 'search = "cross"', "tuning.search = 'cross' is not one of"),
        ('["after_ts", "nll", "csm", "ce"]', '["after", "nll", "csm", "ce"]',
         "endpoints.primary[3] when 'after' is not one of"),
        ("[seeds]", "[seed]", "protocol: seeds is missing"),
        ("max_extensions = 3", "max_extensions = 3\n[[x", "not valid TOML"),
    ],
)  # fmt: skip
def test_a_bad_protocol_is_one_line_naming_the_key(tmp_path, old, new, message):
    text = FILE.read_text()
    assert old in text
    bad = tmp_path / "protocol.toml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(ConfigError, match="protocol") as e:
        load(bad)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(str(bad))


def test_another_protocol_file_must_hold_the_committed_values(tmp_path):
    copy = tmp_path / "protocol.toml"
    copy.write_text(FILE.read_text() + "\n# a comment: the same values\n")
    check_same(copy)  # the same values: fine
    copy.write_text(FILE.read_text().replace("nll = 0.005", "nll = 0.01"))
    with pytest.raises(ConfigError, match="its values differ from docs/protocol.toml"):
        check_same(copy)
    with pytest.raises(ConfigError, match="its values differ"):  # through the study's fields
        from pipeline.study.plan import setup

        setup("digits", [f"study.protocol={copy}", f"out={tmp_path}"], data=False)


def _report(tmp_path: Path, protocol: dict) -> str:
    """report.md of a one-comparison study under `protocol` (study.json's record)."""
    from pipeline.study.report import _paired, _protocol_header

    r = {
        "metric": "ece", "method": "csm", "reference": "ce", "difference": -0.5, "primary": True,
        "units": {"level": "seed", "groups": [0, 1]}, "ci95_t": [-0.9, -0.1],
        "ci95_percentile": [-0.8, -0.2], "ci95_bca": [-0.8, -0.2], "margin": 0.3,
        "bca": {"z0": 0.0, "z0_flagged": False, "blocks": 100}, "resamples": 2000,
        "labels": {"t": "better", "percentile": "better"}, "verdict_from": ["t", "percentile"],
        "verdict": "better",
    }  # fmt: skip
    paired = {"before_ts": {"ece": {"ce": {"csm": r}}}}
    return "\n".join([*_protocol_header(protocol), *_paired(paired, protocol["changed"])])


def test_a_protocol_changed_after_the_start_turns_the_verdicts_exploratory(tmp_path):
    copy = tmp_path / "protocol.toml"
    shutil.copy(FILE, copy)
    out = tmp_path / "study"
    out.mkdir()
    started = sha256(copy)
    assert lock(out, copy, "abc123") == {"sha256": started, "code": "abc123"}
    same = record(out, copy)
    assert same == {
        "file": str(copy), "sha256": started, "started_sha256": started, "code": "abc123",
        "changed": False, "verdicts": "confirmatory",
    }  # fmt: skip
    text = _report(tmp_path, same)
    assert "changed after" not in text and "| before TS | **primary** | ece |" in text
    copy.write_text(copy.read_text().replace("fits = 3", "fits = 4"))  # edited after the start
    assert lock(out, copy, "def456")["sha256"] == started  # the lock keeps the start's
    changed = record(out, copy)
    assert changed["changed"] and changed["verdicts"] == "exploratory"
    assert changed["sha256"] == sha256(copy) != started and changed["code"] == "abc123"
    text = _report(tmp_path, changed)
    assert f"**The protocol changed after the study started** (sha256 {started[:12]}" in text
    assert "every verdict below is exploratory" in text
    assert "| before TS | exploratory | ece |" in text and "**primary**" not in text
    assert (out / LOCK).is_file()


def test_the_report_says_when_the_primary_methods_configurations_differ():
    from pipeline.study.choices_report import configurations_paragraph
    from pipeline.study.tuning_plan import configurations

    tuning = {"ce": {"configurations": 7}, "csm": {"configurations": 9},
              "csm3": {"configurations": 8}, "ls": {"configurations": 13}}  # fmt: skip
    cfg = StudyConfig(methods=("ce", "csm", "csm3", "ls"))
    counts = configurations(cfg, tuning)
    assert counts["primary"] == ["csm", "ce", "csm3"]
    assert counts["spread"] == 2 and not counts["balanced"]  # 9 - 7: ls is no primary method
    text = "\n".join(configurations_paragraph(counts))
    assert "ce 7, csm 9, csm3 8, ls 13" in text
    assert "did not have the same number: they differ by 2" in text
    tuning["csm"]["configurations"] = 8
    counts = configurations(cfg, tuning)
    assert (
        counts["balanced"]
        and "had the same number within one" in configurations_paragraph(counts)[0]
    )
