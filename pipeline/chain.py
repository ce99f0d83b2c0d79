"""Whole chains of stages, run one after another in this process.

`chain` is what `make generate` runs: everything from the real dataset to the shareable
mixed/ folder. Each stage resumes on its own (complete shards are skipped), so rerunning
a chain after an interruption only does the missing work.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.cli import run_stage
from pipeline.runtime import log

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
    # Fashion-MNIST: the same shape; the encoder is trained on all 54k training images (the
    # study's classifiers see 5k), 8 epochs with crops: the annotation space and the judge of
    # generator fidelity should be as good as this small net gets in ~10 CPU minutes.
    "fashion-mnist": [
        ("prepare", ()),
        (
            "train",
            (
                "run=encoder",
                "loss=ce",
                "train_limit=0",
                "epochs=8",
                "milestones=4,7",
                "crop_pad=2",
            ),
        ),  # fmt: skip
        ("fit-generator", ()),
        ("generate", ()),
        ("annotate", ()),
    ],
    "default": [("prepare", ()), ("generate", ()), ("annotate", ())],
}


SHARED_FIELDS = ("out", "name", "seed", "classes_file")


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


def chain(preset: str, sets: Sequence[str]) -> None:
    steps = CHAINS.get(preset, CHAINS["default"])
    out = None
    for i, (stage, extra) in enumerate(steps, 1):
        log.info("chain %s: step %d/%d: %s", preset, i, len(steps), stage)
        out = run_stage(stage, preset, [*extra, *split_sets(sets, stage)])
    print(f"semix: dataset ready in {out}")


def demo(preset: str, sets: Sequence[str]) -> None:
    from pipeline.demo import run_demo

    run_demo(preset, sets)


def study(preset: str, sets: Sequence[str]) -> None:
    from pipeline.study import run_study

    report = run_study(preset, sets)
    print(f"semix study: report in {report}")
    text = report.read_text()
    start = text.find("## The goal")
    if start >= 0:
        print(text[start:].split("\n## ", 1)[0])
