"""Read EDM network pickles without executing them, and convert them once to safetensors + config.

The published EDM checkpoints (``edm-<dataset>-32x32-cond-vp.pkl``) are ``pickle.dump`` of a dict
``{ema, loss_fn, augment_pipe, dataset_kwargs}`` whose networks were pickled by EDM's
``torch_utils.persistence``: every network object becomes a call
``_reconstruct_persistent_obj(meta)`` with ``meta = {type, version, module_src, class_name, state}``,
where ``module_src`` is the *source code* of the module defining the class. A normal unpickle
executes that source. Here a restricted ``pickle.Unpickler`` resolves only the globals that a state
extraction needs, each to a harmless stand-in:

- the persistence hook -> a ``PersistentRecord`` keeping ``class_name`` and ``state`` (the source
  is dropped unread);
- tensors: ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter`` and the storages'
  ``torch.storage._load_from_bytes``, whose bytes are read by ``torch.load(weights_only=True)``;
- plain containers (``OrderedDict``, ``set``, EDM's ``EasyDict`` as a dict), plain
  ``nn.Module`` containers (``ModuleDict`` ... as records), numpy number scalars.

Any other global (``os.system``, ``builtins.eval``, a class of the embedded source) stops the read
with one line naming it. From the record of the network (``ema``) come its init kwargs and its
parameters and buffers; ``edm_config`` maps the kwargs to an ``EDMNetwork`` config, filling EDM's
defaults (which are not in the pickle), and refuses architectures we do not implement.
"""

from __future__ import annotations

import inspect
import io
import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .edm_net import EDMNetwork


class UnsafePickleError(pickle.UnpicklingError, ValueError):
    """The pickle asks for something an EDM network snapshot never contains."""


@dataclass
class PersistentRecord:
    """What ``_reconstruct_persistent_obj(meta)`` would have built, as plain data."""

    class_name: str
    state: dict

    @property
    def init_kwargs(self) -> dict:
        return dict(self.state.get("_init_kwargs") or {})


class ModuleRecord:
    """A non-persistent ``nn.Module`` (``ModuleDict`` ...): its class name and pickled state.

    Pickle builds these with ``cls.__new__`` (NEWOBJ) and ``__setstate__`` (BUILD), so the class
    name is a class attribute of a per-name subclass.
    """

    class_name = "Module"

    def __setstate__(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise UnsafePickleError(f"{self.class_name}: state is not a dict")
        self.state = dict(state)


def _module_class(name: str) -> type[ModuleRecord]:
    return type(name, (ModuleRecord,), {"class_name": name})


class _EasyDict(dict):
    """EDM's ``dnnlib.EasyDict`` (a dict with attribute access), as a plain dict."""


def _reconstruct_persistent_obj(meta: dict) -> PersistentRecord:
    if not isinstance(meta, dict) or meta.get("type") != "class" or "class_name" not in meta:
        raise UnsafePickleError("malformed persistence record (no type='class' / class_name)")
    state = meta.get("state") or {}
    if not isinstance(state, dict):
        raise UnsafePickleError(f"persistence record {meta['class_name']}: state is not a dict")
    return PersistentRecord(str(meta["class_name"]), dict(state))


def _reconstructor(cls: Any, base: Any, state: Any) -> ModuleRecord:
    if not (isinstance(cls, type) and issubclass(cls, ModuleRecord)) or base is not object:
        raise UnsafePickleError(f"copyreg._reconstructor called with {cls!r}: not a torch module")
    if state is not None:
        raise UnsafePickleError(f"copyreg._reconstructor of {cls.class_name} with a base state")
    return cls.__new__(cls)


def _load_from_bytes(data: bytes) -> Any:
    # a storage serialised by torch.save: torch's own restricted unpickler reads it
    return torch.load(io.BytesIO(data), weights_only=True)


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None, meta=None):
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise UnsafePickleError(f"tensor rebuilt from a {type(storage).__name__}, not a storage")
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None) -> torch.Tensor:
    if not isinstance(data, torch.Tensor):
        raise UnsafePickleError("parameter rebuilt from something that is not a tensor")
    return data


def _np_dtype(name: Any, align: bool = False, copy: bool = True) -> np.dtype:
    if not isinstance(name, str) or np.dtype(name).kind not in "biuf":
        raise UnsafePickleError(f"numpy dtype {name!r} is not a plain number type")
    return np.dtype(name)


