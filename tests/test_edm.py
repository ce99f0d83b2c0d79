"""edm backend: our EDM networks (pinned outputs), the restricted pickle reader (a persistence-style
pickle assembled opcode by opcode here, and hostile globals), convert-edm, the Heun/Euler sampler
against closed forms and diffusers, and the generate stage with `--preset cifar100 --set
backend=edm` on a tiny random-weight network (shared noise, batch-size invariance).

The equivalence with the original EDM code (NVlabs/edm) was checked during development outside
the project (docs/generate.md); the pinned values below hold our implementation to it.
"""

from __future__ import annotations

import io
import json
import math
import struct
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from diffusers import EDMEulerScheduler

from core.config import ConfigError
from models.generators import (
    EDMGenerator,
    EDMNetwork,
    SeriesSpec,
    UnsafePickleError,
    load_edm,
    read_edm_pickle,
)
from models.generators.edm import karras_sigmas
from models.generators.edm_pickle import load_edm_pickle
from pipeline.cli import main
from pipeline.registry import resolve_stage_config, run_stage
from shards.reader import iter_shard
from shards.writer import ShardFolder

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {
    "ddpmpp": dict(architecture="ddpmpp", precond="vp", model_channels=8, channel_mult=[1, 2],
                   num_blocks=1, attn_resolutions=[8], augment_dim=9, dropout=0.13),
    "adm": dict(architecture="adm", precond="edm", model_channels=64, channel_mult=[1, 1],
                num_blocks=1, attn_resolutions=[8]),
}  # fmt: skip


def tiny_edm(arch: str = "ddpmpp", label_dim: int = 10, size: int = 16, scale: float = 0.1):
    """A tiny random-weight EDMNetwork; every weight drawn from a fixed generator (EDM zero-inits
    some layers, so random weights make every path count)."""
    net = EDMNetwork(img_resolution=size, img_channels=3, label_dim=label_dim, **TINY[arch])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (scale if p.ndim > 1 else scale / 4))
    return net.eval()


def _inputs(label_dim: int, size: int = 16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 3, size, size, generator=g) * 4
    sigma = torch.tensor([0.002, 1.0, 80.0])
    y = torch.zeros(3, label_dim)
    y[0, 2], y[1, 3], y[2, [4, 5]] = 1.0, 1.0, torch.tensor([0.25, 0.75])  # a mix in row 2
    return x, sigma, y


# ------------------------------------------------------------------ the network


@pytest.mark.parametrize(
    "arch, pinned",
    [
        # computed by NVlabs/edm's own VPPrecond/EDMPrecond with these weights (commit 008a4e5)
        (
            "ddpmpp",
            [-2.00327, 0.68647, -0.64001, -3.8218, 0.496, 3.4384, -1.81585, -1.43939, 3.11456],
        ),
        (
            "adm",
            [-2.00315, 0.68662, -0.63986, -0.76321, 0.11177, 0.72198, 0.01145, 0.01339, 0.01161],
        ),
    ],
)
def test_network_outputs_are_pinned(arch, pinned):
    """Golden values of D(x; σ, y) for fixed random weights (checked equal to NVlabs/edm's code
    for the same weights during development, docs/generate.md)."""
    net = tiny_edm(arch)
    x, sigma, y = _inputs(10)
    with torch.no_grad():
        d = net(x, sigma, y)
    got = [round(v, 5) for v in d[:, 0, 5, 5:8].flatten().tolist()]
    assert d.shape == x.shape and d.dtype == torch.float32
    assert got == pytest.approx(pinned, abs=1e-4)


