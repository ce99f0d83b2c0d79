"""`make study`: the statistics against direct computations, and resume on a real tiny study
(digits, one epoch per run, subprocesses as in real use)."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from core.config import ConfigError
from models.calibration import ece
from pipeline.study import run_study
from pipeline.study.config import StudyConfig, comparison_pairs, run_name
from pipeline.study.plan import plan
from pipeline.study.stats import Predictions, paired_bootstrap
from shards import evals


def _save_predictions(path, logits, labels):
    np.savez(path, logits=logits.astype(np.float32), labels=labels.astype(np.int64))


def _load(path, temperature=1.0) -> Predictions:
    """As the study reads evaluate's predictions.npz."""
    with np.load(path, allow_pickle=False) as z:
        return Predictions.from_logits(z["logits"], z["labels"], temperature)


def test_prediction_ece_equals_the_metric(tmp_path):
    g = np.random.default_rng(0)
    logits, labels = g.normal(size=(500, 4)) * 3, g.integers(0, 4, 500)
    _save_predictions(tmp_path / "p.npz", logits, labels)
    for t in (1.0, 1.7):
        p = _load(tmp_path / "p.npz", t)
        direct = ece(
            torch.from_numpy(logits.astype(np.float32)).double() / t, torch.from_numpy(labels)
        )
        assert p.ece() == pytest.approx(direct, abs=1e-6)
        idx = g.integers(0, 500, 500)  # and on a resample
        direct = ece(
            torch.from_numpy(logits[idx].astype(np.float32)).double() / t,
            torch.from_numpy(labels[idx]),
        )
        assert p.ece(idx) == pytest.approx(direct, abs=1e-6)


def test_bootstrap_interval_separates_a_clear_difference_and_covers_none(tmp_path):
    g = np.random.default_rng(1)
    labels = g.integers(0, 3, 2000)
    runs = {}
    for name, scale in (("ce", 6.0), ("same", 6.0), ("calm", 1.0)):
        runs[name] = {}
        for seed in range(3):
            logits = g.normal(size=(2000, 3))
            logits[np.arange(2000), labels] += 1.0  # ~55 % accurate whatever the scale
            _save_predictions(tmp_path / f"{name}{seed}.npz", logits * scale, labels)
            runs[name][seed] = _load(tmp_path / f"{name}{seed}.npz")
    boot = paired_bootstrap(runs, "ce", n=300, rng=np.random.default_rng(0))
    # scale 6 is wildly overconfident, scale 1 much less: the interval lies below 0
    assert boot["calm"]["ci95"][1] < 0 < -boot["calm"]["relative"]
    # the same distribution: the interval covers 0
    assert boot["same"]["ci95"][0] < 0 < boot["same"]["ci95"][1]
    point = np.mean([p.ece() for p in runs["calm"].values()]) - np.mean(
        [p.ece() for p in runs["ce"].values()]
    )
    assert boot["calm"]["difference"] == pytest.approx(100 * point)


def test_study_config_is_checked():
    with pytest.raises(ConfigError, match="unknown study method"):
        StudyConfig(methods=("ce", "magic"))
    with pytest.raises(ConfigError, match="include ce"):
        StudyConfig(methods=("ls",))
    with pytest.raises(ConfigError, match="add csm"):
        StudyConfig(methods=("ce", "csm+maccal"))
    assert run_name("ce+maccal", 2) == "ce-s2-maccal" and run_name("csm-ce", 0) == "csm-ce-s0"


def _run_and_evaluation(root, stage, run, criterion, digest=None):
    """A finished run folder and a complete evaluation of it, as the stages leave them."""
    from shards.runs import finish_run
    from stages.evaluate import run_digest

    folder = root / stage / run
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "model.json"):
        (folder / name).write_text(f"{run} {name}")
    (folder / "metrics.json").write_text(json.dumps({stage: {"finished": True}}))
    finish_run(folder, ("a", "b"), {})  # the run manifest, last: the run is complete
    upstream = {f"{stage}/{run}": digest or run_digest(folder)}
    with evals.building(evals.eval_dir(root, stage, run)) as tmp:
        (tmp / evals.METRICS).write_text(json.dumps({"evaluation": {"ts_criterion": criterion}}))
        np.savez(tmp / evals.PREDICTIONS, logits=np.zeros((2, 2)), labels=np.zeros(2))
        evals.finish(tmp, class_names=("a", "b"), upstream=upstream, settings={}, code_version="t")


