"""generate stage: the plan, the series/ format, shared noise, determinism (batch size, processes,
kill + rerun), bad images and one-line errors. Tiny random-weight models saved to tmp_path and
loaded back: a unet in the generator/ format of fit-generator, sd and dit pipelines.

CPU bytes depend on the number of intra-op threads (oneDNN picks its 1x1-convolution kernel by
it), so every run compared here uses one thread per process, as torchrun sets by default.
"""

from __future__ import annotations

import json
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    REFERENCE_SERIES,
    kill_when,
    shards_done,
    snapshot,
    subprocess_env,
    tiny_vae,
)
from diffusers import (
    DDIMScheduler,
    DiTPipeline,
    DiTTransformer2DModel,
    StableDiffusionPipeline,
    UNet2DConditionModel,
    UNet2DModel,
)
from PIL import Image
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from core.io import sha256_file
from core.launch import cpu_threads
from core.seeding import derive_seed
from models.generators import NonFiniteImageError, SeriesSpec, load_generator
from pipeline.cli import main
from pipeline.registry import resolve_stage_config, run_stage
from shards.manifest import manifest_digest, read_manifest
from shards.reader import load_split
from stages.generate import GenerationError, Generators, make_plan, sample_series

# One worker runs the whole module, so its module fixtures are built once (make test:
# --dist loadgroup).
pytestmark = pytest.mark.xdist_group("generate")

CONFIG = REFERENCE_SERIES  # conftest's generated_reference: 24 series of K = 4 in 12 shards
FIELDS = {"series", "position", "classes", "names", "alpha", "seed", "generator", "revision"}
FIELDS |= {"sampler", "steps", "guidance"}


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


def _same_folder(a: Path, b: Path) -> None:
    """Byte-identical series folders, config.json aside from `out`."""
    ta, tb = _tree(a), _tree(b)
    ca, cb = (json.loads(t.pop("config.json")) for t in (ta, tb))
    assert ca | {"out": ""} == cb | {"out": ""}
    assert ta.keys() == tb.keys()
    assert [k for k in ta if ta[k] != tb[k]] == []


@pytest.fixture(scope="module")
def src(generator_root) -> Path:
    """A runs folder with digits/real and a random-weight digits/generator in fit-generator's
    format (conftest's generator_root, shared with other modules; read-only: tests copy it)."""
    return generator_root.parent


def _runs(src: Path, dest: Path, generator: bool = True) -> Path:
    shutil.copytree(src / "digits" / "real", dest / "digits" / "real")
    if generator:
        shutil.copytree(src / "digits" / "generator", dest / "digits" / "generator")
    return dest


@pytest.fixture(scope="module")
def reference(generated_reference) -> Path:
    """The uninterrupted single-process run every determinism test compares with (conftest's
    generated_reference: CONFIG from src, one thread; shared with test_multinode)."""
    return generated_reference


def test_plan_walks_pairs_cycles_and_seeds():
    cfg = resolve_stage_config("generate", "digits", ["series_per_pair=2", "alphas=4"])
    plan = make_plan(cfg, 4)
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert plan.pairs == tuple(pairs) and plan.num_series == 12
    assert plan.alphas == (0.0, 1 / 3, 2 / 3, 1.0)
    specs = [plan.spec(s) for s in range(12)]
    assert [(s.class_a, s.class_b) for s in specs] == pairs + pairs  # walked in order, cycled
    assert [s.series_id for s in specs] == list(range(12))
    assert [s.seed for s in specs] == [derive_seed(0, "series", s) for s in range(12)]
    assert len({s.seed for s in specs}) == 12
    # auto shards: >= min_shards (16) where the budget allows, whole series, ids in order
    assert plan.series_per_shard == 1 and plan.num_shards == 12
    big = make_plan(resolve_stage_config("generate", "digits", ["series_per_pair=100"]), 10)
    assert big.num_series == 4500 and big.series_per_shard == 125  # 1000 images of K = 8
    assert [s for i in range(big.num_shards) for s in big.shard_series(i)] == list(range(4500))
    # limit = a prefix of the same plan; pairs=N a seeded subset, kept in walk order
    short = make_plan(resolve_stage_config("generate", "digits", ["limit=5", "alphas=4"]), 4)
    assert short.num_series == 5 and short.spec(4) == plan.spec(4)
    sub = [make_plan(resolve_stage_config("generate", "digits", ["pairs=3", f"seed={s}"]), 10) for s in (0, 0, 1)]  # fmt: skip
    assert sub[0].pairs == sub[1].pairs != sub[2].pairs
    assert len(sub[0].pairs) == 3 and list(sub[0].pairs) == sorted(sub[0].pairs)
    with pytest.raises(GenerationError, match=r"^mixing\.pairs=7: only 6 pairs"):
        make_plan(resolve_stage_config("generate", "digits", ["pairs=7"]), 4)


