"""The docs, the help and the messages in one vocabulary (issue 52, item 4): a key the user
types is spelt by its tree path (`optim.lr=0.05`), never by a flat name config.json records
(`lr`). docs/compat.md is the one page that lists the flat names, and is left out.

The flat names are every stage's rename table, `Config.LEGACY` (stages/configs/legacy.py and
the names a section of parts derives: `csm_weight`, `maccal_q0`), read from the configs, never
a hand list. A key the user would type is
- `key=` (a --set item, `SET="key=..."`, a hint's `set key=`), the key a whole run of
  `[\\w.-]` that no `[\\w.-/$]` precedes (so `optim.lr=` holds no `lr=`);
- `--set key`, an item written without its value;
- in a Markdown field table (its header's first cell is `field`), each `` `key` `` of a row's
  first cell.
Such a key is a flat one, and a failure, when
- scoped by a stage (a chain's `generate.limit=`): the rest is that stage's flat name and none
  of its paths;
- else: it is some stage's flat name and no stage's path or name (`limit=` and `sample_steps=`
  pass: they are shift's and generate's leaves; `method=` does not: finetune's is `objective`,
  annotate's `annotator`, and the word is the study's, `study.methods=`);
- and never when it is the study's own (`study.*`).
Allowed besides, in docs/study.md and pipeline/study/ only: the keys of docs/protocol.toml's
tuning grids (`csm_weight`): the committed protocol of a running study names them so.
A config.json key discussed as such (`host.json`'s `data_path`, "config.json records
`focal_gamma`") is prose, which none of the patterns reads: only the typed forms above are
checked, and a doc writes a flat name as a key only in docs/compat.md.
Where: README.md and docs/*.md, every stage's --help and --fields, and the string literals of
the code (core, models, shards, stages, pipeline) that are no docstring: the messages and hints
(a docstring reaches the user only through --help, checked as printed).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
import tomllib
from conftest import REPO, SEMIX_PACKAGES, string_literals

from core.tree import leaves, shown
from pipeline.cli import main
from pipeline.registry import STAGES, config_module, describe_stage
from pipeline.usage import help_text
from stages.configs.legacy import LEGACY
from stages.presets import DEFAULT

KEY = r"(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)*)"
TYPED = (
    re.compile(rf"(?<![\w.\-/$]){KEY}=(?!=)"),  # key=value: --set, SET="...", a hint
    re.compile(rf"--set\s+[\"']?{KEY}(?![\w.-])"),  # --set key
)
SPAN = re.compile(r"`([^`\n]+)`")
CELL = re.compile(r"(?<!\\)\|")  # a table's cell border (`\|` is a | inside a cell)
OLD_NAMES_PAGE = REPO / "docs" / "compat.md"
DOCS = [
    REPO / "README.md",
    *(p for p in sorted((REPO / "docs").glob("*.md")) if p != OLD_NAMES_PAGE),
]
STUDY = (REPO / "docs" / "study.md", REPO / "pipeline" / "study")


@functools.cache
def vocabulary() -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
    """({stage: its flat names}, {stage: its leaves' paths and the names --fields shows})."""
    flat, paths = {}, {}
    for stage in STAGES:
        config = config_module(stage).Config
        flat[stage] = frozenset(config.LEGACY)
        paths[stage] = frozenset(
            name for leaf in leaves(config) for name in (leaf.path, shown(config, leaf.path))
        )
    return flat, paths


def is_flat(key: str) -> bool:
    """Whether `key`, as the user would type it, is a flat name (the module docstring's rule)."""
    flat, paths = vocabulary()
    head, dot, rest = key.partition(".")
    if head == "study":
        return False
    if dot and head in STAGES:
        return rest in flat[head] and rest not in paths[head]
    return any(key in names for names in flat.values()) and not any(
        key in names for names in paths.values()
    )


def typed_keys(text: str) -> Iterator[tuple[int, str]]:
    """(line, key) of every key `text` gives the user to type."""
    header = None  # the first cell of the header of the table the line is in
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in TYPED:
            for m in pattern.finditer(line):
                yield number, m["key"]
        if not line.startswith("|"):
            header = None
            continue
        first = CELL.split(line)[1]
        if header is None:
            header = first.strip()
        elif header == "field" and not set(line) <= set("|-: "):
            yield from ((number, span) for span in SPAN.findall(first))


def flat_keys(text: str, allowed: Collection[str] = ()) -> list[str]:
    """`line: key` for each flat name `text` gives as a key to type (`allowed` aside)."""
    found = dict.fromkeys(
        f"{number}: {key}"
        for number, key in typed_keys(text)
        if key not in allowed and is_flat(key)
    )
    return list(found)


@functools.cache
def protocol_keys() -> frozenset[str]:
    """The parameters docs/protocol.toml's tuning grids name (`csm_weight`)."""
    protocol = tomllib.loads((REPO / "docs" / "protocol.toml").read_text(encoding="utf-8"))
    return frozenset(key for grid in protocol["tuning"]["grids"].values() for key in grid)


def allowed_in(path: Path) -> frozenset[str]:
    study = any(path == p or p in path.parents for p in STUDY)
    return protocol_keys() if study else frozenset()


# ------------------------------------------------------------------ the finder sees what it checks


@pytest.mark.parametrize(
    "flat, path, found",
    [
        ("--set lr=0.5", "--set optim.lr=0.5", "lr"),
        ('make train SET="resume=auto"', 'make train SET="checkpoint.resume=auto"', "resume"),
        ("or set judge_run= to another run", "or set fidelity.judge= to another run", "judge_run"),
        ("`SET=generate.limit=40`", "`SET=generate.mixing.limit=40`", "generate.limit"),
        ("fit-generator.steps=100", "fit-generator.train_steps=100", "fit-generator.steps"),
        # sample_steps is generate's leaf, fit-generator's flat name
        ("fit-generator.sample_steps=10", "generate.sample_steps=10", "fit-generator.sample_steps"),
        ("--set csm_weight=2", "--set loss.csm.weight=2", "csm_weight"),  # derived names too
        ("maccal_q0=0.7", "maccal.q0=0.7 or objective.q0=0.7", "maccal_q0"),
        ("finetune --set method=maccal", "finetune --set objective=maccal", "method"),
        ("--set mixed_precision", "--set precision", "mixed_precision"),
        (
            "| field | default |\n|---|---|\n| `data_path`, `stream_workers` | auto |",
            "| field | default |\n|---|---|\n| `data.path`, `data.stream_workers` | auto |",
            "data_path",
        ),
    ],
)
def test_the_finder_finds_a_flat_key_and_passes_its_path(flat, path, found):
    assert [hit.partition(": ")[2] for hit in flat_keys(flat)][:1] == [found]
    assert flat_keys(path) == []


@pytest.mark.parametrize(
    "text",
    [
        "limit=100 shift's test images",  # shift's leaf (generate's flat name)
        "study.seeds=0,1 study.methods=ce,csm",  # the study's own
        "config.json records `focal_gamma`; host.json's `data_path`",  # prose, not a key typed
        "| loss | parameters |\n|---|---|\n| `ls` | `ls_alpha` |",  # no field table
        "accelerate launch --mixed_precision=bf16",  # accelerate's flag
        "torch.optim.lr_scheduler; cfg.optim.lr=0.1; ~/lr=2",
    ],
)
def test_the_finder_passes_what_no_user_types(text):
    assert flat_keys(text) == []


def test_the_flat_names_come_from_the_rename_table():
    flat, _ = vocabulary()
    assert all(set(names) <= flat[stage] for stage, names in LEGACY.items())
    assert {"csm_weight", "fedlas_ls_alpha"} <= flat["train"]  # derived from the losses
    assert {"maccal_q0", "fedlas_margin"} <= flat["finetune"]
    assert protocol_keys() and protocol_keys() <= flat["train"] | flat["finetune"]
    assert allowed_in(REPO / "pipeline" / "study" / "tuning.py") == protocol_keys()
    assert allowed_in(REPO / "docs" / "train.md") == frozenset()


# ------------------------------------------------------------------ the docs, help and messages


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_docs_spell_keys_by_their_paths(doc):
    text = doc.read_text(encoding="utf-8")
    assert flat_keys(text, allowed_in(doc)) == [], f"{doc.name}: spell these by their paths"


@pytest.mark.parametrize("stage", list(STAGES))
def test_help_and_fields_spell_keys_by_their_paths(stage):
    for text in (help_text(stage, DEFAULT), describe_stage(stage, DEFAULT)):
        assert flat_keys(text) == [], f"{stage}: {flat_keys(text)}"


def test_the_messages_of_the_code_spell_keys_by_their_paths():
    found = [
        f"{path.relative_to(REPO)}:{line}: {hit.partition(': ')[2]}"
        for package in SEMIX_PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        for line, text in string_literals(path)
        for hit in flat_keys(text, allowed_in(path))
    ]
    assert found == []


def test_faults_quotes_the_unknown_field_message_as_printed(capsys):
    """docs/faults.md quotes train's count of fields; it is the one the message prints."""
    assert main(["train", "--preset", DEFAULT, "--set", "lossx=ce"]) == 2
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(r".*\(--fields lists all \d+\)", line), line
    assert f"`{line}`" in (REPO / "docs" / "faults.md").read_text(encoding="utf-8")