def test_ce_and_csm_run_every_seed_the_primary_five_and_the_exploratory_three(tmp_path):
    cfg = StudyConfig(
        methods=("ce", "csm", "csm3", "ls", "ce+maccal"), tune=False, robustness=False
    )
    assert cfg.seeds == tuple(range(10))  # the defaults: >= 10, >= 5 and 3 seeds
    names = [t.name for t in plan(cfg, "digits", [], tmp_path)]
    # the generator fits are tasks, not runs: fit 0 in the chain, fits 1 and 2 their own
    assert [n for n in names if n.startswith("fit-")] == ["fit-f1", "fit-f2"]
    runs = [n for n in names if n != "prepare" and not n.startswith(("chain", "train-", "fit-"))]
    assert runs == [
        *(f"ce-s{k}" for k in range(10)), *(f"csm-s{k}" for k in range(10)),
        *(f"csm3-s{k}" for k in range(5)), *(f"ls-s{k}" for k in range(3)),
        *(f"ce-s{k}-maccal" for k in range(3)),
    ]  # fmt: skip
    custom = StudyConfig(seeds=(7, 8, 9), primary_seeds=2, other_seeds=1)
    assert custom.seeds_of("csm") == (7, 8, 9) and custom.seeds_of("csm3") == (7, 8)
    assert custom.seeds_of("focal") == (7,)
    for field in ("other_seeds", "primary_seeds", "mixed_sets"):
        with pytest.raises(ConfigError, match=f"{field} >= 1"):
            StudyConfig(**{field: 0})


def test_each_csm_seed_trains_on_one_of_three_independent_mixed_sets(tmp_path):
    """One generator fit with three sets (study.fits=1 study.mixed_sets=3, the protocol before
    fits): seed k's run of a csm-family method trains on mixed set k mod 3 of its family, each
    set its own chain with its own generate seed (the chain's + the set's index); its
    fine-tuning and its record carry the same set."""
    from pipeline.study.mixed_sets import prepare_set

    root = tmp_path / "digits"
    cfg = StudyConfig(stack=False,
        methods=("ce", "csm", "csm3", "csm+maccal"), seeds=(0, 1, 2, 3), tune=False,
        robustness=False, fits=1, mixed_sets=3,
    )  # fmt: skip
    tasks = {t.name: t for t in plan(cfg, "digits", [f"out={tmp_path}", "seed=5"], root)}
    assert [cfg.mixed_set("csm", k) for k in range(4)] == [0, 1, 2, 0]
    assert cfg.mixed_set("ce", 1) is None and cfg.mixed_set("csm+maccal", 2) == 2
    chains = ["chain", "chain-m1", "chain-m2", "chain-k3", "chain-k3-m1", "chain-k3-m2"]
    assert [n for n in tasks if n.startswith("chain")] == chains
    for name in chains[1:]:
        assert tasks[name].after == {"chain"}
    assert "name=digits-m1" in tasks["chain-m1"].steps[0][1]
    for seed, folder, chain in ((0, None, "chain"), (1, "digits-m1", "chain-m1"),
                                (3, None, "chain")):  # fmt: skip
        train = tasks[f"csm-s{seed}"].steps[0][1]
        mixed = [s for s in train if s.startswith("mixed=")]
        assert mixed == ([f"mixed={tmp_path / folder / 'mixed'}"] if folder else [])
        assert tasks[f"csm-s{seed}"].after == {chain}
    assert tasks["csm3-s2"].after == {"chain-k3-m2"}
    assert f"mixed={tmp_path / 'digits-k3-m2' / 'mixed'}" in tasks["csm3-s2"].steps[0][1]
    assert tasks["csm-s1-maccal"].after == {"chain-m1", "csm-s1"}
    # set 0 draws with the chain's seed; set j with seed + j, the upstream shared by link
    (root / "real" / "train").mkdir(parents=True)
    (root / "real" / "train" / "manifest.json").write_text("{}")
    assert prepare_set(root, "", 2, 5) == ["generate.seed=7"]
    assert (tmp_path / "digits-m2" / "real" / "train" / "manifest.json").is_file()
    assert tasks["chain-m1"].prepare() == ["generate.seed=6"]


