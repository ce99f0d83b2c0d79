"""The dataset card of a mixed/ folder: Hub metadata (license, size, `configs` globs) and a
body that says how the data was made, built from the manifest and the annotation report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from huggingface_hub import DatasetCard, DatasetCardData

from shards.manifest import Manifest

DATA_GLOB = "mixed-*.tar"  # the card's `configs` glob: exactly the shards of a mixed/ folder

# Hub license ids semix may write into a card (the Hub refuses ids outside its own list).
HUB_LICENSES = ("apache-2.0", "mit", "bsd-3-clause", "cc0-1.0", "cc-by-4.0", "cc-by-sa-4.0")
HUB_LICENSES += ("cc-by-nc-4.0", "cc-by-nc-sa-4.0", "openrail", "openrail++", "other")
HUB_LICENSES += ("creativeml-openrail-m", "bigscience-openrail-m")
# Known generators, matched on the lowercased model id; images follow the generator's license.
MODEL_LICENSES = {
    "stable-diffusion-v1-": "creativeml-openrail-m",  # CompVis v1-x, runwayml / sd-legacy v1-5
    "stable-diffusion-2": "openrail++",  # stabilityai 2, 2-base, 2-1, 2-1-base
    "stable-diffusion-xl": "openrail++",
    "dit-xl-2": "cc-by-nc-4.0",  # facebook/DiT-XL-2-256, -512
}
BACKEND_LICENSES = {"dit": "cc-by-nc-4.0"}  # every released DiT checkpoint is CC BY-NC 4.0
_SIZES = ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"))
_SIZES += ((1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M"), (100_000_000, "10M<n<100M"))


# ------------------------------------------------------------------------- card metadata


def size_category(n: int) -> str:
    """The Hub's size_categories bucket for n samples."""
    return next((name for bound, name in _SIZES if n < bound), "100M<n<1B")


def license_for(
    generator: Mapping[str, Any], data_license: tuple[str, str] | None, override: str = ""
) -> tuple[str, str]:
    """(Hub license id, one plain sentence for the card saying where it comes from).

    Order: the publisher's override, the license the generate stage recorded, known model ids,
    the in-house UNet's training data (`data_license`: (its license id, what the data is), where
    the preset knows it: the UNet learns only from the real training set, so its images carry
    that license), the backend; otherwise `other`, said plainly.
    """
    model, backend = str(generator.get("model_id", "")), str(generator.get("backend", ""))
    if override:
        return override, f"`{override}`, set by the publisher."
    recorded = str(generator.get("license", ""))
    if recorded in HUB_LICENSES and recorded != "other":
        return recorded, f"`{recorded}`, the license of the generator `{model}`."
    for pattern, lic in MODEL_LICENSES.items():
        if pattern in model.lower():
            return lic, f"`{lic}`, the license of the generator `{model}`."
    if backend == "unet" and data_license is not None:
        lic, source = data_license
        return lic, f"`{lic}`: semix's in-house UNet was trained only on {source}, licensed {lic}."
    if backend in BACKEND_LICENSES:
        lic = BACKEND_LICENSES[backend]
        return lic, f"`{lic}`, the license of the {backend} backend's weights."
    return "other", (
        f"`other`: semix does not know the license of the generator `{model or backend}`. Check "
        "that model's terms before reusing these images."
    )


CITATION = """@inproceedings{luo2025beyond,
  title     = {Beyond One-Hot Labels: Semantic Mixing for Model Calibration},
  author    = {Luo, Haoyang and Tao, Linwei and Dong, Minjing and Xu, Chang},
  booktitle = {Proceedings of the 42nd International Conference on Machine Learning (ICML)},
  year      = {2025}
}"""
FIELDS = (
    ("png", "the image (RGB)"),
    ("cls", "dominant class after re-annotation: a if t_a >= 0.5 else b"),
    ("json.series, json.position", "series id; position k in the series (shared initial noise)"),
    ("json.classes, json.names", "the mixed pair [a, b] as class indices and names"),
    ("json.alpha", "generation weight of class a"),
    ("json.lambda_hat", "re-annotated weight of class a (projection on the prototypes, unclipped)"),
    ("json.soft", "training target [t_a, t_b], t_a = sigmoid(s (lambda_hat - 0.5))"),
    ("json.seed, json.generator, ...", "seed, generator id, revision, sampler, steps, guidance"),
)


