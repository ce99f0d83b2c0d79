"""The command line (issue 24): --set repeats and merges, --fields and --print-config describe
every command without starting work, --fields shows defaults, preset values and the source's
descriptions, a chain's hints name keys the chain accepts, and an uncached model id offline
fails fast in one line. Nothing here uses the network."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, subprocess_env

import pipeline.chain
import pipeline.cli
import pipeline.demo
import pipeline.study
import pipeline.study.command
from core.fielddocs import field_docs
from core.tree import leaves
from pipeline.chain import scope_fields
from pipeline.cli import main
from pipeline.registry import resolve_stage_config
from stages.presets import chain_steps

# ---------------------------------------------------------------- --set


def test_set_may_repeat_and_merges(capsys):
    argv = ["prepare", "--print-config", "--set", "shard_size=7", "--set", "val_fraction=0.25"]
    assert main([*argv, "shard_size=9"]) == 0  # a later value of a key wins
    cfg = json.loads(capsys.readouterr().out)
    assert (cfg["shard_size"], cfg["val_fraction"]) == (9, 0.25)


# ---------------------------------------------------------------- --fields


def _trailing_comments(path: Path, names: set[str]) -> dict[str, str]:
    """field -> the comment at the end of its line, read with a regex (not the code's parser)."""
    found = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^    (\w+): [^#]*?  # (.+)$", line)
        if m and m.group(1) in names:
            found[m.group(1)] = m.group(2).strip()
    return found


def _row(out: str, name: str) -> str:
    rows = [line for line in out.splitlines() if line.split()[:1] == [name]]
    assert len(rows) == 1, (name, out)
    return rows[0]


def test_fields_show_default_preset_value_and_the_source_description(capsys):
    from stages.configs.train import Config

    assert main(["train", "--preset", "digits", "--fields"]) == 0
    out = capsys.readouterr().out
    names = {f.name for f in dataclasses.fields(Config)}
    comments = _trailing_comments(REPO / "stages" / "configs" / "train.py", names)
    comments |= _trailing_comments(REPO / "core" / "config.py", names - set(comments))
    # the losses' parameters say theirs where they are declared (`param(doc=...)`, core/parts.py),
    # each row named by its leaf's path (loss.csm.weight)
    loss = [leaf for leaf in leaves(Config) if leaf.path.startswith("loss.")]
    comments |= {
        leaf.path: leaf.field.metadata["doc"] for leaf in loss if leaf.field.metadata.get("doc")
    }
    assert len(comments) > 20  # the regex found the comments it should
    for name, comment in comments.items():
        assert comment in _row(out, name), name
    row = _row(out, "model")  # default, then the digits preset's value
    assert row.index("resnet50") < row.index("digits-cnn")
    assert "torch intra-op threads" in _row(out, "cpu_threads")  # a comment block above
    assert "20,26" in _row(out, "optim.milestones")  # a section's leaf, as --set spells it
    assert ["preset"] not in [line.split()[:1] for line in out.splitlines()]  # --preset sets it
    # a value that applies only under a condition says so
    assert main(["generate", "--preset", "cifar10", "--fields"]) == 0
    assert "20 when backend=edm" in _row(capsys.readouterr().out, "sample_steps")


def test_field_docs_take_the_subclass_comment():
    from stages.configs.generate import Config

    docs = field_docs(Config)
    assert docs["cpu_threads"].startswith("pinned: CPU bytes")  # generate redeclares it
    assert docs["seed"] == "" and docs["out"] == "parent of every run root"


@pytest.mark.parametrize("command", ["chain", "demo", "study", "train"])
@pytest.mark.parametrize("flag", ["--fields", "--print-config"])
def test_fields_and_print_config_never_start_work(command, flag, tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("work started")

    for module, name in [
        (pipeline.cli, "run_command"),
        (pipeline.cli, "run_stage"),
        (pipeline.chain, "run_stage"),
        (pipeline.demo, "run_stage"),
        (pipeline.study.command, "execute"),
    ]:
        monkeypatch.setattr(module, name, no_work)
    out = tmp_path / "runs"
    assert main([command, flag, "--set", f"out={out}"]) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    if flag == "--print-config":
        json.loads(text)
    else:  # a chain's fields are scoped: the generate step's steps are generate.sample_steps
        assert "generate.sample_steps" in text if command != "train" else "epochs" in text
    assert not out.exists()


def test_chain_print_config_resolves_every_step(tmp_path, capsys):
    sets = ["--set", f"out={tmp_path}", "generate.mixing.limit=3", "--set", "train.epochs=2"]
    assert main(["chain", "--print-config", *sets]) == 0
    steps = json.loads(capsys.readouterr().out)["chain"]
    assert [s["stage"] for s in steps] == [s for s, _ in chain_steps("digits")]
    by_stage = {s["stage"]: s["config"] for s in steps}
    assert by_stage["generate"]["mixing"]["limit"] == 3 and by_stage["train"]["epochs"] == 2
    assert by_stage["train"]["run"] == "encoder"  # the chain's own value
    bad = ["--set", f"out={tmp_path}", "generate.mixing.limit=x"]
    assert main(["chain", "--print-config", *bad]) == 2
    assert "generate.mixing.limit='x' is not a valid int" in capsys.readouterr().err
    # a flat spelling still works in a chain, and so does a loss parameter under its stage
    loss = ["--set", f"out={tmp_path}", "generate.limit=4", "train.loss.weight=2"]
    assert main(["chain", "--print-config", *loss, "train.loss=csm"]) == 0
    by_stage = {s["stage"]: s["config"] for s in json.loads(capsys.readouterr().out)["chain"]}
    assert by_stage["generate"]["mixing"]["limit"] == 4
    assert by_stage["train"]["loss"]["name"] == "csm"
    assert by_stage["train"]["loss"]["csm"]["weight"] == 2.0  # the tree, as code reads it


def test_demo_and_study_commands_reach_their_code(monkeypatch):
    calls = []
    monkeypatch.setattr(pipeline.demo, "run_demo", lambda p, s: calls.append(("demo", p, s)))
    monkeypatch.setattr(pipeline.study, "main", lambda p, s: calls.append(("study", p, s)))
    assert main(["demo", "--set", "train.epochs=1", "--set", "out=x"]) == 0
    assert main(["study", "--preset", "fashion-mnist", "--set", "study.seeds=0"]) == 0
    assert calls == [
        ("demo", "digits", ["train.epochs=1", "out=x"]),
        ("study", "fashion-mnist", ["study.seeds=0"]),
    ]


# ---------------------------------------------------------------- hints a chain accepts


def test_scope_fields_rewrites_keys_but_not_commands():
    msg = "set data_dir=/a or `model` (see `python -m pipeline prepare --set data_dir=x`); out=y"
    assert scope_fields(msg, "prepare", ["data_dir", "model"]) == (
        "set prepare.data_dir=/a or `prepare.model` (see `python -m pipeline prepare --set "
        "data_dir=x`); out=y"
    )
    already = "prepare.data_dir=/a and /x/data_dir=1"
    assert scope_fields(already, "prepare", ["data_dir"]) == already


def test_chain_errors_name_keys_the_chain_accepts(tmp_path, capsys, monkeypatch):
    import stages.prepare

    def missing(cfg):
        raise ValueError("cifar10 archive not found; set data_dir=/path/archive.tar.gz")

    monkeypatch.setattr(stages.prepare, "run", missing)
    assert main(["chain", "--set", f"out={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "set prepare.data_dir=/path/archive.tar.gz" in err and "Traceback" not in err
    # the key as the hint first named it is refused by the chain, naming the scoped one
    assert main(["chain", "--print-config", "--set", f"out={tmp_path}", "data_dir=/x"]) == 2
    err = capsys.readouterr().err
    assert "'data_dir' is not shared" in err and "prepare.data_dir=" in err
    assert main(["study", "--print-config", "--set", "study.bogus=1"]) == 2
    assert "unknown field 'study.bogus'; valid fields: study.methods" in capsys.readouterr().err


# ---------------------------------------------------------------- train run names


def test_train_run_is_named_after_its_loss(capsys):
    assert resolve_stage_config("train", "digits").run == "ce"
    cfg = resolve_stage_config("train", "digits", ["loss=focal"])
    assert cfg.run == "focal" and cfg.recorded()["run"] == "focal"
    assert resolve_stage_config("train", "digits", ["loss=focal", "run=mine"]).run == "mine"
    assert main(["train", "--print-config", "--set", "loss=ls"]) == 0
    assert json.loads(capsys.readouterr().out)["run"] == "ls"


def test_another_config_under_one_name_names_the_fields_and_values(tmp_path):
    from shards.manifest import ShardError
    from shards.writer import write_config

    write_config(tmp_path, {"a": 1, "b": [1, 2], "c": "x", "out": "runs"})
    (tmp_path / "manifest.json").write_text("{}")  # complete: an identity to defend
    write_config(tmp_path, {"a": 1, "b": [1, 2], "c": "x", "out": "elsewhere"})  # not identity
    with pytest.raises(ShardError) as e:
        write_config(tmp_path, {"a": 2, "b": [1, 3], "c": "x"}, "do this")
    assert str(e.value).endswith(
        "different config (differs in: a, b): it has a=1 b=1,2, this one asks a=2 b=1,3; do this"
    )


# ---------------------------------------------------------------- offline


def test_uncached_model_id_offline_fails_fast_in_one_line(digits_root, tmp_path):
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    env = subprocess_env() | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    model = "semix-test/no-such-model"
    argv = ["generate", "--set", f"out={tmp_path}", "backend=sd", f"model={model}", "guidance=7"]
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - t0  # interpreter start and imports included (goal: <= 5 s)
    errors = [line for line in run.stderr.splitlines() if line.startswith("semix generate:")]
    assert run.returncode == 1, run.stderr
    assert len(errors) == 1, run.stderr
    assert f"'{model}'" in errors[0] and "offline" in errors[0]
    assert "model=<a local save_pretrained folder>" in errors[0]
    for noise in ("Traceback", "Retrying", "Couldn't connect", "Will try to load"):
        assert noise not in run.stderr, run.stderr
    assert elapsed < 30, elapsed
    assert not (tmp_path / "digits" / "series").exists()


def test_uncached_hub_dataset_offline_fails_fast_in_one_line(tmp_path):
    """`make generate CLASSES=cifar100` without network: prepare's Hub dataset is not cached;
    one line naming the local alternatives, no retries (they took 34 s before)."""
    env = subprocess_env() | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    argv = ["chain", "--preset", "cifar100", "--set", f"out={tmp_path}"]
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pipeline", *argv], capture_output=True, text=True, env=env,
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    errors = [line for line in run.stderr.splitlines() if line.startswith("semix chain:")]
    assert run.returncode == 1 and len(errors) == 1, run.stderr
    assert "uoft-cs/cifar100" in errors[0] and "offline" in errors[0]
    assert "prepare.data_dir=" in errors[0] and "prepare.hf_dataset=" in errors[0]
    for noise in ("Traceback", "Retrying", "Name or service not known"):
        assert noise not in run.stderr, run.stderr
    assert elapsed < 30, elapsed
    assert not (tmp_path / "cifar100" / "real" / "manifest.json").exists()


def test_uncached_hf_clip_id_offline_fails_fast_in_one_line():
    from models.encoders import HFCLIPEncoder

    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        HFCLIPEncoder("semix-test/no-such-clip", device="cpu")
    assert time.monotonic() - t0 < 30
    assert "\n" not in str(e.value) and "offline" in str(e.value)
    assert "encoder.model=<a local folder" in str(e.value)


@pytest.fixture
def hub_env(monkeypatch):
    """No offline switch, no proxy; hub_offline's cached probe forgotten before and after."""
    import huggingface_hub.constants

    from core import hub

    for key in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub.hub_reachable.cache_clear()
    yield hub
    hub.hub_reachable.cache_clear()


def test_hub_offline_when_the_endpoint_does_not_answer(hub_env, monkeypatch):
    import huggingface_hub.constants

    with socket.socket() as s:  # a local port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    assert hub_env.hub_offline()
    assert time.monotonic() - t0 < hub_env.HUB_PROBE_S + 1
    # switched on for the rest of the process and its children
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE


def test_hub_online_when_the_endpoint_answers(hub_env, monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert not hub_env.hub_offline()
    assert "HF_HUB_OFFLINE" not in os.environ


def test_hub_offline_set_is_trusted_without_a_probe(hub_env, monkeypatch):
    def probe(*args, **kwargs):
        raise AssertionError("probed")

    monkeypatch.setattr(socket, "create_connection", probe)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_env.hub_offline()


def test_resolving_configs_and_a_backend_check_import_no_diffusers():
    """What keeps a one-line failure (bad key, missing upstream, an uncached model id offline)
    quick: a chain's plan, every stage's config and the generator registry import neither
    diffusers nor transformers (seconds on a small CPU); only the backend that runs does."""
    probe = (
        "import sys, contextlib, io\n"
        "from pipeline.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['chain', '--preset', 'cifar100', '--print-config']) == 0\n"
        "    for stage in ('prepare', 'fit-generator', 'generate', 'annotate', 'train'):\n"
        "        assert main([stage, '--preset', 'cifar100', '--print-config']) == 0\n"
        "from models.generators import GENERATORS, UNET_PRESETS\n"
        "from models.generators.registry import generator_class\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'diffusers', 'transformers'})\n"
        "assert not heavy, heavy\n"
        "generator_class('unet')\n"
        "assert 'diffusers' in sys.modules  # the probe sees an import when there is one\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------- a chain's generate on every core


def test_a_chain_spreads_an_unfinished_generate_over_the_cores(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(pipeline.chain, "cpu_processes", lambda: 2)
    monkeypatch.setattr(pipeline.chain, "run_stage", lambda *a: calls.append(("here", *a)))

    def launch(cmd, check):
        calls.append(("launched", cmd))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(pipeline.chain.subprocess, "run", launch)
    sets = [f"out={tmp_path}", "limit=3"]
    assert pipeline.chain.run_step("generate", "digits", sets) == tmp_path / "digits" / "series"
    (_, cmd), = calls  # fmt: skip
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert cmd[5:] == ["-m", "pipeline", "generate", "--preset", "digits", "--set", *sets]
    pipeline.chain.run_step("annotate", "digits", sets[:1])  # not spread: in this process
    assert calls[-1] == ("here", "annotate", "digits", sets[:1])
    series = tmp_path / "digits" / "series"
    series.mkdir(parents=True)
    (series / "manifest.json").write_text("{}")  # complete: the stage itself says so, in-process
    pipeline.chain.run_step("generate", "digits", sets)
    assert calls[-1] == ("here", "generate", "digits", sets)
    monkeypatch.setattr(
        pipeline.chain.subprocess, "run", lambda cmd, check: subprocess.CompletedProcess(cmd, 3)
    )
    (series / "manifest.json").unlink()
    with pytest.raises(
        pipeline.chain.ChainError, match=r"generate in 2 processes failed \(exit 3\)"
    ):
        pipeline.chain.run_step("generate", "digits", sets)


def test_one_process_per_core_only_outside_a_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert pipeline.chain.cpu_processes() == 1