def test_every_method_meets_ce_and_the_verdicts_pairs_meet_theirs():
    pairs = comparison_pairs(("ce", "csm", "csm3", "ce+maccal", "csm+maccal", "ls"))
    assert pairs == [
        ("csm", "ce"), ("csm3", "ce"), ("ce+maccal", "ce"), ("csm+maccal", "ce"), ("ls", "ce"),
        ("csm3", "csm"), ("csm+maccal", "ce+maccal"), ("csm", "ls"),
    ]  # fmt: skip


def test_plan_orders_tasks_by_what_they_need_and_skips_evaluated_runs(tmp_path):
    cfg = StudyConfig(
        stack=False,
        methods=("ce", "ls", "csm-ratio", "ce+maccal"),
        seeds=(0,),
        tune=False,
        robustness=False,
    )
    tasks = {t.name: t for t in plan(cfg, "digits", ["train.epochs=1"], tmp_path)}
    assert list(tasks) == ["prepare", "chain", "ce-s0", "ls-s0", "csm-ratio-s0", "ce-s0-maccal"]
    # only methods that read mixed/ wait for the chain, the others only for real/ (the
    # chain's first step, its own task); a fine-tuning waits for its source run
    assert tasks["ce-s0"].after == tasks["ls-s0"].after == tasks["chain"].after == {"prepare"}
    assert tasks["csm-ratio-s0"].after == {"chain"}
    assert tasks["ce-s0-maccal"].after == {"ce-s0"}
    make, evaluate = tasks["ce-s0-maccal"].steps
    assert make[0] == "finetune" and "run=ce-s0" in make[1]
    assert evaluate[0] == "evaluate" and {"run=ce-s0-maccal", "stage_dir=finetune"} <= set(
        evaluate[1]
    )
    assert "epochs=1" in tasks["ls-s0"].steps[0][1]  # train. overrides reach train only
    assert not any(s.startswith("epochs") for s in evaluate[1])
    no_mixed = StudyConfig(
        stack=False, methods=("ce", "ls"), seeds=(0,), tune=False, robustness=False
    )
    assert [t.name for t in plan(no_mixed, "digits", [], tmp_path)][:2] == ["prepare", "ce-s0"]
    # a complete evaluation of the run as it is, with the study's criterion, marks the task
    # done; another criterion, a run retrained since (other digest), or an evaluation without
    # its manifest (killed mid-write) does not
    _run_and_evaluation(tmp_path, "train", "ce-s0", "nll")
    _run_and_evaluation(tmp_path, "train", "ls-s0", "ece")
    _run_and_evaluation(tmp_path, "train", "csm-ratio-s0", "nll", digest="0" * 64)
    (tmp_path / "eval" / "finetune" / "ce-s0-maccal").mkdir(parents=True)
    (tmp_path / "eval" / "finetune" / "ce-s0-maccal" / "metrics.json").write_text("{}")
    done = {t.name: t.done for t in plan(cfg, "digits", [], tmp_path)}
    assert done == {
        "prepare": False, "chain": False, "ce-s0": True, "ls-s0": False, "csm-ratio-s0": False,
        "ce-s0-maccal": False,
    }  # fmt: skip
    from shards.runs import finish_run

    retrained = tmp_path / "train" / "ce-s0"  # new weights, so a new run manifest
    (retrained / "model.safetensors").write_text("retrained")
    finish_run(retrained, ("a", "b"), {})
    assert not next(t for t in plan(cfg, "digits", [], tmp_path) if t.name == "ce-s0").done


