"""The generator interface (docs/architecture.md) and what the backends share.

A *series* (docs/methods.md §1) is one initial noise z reused for K mixing ratios α_k; image k is sampled
under the condition α_k·c_a + (1−α_k)·c_b. A k-way series (``MixSpec``, models/simplex.py) reuses z
for K weight vectors w over k classes, condition Σ_i w_i·c_i; the 2-way ``SeriesSpec`` is the case
w = (α, 1 − α). The backends only differ in what c is (a class-embedding row, a prompt embedding)
and in how they sample; everything else lives here:

- the noise of a series comes from its own CPU ``torch.Generator`` seeded with ``spec.seed``, so an
  image never depends on the batch size, the device or the other series of the call;
- (series, weight vector) pairs are flattened into rows, each row's classes sorted (so a permuted
  tuple gives the same condition, bit for bit), and sampled in chunks of ``batch_size`` rows; every model
  call is padded to a multiple of ``row_multiple`` rows (see ``Generator._sample_rows`` for why);
- only deterministic samplers (DDIM η=0, DPM-Solver++ and UniPC multistep) are accepted
  (schedulers.py builds them);
- outputs are checked for non-finite values, clipped and quantised to uint8 RGB.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from core import parts
from core.precision import DTYPES, TORCH_NAMES

from .schedulers import SAMPLERS
from .spec import MixSpec, Spec


class NonFiniteImageError(RuntimeError):
    """Some series produced NaN/Inf pixels (typically fp16 overflow).

    ``series_ids`` names them; ``images`` holds the whole uint8 result of the call with those
    series zeroed, so a caller can keep the good series and retry the bad ones in float32.
    """

    def __init__(
        self, series_ids: Sequence[int], images: torch.Tensor | None = None, dtype: str = ""
    ):
        self.series_ids = tuple(series_ids)
        self.images = images
        super().__init__(
            f"non-finite pixels in series {list(self.series_ids)} (dtype {dtype}); retry them in float32"
        )


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A generator's dtype: a torch dtype, or torch's name of it (float32, bfloat16, float16:
    the words a series manifest records; core.precision.TORCH_NAMES)."""
    by_name = {name: DTYPES[word] for word, name in TORCH_NAMES.items()}
    if isinstance(dtype, torch.dtype) and dtype in by_name.values():
        return dtype
    if dtype not in by_name:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(by_name)}")
    return by_name[dtype]


class MixableEmbedding(nn.Embedding):
    """An embedding table that also accepts class-weight vectors.

    Integer labels [B] look rows up as usual; float weights w [B, N] return w @ E, i.e. the mixed
    condition α·E[a] + (1−α)·E[b] of docs/methods.md §1 when w = α·e_a + (1−α)·e_b. A one-hot w gives
    exactly E[a] (products with 0 and 1 are exact), so pure classes are not perturbed.
    """

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        if labels.is_floating_point():
            return labels.to(self.weight.dtype) @ self.weight
        return super().forward(labels)


def make_mixable(parent: nn.Module, name: str) -> MixableEmbedding:
    """Replace ``parent.<name>`` (an ``nn.Embedding``) by a ``MixableEmbedding`` sharing its weight.

    The parameter object and the state-dict key stay the same, so saving/loading is unaffected.
    """
    table = getattr(parent, name)
    if not isinstance(table, nn.Embedding):
        raise ValueError(
            f"{type(parent).__name__}.{name} is {type(table).__name__}, not nn.Embedding"
        )
    mixable = MixableEmbedding(table.num_embeddings, table.embedding_dim, _weight=table.weight)
    mixable.weight = table.weight  # share the Parameter itself, not a copy
    setattr(parent, name, mixable)
    return mixable


def class_weights(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor, n: int) -> torch.Tensor:
    """w = α·e_a + (1−α)·e_b ∈ R^{B×n} (docs/methods.md §1), float32."""
    alpha = alpha.to(torch.float32)
    return mix_weights(torch.stack([a, b], 1), torch.stack([alpha, 1 - alpha], 1), n)


