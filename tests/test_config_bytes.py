"""Every stage x preset config.json (and each chain step's, and off-default variants) keeps its
bytes: a run root written before a config change stays complete (0 tasks)."""

from __future__ import annotations

import json
from pathlib import Path

from config_dump import cases, dump

SNAPSHOT = Path(__file__).parent / "data" / "config_json.json"


def test_every_config_json_keeps_its_bytes():
    before = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    now = dump()
    assert set(now) == set(before)  # the same cases (tests/config_dump.py lists them)
    changed = [key for key in before if now[key] != before[key]]
    assert not changed, f"config.json changed for {len(changed)} cases, e.g. {changed[:3]}"


def test_the_snapshot_covers_every_stage_preset_and_variant():
    from pipeline.registry import STAGES
    from stages.presets import NAMES

    covered = {(stage, preset) for _, stage, preset, _ in cases()}
    assert covered >= {(stage, preset) for stage in STAGES for preset in NAMES}
    assert not any(text.startswith("error:") for text in dump().values())