def test_plans_number_their_class_tuples():
    """The plan computes each tuple from its position (models.simplex.ClassTuples) instead of
    listing them: the very tuples, order and seeded subsets of the listed walk, at ImageNet size
    too (bench/RESULTS.md has its time and memory)."""
    from itertools import combinations

    from core.seeding import make_generator
    from models.simplex import ClassTuples, rank_tuple

    g = torch.Generator().manual_seed(0)
    for n, k in ((1000, 2), (60, 3), (12, 5)):
        every = list(combinations(range(n), k))
        tuples = ClassTuples(n, k)
        assert len(tuples) == len(every) and tuples[-1] == every[-1]
        for r in [0, *torch.randint(0, len(every), (500,), generator=g).tolist()]:
            assert tuples[r] == every[r] and tuples.index(every[r]) == r
        assert list(tuples) == every and every[1] in tuples and (0,) * k not in tuples
    plan = make_plan(resolve_stage_config("generate", "imagenet"), 1000)
    assert len(plan.pairs) == plan.num_series == 499_500 and plan.num_shards == 3_996
    spec = plan.spec(499_499)
    assert (spec.class_a, spec.class_b) == (998, 999) and spec.seed == derive_seed(
        0, "series", 499_499
    )
    # a seeded subset draws what the listed walk drew
    sub = make_plan(resolve_stage_config("generate", "imagenet", ["pairs=500", "seed=3"]), 1000)
    pick = torch.randperm(499_500, generator=make_generator(3, "pairs"))[:500].tolist()
    every = list(combinations(range(1000), 2))
    assert list(sub.pairs) == [every[i] for i in sorted(pick)] and sub.num_series == 500
    # k = 3 over 1,000 classes: 166,167,000 triples, in lexicographic order, never listed
    k3 = make_plan(
        resolve_stage_config("generate", "imagenet", ["mix_classes=3", "lattice=2"]), 1000
    )
    assert len(k3.pairs) == 166_167_000 and k3.pairs[-1] == (997, 998, 999)
    for r in torch.randint(0, 166_167_000 - 1, (500,), generator=g).tolist():
        a, b = k3.pairs[r], k3.pairs[r + 1]
        assert a < b and rank_tuple(a, 1000) == r and 0 <= a[0] < a[1] < a[2] < 1000


