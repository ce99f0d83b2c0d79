"""Generator fidelity: does the generator draw the class it is asked for?

A *judge* classifies generated pure-class images (series endpoints); fidelity is the share it
assigns to the class they were generated for (models.annotation_stats.fidelity_stats). Two judges,
because the answer depends on who asks:

- ``cnn_judge``: a real-only classifier run of the train stage (``train/<run>``), the judge of
  the goals (a CNN accepts only images that look like real ones);
- ``linear_probe``: multinomial logistic regression on the pixels of real/train, fitted here
  (it accepts an image with roughly its class's shape, so it reads higher).

Each judge carries its accuracy on real test images, so a fidelity can be read against it.
One judge *chooses* fit-generator's guidance w (the first: ``judge_run``, else the probe); that
is a channel into the generator, so the chooser must sit inside the study's labelled budget (the
probe fits on the generator's own ``train_limit`` images). ``report_judges`` only measure, and
fidelity.json says which judge played which role.
Used by fit-generator (the fidelity curve while it fits) and annotate (its report).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from core.io import atomic_write_json
from core.logs import log
from core.plots import guidance_cells, image_grid
from core.seeding import derive_seed
from core.tracking import scalars
from models.annotation_stats import fidelity_stats
from models.classifiers import classifier_from_config
from models.generators import Generator, SeriesSpec, load_generator
from models.training import collect_logits
from shards.datasets import load_real
from shards.manifest import ShardError
from shards.runs import load_model
from stages.common.budget import labelled_images
from stages.configs.fit_generator import parse_sampler_cell


@dataclass(frozen=True)
class Judge:
    """``predict``: uint8 images [N, H, W, 3] -> predicted classes [N]."""

    name: str
    predict: Callable[[torch.Tensor], torch.Tensor]
    real_test_accuracy: float  # x100, on real/test
    # the real/train images behind it (stages/common/budget.py); None: its folder does not say
    labelled_train_images: int | None = None


def cnn_judge(
    root: Path, run: str, device, batch_size: int = 256, key: str = "fidelity.judge"
) -> Judge:
    """The real-only classifier train/<run> (its own normalisation and input size); ``key`` is
    the path of the config leaf that named it (for the error: what the user types)."""
    folder = root / "train" / run
    try:
        model, meta = load_model(folder, classifier_from_config)
    except ShardError as e:
        raise ShardError(f"{key}={run}: {e}; or set {key}= to another run or to nothing") from e
    model = model.to(device)
    norm = meta["normalize"]

    def predict(x: torch.Tensor) -> torch.Tensor:
        logits = collect_logits(
            model, x, norm["mean"], norm["std"], batch_size=batch_size, device=device,
            image_size=int(meta["image_size"]),
        )  # fmt: skip
        return logits.argmax(dim=1)

    test = load_real(root / "real" / "test")
    seen = labelled_images(root, "train", run)  # None: its folder does not say
    return Judge(f"cnn:{run}", predict, accuracy(predict, test.images, test.labels), seen)


def pixels(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float [N, H·W] (the channel mean: grey datasets are stored as RGB)."""
    return images.float().mean(dim=-1).flatten(1) / 255.0