def test_bfloat16_keeps_the_embedding_in_float32():
    """bf16 weights run the image path in bf16 only: c_noise (up to 999 under VP) and the mixing
    weights stay float32, so D stays close to the float32 result."""
    net = tiny_edm()
    x, sigma, y = _inputs(10)
    low = torch.nn.Module.to(tiny_edm(), torch.bfloat16)
    with torch.no_grad():
        full, half = net(x, sigma, y), low(x, sigma, y)
        emb = low.model.embed(torch.tensor([999.0]), y[:1])
    assert half.dtype == torch.float32 and emb.dtype == torch.bfloat16
    assert ((half - full).abs().max() / full.abs().max()).item() < 0.05
    with torch.no_grad():
        ref = net.model.embed(torch.tensor([999.0]), y[:1])
    assert torch.allclose(emb.float(), ref, rtol=1e-2, atol=1e-2)


def test_label_enters_linearly():
    """The mix y = 0.3·e_3 + 0.7·e_7 acts as a class whose label-layer column is
    0.3·W[:, 3] + 0.7·W[:, 7] (docs/methods.md §1: α·E(a) + (1−α)·E(b) in the label embedding)."""
    net, virtual = tiny_edm(), tiny_edm()
    with torch.no_grad():
        w = virtual.model.map_label.weight
        w[:, 9] = 0.3 * w[:, 3] + 0.7 * w[:, 7]
        x, sigma, _ = _inputs(10)
        eye = torch.eye(10)
        mixed = net(x[1:], sigma[1:], (0.3 * eye[[3]] + 0.7 * eye[[7]]).expand(2, -1))  # σ = 1, 80
        assert torch.allclose(mixed, virtual(x[1:], sigma[1:], eye[[9, 9]]), atol=1e-5)
        assert not torch.allclose(mixed, net(x[1:], sigma[1:], eye[[3, 3]]), atol=1e-2)


# ------------------------------------------------------------------ the restricted pickle reader


class Ops:
    """A pickle assembled opcode by opcode (protocol 4 opcodes, no framing)."""

    def __init__(self) -> None:
        self.b = bytearray(b"\x80\x04")

    def glob(self, module: str, name: str) -> None:
        self.b += b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL

    def call(self, module: str, name: str, *args) -> None:
        self.glob(module, name)
        self.b += b"("  # MARK
        for a in args:
            self.obj(a)
        self.b += b"tR"  # TUPLE, REDUCE

    def obj(self, v) -> None:
        if v is None:
            self.b += b"N"
        elif v is True or v is False:
            self.b += b"\x88" if v else b"\x89"
        elif isinstance(v, int):
            self.b += b"J" + struct.pack("<i", v)  # BININT
        elif isinstance(v, float):
            self.b += b"G" + struct.pack(">d", v)  # BINFLOAT
        elif isinstance(v, str):
            self.b += b"X" + struct.pack("<I", len(v.encode())) + v.encode()  # BINUNICODE
        elif isinstance(v, bytes):
            self.b += b"B" + struct.pack("<I", len(v)) + v  # BINBYTES
        elif isinstance(v, tuple):
            self.b += b"("
            for a in v:
                self.obj(a)
            self.b += b"t"
        elif isinstance(v, list):
            self.b += b"]("  # EMPTY_LIST, MARK ... APPENDS
            for a in v:
                self.obj(a)
            self.b += b"e"
        elif isinstance(v, set):
            self.b += b"\x8f("  # EMPTY_SET, MARK ... ADDITEMS
            for a in v:
                self.obj(a)
            self.b += b"\x90"
        elif isinstance(v, OrderedDict):
            self.call("collections", "OrderedDict")
            self._items(v)
        elif isinstance(v, dict):
            self.b += b"}"  # EMPTY_DICT
            self._items(v)
        elif isinstance(v, torch.nn.Parameter):
            self.call("torch._utils", "_rebuild_parameter", v.data, True, OrderedDict())
        elif isinstance(v, torch.Tensor):
            blob = io.BytesIO()  # a storage as torch.save writes it (what its pickling embeds)
            torch.save(v.contiguous()._typed_storage(), blob, _use_new_zipfile_serialization=False)
            self.glob("torch._utils", "_rebuild_tensor_v2")
            self.b += b"("
            self.call("torch.storage", "_load_from_bytes", blob.getvalue())
            for a in (0, tuple(v.shape), tuple(v.contiguous().stride()), False, OrderedDict()):
                self.obj(a)
            self.b += b"tR"
        elif isinstance(v, Record):
            # what EDM's persistence writes for a network object: hook(meta), meta with its source
            meta = dict(type="class", version=6, module_src=v.src, class_name=v.name, state=v.state)
            self.call("torch_utils.persistence", "_reconstruct_persistent_obj", meta)
        elif isinstance(v, Container):  # a plain nn.ModuleDict: copyreg._reconstructor + BUILD
            self.glob("copyreg", "_reconstructor")
            self.b += b"("
            self.glob("torch.nn.modules.container", "ModuleDict")
            self.glob("builtins", "object")
            self.b += b"NtR"
            self.obj(v.state)
            self.b += b"b"  # BUILD
        else:
            raise TypeError(type(v))

    def _items(self, d: dict) -> None:
        self.b += b"("
        for k, val in d.items():
            self.obj(k)
            self.obj(val)
        self.b += b"u"  # SETITEMS

    def done(self) -> bytes:
        return bytes(self.b + b".")


