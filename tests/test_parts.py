"""A part owns its config (core/parts.py): a loss's parameters are its own frozen dataclass, the
train config's fields and checks derive from them, and the CLI takes both spellings."""

from __future__ import annotations

import dataclasses
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from core.codec import key
from core.config import (
    IDENTITY,
    OFF_DEFAULT,
    SAID,
    ConfigError,
    RenamedField,
    StageConfig,
    resolve,
)
from core.fielddocs import field_docs
from core.parts import Params, Section, param
from core.tree import get, leaves
from models.losses import LOSSES, FocalLoss, build_loss
from models.objectives import OBJECTIVES, LossEntry, build_objective
from pipeline.chain import split_sets
from pipeline.registry import resolve_stage_config
from stages.configs import annotate as annotate_config
from stages.configs import finetune as finetune_config
from stages.configs import generate as generate_config
from stages.configs import train as train_config


def test_every_loss_parameter_is_a_leaf_of_the_loss_section_with_its_default():
    """The loss section's leaves are the losses' parameters, nothing more: each loss's `Params`
    default is its leaf's, a parameter shared by two losses is one leaf (at its first loss), and
    each leaf is recorded under the flat name config.json has always had. The section keys
    its leaves by their paths; the flat names are only its `legacy`, for the codec."""
    cfg, legacy = train_config.Config(run="x"), train_config.Config.LEGACY
    for name, entry in OBJECTIVES.items():
        paths = train_config.LOSS.paths_of(name)
        for p in dataclasses.fields(entry.params):
            assert get(cfg, paths[p.name]) == p.default, (name, p.name)
    loss_leaves = {
        leaf.path for leaf in leaves(train_config.Config) if leaf.path.startswith("loss.")
    }
    assert loss_leaves == {"loss.name", *train_config.LOSS.legacy.values()}
    assert loss_leaves == {"loss.name", *train_config.LOSS.derived}  # keyed by path
    assert all(d.path == path for path, d in train_config.LOSS.derived.items())
    assert train_config.LOSS.paths_of("mmce_weighted")["lam"] == "loss.mmce.lam"  # one leaf
    # config.json's names since the first runs: the irregular ones are declared by the params
    assert {k: legacy[k] for k in ("mbls_margin", "mbls_lam", "fedlas_theta")} == {
        "mbls_margin": "loss.mbls.m",
        "mbls_lam": "loss.mbls.lam",
        "fedlas_theta": "loss.fedlas_ls.theta",
    }
    assert train_config.LOSS.paths_of("csm", data=False) == {
        "weight": "loss.csm.weight",
        "mixed_loss": "loss.csm.mixed_loss",
    }
    assert train_config.LOSS.paths_of("csm")["sharpening"] == "loss.csm.sharpening"  # data=True
    # the CSM weight: its path everywhere, config.json's key only at the codec
    assert train_config.LOSS.derived["loss.csm.weight"].recorded == "csm_weight"
    assert key(train_config.Config, "loss.csm.weight") == "csm_weight"
    assert "ce" not in {f.name for f in dataclasses.fields(cfg.loss)}  # no parameters, no section


def test_a_flat_loss_name_sets_its_leaf_and_says_its_path_once():
    SAID.clear()  # said once per process: maybe already, by another test
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cfg = resolve_stage_config("train", "digits", ["loss=csm", "csm_weight=2", "csm_weight=3"])
    assert cfg.loss.csm.weight == 3.0 and cfg.recorded()["csm_weight"] == 3.0
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # the derived section classes have a home
    assert [str(w.message) for w in said if w.category is RenamedField] == [
        "csm_weight is now loss.csm.weight"
    ]  # and never `loss is now loss.name`: the section's name picks the loss


@pytest.mark.parametrize(
    "sets",
    [
        ["loss=focal", "focal_gamma=2"],
        ["loss.name=focal", "loss.gamma=2"],
        ["loss.gamma=2", "loss.name=focal"],  # the loss's last --set counts, wherever it is
        ["loss=focal", "loss.focal.gamma=2"],
    ],
)
def test_nested_and_flat_spellings_give_one_config(sets):
    cfg = resolve_stage_config("train", "digits", sets)
    assert (cfg.loss.name, cfg.loss.focal.gamma, cfg.loss.params()) == (
        "focal",
        2.0,
        {"gamma": 2.0},
    )
    assert (
        cfg.recorded()
        == resolve_stage_config("train", "digits", ["loss=focal", "focal_gamma=2"]).recorded()
    )