def test_series_folder(src, reference):
    gen_folder = src / "digits" / "generator"
    manifest = read_manifest(reference)
    assert manifest.kind == "series" and manifest.num_samples == 96 and len(manifest.shards) == 12
    assert all(s.count == 8 for s in manifest.shards)
    assert manifest.upstream == {
        "real": manifest_digest(src / "digits" / "real" / "train"),
        "generator": manifest_digest(gen_folder),
    }
    sha = read_manifest(gen_folder).info["weights_sha256"]
    info = manifest.info
    assert info["generator"] | {"dtype": "?"} == {
        "backend": "unet", "model_id": "digits/generator", "revision": sha, "sampler": "ddim",
        "steps": 6, "guidance": 1.0, "license": "", "dtype": "?",
    }  # fmt: skip
    assert info["alphas"] == [0.0, 1 / 3, 2 / 3, 1.0] and info["num_series"] == 24
    assert info["num_pairs"] == 45 and info["image_size"] == 16 and info["series_per_pair"] == 6
    split = load_split(reference, verify=True)
    assert split.images.shape == (96, 16, 16, 3)
    names = list("0123456789")
    for i, (key, meta, cls) in enumerate(zip(split.keys, split.meta, split.labels.tolist())):
        s, k = divmod(i, 4)
        a, b = [(a, b) for a in range(10) for b in range(a + 1, 10)][s]
        assert key == f"s{s:07d}_{k:02d}" and set(meta) == FIELDS
        assert meta["series"] == s and meta["position"] == k and meta["classes"] == [a, b]
        assert meta["names"] == [names[a], names[b]] and meta["alpha"] == info["alphas"][k]
        assert meta["seed"] == derive_seed(0, "series", s) and meta["revision"] == sha
        assert meta["generator"] == "unet:digits/generator" and meta["steps"] == 6
        assert cls == (a if meta["alpha"] >= 0.5 else b)
    # preview: 8 series (rows) x 4 alphas, 16px tiles scaled x4, alpha labels on top
    with Image.open(reference / "preview.png") as im:
        assert im.size[1] == 14 + 2 + 8 * 66
    # shared noise: α=1 of (a, b) == α=0 of (b, a) == the pure class-a image, same seed
    gen = load_generator("unet", model=gen_folder, steps=6)
    for s in (0, 13):
        meta = split.meta[4 * s]
        a, b = meta["classes"]
        with cpu_threads(1):  # as the reference run
            swapped = gen.generate_series(
                [SeriesSpec(s, b, a, tuple(info["alphas"]), meta["seed"])]
            )
            pure = gen.generate_series([SeriesSpec(s, a, a, (1.0,), meta["seed"])])
        assert torch.equal(split.images[4 * s + 3], swapped[0, 0])
        assert torch.equal(split.images[4 * s + 3], pure[0, 0])
        assert torch.equal(split.images[4 * s], swapped[0, 3])
        assert not torch.equal(split.images[4 * s + 1], split.images[4 * s + 2])


def test_bytes_do_not_depend_on_batch_size(src, reference, tmp_path):
    _runs(src, tmp_path)
    for bs in (1, 7):
        sets = [f"out={tmp_path}", *CONFIG[:2], "limit=2", "series_per_shard=2", f"batch_size={bs}"]
        with cpu_threads(1):
            out = run_stage("generate", "digits", sets)
        name = "series-000000.tar"
        assert (out / name).read_bytes() == (reference / name).read_bytes(), bs
        shutil.rmtree(out)


def _generate_cmd(*launcher: str) -> list[str]:
    return [sys.executable, *launcher, "-m", "pipeline", "generate", "--set", "out=runs", *CONFIG]


def _generate_here(cwd: Path, monkeypatch) -> None:
    """_generate_cmd() run in this process: the same argv through pipeline.cli.main (all
    pipeline/__main__.py runs), from the same cwd, on the one torch thread that the
    subprocess gets from OMP_NUM_THREADS=1 (and `reference` is made with)."""
    monkeypatch.chdir(cwd)
    with cpu_threads(1):
        assert main(_generate_cmd()[3:]) == 0