class Record:
    def __init__(self, name: str, state: dict, src: str = "import os\nos.system('touch PWNED')\n"):
        self.name, self.state, self.src = name, state, src


class Container:
    def __init__(self, state: dict):
        self.state = state


def _module_state(module: torch.nn.Module, **extra) -> dict:
    """The __dict__ an nn.Module pickles, with its children as records (persistent classes) or
    containers (ModuleDict), as EDM's snapshots hold them."""
    children = OrderedDict(
        (n, Container(_module_state(c)) if isinstance(c, torch.nn.ModuleDict) else
         Record(type(c).__name__, _module_state(c)))
        for n, c in module._modules.items()
    )  # fmt: skip
    params = OrderedDict((n, p if p is None else torch.nn.Parameter(p.detach().clone()))
                         for n, p in module._parameters.items())  # fmt: skip
    return dict(training=False, _parameters=params, _buffers=OrderedDict(module._buffers),
                _non_persistent_buffers_set=set(), _modules=children,
                _forward_hooks=OrderedDict(), skip_scale=0.7071, **extra)  # fmt: skip


def _snapshot_pickle(net: EDMNetwork, kwargs: dict, class_name: str = "VPPrecond") -> bytes:
    state = _module_state(net, _init_args=(), _init_kwargs=kwargs)
    ops = Ops()
    ops.obj({"ema": Record(class_name, state), "loss_fn": None, "augment_pipe": None,
             "dataset_kwargs": {"path": "cifar100-32x32.zip", "use_labels": True}})  # fmt: skip
    return ops.done()


# the kwargs EDM's train.py passes for `--cond=1 --arch=ddpmpp --precond=vp` (defaults not stored)
VP_KWARGS = dict(img_resolution=16, img_channels=3, label_dim=10, use_fp16=False,
                 model_type="SongUNet", embedding_type="positional", encoder_type="standard",
                 decoder_type="standard", channel_mult_noise=1, resample_filter=[1, 1],
                 model_channels=8, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8],
                 augment_dim=9, dropout=0.13)  # fmt: skip


@pytest.fixture(scope="module")
def edm_pkl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("edm") / "edm-tiny-16x16-cond-vp.pkl"
    path.write_bytes(_snapshot_pickle(tiny_edm(), VP_KWARGS))
    return path