def test_nested_keys_follow_the_loss_the_preset_or_set_picks():
    # fedlas-ls' alpha and fedlas-mbls' alpha are two fields; the dotted key finds the right one
    cfg = resolve_stage_config("train", "tiny-imagenet", ["loss=fedlas-mbls", "loss.alpha=0.2"])
    assert (cfg.loss.fedlas_mbls.alpha, cfg.loss.fedlas_ls.alpha) == (0.2, 0.05)
    cfg = resolve_stage_config("train", "digits", ["loss.fedlas-ls.alpha=0.3"])  # loss stays ce
    assert (cfg.loss.name, cfg.loss.fedlas_ls.alpha) == ("ce", 0.3)
    cfg = resolve_stage_config(
        "finetune", "cifar100", ["run=x", "objective=fedlas-mbls", "objective.beta=2"]
    )
    assert cfg.objective_params() == {"alpha": 0.1, "beta": 2.0, "margin": 6.0, "theta": 0.5}


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["loss.gamma=2"], "loss.gamma: loss 'ce' has no parameter 'gamma'; its parameters: none"),
        (["loss=focal", "loss.gama=2"], "did you mean 'gamma'?"),
        (["loss.fokal.gamma=2"], "no loss 'fokal'; did you mean 'focal'?"),
        (["loss=focal", "loss.gamma=-1"], "loss.focal.gamma=-1.0 is out of range [0.0, inf)"),
        (["ls_alpha=1.5"], "loss.ls.alpha=1.5 is out of range [0.0, 1.0)"),  # any loss's, at once
        (["csm_targets=both"], "loss.csm.targets='both' is not valid"),
        (["loss=nope"], "loss='nope' is not valid"),
    ],
)
def test_bad_loss_values_are_refused_in_one_line_naming_the_field(sets, needle):
    with pytest.raises(ConfigError) as e:
        resolve_stage_config("train", "digits", sets)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_finetune_takes_its_objectives_parameters_at_trains_paths_and_no_others():
    paths = {leaf.path for leaf in leaves(finetune_config.Config)}
    legacy = finetune_config.Config.LEGACY
    # every objective's parameter is a leaf, keyed by its path; its config.json name maps onto it
    objective = finetune_config.OBJECTIVE
    assert set(objective.derived) == set(objective.legacy.values()) <= paths
    assert objective.legacy.items() <= legacy.items()
    assert objective.paths_of("fedlas-ls")["alpha"] == "loss.fedlas_ls.alpha"  # train's path
    assert legacy["maccal_q0"] == "maccal.q0" and legacy["maccal_q_max"] == "maccal.q_max"
    # a FeDLaS parameter has train's path in finetune, and the same config.json name
    fedlas = {k: v for k, v in legacy.items() if k.startswith("fedlas_") and v.startswith("loss.")}
    assert len(fedlas) == 6
    assert fedlas == {k: train_config.Config.LEGACY[k] for k in fedlas}
    assert "loss.focal.gamma" not in paths and "focal_gamma" not in legacy
    cfg = resolve_stage_config("finetune", "digits", ["run=x", "objective.q0=0.7"])
    assert cfg.maccal.q0 == 0.7 and cfg.objective_params() == {
        "q0": 0.7,
        "gamma": 0.9,
        "tau0": 0.1,
        "lam": 5.0,
        "q_min": 0.3,
        "q_max": 1.0,
    }
    with pytest.raises(ConfigError, match="alpha"):
        resolve_stage_config("finetune", "digits", ["run=x", "objective.alpha=0.1"])
    with pytest.raises(ConfigError, match=r"^maccal\.tau0=-1"):
        resolve_stage_config("finetune", "digits", ["run=x", "maccal_tau0=-1"])
    sets = ["run=x", "objective=fedlas-ls", "loss.fedlas_ls.alpha=0.2", "loss.fedlas_ls.theta=0.9"]
    cfg = resolve_stage_config("finetune", "digits", sets)
    assert cfg.objective_params() == {"alpha": 0.2, "beta": 4.0, "theta": 0.9}
    assert cfg.recorded()["fedlas_ls_alpha"] == 0.2 and cfg.recorded()["fedlas_theta"] == 0.9