def test_two_processes_byte_identical(src, reference, tmp_path):
    _runs(src, tmp_path / "runs")
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(_generate_cmd(*torchrun), cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 process(es)" in proc.stderr
    _same_folder(reference, tmp_path / "runs" / "digits" / "series")


def test_kill_and_rerun_is_byte_identical(src, reference, tmp_path, monkeypatch):
    """The killed run is a real process; the rerun is in-process (_generate_here)."""
    _runs(src, tmp_path / "runs")
    env = subprocess_env() | {"OMP_NUM_THREADS": "1"}
    series = tmp_path / "runs" / "digits" / "series"
    kill_when(_generate_cmd(), shards_done(series, 3), cwd=tmp_path, env=env)
    series = tmp_path / "runs" / "digits" / "series"
    assert not (series / "manifest.json").exists(), "the kill came too late to test resume"
    _generate_here(tmp_path, monkeypatch)
    _same_folder(reference, series)


# ---------------------------------------------------------------- bad images, one-line errors


class FakeGenerator:
    """Series images from the seed; chosen series come out non-finite or blank."""

    def __init__(self, nonfinite=(), blank=()):
        self.nonfinite, self.blank = set(nonfinite), set(blank)

    def generate_series(self, specs, progress=None):
        g = torch.Generator().manual_seed(1)
        out = torch.stack([torch.randint(0, 256, (2, 4, 4, 3), generator=g.manual_seed(s.seed), dtype=torch.uint8) for s in specs])  # fmt: skip
        for i, s in enumerate(specs):
            if s.series_id in self.blank | self.nonfinite:
                out[i] = 0
        bad = [s.series_id for s in specs if s.series_id in self.nonfinite]
        if bad:
            raise NonFiniteImageError(bad, out)
        return out


def _gens(dtype: str, low: FakeGenerator, fp32: FakeGenerator) -> Generators:
    gens = Generators("unet", {}, dtype)
    gens._loaded = {dtype: low, "float32": fp32} if dtype != "float32" else {"float32": fp32}
    return gens


def test_bad_series_are_redone_in_float32_or_named():
    specs = [SeriesSpec(i, 0, 1, (0.0, 1.0), seed=i) for i in range(4)]
    clean = FakeGenerator().generate_series(specs)
    fixed = sample_series(_gens("bfloat16", FakeGenerator({1}, {2}), FakeGenerator()), specs)
    assert torch.equal(fixed, clean)
    with pytest.raises(GenerationError, match=r"non-finite pixels in series \[1\]; blank .* \[2\]"):
        sample_series(_gens("bfloat16", FakeGenerator({1}, {2}), FakeGenerator({1}, {2})), specs)
    with pytest.raises(GenerationError, match=r"^blank \(constant\) images in series \[3\]"):
        sample_series(_gens("float32", None, FakeGenerator(blank={3})), specs)


def _fails(capsys, *argv: str) -> str:
    code = main(["generate", "--set", *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("semix generate: error:")]
    assert code == 1 and len(lines) == 1, err  # the plan may be logged before it
    return lines[0]


def test_one_line_errors(src, tmp_path, capsys):
    runs = _runs(src, tmp_path, generator=False)
    err = _fails(capsys, f"out={runs}", *CONFIG)
    assert "no trained generator" in err and "fit-generator --preset digits" in err
    err = _fails(capsys, f"out={runs}", "backend=sd", "model=nobody/no-such-model", "guidance=7")
    assert "'nobody/no-such-model'" in err and "model=<a local save_pretrained folder>" in err
    assert not (runs / "digits" / "series").exists()  # nothing written: a rerun is not refused
    # a generator whose weights give NaN: the series are named, nothing is written
    shutil.copytree(src / "digits" / "generator", runs / "digits" / "generator")
    unet = UNet2DModel.from_pretrained(runs / "digits" / "generator" / "unet")
    with torch.no_grad():
        unet.conv_out.bias.fill_(float("nan"))
    unet.save_pretrained(runs / "digits" / "generator" / "unet")
    weights = runs / "digits" / "generator" / "unet" / "diffusion_pytorch_model.safetensors"
    err = _fails(capsys, f"out={runs}", *CONFIG)  # weights changed behind the manifest: refused
    assert str(weights) in err and "rerun fit-generator" in err
    manifest = runs / "digits" / "generator" / "manifest.json"  # now a consistent NaN generator
    data = json.loads(manifest.read_text())
    data["info"]["weights_sha256"] = sha256_file(weights)
    manifest.write_text(json.dumps(data))
    err = _fails(capsys, f"out={runs}", *CONFIG)
    assert "non-finite pixels in series [0, 1]" in err
    assert not list((runs / "digits" / "series").glob("*.tar"))


# ---------------------------------------------------------------- sd and dit end to end


def _save_sd(folder: Path) -> None:
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for token in [c + sfx for sfx in ("", "</w>") for c in string.ascii_lowercase + string.digits]:
        vocab[token] = len(vocab)
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=16)  # fmt: skip
    text = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_hidden_layers=1, max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))  # fmt: skip
    unet = UNet2DConditionModel(
        sample_size=8, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
        attention_head_dim=4, norm_num_groups=8,
    )  # fmt: skip
    StableDiffusionPipeline(
        vae=tiny_vae(), text_encoder=text, tokenizer=tokenizer, unet=unet,
        scheduler=DDIMScheduler(clip_sample=False), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(folder)  # fmt: skip


def _save_dit(folder: Path) -> None:
    transformer = DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
        sample_size=4, patch_size=2, num_embeds_ada_norm=1000,
    )  # fmt: skip
    DiTPipeline(transformer=transformer, vae=tiny_vae(), scheduler=DDIMScheduler()).save_pretrained(folder)  # fmt: skip