# k-way data (generate's mix_classes = k >= 3): the fields that differ from the 2-way ones
KWAY_FIELDS = (
    ("png", "the image (RGB)"),
    ("cls", "dominant class after re-annotation: the class with the highest soft target"),
    ("json.series, json.position", "series id; lattice point of the series (shared initial noise)"),
    ("json.classes, json.names", "the k mixed classes as class indices and names"),
    ("json.weights", "generation weights w of the k classes (a point of the simplex lattice)"),
    (
        "json.lambda_hat",
        "re-annotated weights: barycentric coordinates of the image feature in "
        "the affine hull of the k prototypes (unclipped, sum 1)",
    ),
    ("json.soft", "training target over the k classes, softmax((s/2) lambda_hat)"),
    ("json.seed, json.generator, ...", "seed, generator id, revision, sampler, steps, guidance"),
)


def _fmt(value: Any) -> str:
    """Compact Markdown-safe rendering of a manifest value; empty -> an em dash. A mapping
    inside a mapping is put in parentheses: `arch=(arch=cnn, ...)`, never `arch=arch=cnn`."""
    if isinstance(value, Mapping):
        items = [f"{k}=({_fmt(v)})" if isinstance(v, Mapping) else f"{k}={_fmt(v)}"
                 for k, v in value.items()]  # fmt: skip
        return ", ".join(items) or "—"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value) or "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value in (None, "") else str(value).replace("|", "/")


# encoder identity (models.encoders: `identity`) -> the card's rows
ENCODER_KINDS = {
    "module": "semix classifier",
    "openclip": "OpenCLIP",
    "hf-clip": "Hugging Face CLIP",
}
ENCODER_INPUT = ("image_size", "interpolation", "resize_mode", "center_crop", "mean", "std")