@pytest.mark.parametrize(
    "old",
    [
        ["method=fedlas-mbls", "method.beta=2"],
        ["method=fedlas-mbls", "method.fedlas-mbls.beta=2"],
        ["objective=fedlas-mbls", "method.beta=2"],
        ["method.name=fedlas-mbls", "loss.fedlas_mbls.beta=2"],
    ],
)
def test_finetunes_old_word_method_is_its_objective_said_once(old):
    """`method` was finetune's `objective`: the field and the section's shorthands still take
    it, with one note, and config.json records the key `method` as it always has."""
    new = ["run=x", "objective=fedlas-mbls", "objective.beta=2"]
    SAID.clear()  # said once per process: maybe already, by another test
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        cfg = resolve_stage_config("finetune", "cifar100", ["run=x", *old])
    assert [str(w.message) for w in said if w.category is RenamedField] == [
        "method is now objective"
    ]
    assert cfg == resolve_stage_config("finetune", "cifar100", new)
    assert cfg.objective == "fedlas-mbls" and cfg.loss.fedlas_mbls.beta == 2.0
    recorded = cfg.recorded()
    assert recorded["method"] == "fedlas-mbls" and "objective" not in recorded
    assert cfg.output == "x-fedlas-mbls"  # the folder: the value, as before


def test_an_old_shorthand_that_names_nothing_is_refused_as_typed():
    with pytest.raises(ConfigError) as e:
        resolve_stage_config("finetune", "digits", ["run=x", "method.alpha=0.1"])
    assert str(e.value).startswith("method.alpha: objective 'maccal' has no parameter 'alpha'")


def test_a_chain_scopes_a_nested_key_by_its_first_part():
    sets = ["train.loss.gamma=2", "train.loss=focal", "generate.steps=3"]
    assert split_sets(sets, "train") == ["loss.gamma=2", "loss=focal"]


def test_params_check_themselves_wherever_they_are_built():
    assert build_loss("focal", 3, gamma=2.0).gamma == 2.0
    with pytest.raises(ConfigError, match=r"gamma=-1 is out of range"):
        FocalLoss.Params(gamma=-1)
    with pytest.raises(ConfigError, match=r"loss 'focal' takes params \['gamma'\]"):
        build_objective("focal", 3, alpha=0.1)
    assert set(LOSSES) <= set(OBJECTIVES)


@dataclass(frozen=True)
class _Toy(Params):
    scale: float = param(1.0, low=0.0, doc="how much")
    mode: Literal["a", "b"] = param("a")


@dataclass(frozen=True)
class _Other(Params):
    scale: float = param(2.0)


def test_a_sections_leaves_carry_docs_identity_and_clashes_are_refused():
    """A section on a made-up part: each leaf's description for --fields, a registered part's
    leaves recorded only off their default, the leaves keyed by path (config.json's keys only
    in `legacy`), a bad value named by its path, and two parts that would share one recorded
    key with different defaults refused."""
    section = Section("loss", {"toy": LossEntry(_Toy, None, "toy")})
    held = section.tree("toy", __name__)
    assert field_docs(held.Toy)["scale"] == "how much"
    rules = {f.name: f.metadata.get(IDENTITY) for f in dataclasses.fields(held.Toy)}
    assert rules == {"scale": OFF_DEFAULT, "mode": OFF_DEFAULT}
    assert list(section.derived) == ["loss.toy.scale", "loss.toy.mode"]
    assert section.legacy == {"toy_scale": "loss.toy.scale", "toy_mode": "loss.toy.mode"}
    assert section.paths_of("toy") == {"scale": "loss.toy.scale", "mode": "loss.toy.mode"}
    with pytest.raises(ConfigError, match=r"^loss\.toy\.mode='c' is not valid"):
        held(toy=held.Toy(mode="c"))
    with pytest.raises(TypeError, match="differ in name, type or default"):
        Section("loss", {"toy": LossEntry(_Toy, None, "x"), "other": LossEntry(_Other, None, "x")})