def _np_scalar(dtype: Any, data: Any = None) -> int | float | bool:
    if not isinstance(dtype, np.dtype) or dtype.kind not in "biuf" or not isinstance(data, bytes):
        raise UnsafePickleError("numpy scalar that is not a plain number")
    return np.frombuffer(data, dtype=dtype)[0].item()


_MODULE_CLASSES = ("ModuleDict", "ModuleList", "Sequential")
ALLOWED: dict[tuple[str, str], Any] = {
    ("torch_utils.persistence", "_reconstruct_persistent_obj"): _reconstruct_persistent_obj,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): _load_from_bytes,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "object"): object,  # only as copyreg._reconstructor's base
    ("copyreg", "_reconstructor"): _reconstructor,
    ("dnnlib.util", "EasyDict"): _EasyDict,
    ("numpy", "dtype"): _np_dtype,
    ("numpy.core.multiarray", "scalar"): _np_scalar,
    ("numpy._core.multiarray", "scalar"): _np_scalar,
} | {("torch.nn.modules.container", n): _module_class(n) for n in _MODULE_CLASSES}


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``ALLOWED`` (to stand-ins); refuses every other one."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return ALLOWED[(module, name)]
        raise UnsafePickleError(
            f"refusing global {module}.{name}: an EDM network pickle holds only tensors, "
            "containers and persistence records (nothing of it was executed)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refusing a persistent id: not an EDM network pickle")


@dataclass
class EDMSnapshot:
    class_name: str  # the preconditioning class (VPPrecond, EDMPrecond ...)
    init_kwargs: dict
    state_dict: dict[str, torch.Tensor]


