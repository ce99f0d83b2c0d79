"""k-way semantic mixing: k = 2 is the 2-way series (the same bytes through either spec, within
one run), k = 3 series are lattices over a simplex with the same guarantees (shared noise,
determinism, one process = two, a killed run resumed = one not killed).

Float bytes are a machine's: nothing here is compared with bytes recorded elsewhere. Whether a
commit keeps an earlier commit's bytes is checked on one machine by tests/cross_commit.py
(docs/contributing.md).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from test_edm import tiny_edm
from test_generate import _save_dit, _save_sd

from core.launch import cpu_threads
from models.classifiers import build_classifier
from models.generators import SeriesSpec, build_unet, load_generator
from pipeline.cli import main
from pipeline.registry import run_stage
from shards.manifest import read_manifest
from shards.reader import load_split
from shards.runs import save_weights

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("kway")]

GEN = ["alphas=4", "steps=3", "limit=6", "series_per_shard=2"]  # 6 series x 4 = 24 images
ANN = ["batch_size=16", "workers=0", "fidelity_run="]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tree(root: Path) -> dict[str, str]:
    # .index/ (member offsets, derived from the tar bytes; tests/test_stream.py checks them)
    # came after these pins: every file the 2-way code wrote is still compared
    return {
        p.relative_to(root).as_posix(): _sha(p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).parts[0] != ".index"
    }


@pytest.fixture(scope="module")
def kway_src(digits_root, tmp_path_factory) -> Path:
    """runs/digits/ with real/, a random tiny unet generator/ and a random digits-cnn
    train/encoder/ (read-only: tests copy it)."""
    root = tmp_path_factory.mktemp("kway-src") / "digits"
    shutil.copytree(digits_root / "real", root / "real")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        unet = build_unet(16, num_classes=10, channels=(16, 32), attention=(False, True))
        encoder = build_classifier("digits-cnn", 10)
    from conftest import save_generator

    save_generator(root, unet)
    meta = {
        "arch": encoder.arch_config(),
        "class_names": list(read_manifest(root / "real" / "train").class_names),
        "image_size": 16,
        "normalize": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
    }
    save_weights(root / "train" / "encoder", encoder.state_dict(), meta)
    return root


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest / "digits")
    return dest


def test_k2_stage_output_is_the_2way_series(kway_src, tmp_path):
    """mix_classes=2 on the lattice of the alphas gives the same files as the default 2-way
    config, and every stored series is the generator's own output for the spec its samples
    record (the stage's batching and sharding change no pixel)."""
    runs = _copy(kway_src, tmp_path / "default")
    series = run_stage("generate", "digits", [f"out={runs}", *GEN])
    mixed = run_stage("annotate", "digits", [f"out={runs}", *ANN])
    got_series, got_mixed = _tree(series), _tree(mixed)
    explicit = _copy(kway_src, tmp_path / "explicit")  # k = 2 on the lattice m = alphas - 1
    k2 = [f"out={explicit}", *GEN, "mix_classes=2", "lattice=3"]
    data = lambda tree: {k: v for k, v in tree.items() if k.endswith((".tar", "annotation.json"))}  # noqa: E731
    assert data(_tree(run_stage("generate", "digits", k2))) == data(got_series)
    mixed_k2 = run_stage("annotate", "digits", [f"out={explicit}", *ANN])
    assert data(_tree(mixed_k2)) == data(got_mixed) and len(data(got_mixed)) == 4
    split = load_split(series, verify=True)
    assert split.images.shape == (24, 16, 16, 3)
    gen = load_generator("unet", model=kway_src / "generator", steps=3)
    for s in range(6):
        rows = split.meta[4 * s : 4 * s + 4]
        (a, b), seed = rows[0]["classes"], rows[0]["seed"]
        spec = SeriesSpec(s, a, b, tuple(r["alpha"] for r in rows), seed)
        assert torch.equal(gen.generate_series([spec])[0], split.images[4 * s : 4 * s + 4])


def _backend(name: str, folder: Path):
    torch.manual_seed(0)  # random init of the tiny model only
    if name == "sd":
        _save_sd(folder)
        return load_generator("sd", model=folder, steps=2, image_size=16, guidance=3.0,
                              class_names=list("0123456789"))  # fmt: skip
    if name == "dit":
        _save_dit(folder)
        return load_generator("dit", model=folder, steps=2, image_size=16, guidance=2.0,
                              class_ids=list(range(10, 20)))  # fmt: skip
    tiny_edm().save_pretrained(folder)
    return load_generator("edm", model=folder, steps=2)


@pytest.mark.parametrize("name", ["sd", "dit", "edm"])
def test_k2_backends_render_a_2way_series_as_its_mix_spec(name, tmp_path):
    """Every backend renders SeriesSpec(a, b, α) as the k-way MixSpec((a, b), (α, 1 − α)) and
    as the swapped SeriesSpec(b, a, 1 − α), byte for byte; other noise gives other images."""
    from models.generators import MixSpec

    gen = _backend(name, tmp_path / name)
    alphas = (0.0, 0.25, 0.5, 0.75, 1.0)  # exact in float32, and so is 1 - α
    with cpu_threads(1):
        two_way = gen.generate_series([SeriesSpec(0, 3, 7, alphas, 11)])
        mix = gen.generate_series([MixSpec(0, (3, 7), tuple((a, 1 - a) for a in alphas), 11)])
        swapped = gen.generate_series([SeriesSpec(0, 7, 3, tuple(1 - a for a in alphas), 11)])
        other = gen.generate_series([SeriesSpec(0, 3, 7, alphas, 12)])
    assert two_way.shape == (1, 5, 16, 16, 3) and two_way.dtype == torch.uint8
    assert torch.equal(two_way, mix) and torch.equal(two_way, swapped)
    assert not torch.equal(two_way, other)


# ---------------------------------------------------------------- k = 3: plan and generation

K3 = ["mix_classes=3", "lattice=2", "steps=2", "limit=6", "series_per_shard=1"]  # 6 x 6 images


def test_k3_plan_walks_tuples_and_lattice():
    from pipeline.registry import resolve_stage_config
    from stages.generate import make_plan

    cfg = resolve_stage_config("generate", "digits", ["mix_classes=3", "lattice=2", "series_per_tuple=2"])  # fmt: skip
    plan = make_plan(cfg, 4)
    triples = [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]
    assert plan.pairs == tuple(triples) and plan.num_series == 8
    assert plan.alphas == ((0, 0, 1), (0, 0.5, 0.5), (0, 1, 0), (0.5, 0, 0.5), (0.5, 0.5, 0), (1, 0, 0))  # fmt: skip
    specs = [plan.spec(s) for s in range(8)]
    assert [s.classes for s in specs] == triples + triples  # walked in order, cycled
    sub = make_plan(resolve_stage_config("generate", "digits", ["mix_classes=3", "tuples=3"]), 10)
    assert len(sub.pairs) == 3 and list(sub.pairs) == sorted(sub.pairs)
    assert len(sub.alphas) == 36  # alphas=8 -> m = 7: C(9, 2) lattice points
    # the k-way fields stay out of a 2-way config.json
    assert "mix_classes" not in resolve_stage_config("generate", "digits", []).recorded()
    assert cfg.recorded()["mix_classes"] == 3


@pytest.mark.parametrize(
    "sets, message",
    [
        (["mixing.mix_classes=3", "mixing.pairs=2"], "use mixing.tuples=N"),
        (["pairs=2", "tuples=3"], "disagree"),  # the flat names they had
        (["mixing.alphas=4", "mixing.lattice=5"], "alphas=4 and mixing.lattice=5 disagree"),
        (["mix_classes=1"], "mix_classes"),
    ],
)
def test_contradictory_kway_settings_are_one_line_errors(sets, message):
    from core.config import ConfigError
    from pipeline.registry import resolve_stage_config

    with pytest.raises(ConfigError, match=message):
        resolve_stage_config("generate", "digits", sets)


@pytest.fixture(scope="module")
def k3_reference(kway_src, tmp_path_factory) -> Path:
    runs = _copy(kway_src, tmp_path_factory.mktemp("k3-ref"))
    with cpu_threads(1):
        return run_stage("generate", "digits", [f"out={runs}", *K3])


def test_k3_series_vertices_permutations_and_fields(kway_src, k3_reference):
    from models.generators import MixSpec

    split = load_split(k3_reference, verify=True)
    info = read_manifest(k3_reference).info
    assert info["mix_classes"] == 3 and info["lattice"] == 2 and len(info["weights"]) == 6
    assert split.images.shape == (36, 16, 16, 3)
    for meta, cls in zip(split.meta, split.labels.tolist()):
        assert len(meta["classes"]) == len(meta["weights"]) == len(meta["names"]) == 3
        assert "alpha" not in meta and abs(sum(meta["weights"]) - 1) < 1e-12
        assert cls == meta["classes"][max(range(3), key=lambda i: (meta["weights"][i], -i))]
    gen = load_generator("unet", model=kway_src / "generator", steps=2)
    for s in (0, 4):
        rows = split.meta[6 * s : 6 * s + 6]
        classes, seed = tuple(rows[0]["classes"]), rows[0]["seed"]
        weights = tuple(tuple(r["weights"]) for r in rows)
        with cpu_threads(1):  # as the reference run
            # a lattice vertex is the pure-class image of the same noise
            # (6 rows, as a shard of the reference: CPU BLAS rounds by the padded row count)
            for pos, c in ((5, classes[0]), (2, classes[1]), (0, classes[2])):
                pure = gen.generate_series([SeriesSpec(s, c, c, (1.0,) * 6, seed)])
                assert torch.equal(split.images[6 * s + pos], pure[0, 0])
            # permuting the tuple (and its weights) gives the same images
            perm = (2, 0, 1)
            again = gen.generate_series([MixSpec(s, tuple(classes[i] for i in perm), tuple(tuple(w[i] for i in perm) for w in weights), seed)])  # fmt: skip
        assert torch.equal(again[0], split.images[6 * s : 6 * s + 6])
        assert not torch.equal(split.images[6 * s + 1], split.images[6 * s + 3])
    assert (k3_reference / "preview.png").is_file()


# ---------------------------------------------------------------- annotation


def test_barycentric_recovers_known_weights_and_is_the_projection_for_k2():
    from models.annotation import project_lambda, soft_targets
    from models.simplex import barycentric, softmax_targets

    g = torch.Generator().manual_seed(0)
    for k in (2, 3, 5):
        p = torch.randn(64, k, 32, generator=g) * 3 + 10  # a large common component, as CLIP's
        w = torch.randn(64, k, generator=g)
        w[:, -1] = 1 - w[:, :-1].sum(dim=1)  # any affine weights, also outside the simplex
        f = (w.double()[:, :, None] * p.double()).sum(dim=1).float()
        lam = barycentric(f, p)
        assert torch.allclose(lam, w, atol=2e-4), (k, (lam - w).abs().max())
        assert torch.allclose(lam.sum(dim=1), torch.ones(64), atol=1e-5)
    # exact on float64 features: the unclipped least-squares coordinates
    p = torch.randn(8, 3, 16, generator=g, dtype=torch.float64)
    w = torch.softmax(torch.randn(8, 3, generator=g, dtype=torch.float64), dim=1)
    assert torch.allclose(barycentric((w[:, :, None] * p).sum(1), p).double(), w, atol=1e-7)
    # k = 2: today's projection on the line through p_a and p_b, and today's sigmoid target
    f, pa, pb = (torch.randn(100, 16, generator=g) for _ in range(3))
    lam2 = barycentric(f, torch.stack([pa, pb], dim=1))
    assert torch.allclose(lam2[:, 0], project_lambda(f, pa, pb), atol=1e-6)
    for s in (2.3, 4.0):
        t = softmax_targets(lam2, s)
        assert torch.allclose(t[:, 0], soft_targets(lam2[:, 0], s), atol=1e-6)  # σ(s(λ̂_a − ½))
        assert torch.allclose(t[:, 1], 1 - soft_targets(lam2[:, 0], s), atol=1e-6)
    with pytest.raises(ValueError, match="affinely dependent"):
        barycentric(f[:1], torch.stack([pa[:1], pb[:1], (pa[:1] + pb[:1]) / 2], dim=1))


def test_edge_monotone_share_and_spearman():
    from models.simplex import lattice_points, lattice_weights, simplex_stats

    points = lattice_points(3, 2)
    w = torch.tensor(lattice_weights(3, 2)).repeat(2, 1)
    series, positions = torch.tensor([0] * 6 + [1] * 6), torch.arange(6).repeat(2)
    assert simplex_stats(w, w, series, positions, points)["edge_monotone_share"] == 1.0
    lam = w.clone()
    lam[7] = torch.tensor([0.9, 0.05, 0.05])  # series 1, point (0, ½, ½) pulled towards class 1
    stats = simplex_stats(lam, w, series, positions, points)
    assert stats["edge_monotone_share"] == 0.5 and stats["n_series_checked"] == 2
    assert stats["spearman_lambda_weight"] < 1.0


K3_REPORT = ("annotation.json", "annotation.png", "ternary.png", "manifest.json")


@pytest.mark.parametrize("method", ["projection", "ratio", "similarity"])
def test_k3_annotate_writes_k_way_labels_and_report(kway_src, k3_reference, tmp_path, method):
    runs = _copy(kway_src, tmp_path)
    series = runs / "digits" / "series"
    shutil.copytree(k3_reference, series)
    mixed = run_stage("annotate", "digits", [f"out={runs}", *ANN, f"method={method}"])
    got = {name: _sha((mixed / name).read_bytes()) for name in K3_REPORT}
    again = _copy(kway_src, tmp_path / "again")  # the same inputs: the same report bytes
    shutil.copytree(series, again / "digits" / "series")
    rerun = run_stage("annotate", "digits", [f"out={again}", *ANN, f"method={method}"])
    assert {name: _sha((rerun / name).read_bytes()) for name in K3_REPORT} == got
    split = load_split(mixed, verify=True)
    for meta, cls in zip(split.meta, split.labels.tolist()):
        assert len(meta["classes"]) == len(meta["weights"]) == 3
        assert len(meta["lambda_hat"]) == len(meta["soft"]) == 3
        assert abs(sum(meta["weights"]) - 1) < 1e-12 and abs(sum(meta["soft"]) - 1) < 1e-5
        assert cls == meta["classes"][max(range(3), key=lambda i: (meta["soft"][i], -i))]
        if method == "ratio":
            assert meta["soft"] == meta["lambda_hat"] == pytest.approx(meta["weights"])
        if method == "projection":
            assert abs(sum(meta["lambda_hat"]) - 1) < 1e-5
            expected = torch.softmax(2.0 * torch.tensor(meta["lambda_hat"]), 0)  # s = 4
            assert torch.allclose(torch.tensor(meta["soft"]), expected, atol=1e-6)
    report = __import__("json").loads((mixed / "annotation.json").read_text())
    assert report["mix_classes"] == 3 and report["n_images"] == 36
    assert report["spearman_lambda_weight"] is not None
    assert report["n_series_checked"] == 6
    if method == "ratio":
        assert report["spearman_lambda_weight"] == pytest.approx(1.0)
        assert report["edge_monotone_share"] == 1.0
    assert (mixed / "ternary.png").is_file() and (mixed / "annotation.png").is_file()
    assert read_manifest(mixed).info["mix_classes"] == 3


# ---------------------------------------------------------------- shards and training


def test_kway_sampler_picks_the_best_member_for_y_and_a_mixed_one():
    from models.simplex import lattice_weights
    from models.training import SeriesIndex, csm_targets, interior_positions, sample_csm_members

    w = torch.tensor(lattice_weights(3, 2))  # 6 points, vertices at 0, 2, 5
    interior = interior_positions(w)
    assert interior.tolist() == [1, 3, 4]
    classes = torch.tensor([[0, 1, 2], [1, 3, 4], [0, 2, 4], [2, 3, 4]])
    g = torch.Generator().manual_seed(0)
    soft = torch.softmax(torch.randn(4, 6, 3, generator=g) * 3, dim=2)
    index = SeriesIndex(classes, 5)
    y = torch.randint(0, 5, (256,), generator=g)
    series, pos = sample_csm_members(y, index, soft, torch.Generator().manual_seed(1), interior=interior)  # fmt: skip
    assert (classes[series[:, 0]] == y[:, None]).any(dim=1).all()  # a series containing y
    for b in range(len(y)):
        col = (classes[series[b, 0]] == y[b]).nonzero().item()
        assert pos[b, 0] == soft[series[b, 0], :, col].argmax()  # its best member for y
    assert set(pos[:, 1].tolist()) == {1, 3, 4}  # a random point mixing >= 2 classes
    t = csm_targets(classes[series].flatten(0, 1), soft[series, pos].flatten(0, 1), 5)
    assert torch.allclose(t.sum(dim=1), torch.ones(512)) and t.shape == (512, 5)
    assert torch.equal(t.nonzero()[:, 1].unique(), torch.arange(5))


def test_series_index_lists_the_series_of_each_class():
    """Row c of SeriesIndex: every series containing class c, ascending, once (a class twice in
    a series counts once; ids outside the classes belong to no row), against the definition."""
    from models.training import SeriesIndex

    g = torch.Generator().manual_seed(0)
    for num_classes, n_series, k in ((5, 40, 2), (9, 60, 3), (4, 3, 2), (7, 0, 2)):
        classes = torch.randint(-1, num_classes + 1, (n_series, k), generator=g)
        index = SeriesIndex(classes, num_classes)
        for c in range(num_classes):
            rows = [s for s in range(n_series) if c in classes[s].tolist()]
            assert index.counts[c] == len(rows)
            assert index.table[c, : len(rows)].tolist() == rows
        assert index.missing() == [c for c in range(num_classes) if index.counts[c] == 0]


def _write_k3_mixed(folder: Path, real_train: Path) -> Path:
    """A small k = 3 mixed/ folder: pixel blends of real images of (c, c+1, c+2 mod 10)."""
    import numpy as np

    from models.simplex import lattice_weights, softmax_targets
    from shards.writer import ShardFolder

    split = load_split(real_train)
    names = list(split.class_names)
    first = {c: split.images[split.labels == c][0].numpy().astype(float) for c in range(10)}
    weights = lattice_weights(3, 2)
    samples = []
    for sid in range(10):
        tup = sorted({sid, (sid + 1) % 10, (sid + 2) % 10})
        for k, w in enumerate(weights):
            image = sum(w_i * first[c] for w_i, c in zip(w, tup))
            lam = [w_i + 0.05 * np.sin(sid + k + i) for i, w_i in enumerate(w)]
            soft = softmax_targets(torch.tensor([lam]), 4.0)[0].tolist()
            meta = dict(series=sid, position=k, classes=tup, names=[names[c] for c in tup],
                        weights=list(w), seed=sid, generator="blend", revision="", sampler="none",
                        steps=0, guidance=0.0, lambda_hat=lam, soft=soft)  # fmt: skip
            samples.append({"__key__": f"s{sid:07d}_{k:02d}", "png": image.round().astype(np.uint8),
                            "cls": tup[int(np.argmax(soft))], "json": meta})  # fmt: skip
    shards = ShardFolder(folder, "mixed")
    shards.write(0, samples[:30])
    shards.write(1, samples[30:])
    info = {"mix_classes": 3, "lattice": 2, "weights": [list(w) for w in weights]}
    shards.finish(2, kind="mixed", class_names=names, info=info)
    return folder


def test_csm_trains_on_k3_series(digits_root, tmp_path):
    """train reads a k = 3 mixed/ folder as written (tuples, λ̂, soft) and what it learns depends
    on the k-way targets: the stored soft labels, the generation weights (csm_targets=ratio) and
    λ̂ re-sharpened with s = 2.3 under a soft cross-entropy give three different models."""
    import json

    from safetensors.torch import load_file

    from models.simplex import lattice_weights
    from shards.datasets import check_mixed_sample, load_series_table
    from shards.reader import iter_folder

    root = tmp_path / "digits"
    shutil.copytree(digits_root / "real", root / "real")
    _write_k3_mixed(root / "mixed", root / "real" / "train")
    table = load_series_table(root / "mixed", [str(c) for c in range(10)])
    assert table.mix_classes == 3 and table.soft.shape == (10, 6, 3) and table.members == 6
    written = sorted(iter_folder(root / "mixed"), key=lambda s: (s["meta"]["series"], s["meta"]["position"]))  # fmt: skip
    for sample in written:
        check_mixed_sample(sample)  # publish's field check accepts k-way samples
    meta = [s["meta"] for s in written]
    assert table.classes.tolist() == [m["classes"] for m in meta[::6]]
    soft = torch.tensor([m["soft"] for m in meta], dtype=torch.float64)
    assert torch.allclose(table.soft.flatten(0, 1).double(), soft, atol=1e-6)
    lattice = torch.tensor(lattice_weights(3, 2), dtype=torch.float64)
    assert torch.allclose(table.alpha.double(), lattice.expand(10, 6, 3))
    weights = {}
    for name, sets in {"soft": [], "ratio": ["loss.csm.targets=ratio"], "ce": ["loss.csm.mixed_loss=ce", "loss.csm.sharpening=2.3"]}.items():  # fmt: skip
        run = run_stage("train", "digits", [f"out={tmp_path}", f"run=k3-{name}", "loss=csm", "epochs=1",
                                            "train_limit=128", "batch_size=64", *sets])  # fmt: skip
        history = json.loads((run / "metrics.json").read_text())["train"]["history"]
        assert len(history) == 1 and torch.isfinite(torch.tensor(history[0]["loss"]))
        weights[name] = load_file(str(run / "model.safetensors"))
    for x, y in (("soft", "ratio"), ("soft", "ce"), ("ratio", "ce")):
        assert any(not torch.equal(weights[x][k], weights[y][k]) for k in weights[x]), (x, y)


# ---------------------------------------------------------------- k = 3: processes, kill + rerun


def _subprocess(stage: str, cwd: Path, *launcher: str, sets=K3, popen: bool = False):
    import subprocess
    import sys

    from conftest import subprocess_env

    cmd = [sys.executable, *launcher, "-m", "pipeline", stage, "--set", "out=runs", *sets]
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    if popen:  # for conftest.kill_when
        return cmd
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _same(a: Path, b: Path) -> None:
    import json

    ta, tb = _tree(a), _tree(b)
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    assert ca | {"out": ""} == cb | {"out": ""}
    assert [k for k in ta.keys() | tb.keys() if k != "config.json" and ta.get(k) != tb.get(k)] == []


TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.mark.slow
def test_k3_two_processes_byte_identical(kway_src, k3_reference, tmp_path):
    """The tier checks the same at k = 2 (test_generate.py::test_two_processes_byte_identical):
    which rank draws which shard does not depend on k, and k = 3's bytes stay checked in
    the tier in this process (test_k3_series_vertices_permutations_and_fields)."""
    _copy(kway_src, tmp_path / "runs")
    proc = _subprocess("generate", tmp_path, *TORCHRUN)
    assert "2 process(es)" in proc.stderr
    _same(k3_reference, tmp_path / "runs" / "digits" / "series")


@pytest.mark.slow
def test_k3_kill_and_rerun_is_byte_identical(kway_src, k3_reference, tmp_path, monkeypatch):
    """The tier checks the same at k = 2
    (test_generate.py::test_kill_and_rerun_is_byte_identical):
    a resume skips complete shards whatever k is."""
    from conftest import kill_when, shards_done

    _copy(kway_src, tmp_path / "runs")
    cmd = _subprocess("generate", tmp_path, popen=True)  # the command, run by the harness
    kill_when(cmd, shards_done(tmp_path / "runs" / "digits" / "series", 2), cwd=tmp_path)
    series = tmp_path / "runs" / "digits" / "series"
    assert not (series / "manifest.json").exists(), "the kill came too late to test resume"
    # the rerun in-process: the same argv through pipeline.cli.main (all pipeline/__main__.py
    # runs) from the same cwd, on the one thread the killed process had from OMP_NUM_THREADS=1
    monkeypatch.chdir(tmp_path)
    with cpu_threads(1):
        assert main(cmd[3:]) == 0
    _same(k3_reference, series)


@pytest.mark.slow
def test_k3_annotate_two_processes_byte_identical(kway_src, k3_reference, tmp_path):
    """The tier checks the same at k = 2
    (test_annotate.py::test_two_processes_write_the_same_bytes), and k = 3's annotation
    bytes in this process (test_k3_annotate_writes_k_way_labels_and_report)."""
    one = _copy(kway_src, tmp_path / "one")
    shutil.copytree(k3_reference, one / "digits" / "series")
    with cpu_threads(1):
        mixed = run_stage("annotate", "digits", [f"out={one}", *ANN])
    _copy(kway_src, tmp_path / "runs")
    shutil.copytree(k3_reference, tmp_path / "runs" / "digits" / "series")
    _subprocess("annotate", tmp_path, *TORCHRUN, sets=ANN)
    _same(mixed, tmp_path / "runs" / "digits" / "mixed")