@pytest.mark.parametrize("backend", ["sd", "dit"])
def test_pretrained_backends_end_to_end(src, tmp_path, backend):
    torch.manual_seed(0)  # random init of the tiny model only
    model = tmp_path / f"tiny-{backend}"
    {"sd": _save_sd, "dit": _save_dit}[backend](model)
    runs = _runs(src, tmp_path / "runs", generator=False)
    extra = {"sd": ["guidance=3"], "dit": ["guidance=2", "backend.dit.class_ids=" + ",".join(map(str, range(10, 20)))]}  # fmt: skip
    sets = [f"out={runs}", f"backend={backend}", f"model={model}", "pairs=2", "series_per_pair=1"]
    sets += ["alphas=3", "steps=2"]
    out = run_stage("generate", "digits", [*sets, *extra[backend]])
    manifest = read_manifest(out)
    assert manifest.num_samples == 6 and manifest.upstream.keys() == {"real"}
    ident = manifest.info["generator"]
    assert ident["backend"] == backend and ident["model_id"] == model.name
    assert ident["guidance"] == {"sd": 3.0, "dit": 2.0}[backend]
    split = load_split(out)
    assert split.images.shape == (6, 16, 16, 3)  # resized to real/'s 16 px
    assert split.meta[0]["generator"] == f"{backend}:{model.name}"
    # shared noise through the stage: α=1 of series 0 == the pure class-a image of its noise
    kwargs = {"sd": dict(class_names=list("0123456789"), guidance=3.0), "dit": dict(class_ids=list(range(10, 20)), guidance=2.0)}  # fmt: skip
    gen = load_generator(backend, model=model, steps=2, image_size=16, **kwargs[backend])
    a = split.meta[0]["classes"][0]
    pure = gen.generate_series([SeriesSpec(0, a, a, (1.0,), split.meta[0]["seed"])])
    assert torch.equal(split.images[2], pure[0, 0])


def test_complete_generate_rerun_on_read_only_copy(src, reference, tmp_path, read_only):
    out = tmp_path / "runs"
    shutil.copytree(reference.parent.parent, out)  # the complete runs root of the reference
    before = snapshot(out)
    read_only(out)
    with cpu_threads(1):
        series = run_stage("generate", "digits", [f"out={out}", *CONFIG])
    assert series == out / "digits" / "series"
    assert snapshot(out) == before
