"""The parts a stage picks as sections of its config tree (core.parts.Section.tree), beyond
train's loss (tests/test_parts.py): generate's `backend` and annotate's `encoder`. The picked
part is `<section>.name` (set as `backend=sd`), each part's parameters are leaves
`<section>.<part>.<param>`, config.json records them under their flat names, and --set takes
every spelling."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest

from core.config import SAID, ConfigError, RenamedField
from core.tree import get, leaves
from models.generators import GENERATORS
from pipeline.chain import field_names, scope_fields
from pipeline.cli import main
from pipeline.registry import resolve_stage_config
from stages.configs import annotate as annotate_config
from stages.configs import generate as generate_config

BUILT_IN_BACKENDS = ("unet", "sd", "dit", "edm")


def test_every_backend_parameter_is_a_leaf_with_its_default_and_its_flat_name():
    cfg = resolve_stage_config("generate", "digits")
    for name in BUILT_IN_BACKENDS:
        paths = generate_config.BACKEND.paths_of(name)
        for p in dataclasses.fields(GENERATORS[name].params):
            assert get(cfg, paths[p.name]) == p.default, (name, p.name)
    legacy = generate_config.Config.LEGACY
    assert {k: legacy[k] for k in generate_config.BACKEND.legacy} == {
        "prompt_template": "backend.sd.prompt_template",
        "negative_prompt": "backend.sd.negative_prompt",
        "native_size": "backend.sd.native_size",
        "dit_class_ids": "backend.dit.class_ids",
    }
    backend_leaves = {
        leaf.path for leaf in leaves(generate_config.Config) if leaf.path.startswith("backend.")
    }
    assert backend_leaves == {"backend.name", *generate_config.BACKEND.legacy.values()}
    sections = {f.name for f in dataclasses.fields(cfg.backend)}
    assert {"sd", "dit"} <= sections and not {"unet", "edm"} & sections  # no parameters
    assert cfg.backend.name == "unet" and cfg.backend.params() == {}
    assert cfg.recorded()["backend"] == "unet" and "backend.name" not in cfg.recorded()


@pytest.mark.parametrize(
    "sets",
    [
        ["backend=sd", "native_size=512"],
        ["backend.name=sd", "backend.native_size=512"],
        ["backend=unet", "backend.native_size=512", "backend=sd"],  # the last pick counts
        ["backend=sd", "backend.sd.native_size=512"],
    ],
)
def test_nested_and_flat_backend_spellings_give_one_config(sets):
    cfg = resolve_stage_config("generate", "cifar10", sets)
    assert (cfg.backend.name, cfg.backend.sd.native_size) == ("sd", 512)
    assert cfg.backend.params() == {
        "prompt_template": "a photo of a {name}",
        "negative_prompt": "",
        "native_size": 512,
    }
    flat = resolve_stage_config("generate", "cifar10", ["backend=sd", "native_size=512"])
    assert cfg.recorded() == flat.recorded() and flat.recorded()["native_size"] == 512


def test_a_flat_backend_name_sets_its_leaf_and_says_its_path_once():
    SAID.clear()  # said once per process: maybe already, by another test
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cfg = resolve_stage_config(
            "generate", "imagenet", ["dit_class_ids=1,2", "dit_class_ids=3,4"]
        )
    assert cfg.backend.dit.class_ids == (3, 4) and cfg.recorded()["dit_class_ids"] == [3, 4]
    assert cfg.backend.params() == {"class_ids": (3, 4)}  # dit's, what its builder takes
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # the derived section classes have a home
    assert [str(w.message) for w in said if w.category is RenamedField] == [
        "dit_class_ids is now backend.dit.class_ids"
    ]  # and never `backend is now backend.name`: the section's name picks the backend


def test_the_edm_preset_values_follow_the_picked_backend():
    """A preset's `when` condition names the section (`backend=edm`): it reads `backend.name`."""
    assert resolve_stage_config("generate", "cifar10", ["backend=edm"]).sampler == "heun"
    assert resolve_stage_config("generate", "cifar10", ["backend.name=edm"]).sampler == "heun"
    assert resolve_stage_config("generate", "cifar10").sampler == "ddim"


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (
            ["backend.native_size=512"],  # digits picks unet, which has none
            "backend.native_size: backend 'unet' has no parameter 'native_size'; its parameters: "
            "none",
        ),
        (["backend.dti.class_ids=1"], "no backend 'dti'; did you mean 'dit'?"),
        (["backend.sd.native_size=-1"], "backend.sd.native_size=-1 is out of range [0, inf)"),
        (["native_size=-1"], "backend.sd.native_size=-1 is out of range"),  # any backend's
        (["backend.sd.prompt_template=a photo"], "backend.sd.prompt_template must contain"),
        (["backend=nope"], "backend='nope' is not valid"),
    ],
)
def test_bad_backend_values_are_refused_in_one_line_naming_the_leaf(sets, needle):
    with pytest.raises(ConfigError) as e:
        resolve_stage_config("generate", "digits", sets)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_fields_and_print_config_show_the_backend_section(capsys):
    assert main(["generate", "--preset", "cifar10", "--fields"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0] for line in out if line.startswith("  ") and line.split()}
    assert {"backend", "backend.sd.native_size", "backend.dit.class_ids"} <= rows
    assert not {"backend.name", "native_size", "dit_class_ids"} & rows
    (backend,) = [line for line in out if line.split()[:1] == ["backend"]]
    assert all(b in backend for b in BUILT_IN_BACKENDS)  # the section checks its choices
    assert main(["generate", "--preset", "cifar10", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert '"backend": {' in printed and '"native_size": 0' in printed


def test_every_encoder_parameter_is_a_leaf_recorded_by_its_flat_name():
    """The CLIP kinds share their model, one leaf at the first (encoder.openclip.model)."""
    cfg = resolve_stage_config("annotate", "cifar10")
    assert annotate_config.ENCODER.legacy == {
        "encoder_model": "encoder.openclip.model",
        "encoder_pretrained": "encoder.openclip.pretrained",
        "encoder_cache": "encoder.openclip.cache",
        "encoder_run": "encoder.classifier.run",
    }
    assert annotate_config.ENCODER.paths_of("hf-clip") == {"model": "encoder.openclip.model"}
    assert [f.name for f in dataclasses.fields(cfg.encoder)] == ["name", "openclip", "classifier"]
    assert (cfg.encoder.name, cfg.encoder.params()) == (
        "openclip",
        {"model": "ViT-B-32", "pretrained": "openai", "cache": ""},
    )
    recorded = cfg.recorded()
    assert recorded["encoder"] == "openclip" and recorded["encoder_run"] == "encoder"
    assert not any(key.startswith("encoder.") for key in recorded)


@pytest.mark.parametrize(
    "sets",
    [
        ["encoder=classifier", "encoder_run=enc2"],
        ["encoder.name=classifier", "encoder.run=enc2"],
        ["encoder=classifier", "encoder.classifier.run=enc2"],
    ],
)
def test_nested_and_flat_encoder_spellings_give_one_config(sets):
    cfg = resolve_stage_config("annotate", "cifar10", sets)
    assert (cfg.encoder.name, cfg.encoder.params()) == ("classifier", {"run": "enc2"})
    flat = resolve_stage_config("annotate", "cifar10", ["encoder=classifier", "encoder_run=enc2"])
    assert cfg.recorded() == flat.recorded() and flat.recorded()["encoder_run"] == "enc2"
    assert pickle.loads(pickle.dumps(cfg)) == cfg


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["encoder=nope"], "encoder='nope' is not valid"),
        (["encoder.model=x"], "encoder 'classifier' has no parameter 'model'"),  # digits'
        (["encoder.clip.model=x"], "no encoder 'clip'"),
        (["prototypes=text"], "encoder=classifier has none"),
    ],
)
def test_bad_encoder_values_are_refused_in_one_line(sets, needle):
    with pytest.raises(ConfigError) as e:
        resolve_stage_config("annotate", "digits", sets)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_chain_scopes_a_sections_paths_and_shorthands_in_a_stages_errors():
    """An encoder's hint names the picked encoder's parameter by its shorthand
    (`encoder.pretrained=`); inside a chain it is scoped like a leaf's path."""
    fields = field_names("annotate")
    assert {"encoder", "encoder.openclip.model", "encoder.model", "encoder_model"} <= set(fields)
    assert {"backend", "backend.dit.class_ids", "backend.class_ids"} <= set(field_names("generate"))
    message = "OpenCLIP weights are not cached; encoder.pretrained=/path/to/checkpoint takes a file"
    assert scope_fields(message, "annotate", fields) == message.replace(
        "encoder.pretrained=", "annotate.encoder.pretrained="
    )
    message = "encoder.classifier.run=nope: no trained weights"
    assert scope_fields(message, "annotate", fields) == f"annotate.{message}"