def _encoder_rows(identity: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """The annotation encoder as card rows: what it is, its architecture (a semix classifier's
    arch config), which weights, its input; whatever else the identity holds in a last row."""
    if not identity:
        return [("encoder", "—")]
    rest = dict(identity)
    kind, name, run = rest.pop("kind", ""), rest.pop("name", ""), rest.pop("run", "")
    what = ENCODER_KINDS.get(kind, kind)
    named = f"`{_fmt(name)}`" if name else ""
    if run:
        named = f"{named} (train run `{_fmt(run)}`)".strip()
    rows = [("encoder", " ".join(x for x in (what, named) if x) or "—")]
    arch = rest.pop("arch", None)
    if isinstance(arch, Mapping):
        arch = dict(arch)
        head = arch.pop("arch", "")
        rows.append(
            ("encoder architecture", f"{_fmt(head)} ({_fmt(arch)})" if arch else _fmt(head))
        )
    elif arch:
        rows.append(("encoder architecture", _fmt(arch)))
    weights = []
    if rest.get("pretrained"):
        weights.append(f"pretrained `{_fmt(rest['pretrained'])}`")
    rest.pop("pretrained", None)
    if "init_seed" in rest:
        weights.append(f"random init (seed {_fmt(rest.pop('init_seed'))})")
    for key in ("weights_sha256", "checkpoint_sha256"):
        digest = rest.pop(key, None)
        if isinstance(digest, Mapping):
            weights += [f"{_fmt(f)} sha256 `{_fmt(d)}`" for f, d in digest.items()]
        elif digest:
            weights.append(f"sha256 `{_fmt(digest)}`")
    if rest.get("revision"):
        weights.append(f"revision `{_fmt(rest['revision'])}`")
    rest.pop("revision", None)
    if weights:
        rows.append(("encoder weights", ", ".join(weights)))
    seen = {k: rest.pop(k) for k in ENCODER_INPUT if k in rest}
    if seen:
        size = seen.get("image_size")
        parts = ["x".join(str(v) for v in size) + " px" if isinstance(size, (list, tuple)) else ""]
        if seen.get("interpolation"):
            parts.append(f"{seen['interpolation']} resize ({_fmt(seen.get('resize_mode'))})")
        if seen.get("center_crop"):
            parts.append("center crop " + "x".join(str(v) for v in seen["center_crop"]))
        parts += [f"{k} {_fmt(seen[k])}" for k in ("mean", "std") if k in seen]
        rows.append(("encoder input", ", ".join(p for p in parts if p) or "—"))
    if rest:
        rows.append(("encoder (other)", _fmt(rest)))
    return rows


def _stats_lines(stats: Mapping[str, Any]) -> list[str]:
    """Annotation report (annotation.json) as prose and a per-alpha table; absent keys skipped."""
    lines = []
    if stats.get("spearman_lambda_weight") is not None:
        k = stats.get("mix_classes", "k")
        lines.append(
            f"- Spearman correlation of λ̂_i with w_i over every image and its {k} classes: "
            f"{stats['spearman_lambda_weight']:.3f}"
        )
    if stats.get("edge_monotone_share") is not None:
        n = stats.get("n_series_checked", "?")
        lines.append(
            f"- series whose λ̂ follows w along every lattice edge: "
            f"{stats['edge_monotone_share']:.1%} (of {n})"
        )
    if stats.get("spearman_lambda_alpha") is not None:
        lines.append(f"- Spearman correlation of λ̂ with α: {stats['spearman_lambda_alpha']:.3f}")
    if stats.get("monotone_share") is not None:
        n = stats.get("n_series_checked", "?")
        lines.append(f"- series whose λ̂ rises with α: {stats['monotone_share']:.1%} (of {n})")
    lam = stats.get("lambda_hat") or {}
    if {"mean", "std", "min", "max"} <= set(lam):
        lines.append(
            f"- λ̂ mean {lam['mean']:.3f} ± {lam['std']:.3f}, range [{lam['min']:.3f}, "
            f"{lam['max']:.3f}]; below 0: {lam.get('share_below_0', 0):.1%}, "
            f"above 1: {lam.get('share_above_1', 0):.1%}"
        )
    rows = stats.get("per_alpha") or []
    if rows:
        lines += ["", "| α | images | mean λ̂ | std λ̂ |", "|---|---|---|---|"]
        lines += [
            f"| {r['alpha']:.3g} | {r['n']} | {r['mean']:.3f} | {r['std']:.3f} |" for r in rows
        ]
    return lines


def build_card(
    manifest: Manifest,
    annotation: Mapping[str, Any] | None,
    *,
    repo: str,
    license_id: str,
    license_note: str,
    files: Sequence[str],
) -> DatasetCard:
    """The dataset card: Hub metadata through DatasetCardData, body from the manifest + report.

    `files` are the repo paths being published, so the card links only plots that exist.
    """
    info, n = manifest.info, manifest.num_samples
    gen, ann = info.get("generator", {}), info.get("annotation", {})
    name = repo.split("/")[-1]
    data = DatasetCardData(
        license=license_id,
        task_categories=["image-classification"],
        tags=["semix", "calibration", "synthetic", "soft-labels", "diffusion", "webdataset"],
        size_categories=[size_category(n)],
        pretty_name=f"{name} (semix CSM mixed data)",
        configs=[{"config_name": "default", "data_files": [{"split": "train", "path": DATA_GLOB}]}],
    )
    classes = manifest.class_names
    shown = ", ".join(classes[:20]) + (", …" if len(classes) > 20 else "")
    k = int(info.get("mix_classes", 2))
    if k == 2:
        mixing = [
            ("classes mixed per series (k)", "2"),
            ("α grid (weight of class a)", _fmt(info.get("alphas"))),
            ("series per pair", _fmt(info.get("series_per_pair"))),
            ("pairs / series", f"{_fmt(info.get('num_pairs'))} / {_fmt(info.get('num_series'))}"),
        ]
    else:
        mixing = [
            ("classes mixed per series (k)", str(k)),
            ("simplex lattice m (weights n_i / m)", _fmt(info.get("lattice"))),
            ("lattice points per series", _fmt(len(info.get("weights") or ()))),
            ("series per tuple", _fmt(info.get("series_per_tuple"))),
            ("tuples / series", f"{_fmt(info.get('num_tuples'))} / {_fmt(info.get('num_series'))}"),
        ]
    made = [
        ("generator", f"{_fmt(gen.get('backend'))} `{_fmt(gen.get('model_id'))}`"),
        ("revision", _fmt(gen.get("revision"))),
        ("sampler", f"{_fmt(gen.get('sampler'))}, {_fmt(gen.get('steps'))} steps"),
        ("guidance", _fmt(gen.get("guidance"))),
        *mixing,
        ("image size", _fmt(info.get("image_size"))),
        ("annotation method", _fmt(ann.get("method"))),
        *_encoder_rows(ann.get("encoder")),
        ("prototypes", _fmt(ann.get("prototypes"))),
        ("sharpening s", _fmt(ann.get("sharpening"))),
        ("images / shards", f"{n} / {len(manifest.shards)}"),
        ("semix version", _fmt(manifest.code_version)),
    ]
    body = [
        f"# {data.pretty_name}",
        "",
        (
            f"{n} synthetic images made with semix by Calibration-aware "
            "Semantic Mixing (CSM): each series shares one initial noise and morphs class a into "
            "class b as the mixing weight α goes from 0 to 1; every image carries a soft label "
            f"re-annotated from image features. {len(classes)} classes: {shown}."
        )
        if k == 2
        else (
            f"{n} synthetic images made with semix by {k}-way semantic mixing (CSM extended "
            f"to {k} classes): each series shares one initial noise rendered at every point of "
            f"a simplex lattice of weights over {k} classes; every image carries a soft label "
            f"over its {k} classes re-annotated from image features. {len(classes)} classes: "
            f"{shown}."
        ),
        "",
        "## How it was made",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in made],
        "",
        "Settings come from `manifest.json` (`info`), which also lists every shard with its "
        "sample count and sha256. The stages' `config.json` files are not published: they hold "
        "local paths.",
    ]
    if annotation:
        body += [
            "",
            "## Annotation statistics",
            "",
            *_stats_lines(annotation.get("stats", annotation)),
        ]
    plots = ("annotation.png", "ternary.png", "preview.png")
    body += [f"\n![{p[:-4]}]({p})" for p in plots if p in files]
    body += ["", "## Fields", "", "| field | meaning |", "|---|---|"]
    body += [f"| `{name}` | {v} |" for name, v in (FIELDS if k == 2 else KWAY_FIELDS)]
    body += [
        "",
        "## Load it",
        "",
        "```python",
        "from datasets import load_dataset",
        f'ds = load_dataset("{repo}", split="train")  # png, cls, json (alpha, lambda_hat, soft, ...)',
        "```",
        "",
        "```python",
        "import glob, webdataset as wds",
        "from huggingface_hub import snapshot_download",
        f'local = snapshot_download("{repo}", repo_type="dataset")',
        f'ds = wds.WebDataset(sorted(glob.glob(local + "/{DATA_GLOB}"))).decode("pil")',
        "```",
        "",
        f"With semix: `make pull REPO={repo}` verifies every shard against `manifest.json`, then "
        f"`make train MIXED=runs/{name}/mixed` trains on it.",
        "",
        "## License",
        "",
        license_note,
        "",
        "## Citation",
        "",
        "```bibtex",
        CITATION,
        "```",
    ]
    return DatasetCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body) + "\n")