def linear_probe(
    root: Path, train_limit: int = 0, l2: float = 1e-3, iterations: int = 200
) -> Judge:
    """Logistic regression on the pixels of the first ``train_limit`` images of real/train (0 = all;
    LBFGS, full batch, deterministic: zero initialisation, no random draw)."""
    train = load_real(root / "real" / "train")
    x, y = pixels(train.images), train.labels.long()
    if train_limit:
        x, y = x[:train_limit], y[:train_limit]
    # centred per pixel, scaled by one global std: a per-pixel std would blow up pixels that
    # are constant in real images (digit borders) wherever a generated image is not
    mean = x.mean(0)
    std = (x - mean).std()
    x = (x - mean) / std
    n_classes = len(train.class_names)
    w = torch.zeros(x.shape[1], n_classes, requires_grad=True)
    b = torch.zeros(n_classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(x @ w + b, y) + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    w, b = w.detach(), b.detach()

    def predict(images: torch.Tensor) -> torch.Tensor:
        return (((pixels(images) - mean) / std) @ w + b).argmax(dim=1)

    test = load_real(root / "real" / "test")
    return Judge("linear probe", predict, accuracy(predict, test.images, test.labels), len(y))


def accuracy(predict: Callable, images: torch.Tensor, labels: torch.Tensor) -> float:
    return 100.0 * float((predict(images).cpu() == labels.cpu()).double().mean())


def endpoint_fidelity(
    gen: Generator,
    guidance_grid: Sequence[float],
    judges: Sequence[Judge],
    class_names: Sequence[str],
    *,
    seed: int,
    per_class: int,
    clip_sample: bool | None = None,
) -> dict[str, dict[str, Any]]:
    """{w: {judge name: fidelity_stats}} for pure-class images of every class: image j of every
    class starts from the same noise (seeded by (seed, j)), so classes differ only in the
    condition, and every w sees the same noise. Each w (and ``clip_sample``, the x̂₀ clipping;
    None: the generator's own) is the sampling call's, so ``gen`` is judged, not changed."""
    n_classes = len(class_names)
    seeds = [derive_seed(seed, "fidelity", j) for j in range(per_class)]
    specs = [
        SeriesSpec(c * per_class + j, c, c, (1.0,), seeds[j])
        for c in range(n_classes)
        for j in range(per_class)
    ]
    expected = torch.arange(n_classes).repeat_interleave(per_class)
    out = {}
    for w in guidance_grid:
        images = gen.generate_series(specs, guidance=float(w), clip_sample=clip_sample)[:, 0]
        out[f"{w:g}"] = {
            j.name: fidelity_stats(
                j.predict(images), expected, tuple(class_names), j.real_test_accuracy
            )
            for j in judges
        }
    return out


def best_guidance(point: dict[str, dict[str, Any]], judge: str) -> float:
    """The w whose endpoints ``judge`` accepts most often (ties: the smaller w)."""
    return float(min(point, key=lambda w: (-point[w][judge]["accuracy"], float(w))))


def make_judges(
    root: Path, cnn_run: str, device, train_limit: int = 0, report: Sequence[str] = ()
) -> list[Judge]:
    """The chooser first: the CNN judge train/<cnn_run> if named, else the linear probe (fitted
    on the first ``train_limit`` real/train images); then the probe, then the ``report`` runs, which
    only measure."""
    judges = [cnn_judge(root, cnn_run, device)] if cnn_run else []
    judges.append(linear_probe(root, train_limit))
    judges += [cnn_judge(root, run, device, key="fidelity.report_judges") for run in report]
    for i, j in enumerate(judges):
        log.info(
            "fidelity judge %s (%s, %s labelled train images): %.1f %% on real test",
            j.name, "chooses w" if i == 0 else "reports only", j.labelled_train_images,
            j.real_test_accuracy,
        )  # fmt: skip
    return judges


class FidelityCheck:
    """fit-generator's fidelity while it fits: one call per point of the curve, then the chosen
    guidance and the files (fidelity.json, fidelity.png)."""

    def __init__(
        self,
        judges: Sequence[Judge],
        guidance_grid: Sequence[float],
        class_names: Sequence[str],
        seed: int,
        per_class: int,
        clip_choice: bool = False,
        samplers: Sequence[str] = (),
    ) -> None:
        self.judges, self.guidance_grid = list(judges), tuple(guidance_grid)
        self.class_names, self.seed, self.per_class = tuple(class_names), seed, per_class
        self.clip_choice = clip_choice
        self.samplers = tuple(samplers)  # fidelity.samplers' entries, "<sampler>:<steps>[:bf16]"

    def _cells(self, gen: Generator, saved: str) -> dict[str, Any]:
        """{"guidance": {w: {judge: stats}}} at the sampler's saved clipping; with clip_choice
        also "clip": {"on" | "off": {w: ...}} (both settings, each the sampling calls' own:
        ``gen`` keeps its sampler) and "clip_saved"."""
        out: dict[str, Any] = {}
        for clip in ("on", "off") if self.clip_choice else (None,):
            cells = endpoint_fidelity(
                gen, self.guidance_grid, self.judges, self.class_names, seed=self.seed,
                per_class=self.per_class, clip_sample=None if clip is None else clip == "on",
            )  # fmt: skip
            if clip is None or clip == saved:
                out["guidance"] = cells
            if clip is not None:
                out.setdefault("clip", {})[clip] = cells
        if self.clip_choice:
            out["clip_saved"] = saved
        return out

    def sampler_cells(self, gen: Generator, saved: str) -> dict[str, Any]:
        """Every fidelity.samplers entry judged as the fit's own cells are (the same noise, w
        and clipping), on the same weights: {entry: {"guidance": ..., "clip": ...}}. A bf16
        entry is judged only where the device computes bf16 natively (core.precision), on a
        bf16 copy of the weights, as generate's precision=bf16 samples; elsewhere it is left
        out (logged), so the study never keeps it there."""
        import copy

        from core.precision import native_bf16

        out = {}
        for entry in self.samplers:
            sampler, steps, precision = parse_sampler_cell(entry)
            if precision == "bf16" and not native_bf16(gen.device):
                log.info("fit-generator: %s left out: %s has no native bf16", entry, gen.device)
                continue
            unet = gen.unet if precision == "fp32" else copy.deepcopy(gen.unet).bfloat16()  # type: ignore[attr-defined]
            variant = type(gen).from_model(  # type: ignore[attr-defined]
                unet, gen.scheduler_config, sampler=sampler, steps=steps, device=gen.device,  # type: ignore[attr-defined]
                dtype="bfloat16" if precision == "bf16" else "float32", guidance=gen.guidance,
            )  # fmt: skip
            out[entry] = self._cells(variant, saved)
        return out

    def __call__(self, gen: Generator, step: int) -> dict[str, Any]:
        """One point of the curve at fit step ``step``, logged as it comes: {"step", "guidance":
        {w: {judge: stats}}} with the sampler's saved x̂₀ clipping; with ``clip_choice`` also
        "clip": {"on" | "off": {w: ...}} (both settings, the saved one's the same as "guidance")
        and "clip_saved"; with ``samplers``, "samplers": {entry: the same for that sampler}."""
        start = time.perf_counter()
        saved = "on" if gen.scheduler.config.get("clip_sample", False) else "off"
        point: dict[str, Any] = {"step": step, **self._cells(gen, saved)}
        if self.samplers:  # the faster cells; the choice below reads the fit's own only
            point["samplers"] = self.sampler_cells(gen, saved)
        text = " | ".join(
            f"{'' if c is None else f'clip {c}, '}w={w}: "
            + ", ".join(f"{j} {st['accuracy']:.1f} %" for j, st in by_judge.items())
            for c, by_w in point.get("clip", {None: point["guidance"]}).items()
            for w, by_judge in by_w.items()
        )
        log.info(
            "fit-generator: step %d endpoint fidelity %s (%.0f s)",
            step, text, time.perf_counter() - start,
        )  # fmt: skip
        return point

    def choose(self, curve: list[dict[str, Any]]) -> tuple[float, bool | None, dict[str, float]]:
        """The best w of the last point by the first judge (the chooser: judge_run's CNN, else
        the probe), with the best x̂₀ clipping when the point has both (ties: the saved
        setting, then the smaller w; None: the saved setting, not chosen), and the fidelity
        there by every judge."""
        last, chooser = curve[-1], self.judges[0].name
        if "clip" not in last:
            w = best_guidance(last["guidance"], chooser)
            cells = last["guidance"][f"{w:g}"]
            return w, None, {name: round(st["accuracy"], 2) for name, st in cells.items()}
        clip, w = min(
            ((c, w) for c, by_w in last["clip"].items() for w in by_w),
            key=lambda cw: (
                -last["clip"][cw[0]][cw[1]][chooser]["accuracy"],
                cw[0] != last["clip_saved"],
                float(cw[1]),
            ),
        )
        cells = last["clip"][clip][w]
        summary = {name: round(st["accuracy"], 2) for name, st in cells.items()}
        return float(w), clip == "on", summary

    def write(
        self,
        folder: Path,
        curve: list[dict[str, Any]],
        guidance: float,
        clip_sample: bool | None = None,
    ) -> None:
        """fidelity.json (every point, w and judge, per class; the chosen w, and the chosen x̂₀
        clipping when it was chosen) and fidelity.png (fidelity against w at the last point by
        the chooser, one line per clipping setting, the most faithful cell starred), then the
        chosen cell's per-class numbers in the log."""
        judges = {
            j.name: {
                "real_test_accuracy": j.real_test_accuracy,
                "labelled_train_images": j.labelled_train_images,
                "role": "chooses w" if i == 0 else "reports only",
            }
            for i, j in enumerate(self.judges)
        }
        chosen = {} if clip_sample is None else {"clip_sample": clip_sample}
        atomic_write_json(
            folder / "fidelity.json",
            {"guidance": guidance, **chosen, "judges": judges, "curve": curve},
        )
        last = curve[-1]
        by_clip = last.get("clip", {None: last["guidance"]})
        # fidelity against w at the last check, one line per clipping setting, by the chooser
        # (the judges' numbers per point are in fidelity.json and the log): a curve over steps
        # is one dot per cell when the fit checks once, at its end
        chooser = self.judges[0].name
        what = f"w={guidance:g}"
        what += "" if clip_sample is None else f", clip {'on' if clip_sample else 'off'}"
        cells = [
            (clip, float(w), float(by_judge[chooser]["accuracy"]))
            for clip, by_w in by_clip.items()
            for w, by_judge in by_w.items()
        ]
        saved = None if clip_sample is None else ("on" if clip_sample else "off")
        guidance_cells(
            cells, folder / "fidelity.png", chosen=(saved, float(guidance)),
            chosen_label="the fit's most faithful", title=f"generator fidelity at step "
            f"{last['step']} by {chooser} (most faithful: {what}; a study may choose another "
            "cell on val)",
        )  # fmt: skip
        cell = by_clip[None if clip_sample is None else ("on" if clip_sample else "off")]
        for name, st in cell[f"{guidance:g}"].items():
            per_class = ", ".join(
                f"{c} {v['accuracy']:.0f}"
                + "".join(f" ({k}: {share:.0f})" for k, share in v.get("taken_for", {}).items())
                for c, v in st["per_class"].items()
            )
            log.info("fit-generator: %s %s per class in %% (taken for): %s", what, name, per_class)


def fidelity_scalars(point: dict[str, Any]) -> dict[str, float]:
    """A point of the fidelity curve for the trackers: fidelity/<judge>/w_<w> = the share (%) of
    the endpoints the judge takes for their class (names made tracker-safe: linear_probe)."""
    return scalars(
        {
            f"fidelity/{judge}/w_{w}": stats["accuracy"]
            for w, by_judge in point["guidance"].items()
            for judge, stats in by_judge.items()
        }
    )


def sample_grid(
    folder: Path,
    class_names: tuple[str, ...],
    device,
    guidance: float,
    steps: int,
    per_class: int,
    seed: int,
    clip_sample: bool | None = None,
) -> Path:
    """sample_grid.png of a fitted generator folder (the generate stage's loading path) at the
    recorded guidance and x̂₀ clipping: one row per class, `per_class` columns; column j shares
    one noise across classes, so rows differ only in the class."""
    gen = load_generator(
        "unet", model=folder, steps=steps, device=device, guidance=guidance,
        clip_sample=clip_sample,
    )  # fmt: skip
    n = per_class
    seeds = [derive_seed(seed, "fit-grid", j) for j in range(n)]
    specs = [
        SeriesSpec(c * n + j, c, c, (1.0,), seeds[j])
        for c in range(len(class_names))
        for j in range(n)
    ]
    images = gen.generate_series(specs).view(len(class_names), n, *gen.noise_shape[1:], 3)
    scale = max(1, 64 // gen.image_size)
    return image_grid(
        images.numpy(), folder / "sample_grid.png", row_labels=class_names, scale=scale
    )
