"""Whole chains of stages, run one after another in this process.

`chain` is what `make generate` runs: everything from the real dataset to the shareable
mixed/ folder. Each stage resumes on its own (complete shards are skipped), so rerunning
a chain after an interruption only does the missing work.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.config import ConfigError, parse_sets
from core.runtime import log
from pipeline.registry import STAGES, check_out, resolve_stage_config, run_stage, stage_modules

# preset -> [(stage, extra --set values)]. The digits chain trains a quick real-only
# classifier first: its features are the annotation space (CLIP means nothing on 8x8 digits).
CHAINS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "digits": [
        ("prepare", ()),
        ("train", ("run=encoder", "loss=ce")),
        ("fit-generator", ()),
        ("generate", ()),
        ("annotate", ()),
    ],
    # Fashion-MNIST, fair to every study method (docs/study.md): the annotation encoder and the
    # generator see only the 5k labelled images the study's classifiers see (the train preset's
    # train_limit; fit-generator's too). A separate judge trained on all 54k (8 epochs, crops)
    # only measures generator fidelity and feeds nothing into any method.
    "fashion-mnist": [
        ("prepare", ()),
        (
            "train",
            ("run=judge", "loss=ce", "train_limit=0", "epochs=8", "milestones=4,7", "crop_pad=2"),
        ),
        ("train", ("run=encoder", "loss=ce")),
        ("fit-generator", ()),
        ("generate", ()),
        ("annotate", ()),
    ],
    "default": [("prepare", ()), ("generate", ()), ("annotate", ())],
}


SHARED_FIELDS = ("out", "name", "seed", "classes_file", "verify_sha256")


def split_sets(sets: Sequence[str], stage: str) -> list[str]:
    """The --set values meant for `stage`: shared fields, plus `stage.key=value` ones."""
    mine = []
    for item in sets:
        key = item.partition("=")[0]
        scope, dot, _ = key.rpartition(".")
        if dot and scope == stage:
            mine.append(item[len(scope) + 1 :])
        elif not dot and key in SHARED_FIELDS:
            mine.append(item)
        elif not dot:
            raise ValueError(
                f"{key!r} is not shared by every stage of the chain; scope it as <stage>.{key}=... "
                f"(shared: {', '.join(SHARED_FIELDS)})"
            )
    return mine


def check_chain(preset: str, sets: Sequence[str]) -> None:
    """Resolve every step's config before the first step runs: a misspelt or invalid field fails
    in one line now, not after minutes of the stages before the one it belongs to. Fields
    scoped to stages outside the chain (the demo's train./finetune./evaluate.) are checked by
    name and type; an unknown scope is refused."""
    steps = CHAINS.get(preset, CHAINS["default"])
    for key in (item.partition("=")[0] for item in sets):
        scope, dot, _ = key.rpartition(".")
        if dot and scope not in STAGES:
            raise ConfigError(
                f"{key!r}: unknown stage {scope!r}; choose one of {', '.join(STAGES)}"
            )
    for stage, extra in steps:
        check_out(resolve_stage_config(stage, preset, [*extra, *split_sets(sets, stage)]))
    in_chain = {stage for stage, _ in steps}
    for stage in sorted(set(STAGES) - in_chain):
        parse_sets(stage_modules(stage)[0].Config, split_sets(sets, stage))


def chain(preset: str, sets: Sequence[str]) -> None:
    steps = CHAINS.get(preset, CHAINS["default"])
    check_chain(preset, sets)
    out = None
    for i, (stage, extra) in enumerate(steps, 1):
        log.info("chain %s: step %d/%d: %s", preset, i, len(steps), stage)
        out = run_stage(stage, preset, [*extra, *split_sets(sets, stage)])
    print(f"semix: dataset ready in {out}")