def _collect(record: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    """Parameters and persistent buffers of a record tree, keyed like ``state_dict()``."""
    state = getattr(record, "state", {})  # a ModuleRecord without BUILD has none
    skip = set(state.get("_non_persistent_buffers_set") or ())
    for kind in ("_parameters", "_buffers"):
        for name, value in (state.get(kind) or {}).items():
            if value is not None and name not in skip:
                if not isinstance(value, torch.Tensor):
                    raise UnsafePickleError(f"{prefix}{name} is a {type(value).__name__}")
                out[prefix + name] = value
    for name, child in (state.get("_modules") or {}).items():
        if child is None:
            continue
        if not isinstance(child, PersistentRecord | ModuleRecord):
            raise UnsafePickleError(f"module {prefix}{name} is a {type(child).__name__}")
        _collect(child, f"{prefix}{name}.", out)


def read_edm_pickle(path: str | Path) -> EDMSnapshot:
    """Init kwargs and weights of the network in an EDM pickle (its ``ema``), nothing executed."""
    with open(path, "rb") as f:
        try:
            data = RestrictedUnpickler(f).load()
        except UnsafePickleError as e:
            raise UnsafePickleError(f"{path}: {e}") from None
        except (pickle.UnpicklingError, EOFError) as e:
            raise UnsafePickleError(f"{path}: not a readable pickle ({e})") from None
    net = data.get("ema") if isinstance(data, dict) else data
    if not isinstance(net, PersistentRecord):
        raise UnsafePickleError(f"{path}: no EDM network (a persistence record under 'ema') in it")
    if net.state.get("_init_args"):
        raise UnsafePickleError(
            f"{path}: {net.class_name} has positional init args; expected kwargs"
        )
    weights: dict[str, torch.Tensor] = {}
    _collect(net, "", weights)
    return EDMSnapshot(net.class_name, net.init_kwargs, weights)


# EDM's constructor defaults (its training/networks.py signatures): the pickle stores only the
# kwargs that were passed, so these complete a config. Unknown kwargs are refused.
_PRECOND_DEFAULTS: dict[str, dict[str, Any]] = {
    "VPPrecond": dict(beta_d=19.9, beta_min=0.1, M=1000, epsilon_t=1e-5, model_type="SongUNet"),
    "EDMPrecond": dict(sigma_min=0, sigma_max=math.inf, sigma_data=0.5, model_type="DhariwalUNet"),
}
_UNET_DEFAULTS: dict[str, dict[str, Any]] = {
    "SongUNet": dict(
        augment_dim=0,
        model_channels=128,
        channel_mult=[1, 2, 2, 2],
        channel_mult_emb=4,
        num_blocks=4,
        attn_resolutions=[16],
        dropout=0.10,
        label_dropout=0,
        embedding_type="positional",
        channel_mult_noise=1,
        encoder_type="standard",
        decoder_type="standard",
        resample_filter=[1, 1],
    ),
    "DhariwalUNet": dict(
        augment_dim=0,
        model_channels=192,
        channel_mult=[1, 2, 3, 4],
        channel_mult_emb=4,
        num_blocks=3,
        attn_resolutions=[32, 16, 8],
        dropout=0.10,
        label_dropout=0,
    ),
}
# DDPM++ only: NCSN++ (fourier embedding, residual/skip encoder, skip decoder) is not implemented
_DDPMPP_ONLY = dict(embedding_type="positional", encoder_type="standard", decoder_type="standard")


def edm_config(class_name: str, init_kwargs: dict) -> dict[str, Any]:
    """``EDMNetwork`` config of an EDM ``VPPrecond``/``EDMPrecond`` built with ``init_kwargs``."""
    if class_name not in _PRECOND_DEFAULTS:
        raise ValueError(
            f"EDM network {class_name} is not supported; semix implements VPPrecond and EDMPrecond"
        )
    kw = _PRECOND_DEFAULTS[class_name] | dict(label_dim=0, use_fp16=False) | dict(init_kwargs)
    model_type = kw.pop("model_type")
    if model_type not in _UNET_DEFAULTS:
        raise ValueError(f"EDM model_type {model_type} is not supported (SongUNet, DhariwalUNet)")
    kw = _UNET_DEFAULTS[model_type] | kw
    for key, want in (_DDPMPP_ONLY if model_type == "SongUNet" else {}).items():
        if kw.pop(key) != want:
            raise ValueError(
                f"EDM SongUNet with {key}={init_kwargs[key]!r} (NCSN++) is not supported"
            )
    kw.pop("use_fp16"), kw.pop("label_dropout")  # training-time only
    arch = "ddpmpp" if model_type == "SongUNet" else "adm"
    config = dict(architecture=arch, precond="vp" if class_name == "VPPrecond" else "edm")
    if arch == "adm":
        kw.setdefault("channel_mult_noise", 1)
        kw.setdefault("resample_filter", [1, 1])
    if config["precond"] == "edm":
        for key in ("sigma_min", "sigma_max"):  # None = unbounded
            kw[key] = None if kw[key] in (0, math.inf) else float(kw[key])
    img_channels = kw.pop("img_channels")
    config |= dict(img_resolution=int(kw.pop("img_resolution")), img_channels=int(img_channels))
    unknown = sorted(set(kw) - set(inspect.signature(EDMNetwork.__init__).parameters))
    if unknown:
        raise ValueError(f"EDM network kwargs not understood: {', '.join(unknown)}")
    for key in ("channel_mult", "attn_resolutions", "resample_filter"):
        kw[key] = [int(v) for v in kw[key]]
    return config | kw


def load_edm_pickle(path: str | Path, dtype: torch.dtype = torch.float32) -> EDMNetwork:
    """An ``EDMNetwork`` with the weights of an EDM pickle (read by ``read_edm_pickle``)."""
    snap = read_edm_pickle(path)
    try:
        net = EDMNetwork(**edm_config(snap.class_name, snap.init_kwargs))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: incomplete EDM network kwargs ({e})") from None
    expected = net.state_dict()
    missing = sorted(set(expected) - set(snap.state_dict))
    extra = sorted(set(snap.state_dict) - set(expected))
    shapes = [k for k in expected if k in snap.state_dict and
              snap.state_dict[k].shape != expected[k].shape]  # fmt: skip
    if missing or extra or shapes:
        raise ValueError(
            f"{path}: weights do not fit the network of its kwargs (missing {missing[:3]}, "
            f"unexpected {extra[:3]}, other shape {shapes[:3]})"
        )
    net.load_state_dict(snap.state_dict)
    # nn.Module.to: ModelMixin.to warns about fp32-kept modules, and this network keeps none
    return torch.nn.Module.to(net, dtype).eval()


def convert_edm_pickle(src: str | Path, dest: str | Path) -> Path:
    """Write ``dest/`` (``config.json`` + ``diffusion_pytorch_model.safetensors``) from a pickle.

    The folder is written beside ``dest`` and renamed into place, so it exists only complete.
    """
    dest = Path(dest)
    net = load_edm_pickle(src)
    tmp = dest.with_name(dest.name + ".tmp")
    net.save_pretrained(tmp, safe_serialization=True)
    tmp.replace(dest)
    return dest