def test_a_done_chain_whose_generator_the_config_no_longer_asks_for_is_refused(tmp_path):
    """The study reuses a done chain as it is: a generator fitted with another config (a preset
    changed since) stops it in one line naming the field and the fixes, never a silent reuse."""
    from pipeline.registry import resolve_stage_config
    from pipeline.study.plan import setup
    from shards.manifest import ShardError

    out = [f"out={tmp_path}"]
    fitted = resolve_stage_config("fit-generator", "digits", out).recorded()
    (tmp_path / "digits" / "generator").mkdir(parents=True)
    (tmp_path / "digits" / "generator" / "config.json").write_text(json.dumps(fitted))
    (tmp_path / "digits" / "generator" / "manifest.json").write_text("{}")  # a complete fit
    (tmp_path / "digits" / "mixed").mkdir()
    (tmp_path / "digits" / "mixed" / "manifest.json").write_text("{}")
    study = ["study.methods=ce,csm", "study.seeds=0", "study.tune=false"]
    assert next(t for t in setup("digits", [*out, *study])[2] if t.name == "chain").done
    with pytest.raises(ShardError) as err:  # the chain asks for v-prediction now
        setup("digits", [*out, *study, "fit-generator.prediction_type=v_prediction"])
    line = str(err.value)
    assert "\n" not in line and "differs in: noise.prediction_type" in line
    assert (
        "noise.prediction_type unset" in line and "fit-generator.<field>" in line and "out=" in line
    )


def test_study_runs_reports_and_resumes_only_what_is_missing(digits_root, tmp_path, capsys):
    shutil.copytree(digits_root / "real", tmp_path / "digits" / "real")
    sets = [
        f"out={tmp_path}", "study.methods=ce,ce+maccal", "study.seeds=0,1", "study.jobs=2",
        "study.bootstrap=200", "train.epochs=2", "train.milestones=", "finetune.maccal_epochs=1",
        "train.train_limit=640",  # about half of real/train: ce's stack and the maccal runs on it
        "study.tune=false",  # the tuning grids run in tests/test_study_tune.py
        "shift.corruptions=gaussian_noise,contrast",  # 2 of 11: the same 5 severities, 359 test
    ]  # fmt: skip
    report = run_study("digits", sets)
    study = json.loads((report.parent / "study.json").read_text())
    assert sorted((r["method"], r["seed"]) for r in study["records"]) == sorted(
        (m, s) for m in ("ce", "ce+maccal") for s in (0, 1)
    )
    # the seconds are this machine's: in host.json, never in study.json
    host = json.loads((report.parent / "host.json").read_text())
    assert not any("seconds" in key for key in study)
    assert set(host["task_seconds_this_invocation"]) == {
        "shift", "ood", "train-ce", "ce-s0", "ce-s1", "ce-s0-maccal", "ce-s1-maccal",
    }  # fmt: skip
    for r in study["records"]:  # each record is the run's own evaluation
        ev = json.loads((tmp_path / "digits" / "eval" / r["run"] / "metrics.json").read_text())
        assert r["before_ts"]["ece"] == ev["evaluation"]["before_ts"]["ece"]
        assert r["temperature"] == ev["evaluation"]["temperature"] and r["ts_criterion"] == "nll"
        # the robustness table: under shift per severity, and on the OOD set (digits: noise)
        mean = ev["evaluation"]["corruptions"]["after_ts"]["mean"]
        assert r["shift"]["after_ts"] == mean and set(mean) == {"1", "2", "3", "4", "5"}
        assert set(r["ood"]) == {"uniform"} and 0 <= r["ood"]["uniform"]["auroc"] <= 100
    shift = study["shift_paired"]["after_ts"]["ece"]["ce"]["ce+maccal"]
    assert shift["seeds"] == [0, 1] and shift["n_test"] == 359  # the digits test split
    assert (report.parent / "shift.png").is_file() and "Under shift" in report.read_text()
    ce = [r["before_ts"]["ece"] for r in study["records"] if r["method"] == "ce"]
    assert study["summary"]["ce"]["before_ts.ece"]["mean"] == pytest.approx(np.mean(ce))
    assert study["summary"]["ce"]["before_ts.ece"]["std"] == pytest.approx(np.std(ce, ddof=1))
    text = report.read_text()
    assert "| ce+maccal |" in text and "95 % interval" in text
    assert (report.parent / "reliability.png").is_file() and (report.parent / "ece.png").is_file()

    # a rerun does nothing; a study killed before ce-s1 was evaluated reruns only that
    assert run_study("digits", sets) == report
    again = json.loads((report.parent / "study.json").read_text())
    host = json.loads((report.parent / "host.json").read_text())
    assert host["task_seconds_this_invocation"] == {}
    assert again == study  # nothing ran: the same study.json
    shutil.rmtree(tmp_path / "digits" / "eval" / "train" / "ce-s1")
    run_study("digits", sets)
    third = json.loads((report.parent / "host.json").read_text())
    assert list(third["task_seconds_this_invocation"]) == ["ce-s1"]
    log = (report.parent / "logs" / "ce-s1.log").read_text()
    # the stack of ce's seeds is complete: only ce-s1's evaluation ran again
    assert "-m pipeline evaluate" in log and "-m pipeline train" not in log