def test_reader_extracts_kwargs_and_weights(edm_pkl, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the embedded "source" would create PWNED here if it ran
    snap = read_edm_pickle(edm_pkl)
    net = tiny_edm()
    assert snap.class_name == "VPPrecond" and snap.init_kwargs == VP_KWARGS
    assert snap.state_dict.keys() == net.state_dict().keys()
    assert all(torch.equal(snap.state_dict[k], v) for k, v in net.state_dict().items())
    loaded = load_edm_pickle(edm_pkl)
    public = [{k: v for k, v in json.loads(n.to_json_string()).items() if not k.startswith("_")}
              for n in (loaded, net)]  # fmt: skip
    assert public[0] == public[1]  # EDM's defaults (not in the pickle) filled in
    x, sigma, y = _inputs(10)
    with torch.no_grad():
        assert torch.equal(loaded(x, sigma, y), net(x, sigma, y))
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize(
    "module, name", [("os", "system"), ("builtins", "eval"), ("posix", "system"), ("torch", "load")]
)
def test_reader_refuses_other_globals(tmp_path, monkeypatch, module, name):
    monkeypatch.chdir(tmp_path)
    ops = Ops()
    ops.b += b"}("
    ops.obj("ema")
    ops.call(module, name, "touch PWNED")
    ops.b += b"u"
    path = tmp_path / "evil.pkl"
    path.write_bytes(ops.done())
    with pytest.raises(UnsafePickleError, match=rf"refusing global {module}\.{name}") as e:
        read_edm_pickle(path)
    assert "\n" not in str(e.value) and not (tmp_path / "PWNED").exists()


def test_reader_refuses_foreign_networks(tmp_path):
    path = tmp_path / "ve.pkl"
    path.write_bytes(_snapshot_pickle(tiny_edm(), VP_KWARGS, class_name="VEPrecond"))
    with pytest.raises(ValueError, match="VEPrecond is not supported"):
        load_edm_pickle(path)
    path.write_bytes(_snapshot_pickle(tiny_edm(), VP_KWARGS | dict(embedding_type="fourier")))
    with pytest.raises(ValueError, match="NCSN"):
        load_edm_pickle(path)


def test_convert_writes_safetensors_and_config(edm_pkl, tmp_path):
    out = run_stage("convert-edm", "cifar100", [f"out={tmp_path}", f"source={edm_pkl}"])
    assert out == tmp_path / "cifar100" / "edm"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "diffusion_pytorch_model.safetensors",
    ]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "ddpmpp" and cfg["precond"] == "vp" and cfg["label_dim"] == 10
    assert cfg["channel_mult_emb"] == 4  # EDM's default
    x, sigma, y = _inputs(10)
    with torch.no_grad():
        assert torch.equal(load_edm(out)(x, sigma, y), tiny_edm()(x, sigma, y))
    assert run_stage("convert-edm", "cifar100", [f"out={tmp_path}", f"source={edm_pkl}"]) == out


# ------------------------------------------------------------------ the sampler