def mix_weights(classes: torch.Tensor, weights: torch.Tensor, n: int) -> torch.Tensor:
    """Σ_i w_i·e_{c_i} ∈ R^{B×n}, float32, for classes [B, k] and weights [B, k].

    Summed left to right as w_1·e_{c_1} + w_2·e_{c_2} + ...: for k = 2 the very float operations
    of α·e_a + (1−α)·e_b. With distinct classes every entry is one w_i plus exact zeros, so the
    result does not depend on the order of the tuple.
    """
    weights = weights.to(torch.float32)
    out = weights[:, :1] * F.one_hot(classes[:, 0], n).float()
    for i in range(1, classes.shape[1]):
        out = out + weights[:, i : i + 1] * F.one_hot(classes[:, i], n).float()
    return out


class Shared(TypedDict, total=False):
    """The arguments every backend hands on to ``Generator.__init__`` as they are, stated once:
    a backend's signature ends in ``**shared: Unpack[Shared]`` (stages/generate/model.py)."""

    revision: str | None
    sampler: str
    steps: int
    device: str | torch.device
    dtype: str | torch.dtype
    batch_size: int
    row_multiple: int
    torch_compile: bool


class Generator(ABC):
    """Base of the backends: shared noise, chunking, post-processing and identity metadata.

    Subclasses set the attributes below and implement ``_load`` (read the network),
    ``noise_shape``, ``condition`` and ``sample``. A backend built with ``lazy=True`` reads no
    weights until ``load()`` or its first ``generate_series``: ``metadata()`` (the generator's
    identity) needs only the constructor's arguments, so a stage can record what made its images
    without loading a model it may not need (a resumed run with nothing left to do). Its own
    parameters are its nested ``Params``: leaves of the generate config's ``backend`` section
    (``backend.<name>.<param>``), passed to the constructor by name.
    """

    backend: str  # its name in the registry (models.generators.GENERATORS)
    model: str | Path  # hub id, local folder or file
    revision: str | None
    sampler: str
    steps: int
    guidance: float  # 1.0 = no classifier-free guidance
    image_size: int  # output resolution (H = W)
    num_classes: int
    # the deterministic samplers this backend offers; the first is its default
    samplers: Mapping[str, Any] = SAMPLERS
    default_steps: ClassVar[int] = 25
    default_batch_size: ClassVar[int] = 64  # rows per model call
    Params: ClassVar[type[parts.Params]] = parts.Params  # its own parameters: none by default

    def __init__(
        self,
        model: str | Path,
        *,
        revision: str | None = None,
        sampler: str | None = None,
        steps: int | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "float32",
        batch_size: int | None = None,
        row_multiple: int = 8,
        torch_compile: bool = False,
    ) -> None:
        """None: the backend's own (its first sampler, ``default_steps``/``_batch_size``)."""
        sampler = next(iter(self.samplers)) if sampler is None else sampler
        steps = self.default_steps if steps is None else steps
        batch_size = self.default_batch_size if batch_size is None else batch_size
        if sampler not in self.samplers:
            raise ValueError(
                f"unknown or non-deterministic sampler {sampler!r}; choose one of "
                f"{sorted(self.samplers)} (ancestral/SDE samplers break the shared noise of a series)"
            )
        if steps < 1 or batch_size < 1 or row_multiple < 1:
            raise ValueError(
                f"steps, batch_size, row_multiple must be >= 1, got {steps}, {batch_size}, {row_multiple}"
            )
        self.model, self.revision = model, revision
        self.sampler = sampler
        self.steps = int(steps)
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype)
        self.batch_size = int(batch_size)
        self.row_multiple = int(row_multiple)
        self.torch_compile = bool(torch_compile)  # torch.compile the denoiser when it loads
        self._loaded = False

    def load(self) -> Generator:
        """Read the network (once); a model that is missing or broken fails here, in one line."""
        if not self._loaded:
            self._load()
            self._loaded = True
        return self

    # -- backend hooks ---------------------------------------------------------------------------

    @abstractmethod
    def _load(self) -> None:
        """Read the weights onto the device and set what depends on them."""

    @property
    @abstractmethod
    def noise_shape(self) -> tuple[int, ...]:
        """Shape of one series' initial noise (pixels or latents), without the batch dim."""

    @abstractmethod
    def condition(self, classes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Mixed condition Σ_i w_i·c_i for rows of classes [B, k] and weights [B, k] (float32;
        k = 2: (α, 1 − α)), batch dim first, on the device. Sum left to right: for k = 2 that is
        α·c_a + (1−α)·c_b, the 2-way code's float operations."""

    @abstractmethod
    def sample(self, noise: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Denoise unit noise [B, *noise_shape] under ``cond``; images [B, 3, h, w] in [-1, 1].
        A backend with per-call settings (``call_settings``) takes them as keyword arguments,
        each None by default: the generator's own."""

    def call_settings(self, guidance: float | None, clip_sample: bool | None) -> dict[str, Any]:
        """One ``generate_series`` call's sampling settings, checked once, as the keyword
        arguments ``sample`` gets for that call (None: the generator's own, passed as nothing,
        so a backend whose ``sample`` takes none samples as it always has). A backend takes
        neither by default: a w other than its own is refused, and x̂₀ clipping; the backends
        that guide (unet, dit, sd) or clip (unet) override this."""
        if guidance is not None and float(guidance) != self.guidance:
            raise ValueError(
                f"guidance={guidance:g}: the {self.backend} backend samples at w = "
                f"{self.guidance:g} only"
            )
        if clip_sample is not None:
            raise ValueError(
                f"clip_sample={clip_sample}: the {self.backend} backend has no x̂₀ clipping"
            )
        return {}

    # -- shared machinery ------------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        """The model as outputs name it: a hub id as given, a local folder or file by its last
        component (outputs hold no absolute paths; the revision pins local weights)."""
        path = Path(self.model)
        return path.name if path.exists() else str(self.model)

    def metadata(self) -> dict[str, Any]:
        """Identity of the generator, to store with every image it makes: what was sampled, how
        and in which precision; known before the weights are read (``lazy=True``). The output
        resolution is not in it: a series folder records it once for all its images."""
        return {
            "backend": self.backend,
            "model_id": self.model_id,
            "revision": self.revision,
            "sampler": self.sampler,
            "steps": self.steps,
            "guidance": self.guidance,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def initial_noise(self, seed: int) -> torch.Tensor:
        """z ~ N(0, I) of one series, drawn on the CPU in float32 from its own generator."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return torch.randn(self.noise_shape, generator=gen, dtype=torch.float32)

    def to_uint8(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, h, w] in [0, 1] -> uint8 [B, H, W, 3] at ``image_size`` (antialiased resize)."""
        x = images.float().clamp(0, 1)
        if x.shape[-2:] != (self.image_size, self.image_size):
            size = (self.image_size, self.image_size)
            x = F.interpolate(x, size=size, mode="bicubic", antialias=True, align_corners=False)
            x = x.clamp(0, 1)
        return (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu()

    def _check_specs(self, specs: Sequence[Spec]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (classes [S, K, k], weights [S, K, k]) of every series, checked."""
        if not specs:
            raise ValueError("generate_series needs at least one SeriesSpec")
        rows = [s.rows() for s in specs]
        shape = rows[0][1].shape
        for s, (classes, weights) in zip(specs, rows):
            if weights.shape != shape or shape[0] == 0:
                raise ValueError(
                    f"all series need the same non-zero number of alphas (weight vectors of one "
                    f"length); series {s.series_id} has {tuple(weights.shape)}, not {tuple(shape)}"
                )
            bad = [c for c in classes[0].tolist() if not 0 <= c < self.num_classes]
            if bad:
                raise ValueError(
                    f"series {s.series_id}: class {bad[0]} outside [0, {self.num_classes})"
                )
            if not bool(((weights >= 0) & (weights <= 1)).all()):
                raise ValueError(f"series {s.series_id}: alphas must lie in [0, 1], got {s.alphas}")
            if isinstance(s, MixSpec) and len(set(s.classes)) != len(s.classes):
                raise ValueError(f"series {s.series_id}: classes {s.classes} repeat a class")
        return torch.stack([c for c, _ in rows]), torch.stack([w for _, w in rows])

    def _sample_rows(
        self,
        noise: torch.Tensor,
        classes: torch.Tensor,
        weights: torch.Tensor,
        settings: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """Sample one chunk of rows under the call's ``settings`` (``call_settings``); returns
        float images in [-1, 1] (possibly non-finite).

        Why the padding: CPU BLAS kernels treat the rows of a matrix product in register blocks, and
        a partial block (a batch of 1 -> a matrix-vector product, or 7 rows) takes another code path
        with another rounding. Padding every model call to a multiple of ``row_multiple`` (repeating
        the last row) makes a row's result independent of the batch size on the CPU (the tests
        check batch sizes 1 vs 7). Rows never interact otherwise (no batch statistics in eval mode),
        so the padding's content is irrelevant. GPU libraries pick kernels per shape: there, bytes
        are reproducible for a fixed ``batch_size``, not promised across batch sizes.
        """
        n = noise.shape[0]
        pad = -n % self.row_multiple
        idx = torch.cat([torch.arange(n), torch.full((pad,), n - 1)])
        noise, classes, weights = noise[idx], classes[idx], weights[idx]
        # canonical order of each row's classes: a permuted tuple is the same condition
        order = torch.argsort(classes, dim=1, stable=True)
        classes, weights = classes.gather(1, order), weights.gather(1, order)
        cond = self.condition(classes.to(self.device), weights.to(self.device))
        x = self.sample(noise.to(device=self.device, dtype=self.dtype), cond, **(settings or {}))
        return x[:n]

    @torch.inference_mode()
    def generate_series(
        self,
        specs: Sequence[Spec],
        batch_size: int | None = None,
        progress: Callable[[int], Any] | None = None,
        *,
        guidance: float | None = None,
        clip_sample: bool | None = None,
    ) -> torch.Tensor:
        """Images of every series: uint8 [n_series, K, H, W, 3] (RGB, CPU).

        ``specs`` are 2-way ``SeriesSpec`` or k-way ``MixSpec`` (one k for the whole call).
        ``batch_size`` rows (one row = one (series, weight vector) image) per model call; ``progress(n)`` is
        called with the number of images finished after each chunk (e.g. ``tqdm.update``).
        ``guidance`` (w) and ``clip_sample`` (x̂₀ clipping on / off, unet) are this call's
        sampling settings, None: the generator's own; they reach the sampler for this call only,
        so judging a generator at several settings (stages/common/fidelity.py) never changes it.
        Raises ``NonFiniteImageError`` naming the series with NaN/Inf pixels.
        """
        # 1. Load the network if it is not yet, check inputs
        self.load()
        classes, weights = self._check_specs(specs)
        settings = self.call_settings(guidance, clip_sample)
        n_alphas = classes.shape[1]
        batch_size = batch_size or self.batch_size
        # 2. One noise tensor per series, on the CPU; flatten (series, weight vector) into rows
        noise = torch.stack([self.initial_noise(s.seed) for s in specs])
        series_of_row = torch.arange(len(specs)).repeat_interleave(n_alphas)
        classes, weights = classes.flatten(0, 1), weights.flatten(0, 1)
        # 3. Sample chunk by chunk
        n_rows = len(series_of_row)
        out = torch.zeros(n_rows, self.image_size, self.image_size, 3, dtype=torch.uint8)
        bad: set[int] = set()
        for start in range(0, n_rows, batch_size):
            rows = slice(start, min(start + batch_size, n_rows))
            x = self._sample_rows(
                noise[series_of_row[rows]], classes[rows], weights[rows], settings
            )
            finite = torch.isfinite(x).flatten(1).all(dim=1).cpu()
            bad.update(series_of_row[rows][~finite].tolist())
            out[rows] = self.to_uint8(torch.nan_to_num(x.float() / 2 + 0.5))
            if progress is not None:
                progress(rows.stop - rows.start)
        out = out.view(len(specs), n_alphas, self.image_size, self.image_size, 3)
        # 4. Never hand back non-finite images silently
        if bad:
            out[sorted(bad)] = 0
            ids = [specs[i].series_id for i in sorted(bad)]
            raise NonFiniteImageError(ids, out, dtype=str(self.dtype).removeprefix("torch."))
        return out