def test_an_encoders_parameters_are_its_own():
    # the CLIP kinds share one leaf (encoder.openclip.model); the classifier kind has only its run
    cfg = resolve_stage_config("annotate", "digits", ["encoder=hf-clip", "encoder.model=/m"])
    assert (cfg.encoder.name, cfg.encoder.openclip.model) == ("hf-clip", "/m")
    assert cfg.encoder.params() == {"model": "/m"} and cfg.recorded()["encoder_model"] == "/m"
    cfg = resolve_stage_config("annotate", "digits", ["encoder.run=enc2"])
    assert cfg.encoder.classifier.run == "enc2"
    with pytest.raises(ConfigError, match="encoder 'classifier' has no parameter 'model'"):
        resolve_stage_config("annotate", "digits", ["encoder.model=ViT-B-16"])
    paths = {leaf.path for leaf in leaves(type(cfg))}
    assert {"encoder.openclip.model", "encoder.openclip.pretrained"} <= paths
    assert {"encoder.openclip.cache", "encoder.classifier.run"} <= paths


@pytest.mark.parametrize(
    "section", [train_config.LOSS, generate_config.BACKEND, annotate_config.ENCODER]
)
def test_docs_compat_lists_every_part_parameters_flat_name_and_path(section):
    text = (Path(__file__).parents[1] / "docs" / "compat.md").read_text(encoding="utf-8")
    rows = dict(re.findall(rf"^\| `(\w+)` \| `({section.name}\.[\w.]+)`[^|]* \|$", text, re.M))
    assert rows == section.legacy


@dataclass(frozen=True)
class _Shared(Params):
    scale: float = param(1.0, low=0.0, doc="how much")


_TOYS = Section(
    "loss",
    {
        "toy": LossEntry(_Toy, None, "toy"),
        "toy-too": LossEntry(_Shared, None, "toy"),  # its scale is toy's field, toy_scale
        "none": LossEntry(Params, None, "none"),
    },
)
Loss = _TOYS.tree("toy", __name__)  # module level: the config's annotation names it


def test_a_tree_section_holds_each_parameter_once_and_records_it_by_its_flat_name():
    """Section.tree on a made-up config: a subsection per part with parameters, a parameter two
    parts share one leaf (at the first), its checks naming the path, `loss=` its `name` leaf,
    config.json's flat names, and a part that would hide `name` refused."""

    @dataclass(frozen=True)
    class Config(StageConfig):
        LEGACY = _TOYS.legacy
        SECTIONS = (_TOYS,)
        loss: Loss = dataclasses.field(default_factory=Loss)

    assert [f.name for f in dataclasses.fields(Loss)] == ["name", "toy"]  # none: no section
    assert _TOYS.legacy == {"toy_scale": "loss.toy.scale", "toy_mode": "loss.toy.mode"}
    assert _TOYS.paths_of("toy-too") == {"scale": "loss.toy.scale"}  # toy's leaf

    class Presets:
        def lookup(self, preset):
            return preset, {}

    cfg = resolve(Config, Presets(), "p", ["loss=toy-too", "loss.scale=3"])
    assert (cfg.loss.name, cfg.loss.toy.scale, cfg.loss.params()) == (
        "toy-too",
        3.0,
        {"scale": 3.0},
    )
    assert cfg.recorded() == {
        **StageConfig(preset="p").recorded(),
        "loss": "toy-too",
        "toy_scale": 3.0,
    }
    with pytest.raises(ConfigError, match=r"^loss\.toy\.scale=-1\.0 is out of range"):
        resolve(Config, Presets(), "p", ["loss.toy-too.scale=-1"])
    with pytest.raises(ConfigError, match=r"^loss='nope' is not valid"):
        resolve(Config, Presets(), "p", ["loss=nope"])
    with pytest.raises(TypeError, match="would hide loss.name"):
        Section("loss", {"name": LossEntry(_Shared, None, "x")}).tree("name", __name__)
