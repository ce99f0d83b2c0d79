"""Generator fidelity by every judge, side by side, on the endpoints generate drew.

    python -m bench judges                                        # runs/fashion-mnist
    SEMIX_BENCH_JUDGES=/data/runs/fashion-mnist python -m bench judges

fit-generator chooses w on images from its own fixed noise. This reads the endpoints of series/
(α = 0 and 1 of every series: noise that chose nothing) and asks every judge: the CNN runs that
fit-generator's fidelity.json names (which one chose w, and on how many labelled images), and
logistic regression on pixels fitted on the generator's own images and on all of real/train. A
goal met by one judge only is not met. Beside them, two facts read off the pixels, generated
against real test images of the same class: the share whose right half holds more ink (every
Fashion-MNIST shoe points one way: mirrored shoes show up here) and the background (the mean of
the four 4x4 corners, 0-255).
"""

from __future__ import annotations

import json

import torch

from bench import fit_config, run_root
from shards.datasets import load_real
from stages.annotate.report import endpoints
from stages.common.fidelity import cnn_judge, linear_probe

CORNER = 4  # px: the corner patches read as background


def right_heavy(images: torch.Tensor) -> torch.Tensor:
    """1 where the right half of the (grey) image holds more ink than the left."""
    grey = images.float().mean(dim=-1)
    half = grey.shape[-1] // 2
    return grey[..., half + grey.shape[-1] % 2 :].sum((1, 2)) > grey[..., :half].sum((1, 2))


def corners(images: torch.Tensor) -> torch.Tensor:
    """The mean of the four CORNER x CORNER corner patches of each image (0-255)."""
    g = images.float().mean(dim=-1)
    c = CORNER
    patches = [g[:, :c, :c], g[:, :c, -c:], g[:, -c:, :c], g[:, -c:, -c:]]
    return torch.stack([p.mean((1, 2)) for p in patches]).mean(0)


def run() -> dict | None:
    root = run_root(
        "judges",
        "SEMIX_BENCH_JUDGES",
        ("runs/fashion-mnist",),
        "series/manifest.json",
        "generated series",
    )
    if root is None:
        return None
    generator = fit_config(root / "generator")
    fidelity = json.loads((root / "generator" / "fidelity.json").read_text())
    images, expected = endpoints(root / "series")
    test = load_real(root / "real" / "test")
    names = test.class_names

    judges = []  # (name, role, labelled images, real test %, predictions)
    for name, info in fidelity["judges"].items():
        if name.startswith("cnn:"):
            j = cnn_judge(root, name.removeprefix("cnn:"), "cpu")
            judges.append((name, info.get("role", "?"), j.labelled_train_images,
                           j.real_test_accuracy, j.predict(images)))  # fmt: skip
    for limit in dict.fromkeys((generator.train_limit, 0)):
        j = linear_probe(root, limit)
        judges.append((f"probe ({j.labelled_train_images})", "reports only",
                       j.labelled_train_images, j.real_test_accuracy, j.predict(images)))  # fmt: skip

    rows = []
    real_right, gen_right = right_heavy(test.images), right_heavy(images)
    for k in [*range(len(names)), None]:
        mine = expected == k if k is not None else torch.ones_like(expected, dtype=torch.bool)
        real = test.labels == k if k is not None else torch.ones_like(test.labels, dtype=torch.bool)
        row = {"class": names[k] if k is not None else f"all ({int(mine.sum())} endpoints)"}
        for name, _, _, _, pred in judges:
            row[f"{name} %"] = f"{100 * float((pred[mine] == expected[mine]).double().mean()):.1f}"
        row["right-heavy real / gen %"] = (
            f"{100 * float(real_right[real].double().mean()):.0f} / "
            f"{100 * float(gen_right[mine].double().mean()):.0f}"
        )
        rows.append(row)

    real_bg, gen_bg = corners(test.images), corners(images)
    annotation = root / "mixed" / "annotation.json"
    spearman = (
        json.loads(annotation.read_text()).get("spearman_lambda_alpha")
        if annotation.is_file()
        else None
    )
    notes = [
        f"{root}: generator {generator.unet}, {generator.train_steps} fit steps, "
        f"{generator.noise.prediction_type}, augment.flip={generator.augment.flip}, "
        f"train_limit={generator.train_limit}, guidance w = {fidelity['guidance']:g} "
        f"chosen by {next(iter(fidelity['judges']))}; {len(images)} endpoints of series/.",
        "judges (role, labelled train images, accuracy on real test): "
        + "; ".join(f"{n} ({r}, {n_img}, {acc:.1f} %)" for n, r, n_img, acc, _ in judges),
        f"background (mean of the 4x4 corners, 0-255): real test {float(real_bg.mean()):.2f} "
        f"({100 * float((real_bg > 10).double().mean()):.1f} % above 10), generated "
        f"{float(gen_bg.mean()):.2f} ({100 * float((gen_bg > 10).double().mean()):.1f} % above 10)",
        "Spearman(α, λ̂) of the annotated set (mixed/annotation.json): "
        + ("-" if spearman is None else f"{spearman:.3f}"),
    ]
    return {"title": f"generator fidelity by every judge ({root.name}, fresh noise)",
            "rows": rows, "notes": notes}  # fmt: skip