def test_schedule_is_edm_karras():
    """t_i = (σmax^(1/ρ) + i/(N−1)(σmin^(1/ρ) − σmax^(1/ρ)))^ρ, then t_N = 0 (EDM eq. 5)."""
    t = karras_sigmas(20, 0.002, 80.0, 7.0)
    i = torch.arange(20, dtype=torch.float64)
    want = (80 ** (1 / 7) + i / 19 * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7
    assert len(t) == 21 and t[-1] == 0.0
    assert torch.allclose(torch.tensor(t[:-1], dtype=torch.float64), want, rtol=1e-6)


def _gaussian_generator(folder: Path, sampler: str, steps: int, s: float = 0.5):
    """An EDMGenerator whose denoiser is exact for data ~ N(0, s²): D(x; σ) = x·s²/(s² + σ²)."""
    tiny_edm().save_pretrained(folder)
    gen = EDMGenerator(folder, sampler=sampler, steps=steps)
    calls = []
    gen._forward = lambda x, sigma, y: calls.append(1) or x * s**2 / (s**2 + sigma[0] ** 2)
    return gen, calls


def test_heun_and_euler_against_the_exact_ode(tmp_path):
    """Probability-flow ODE of N(0, s²) data: x(σ) = x(σ₀)·√(s²+σ²)/√(s²+σ₀²) exactly. Heun
    (2N−1 network calls, the last step Euler into σ = 0) converges with order 2, Euler (N calls)
    with order 1."""
    s, z = 0.5, torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    exact = z * 80 * math.sqrt(s**2) / math.sqrt(s**2 + 80**2)
    err = {}
    for sampler in ("heun", "euler"):
        for steps in (20, 40):
            gen, calls = _gaussian_generator(tmp_path / f"{sampler}{steps}", sampler, steps, s)
            x = gen.sample(z, torch.zeros(2, 10))
            err[sampler, steps] = ((x - exact).abs().max() / exact.abs().max()).item()
            assert len(calls) == (2 * steps - 1 if sampler == "heun" else steps)
    assert err["heun", 20] < 0.06 and err["heun", 20] < err["euler", 20] / 3
    assert err["heun", 20] / err["heun", 40] > 3.5  # 2nd order: error / 4 per doubling
    assert 1.6 < err["euler", 20] / err["euler", 40] < 2.5  # 1st order


def test_euler_step_matches_diffusers(tmp_path):
    """Our Euler update equals EDMEulerScheduler.step given the same denoised estimate."""
    gen, _ = _gaussian_generator(tmp_path, "euler", 5)
    sched = EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, rho=7.0, final_sigmas_type="zero")
    sched.set_timesteps(5)
    sched.is_scale_input_called = True  # our network preconditions its input itself
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 80
    ours = x.double()
    for i, t in enumerate(sched.timesteps):
        denoised = x * 0.25 / (0.25 + sched.sigmas[i] ** 2)
        x = sched.step(x, t, x, pred_original_sample=denoised).prev_sample
        ours = ours + (gen.sigmas[i + 1] - gen.sigmas[i]) * gen._d(ours, gen.sigmas[i], None)
    assert torch.allclose(ours.float(), x, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the generate stage


def _real(root: Path, classes: int, size: int) -> None:
    """A minimal real/train: the stage reads class names and image size from it."""
    folder = ShardFolder(root / "real" / "train", "train")
    images = torch.randint(0, 256, (classes, size, size, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)  # fmt: skip
    samples = [{"__key__": f"train_{i:07d}", "png": images[i], "cls": i} for i in range(classes)]
    folder.write(0, samples)
    folder.finish(1, kind="real", class_names=[f"c{c}" for c in range(classes)], info={"image_size": size})  # fmt: skip


@pytest.fixture(scope="module")
def cifar100_runs(tmp_path_factory) -> tuple[Path, Path]:
    """runs/cifar100/real (100 classes, 32 px) and a tiny 100-class EDM network folder."""
    out = tmp_path_factory.mktemp("runs")
    _real(out / "cifar100", 100, 32)
    tiny_edm(label_dim=100, size=32).save_pretrained(out / "tiny-edm")
    return out, out / "tiny-edm"


def test_cifar100_edm_stage_end_to_end(cifar100_runs, capsys):
    out, model = cifar100_runs
    sets = [f"out={out}", "backend=edm", f"model={model}", "limit=3", "preview_series=2"]
    assert main(["generate", "--preset", "cifar100", "--set", *sets]) == 0, capsys.readouterr().err
    series = out / "cifar100" / "series"
    cfg = json.loads((series / "config.json").read_text())
    assert (cfg["sampler"], cfg["steps"], cfg["guidance"]) == ("heun", 25, 1.0)  # the paper's
    manifest = json.loads((series / "manifest.json").read_text())
    assert manifest["info"]["generator"]["model_id"] == "tiny-edm"
    samples = [s for shard in sorted(series.glob("series-*.tar")) for s in iter_shard(shard)]
    assert len(samples) == 3 * 8 and samples[0]["meta"]["generator"] == "edm:tiny-edm"
    # the stage's images are the backend's for the plan's specs
    cfg = resolve_stage_config("generate", "cifar100", sets)
    gen = EDMGenerator(model, sampler="heun", steps=25, num_classes=100)
    first = samples[0]["meta"]
    spec = SeriesSpec(0, *first["classes"], tuple(i / 7 for i in range(8)), first["seed"])
    again = gen.generate_series([spec])[0]
    assert all(
        torch.equal(torch.from_numpy(samples[k]["image"].copy()), again[k]) for k in range(8)
    )
    assert cfg.backend.name == "edm"


def test_shared_noise_and_batch_size_invariance(cifar100_runs):
    """α = 1 of (a, b) = α = 0 of (b, a) = the pure class-a image, byte for byte; the bytes do not
    depend on the batch size."""
    _, model = cifar100_runs
    gen = EDMGenerator(model, steps=4, num_classes=100)
    alphas = (0.0, 0.5, 1.0)
    specs = [SeriesSpec(0, 3, 8, alphas, 11), SeriesSpec(1, 8, 3, alphas, 11),
             SeriesSpec(2, 3, 3, (1.0,) * 3, 11), SeriesSpec(3, 5, 9, alphas, 12)]  # fmt: skip
    out = {b: gen.generate_series(specs, batch_size=b) for b in (1, 5, 64)}
    assert torch.equal(out[1], out[5]) and torch.equal(out[1], out[64])
    img = out[1]
    assert torch.equal(img[0, 2], img[1, 0]) and torch.equal(img[0, 2], img[2, 0])
    assert torch.equal(img[0, 0], img[1, 2])  # pure b both ways
    assert not torch.equal(img[0, 1], img[0, 0]) and not torch.equal(img[0, 2], img[0, 0])
    assert img.flatten(2).float().std(dim=2).min() > 5  # not blank
    # no guidance: a call at w = 1 samples as the generator does, any other w is refused
    assert torch.equal(gen.generate_series(specs, guidance=1.0), img)
    for setting in ({"guidance": 2.0}, {"clip_sample": True}):
        with pytest.raises(ValueError, match="the edm backend"):
            gen.generate_series(specs, **setting)


def test_presets_and_one_line_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for preset, steps in (("cifar10", 20), ("cifar100", 25), ("tiny-imagenet", 25)):
        cfg = resolve_stage_config("generate", preset, ["backend=edm"])
        assert (cfg.sampler, cfg.sample_steps, cfg.guidance) == ("heun", steps, 1.0)
    edm30 = resolve_stage_config("generate", "cifar10", ["backend=edm", "sample_steps=30"])
    assert edm30.sample_steps == 30
    assert resolve_stage_config("generate", "cifar10", []).sampler == "ddim"  # sd untouched
    with pytest.raises(ConfigError, match="sampler='ddim'"):
        resolve_stage_config("generate", "cifar10", ["backend=edm", "sampler=ddim"])
    with pytest.raises(ConfigError, match="no classifier-free guidance"):
        resolve_stage_config("generate", "cifar10", ["backend=edm", "guidance=2"])
    # offline: one line naming the file and where it is published; nothing written
    _real(tmp_path / "cifar100", 100, 32)
    sets = [f"out={tmp_path}", "backend=edm", "model=/nowhere/edm-cifar100.pkl", "limit=1"]
    assert main(["generate", "--preset", "cifar100", "--set", *sets]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "/nowhere/edm-cifar100.pkl not found" in err
    assert "DM-Improves-AT" in err and "convert-edm" in err
    assert not (tmp_path / "cifar100" / "series").exists()
    # a hostile pickle: one line, exit 1
    evil = tmp_path / "evil.pkl"
    ops = Ops()
    ops.call("os", "system", "touch PWNED")
    evil.write_bytes(ops.done())
    sets = [f"out={tmp_path}", "backend=edm", f"model={evil}"]
    assert main(["generate", "--preset", "cifar100", "--set", *sets]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the logged plan
    assert err.startswith("semix generate: error:") and "refusing global os.system" in err
    assert not (tmp_path / "PWNED").exists()
