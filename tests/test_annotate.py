"""annotate stage: series/ + real/train -> mixed/ (λ̂, soft labels, prototypes, report, resume, ranks).

The series here are pixel blends of real digits (K = 4, α = 0, 1/3, 2/3, 1), written in the
series/ format of docs/architecture.md; the encoder is a digits-cnn trained for a few steps and
saved as runs/digits/train/encoder/ through shards.runs, as the train stage does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import kill_when, shards_done, snapshot, subprocess_env, tiny_openclip
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from core.launch import cpu_threads
from core.plots import image_grid
from models.annotation import class_prototypes, project_lambda, soft_targets, text_prototypes
from models.classifiers import DigitsCNN, build_classifier
from models.encoders import ModuleFeatureEncoder, OpenCLIPEncoder
from pipeline.cli import main
from pipeline.registry import run_stage
from shards.manifest import manifest_digest, read_manifest, write_manifest
from shards.reader import load_split
from shards.runs import save_weights
from shards.writer import ShardFolder

K, N_SERIES, PER_SHARD = 4, 48, 1  # 48 series shards of 4 images: a kill lands mid-run
ALPHAS = [k / (K - 1) for k in range(K)]
TINY_CLIP = "semix-annotate-tiny-clip"
SUBPROCESS_SETS = ["out=runs", "batch_size=4"]


# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.xdist_group("annotate")]


def _env() -> dict[str, str]:
    return {**subprocess_env(), "OMP_NUM_THREADS": "1"}


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _train_encoder(root: Path) -> None:
    """digits-cnn, 30 Adam steps on real/train: enough for features that separate the digits."""
    train = load_split(root / "real" / "train")
    x = train.images.permute(0, 3, 1, 2).float() / 255
    mean, std = x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3))
    x = (x - mean[:, None, None]) / std[:, None, None]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_classifier("digits-cnn", 10)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        idx = torch.randint(0, len(x), (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), train.labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    meta = {
        "arch": model.arch_config(),
        "class_names": list(train.class_names),
        "image_size": 16,
        "normalize": {"mean": mean.tolist(), "std": std.tolist()},
    }
    save_weights(root / "train" / "encoder", model.state_dict(), meta)


def _write_series(root: Path) -> None:
    """series/: N_SERIES pixel-blend series of real digits, PER_SHARD series per shard."""
    real = root / "real" / "train"
    train = load_split(real)
    names = train.class_names
    g = torch.Generator().manual_seed(1)
    folder = ShardFolder(root / "series", prefix="series")
    grid = []
    for shard in range(N_SERIES // PER_SHARD):
        samples = []
        for sid in range(shard * PER_SHARD, (shard + 1) * PER_SHARD):
            a, b = torch.randperm(10, generator=g)[:2].tolist()
            pick = [
                torch.nonzero(train.labels == c).flatten()[torch.randint(0, 50, (1,), generator=g)]
                for c in (a, b)
            ]
            x_a, x_b = (train.images[int(p)].float() for p in pick)
            row = []
            for k, alpha in enumerate(ALPHAS):
                image = (alpha * x_a + (1 - alpha) * x_b).round().to(torch.uint8).numpy()
                row.append(image)
                meta = {
                    "series": sid,
                    "position": k,
                    "classes": [a, b],
                    "names": [names[a], names[b]],
                    "alpha": alpha,
                    "seed": sid,
                    "generator": "pixel-blend",
                    "revision": None,
                    "sampler": "none",
                    "steps": 0,
                    "guidance": 0.0,
                }
                cls = a if alpha >= 0.5 else b
                samples.append(
                    {"__key__": f"s{sid:07d}_{k:02d}", "png": image, "cls": cls, "json": meta}
                )
            grid.append(row)
        folder.write(shard, samples)
    image_grid(np.stack(grid[:8]), root / "series" / "preview.png")
    folder.finish(
        N_SERIES // PER_SHARD,
        kind="series",
        class_names=names,
        upstream={"real": manifest_digest(real)},
        info={"generator": {"backend": "pixel-blend"}, "alphas": ALPHAS, "num_series": N_SERIES},
    )


@pytest.fixture(scope="module")
def source_root(digits_root, tmp_path_factory) -> Path:
    """runs/digits/ with real/, train/encoder/ and series/ (read-only: tests copy it)."""
    root = tmp_path_factory.mktemp("annotate-src") / "digits"
    shutil.copytree(digits_root / "real", root / "real")
    _train_encoder(root)
    _write_series(root)
    return root


@pytest.fixture
def runs(source_root, tmp_path) -> Path:
    """A writable copy: tmp_path/runs/digits/."""
    shutil.copytree(source_root, tmp_path / "runs" / "digits")
    return tmp_path / "runs"


def _annotate(runs: Path, *sets: str) -> Path:
    return run_stage("annotate", "digits", [f"out={runs}", "batch_size=16", "workers=0", *sets])


def _direct_encoder(root: Path) -> ModuleFeatureEncoder:
    state = load_file(str(root / "train" / "encoder" / "model.safetensors"))
    meta = json.loads((root / "train" / "encoder" / "model.json").read_text())
    model = build_classifier("digits-cnn", 10)
    model.load_state_dict(state)
    norm = meta["normalize"]
    return ModuleFeatureEncoder(model, 16, norm["mean"], norm["std"], {}, device="cpu")


# -- the projection stage output ---------------------------------------------------------------


def test_projection_output_matches_direct_computation(runs):
    root = runs / "digits"
    mixed = _annotate(runs, "workers=2")  # worker processes read + decode the series
    series, out = load_split(root / "series"), load_split(mixed, verify=True)
    # same keys and images, PNG bytes passed through: tar members identical but json/cls
    assert out.keys == series.keys and torch.equal(out.images, series.images)
    # prototypes = per-class mean of the unnormalised features of every real training image
    encoder = _direct_encoder(root)
    real = load_split(root / "real" / "train")
    protos = load_file(str(mixed / "prototypes.safetensors"))["prototypes"]
    expected = class_prototypes(encoder.encode(real.images), real.labels, 10)
    torch.testing.assert_close(protos, expected, atol=1e-5, rtol=1e-5)
    # λ̂ and soft from the stored prototypes and a direct encoder call (docs/methods.md §2)
    f = encoder.encode(series.images)
    a = torch.tensor([m["classes"][0] for m in series.meta])
    b = torch.tensor([m["classes"][1] for m in series.meta])
    lam = torch.tensor([m["lambda_hat"] for m in out.meta])
    torch.testing.assert_close(lam, project_lambda(f, protos[a], protos[b]), atol=1e-5, rtol=1e-5)
    t_a = torch.tensor([m["soft"][0] for m in out.meta])
    torch.testing.assert_close(t_a, soft_targets(lam, 4.0), atol=1e-6, rtol=0)
    for s, m, cls in zip(series.meta, out.meta, out.labels.tolist()):
        assert {k: m[k] for k in s} == s and set(m) == {*s, "lambda_hat", "soft"}
        assert m["soft"][0] + m["soft"][1] == pytest.approx(1.0)
        assert cls == (s["classes"][0] if m["soft"][0] >= 0.5 else s["classes"][1])
    # λ̂ follows α on blends of real digits (the encoder is meaningful), α = 1 lands near 1
    report = json.loads((mixed / "annotation.json").read_text())
    assert report["spearman_lambda_alpha"] > 0.7 and report["n_images"] == N_SERIES * K
    assert report["method"] == "projection" and report["sharpening"] == 4.0
    ends = [m["lambda_hat"] for m in out.meta if m["alpha"] == 1.0]
    starts = [m["lambda_hat"] for m in out.meta if m["alpha"] == 0.0]
    assert np.mean(ends) > 0.6 and np.mean(starts) < 0.4
    # manifest: series info + annotation, upstream digests; preview copied, plot written
    manifest = read_manifest(mixed)
    assert manifest.kind == "mixed" and manifest.num_samples == N_SERIES * K
    assert manifest.upstream == {
        "series": manifest_digest(root / "series"),
        "real": manifest_digest(root / "real" / "train"),
    }
    series_m = read_manifest(root / "series")
    ann = manifest.info.pop("annotation")
    assert manifest.info == series_m.info
    assert (
        ann["method"] == "projection" and ann["prototypes"] == "real" and ann["sharpening"] == 4.0
    )
    assert ann["encoder"]["kind"] == "module" and ann["encoder"]["run"] == "encoder"
    assert (mixed / "preview.png").read_bytes() == (root / "series" / "preview.png").read_bytes()
    assert (mixed / "annotation.png").read_bytes()[:4] == b"\x89PNG"
    proto_meta = json.loads((mixed / "prototypes.json").read_text())
    assert proto_meta["key"]["encoder"] == ann["encoder"] and sum(proto_meta["counts"]) == len(real)


def test_train_limit_takes_the_prototypes_from_the_first_n_training_images(runs):
    """A fair study's annotation sees only the labelled images its classifiers see: with
    train_limit=N the prototypes are the class means over the first N of real/train (the
    images train's train_limit=N reads); config.json records the field only when set."""
    root = runs / "digits"
    mixed = _annotate(runs, "train_limit=300")
    real = load_split(root / "real" / "train")
    encoder = _direct_encoder(root)
    protos = load_file(str(mixed / "prototypes.safetensors"))["prototypes"]
    expected = class_prototypes(encoder.encode(real.images[:300]), real.labels[:300], 10)
    torch.testing.assert_close(protos, expected, atol=1e-5, rtol=1e-5)
    everything = class_prototypes(encoder.encode(real.images), real.labels, 10)
    assert not torch.allclose(protos, everything, atol=1e-3)
    meta = json.loads((mixed / "prototypes.json").read_text())
    assert meta["key"]["train_limit"] == 300 and sum(meta["counts"]) == 300
    assert json.loads((mixed / "config.json").read_text())["train_limit"] == 300
    shutil.rmtree(mixed)
    plain = _annotate(runs)
    assert "train_limit" not in json.loads((plain / "config.json").read_text())
    assert "train_limit" not in json.loads((plain / "prototypes.json").read_text())["key"]


def test_png_bytes_pass_through(runs):
    import tarfile

    root = runs / "digits"
    mixed = _annotate(runs, "method=ratio")
    for i in (0, 7):
        with (
            tarfile.open(root / "series" / f"series-{i:06d}.tar") as s,
            tarfile.open(mixed / f"mixed-{i:06d}.tar") as m,
        ):
            s_png = {x.name: s.extractfile(x).read() for x in s if x.name.endswith(".png")}
            m_png = {x.name: m.extractfile(x).read() for x in m if x.name.endswith(".png")}
            assert s_png == m_png and len(s_png) == PER_SHARD * K
    out = load_split(mixed)
    # ratio: no re-annotation, t_a = α, and no encoder or prototypes involved
    t_a = [m["soft"][0] for m in out.meta]
    assert t_a == pytest.approx([m["alpha"] for m in out.meta], abs=1e-7)  # float32, as every λ̂
    assert read_manifest(mixed).info["annotation"]["encoder"] is None
    assert not (mixed / "prototypes.safetensors").exists()


# -- each image encoded once; prototypes reused or recomputed ------------------------------------


def test_each_image_encoded_once_and_prototypes_reused(runs, monkeypatch):
    counted = []
    original = DigitsCNN.forward_features

    def counting(self, x):
        counted.append(x.shape[0])
        return original(self, x)

    monkeypatch.setattr(DigitsCNN, "forward_features", counting)
    root = runs / "digits"
    n_real = read_manifest(root / "real" / "train").num_samples
    # the fidelity check (fidelity_run=encoder) classifies real/test and both endpoints of every
    # series once more, each image once, whenever the report is made
    fidelity = read_manifest(root / "real" / "test").num_samples + 2 * N_SERIES
    mixed = _annotate(runs)
    assert sum(counted) == n_real + N_SERIES * K + fidelity
    first = _tree_bytes(mixed)

    counted.clear()  # rerun: prototypes reused, every shard complete -> nothing encoded
    _annotate(runs)
    assert sum(counted) == 0 and _tree_bytes(mixed) == first

    # a run interrupted before shard 5 and the manifest: only that shard is redone
    (mixed / ".done" / "mixed-000005.json").unlink()
    (mixed / "manifest.json").unlink()
    _annotate(runs)
    assert sum(counted) == PER_SHARD * K + fidelity and _tree_bytes(mixed) == first

    # a retrained encoder (same run name, new weights): prototypes and every shard recomputed
    counted.clear()
    state = load_file(str(root / "train" / "encoder" / "model.safetensors"))
    meta = json.loads((root / "train" / "encoder" / "model.json").read_text())
    state = {k: v * 1.01 if v.is_floating_point() else v for k, v in state.items()}
    save_weights(root / "train" / "encoder", state, meta)
    _annotate(runs)
    assert sum(counted) == n_real + N_SERIES * K + fidelity
    old = load_safetensors(first["prototypes.safetensors"])["prototypes"]
    assert load_file(str(mixed / "prototypes.safetensors"))["prototypes"].ne(old).any()
    assert (
        read_manifest(mixed).info["annotation"]["encoder"]["weights_sha256"]
        != json.loads(first["manifest.json"])["info"]["annotation"]["encoder"]["weights_sha256"]
    )


# -- text prototypes with a tiny OpenCLIP --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_openclip_file(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("openclip")
    model = tiny_openclip(folder, TINY_CLIP)
    save_file(model.state_dict(), folder / "tiny.safetensors")
    return folder / "tiny.safetensors"


def test_text_prototypes_with_tiny_openclip(runs, tiny_openclip_file):
    root = runs / "digits"
    templates = ("a photo of the digit {}.", "a handwritten {}")
    mixed = _annotate(
        runs,
        "encoder=openclip",
        f"encoder.openclip.model={TINY_CLIP}",
        f"encoder.openclip.pretrained={tiny_openclip_file}",
        "prototypes=text",
        "text_templates=" + ",".join(templates),
    )
    encoder = OpenCLIPEncoder(TINY_CLIP, str(tiny_openclip_file), device="cpu")
    names = read_manifest(root / "series").class_names
    protos = load_file(str(mixed / "prototypes.safetensors"))["prototypes"]
    torch.testing.assert_close(
        protos, text_prototypes(encoder, names, templates), atol=1e-5, rtol=1e-5
    )
    series, out = load_split(root / "series"), load_split(mixed)
    a = torch.tensor([m["classes"][0] for m in series.meta])
    b = torch.tensor([m["classes"][1] for m in series.meta])
    expected = project_lambda(encoder.encode(series.images), protos[a], protos[b])
    lam = torch.tensor([m["lambda_hat"] for m in out.meta])
    torch.testing.assert_close(lam, expected, atol=1e-4, rtol=1e-4)
    manifest = read_manifest(mixed)
    assert manifest.info["annotation"]["prototypes"] == "text"
    assert manifest.info["annotation"]["text_templates"] == list(templates)
    assert manifest.info["annotation"]["encoder"]["kind"] == "openclip"
    assert "real" not in manifest.upstream  # no real image was needed


# -- processes and resume (subprocesses) ---------------------------------------------------------


def _cmd(*launcher: str) -> list[str]:
    return [
        *launcher,
        "-m",
        "pipeline",
        "annotate",
        "--preset",
        "digits",
        "--set",
        *SUBPROCESS_SETS,
    ]


def _workdir(source_root: Path, path: Path) -> Path:
    shutil.copytree(source_root, path / "runs" / "digits")
    return path


def _annotate_here(cwd: Path) -> None:
    """_cmd() run in this process: the same argv through pipeline.cli.main (all
    pipeline/__main__.py runs), from the same cwd, on the one torch thread that the
    subprocesses get from OMP_NUM_THREADS=1 (_env)."""
    with contextlib.chdir(cwd), cpu_threads(1):
        assert main(_cmd()[2:]) == 0


@pytest.fixture(scope="module")
def reference(source_root, tmp_path_factory) -> dict[str, bytes]:
    """mixed/ of one plain single-process run (in-process: _annotate_here)."""
    cwd = _workdir(source_root, tmp_path_factory.mktemp("single"))
    _annotate_here(cwd)
    return _tree_bytes(cwd / "runs" / "digits" / "mixed")


def test_two_processes_write_the_same_bytes(reference, source_root, tmp_path):
    cwd = _workdir(source_root, tmp_path)
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
    ]
    result = subprocess.run(_cmd(*launcher), cwd=cwd, env=_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 process(es)" in result.stderr  # both ranks took part
    mixed = _tree_bytes(cwd / "runs" / "digits" / "mixed")
    assert sorted(mixed) == sorted(reference)
    assert mixed == reference


def test_kill_and_rerun_is_byte_identical(reference, source_root, tmp_path):
    cwd = _workdir(source_root, tmp_path)
    env = _env()
    kill_when(
        _cmd(sys.executable), shards_done(cwd / "runs" / "digits" / "mixed", 3), cwd=cwd, env=env
    )
    mixed = cwd / "runs" / "digits" / "mixed"
    assert not (mixed / "manifest.json").exists(), "the kill came too late to test resume"
    _annotate_here(cwd)  # the rerun; the killed run was a real process
    assert _tree_bytes(mixed) == reference


# -- bad input: one clear line, non-zero exit, nothing written ------------------------------------


def _fails(capsys, runs: Path, *sets: str, code: int = 1) -> str:
    rc = main(["annotate", "--preset", "digits", "--set", f"out={runs}", *sets])
    err = capsys.readouterr().err
    assert rc == code and err.count("\n") == 1, err
    assert not (runs / "digits" / "mixed" / "manifest.json").exists()
    return err


def test_bad_input_is_refused_with_one_line(runs, capsys, monkeypatch, tmp_path):
    root = runs / "digits"
    assert "encoder.classifier.run=nope" in _fails(capsys, runs, "encoder.classifier.run=nope")
    assert "needs an encoder with a text tower" in _fails(capsys, runs, "prototypes=text", code=2)
    assert "annotator='mixup'" in _fails(capsys, runs, "annotator=mixup", code=2)
    # OpenCLIP tag that is not cached, offline
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    err = _fails(capsys, runs, "encoder=openclip", f"encoder.openclip.cache={tmp_path / 'cache'}")
    assert "ViT-B-32/openai" in err and "encoder.pretrained=" in err
    # missing checkpoint file of the encoder run
    (root / "train" / "encoder" / "model.safetensors").unlink()
    assert "no trained weights" in _fails(capsys, runs)
    # empty series folder
    empty = tmp_path / "empty-series"
    ShardFolder(empty, "series").finish(0, kind="series", class_names=list("0123456789"))
    assert "holds no series" in _fails(capsys, runs, f"series={empty}", "method=ratio")
    # series and real with different class lists
    manifest = read_manifest(root / "series")
    write_manifest(root / "series", dataclasses.replace(manifest, class_names=tuple("abcdefghij")))
    assert "class lists differ" in _fails(capsys, runs)
    # incomplete series folder (no manifest)
    (root / "series" / "manifest.json").unlink()
    assert "incomplete" in _fails(capsys, runs, "method=ratio")
    assert not (root / "mixed").exists()


def test_complete_annotate_rerun_on_read_only_copy(runs, read_only):
    mixed = _annotate(runs)
    before = snapshot(runs)
    read_only(runs)
    with pytest.raises(OSError, match="Read-only"):  # the guard works
        (mixed / "probe").write_text("x")
    assert _annotate(runs) == mixed  # complete: only reads
    assert snapshot(runs) == before
