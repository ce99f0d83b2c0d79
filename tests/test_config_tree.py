"""The stage configs as trees: one word per concept across every stage's leaves, the flat
names of config.json mapped onto existing leaves, and docs/compat.md listing that map."""

from __future__ import annotations

import re
import warnings

import pytest
from conftest import REPO

from core.config import SAID, ConfigError, RenamedField
from core.tree import get, leaves
from pipeline.registry import STAGES, config_module, resolve_stage_config
from stages.configs.legacy import LEGACY

# words that name one concept: across every stage, at most one of each group is a leaf's name
SYNONYMS = (
    {"flip", "hflip"},
    {"clip_norm", "grad_clip", "max_grad_norm"},
    {"precision", "mixed_precision", "dtype"},
    {"limit", "checkpoint_limit", "checkpoints_total_limit"},
    {"judge", "judge_run", "fidelity_run", "endpoint_judge"},
    {"loss", "objective"},
    {"resume", "resume_from_checkpoint"},
    {"sample_steps", "num_inference_steps"},
    {"train_steps", "max_train_steps"},
)
# words that meant two things: no leaf may be named by them alone
AMBIGUOUS = {"steps"}


def leaf_names() -> dict[str, set[str]]:
    """{leaf name: the stages whose configs have a leaf of that name}."""
    found: dict[str, set[str]] = {}
    for stage in STAGES:
        for leaf in leaves(config_module(stage).Config):
            found.setdefault(leaf.path.rpartition(".")[2], set()).add(stage)
    return found


def test_no_concept_has_two_names_across_the_stages():
    names = leaf_names()
    for group in SYNONYMS:
        used = sorted(group & set(names))
        assert len(used) <= 1, f"one concept, several names: {used}"
    assert not AMBIGUOUS & set(names), AMBIGUOUS & set(names)
    # the five concepts of the old configs each have their one word now
    assert {"flip", "clip_norm", "precision", "limit", "judge"} <= set(names)


def test_every_flat_name_maps_onto_a_leaf_and_shadows_none():
    assert set(LEGACY) <= set(STAGES)
    for stage, names in LEGACY.items():
        paths = {leaf.path for leaf in leaves(config_module(stage).Config)}
        assert set(names.values()) <= paths, stage
        assert not set(names) & paths, stage  # a flat name is never also a path
        assert len(set(names.values())) == len(names), stage  # one flat name per leaf


def test_a_flat_name_sets_its_leaf_and_says_its_new_name():
    SAID.clear()  # said once per process: maybe already, by another test
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        old = resolve_stage_config("train", "digits", ["loss=csm", "lr=0.02", "flip=true"])
    new = resolve_stage_config("train", "digits", ["loss=csm", "optim.lr=0.02", "augment.flip=1"])
    assert old == new and new.optim.lr == 0.02 and new.augment.flip
    assert [str(w.message) for w in said if w.category is RenamedField] == [
        "lr is now optim.lr",
        "flip is now augment.flip",
    ]
    fit = resolve_stage_config("fit-generator", "digits", ["checkpoints_total_limit=3"])
    assert fit.checkpoint.limit == 3 and fit.recorded()["checkpoints_total_limit"] == 3


def test_a_config_object_answers_its_paths_only():
    """The flat names are config.json's, --set's and the presets'; code reads a leaf by its path,
    so a flat name read in code fails at once instead of reading a leaf by another name."""
    for stage in ("train", "fit-generator", "generate", "annotate"):
        cfg = resolve_stage_config(stage, "digits")
        for flat, path in LEGACY[stage].items():
            assert not hasattr(cfg, flat) and flat in cfg.to_dict(), (stage, flat)
            get(cfg, path)  # its leaf answers the path
    with pytest.raises(AttributeError, match="has no attribute 'steps'"):
        resolve_stage_config("fit-generator", "digits", ["steps=7"]).steps  # noqa: B018


def test_a_leaf_keeps_its_check_and_names_itself():
    with pytest.raises(ConfigError, match=r"^optim\.lr=-1\.0 is out of range"):
        resolve_stage_config("train", "digits", ["optim.lr=-1"])
    with pytest.raises(ConfigError, match=r"^checkpoint\.limit=0 is out of range"):
        resolve_stage_config("fit-generator", "digits", ["checkpoints_total_limit=0"])
    with pytest.raises(ConfigError, match=r"unknown field 'optim\.lx'; did you mean 'optim\.lr'"):
        resolve_stage_config("train", "digits", ["optim.lx=1"])


def test_docs_compat_lists_every_flat_name():
    text = (REPO / "docs" / "compat.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| ([\w-]+) \| `(\w+)` \| `([\w.]+)` \|$", text, re.M))
    listed = {
        (stage, flat, path) for stage, names in LEGACY.items() for flat, path in names.items()
    }
    assert rows == listed