def _mixed_manifest(folder, num_samples: int, num_classes: int = 10):
    """A mixed/ manifest with `num_samples` in 3 shards (what prepare_kway reads)."""
    from shards.manifest import Manifest, ShardRecord, write_manifest

    folder.mkdir(parents=True)
    counts = [num_samples // 3, num_samples // 3, num_samples - 2 * (num_samples // 3)]
    shards = tuple(ShardRecord(f"mixed-{i:06d}.tar", c, "0" * 64, 1) for i, c in enumerate(counts))
    names = tuple(f"c{i}" for i in range(num_classes))
    write_manifest(folder, Manifest("mixed", names, shards))


@pytest.mark.parametrize(
    ("images", "classes", "tuples", "per_tuple"),
    [(2160, 10, 72, 2), (5760, 10, 96, 4), (1800, 10, 120, 1), (30, 4, 2, 1)],
)
def test_kway_set_gets_the_image_budget_of_csm(tmp_path, images, classes, tuples, per_tuple):
    """csm3's chain: m = 4 (15 images per series), tuples x series_per_tuple series = csm's
    image count / 15, every tuple the same number of series, at most C(n, 3) tuples."""
    from math import comb

    from pipeline.study.mixed_sets import KWAY_LATTICE, prepare_kway

    root = tmp_path / "digits"
    _mixed_manifest(root / "mixed", images, classes)
    sets = dict(s.split("=") for s in prepare_kway(root, 3))
    assert (
        sets["generate.mixing.mix_classes"] == "3"
        and int(sets["generate.mixing.lattice"]) == KWAY_LATTICE
    )
    t, s = int(sets["generate.mixing.tuples"]), int(sets["generate.mixing.series_per_tuple"])
    assert (t, s) == (tuples, per_tuple)
    assert t <= comb(classes, 3) and t * s * 15 == images


def test_kway_chain_shares_complete_upstream_folders_by_link(tmp_path):
    from pipeline.study.mixed_sets import kway_root, prepare_kway

    root = tmp_path / "digits"
    _mixed_manifest(root / "mixed", 2160)
    for rel in ("real/train/manifest.json", "generator/unet/w.safetensors", "train/encoder/m.json"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
    (root / "train" / "ce-s0").mkdir()  # study runs are not shared
    prepare_kway(root, 3)
    k3 = kway_root(root, 3)
    assert k3 == tmp_path / "digits-k3"
    for rel in ("real/train/manifest.json", "generator/unet/w.safetensors", "train/encoder/m.json"):
        assert (k3 / rel).read_bytes() == rel.encode()
        assert (k3 / rel).stat().st_ino == (root / rel).stat().st_ino  # a link, not a copy
    assert not (k3 / "train" / "ce-s0").exists() and not (k3 / "mixed").exists()
    assert not list(k3.rglob(".*linking"))
    prepare_kway(root, 3)  # a second time: nothing changes, nothing fails


def test_csm3_plan_trains_on_the_kway_set_after_its_chain(tmp_path):
    from pipeline.study.plan import plan

    root = tmp_path / "digits"
    cfg = StudyConfig(
        stack=False,
        methods=("ce", "csm", "csm3"),
        seeds=(0, 1),
        tune=False,
        robustness=False,
        fits=1,
        mixed_sets=1,
    )
    tasks = {t.name: t for t in plan(cfg, "digits", [f"out={tmp_path}"], root)}
    assert tasks["chain-k3"].after == {"chain"} and tasks["chain-k3"].prepare is not None
    chain_sets = tasks["chain-k3"].steps[0][1]
    assert "name=digits-k3" in chain_sets and f"out={tmp_path}" in chain_sets
    for seed in (0, 1):
        task = tasks[f"csm3-s{seed}"]
        assert task.after == {"chain-k3"}
        train = task.steps[0][1]
        assert f"mixed={tmp_path / 'digits-k3' / 'mixed'}" in train and "loss=csm" in train
    assert not any(s.startswith("mixed=") for s in tasks["csm-s0"].steps[0][1])
    with pytest.raises(ConfigError, match="add csm"):
        StudyConfig(methods=("ce", "csm3"))


def test_csm_redraw_plan_trains_on_its_own_checked_set_after_its_chain(tmp_path):
    from pipeline.study.mixed_sets import prepare_redraw
    from pipeline.study.plan import plan

    root = tmp_path / "digits"
    cfg = StudyConfig(
        stack=False, methods=("ce", "csm", "csm-redraw"), seeds=(0,), tune=False, robustness=False
    )
    tasks = {t.name: t for t in plan(cfg, "digits", [f"out={tmp_path}"], root)}
    chain = tasks["chain-redraw"]
    assert chain.after == {"chain"} and "name=digits-redraw" in chain.steps[0][1]
    task = tasks["csm-redraw-s0"]
    assert task.after == {"chain-redraw"}
    assert f"mixed={tmp_path / 'digits-redraw' / 'mixed'}" in task.steps[0][1]
    for rel in ("real/train/manifest.json", "train/judge/m.json"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
    assert prepare_redraw(root) == ["generate.endpoint.check=redraw"]
    assert (
        tmp_path / "digits-redraw" / "train" / "judge" / "m.json"
    ).read_bytes() == b"train/judge/m.json"
    with pytest.raises(ConfigError, match="add csm"):
        StudyConfig(methods=("ce", "csm-redraw"))


def test_a_train_methods_seeds_on_one_mixed_set_train_as_one_stack(tmp_path):
    """study.stack (the default): one `train seeds=...` task per method and mixed set, the
    seed tasks evaluate after it; off: a train step in every seed's task."""
    root = tmp_path / "digits"
    cfg = StudyConfig(methods=("ce", "csm", "ce+maccal"), seeds=(0, 1, 2, 3), tune=False,
                      robustness=False)  # fmt: skip
    tasks = {t.name: t for t in plan(cfg, "digits", [f"out={tmp_path}"], root)}
    ce = tasks["train-ce"]
    ((stage, sets),) = ce.steps
    assert stage == "train" and "run=ce" in sets and "seeds=0,1,2,3" in sets and not ce.done
    assert [tasks[f"ce-s{k}"].steps[0][0] for k in range(4)] == ["evaluate"] * 4
    assert all("train-ce" in tasks[f"ce-s{k}"].after for k in range(4))
    # csm: one stack per mixed set (seed k on fit k mod 3's one set), each after its own chain
    assert "seeds=0,3" in tasks["train-csm"].steps[0][1] and "chain" in tasks["train-csm"].after
    csm1 = tasks["train-csm-f1"]
    assert "seeds=1" in csm1.steps[0][1] and "chain-f1" in csm1.after
    assert f"mixed={tmp_path / 'digits-f1' / 'mixed'}" in csm1.steps[0][1]
    assert "train-csm-f2" in tasks["csm-s2"].after
    # fine-tunings are not stacked; done once every run of the stack is complete
    assert (
        tasks["ce-s0-maccal"].steps[0][0] == "finetune" and "ce-s0" in tasks["ce-s0-maccal"].after
    )
    for k in range(4):
        _run_and_evaluation(root, "train", f"ce-s{k}", "nll")
    again = {t.name: t for t in plan(cfg, "digits", [f"out={tmp_path}"], root)}
    assert again["train-ce"].done and not again["train-csm"].done
    apart = {
        t.name: t for t in plan(replace(cfg, stack=False), "digits", [f"out={tmp_path}"], root)
    }
    assert not any(n.startswith("train-") for n in apart)
    assert [s[0] for s in apart["ce-s1"].steps] == ["train", "evaluate"]
