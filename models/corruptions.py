"""Common corruptions at five severities, for small images (28x28 grey first): the parts of the
`shift` stage that build Fashion-MNIST-C (or <any prepared test split>-C) offline.

    out = corrupt(images, "motion_blur", severity=3, rng=np.random.default_rng(seed))

`images` is uint8 [N, H, W, C] (C = 1 for grey sets, 3 for colour); the result has the same
shape and dtype. Every random draw comes from the `rng` the caller passes (the stage seeds one
per (seed, corruption, severity)), all N images drawn at once in a fixed order, so the same
inputs and generator give the same bytes.

The corruptions and their severity ladders follow CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019,
`make_cifar_c.py`) and MNIST-C (Mu & Gilmer, 2019, `corruptions.py`), where each has five levels
in code. Where a ladder was made for 32 px colour photos (CIFAR-10-C) and is invisible on 28 px
grey images, or made for strokes on black (MNIST-C) and wipes out a 28 px garment at level 2,
the ladder here lies between the two, and `Corruption.source` says so. Spatial parameters
(blur widths, displacement sizes) are set for 28 px and scale with the image side / 28. The
weather corruptions (fog, frost, snow, spatter) need texture files or an ImageMagick binding
and mean little at 28 px; they are left out. The table with every ladder: docs/shift.md.

Why no library: `imagecorruptions` (the packaged CIFAR-C/ImageNet-C code) installs with the
pinned set, but draws from numpy's global RNG (no generator argument: a seed per (corruption,
severity) would mean reseeding global state), carries ImageNet's 224 px ladders (a Gaussian blur
of sigma 1..6 px, frost crops of 224 px), wants RGB HxWx3, and brings OpenCV and scikit-image
in. What is needed here is small: numpy for the draws and the bilinear warps, scipy.ndimage
(installed with scikit-learn) for Gaussian filtering, Pillow for JPEG and box resampling.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image
from scipy.ndimage import gaussian_filter

from core.config import ConfigError

SEVERITIES = (1, 2, 3, 4, 5)  # CIFAR-C's five levels, stacked in this order
BASE_SIZE = 28  # the side the spatial ladders are set for


# ---------------------------------------------------------------- helpers


WARP_CHUNK = 1024  # images per _bilinear batch


def _bilinear(x: np.ndarray, ys: np.ndarray, xs: np.ndarray, fill: float | None) -> np.ndarray:
    """x [N, H, W, C] sampled at source coordinates (ys, xs) [N, H, W], bilinear. Neighbours
    outside the image are the nearest edge pixel (fill None) or `fill` (as skimage's warp with
    cval: a pixel half outside is blended with it)."""
    if len(x) > WARP_CHUNK:  # bounded memory: each image is sampled on its own
        return np.concatenate(
            [
                _bilinear(
                    x[i : i + WARP_CHUNK], ys[i : i + WARP_CHUNK], xs[i : i + WARP_CHUNK], fill
                )
                for i in range(0, len(x), WARP_CHUNK)
            ]
        )
    n, h, w, _ = x.shape
    y0, x0 = np.floor(ys), np.floor(xs)
    wy, wx = (ys - y0)[..., None], (xs - x0)[..., None]
    index = np.arange(n)[:, None, None]

    def at(yy: np.ndarray, xx: np.ndarray) -> np.ndarray:
        v = x[index, np.clip(yy, 0, h - 1).astype(np.intp), np.clip(xx, 0, w - 1).astype(np.intp)]
        if fill is None:
            return v
        inside = (yy >= 0) & (yy <= h - 1) & (xx >= 0) & (xx <= w - 1)
        return np.where(inside[..., None], v, fill)

    top = at(y0, x0) * (1 - wx) + at(y0, x0 + 1) * wx
    bottom = at(y0 + 1, x0) * (1 - wx) + at(y0 + 1, x0 + 1) * wx
    return top * (1 - wy) + bottom * wy


def _grid(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixel row and column coordinates, each [1, H, W]."""
    _, h, w, _ = x.shape
    ys, xs = np.meshgrid(
        np.arange(h, dtype=np.float64), np.arange(w, dtype=np.float64), indexing="ij"
    )
    return ys[None], xs[None]


def _per_image(x: np.ndarray, fn: Callable[[Image.Image], Image.Image]) -> np.ndarray:
    """Apply a Pillow operation to each image (uint8, mode L or RGB); floats in [0, 1] back."""
    u8 = np.round(x * 255.0).astype(np.uint8)
    mode = "L" if x.shape[-1] == 1 else "RGB"
    out = np.empty_like(u8)
    for i, im in enumerate(u8):
        pil = Image.fromarray(im[..., 0] if mode == "L" else im, mode=mode)
        out[i] = np.asarray(fn(pil)).reshape(im.shape)
    return out.astype(np.float64) / 255.0


def _scale(x: np.ndarray) -> float:
    """Spatial parameters are set for 28 px: side / 28."""
    return x.shape[1] / BASE_SIZE


# ---------------------------------------------------------------- corruptions
# Each takes floats in [0, 1] [N, H, W, C], its severity's parameter and the generator, and
# returns floats (clipped to [0, 1] and rounded to uint8 by `corrupt`).


def gaussian_noise(x: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """x + n, n ~ N(0, sigma^2) i.i.d. per pixel and channel."""
    return x + rng.normal(0.0, sigma, x.shape)


def shot_noise(x: np.ndarray, lam: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson photon noise: Poisson(lam * x) / lam (fewer photons lam = noisier)."""
    return rng.poisson(x * lam) / lam


def impulse_noise(x: np.ndarray, amount: float, rng: np.random.Generator) -> np.ndarray:
    """Salt and pepper: a fraction `amount` of the values set to 0 or 1, half each (as
    skimage's random_noise(mode="s&p"), which CIFAR-C and MNIST-C call)."""
    hit = rng.random(x.shape) < amount
    salt = rng.random(x.shape) < 0.5
    return np.where(hit, salt.astype(np.float64), x)


def gaussian_blur(x: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian filter of standard deviation sigma px over H and W (edges: nearest)."""
    s = sigma * _scale(x)
    return gaussian_filter(x, sigma=(0, s, s, 0), mode="nearest")


def motion_blur(x: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """A one-sided streak along an angle theta ~ U(-45, 45) degrees per image: the sum of x
    shifted by t = 0, 1, ..., ceil(3 sigma) px along theta, weighted exp(-t^2 / 2 sigma^2) and
    normalised (ImageMagick's motion blur, which CIFAR-C and MNIST-C call, radius 3 sigma).
    Each image's taps are splatted bilinearly into one kernel K (= bilinear sampling at every
    tap) and out(p) = sum_d K(d) x(p - d) is computed by FFT on the image padded with its edge
    pixels (a circular convolution that never wraps: the pad is as wide as the kernel)."""
    s = sigma * _scale(x)
    n, h, w, _ = x.shape
    theta = np.deg2rad(rng.uniform(-45.0, 45.0, n))
    taps = np.arange(math.ceil(3 * s) + 1, dtype=np.float64)
    weights = np.exp(-(taps**2) / (2 * s * s))
    weights /= weights.sum()
    r = int(taps[-1]) + 1  # every tap's bilinear footprint lies within offsets -r..r
    size = (h + 2 * r, w + 2 * r)
    out = np.empty_like(x)
    for start in range(0, n, MOTION_CHUNK):  # bounded memory; each image is independent
        part = slice(start, min(start + MOTION_CHUNK, n))
        dy = taps[None] * np.sin(theta[part])[:, None]  # [n', taps]
        dx = taps[None] * np.cos(theta[part])[:, None]
        y0, x0 = np.floor(dy), np.floor(dx)
        fy, fx = dy - y0, dx - x0
        kernel = np.zeros((len(dy), *size))
        index = np.broadcast_to(np.arange(len(dy))[:, None], dy.shape)
        for oy, ox, wk in (
            (0, 0, (1 - fy) * (1 - fx)),
            (0, 1, (1 - fy) * fx),
            (1, 0, fy * (1 - fx)),
            (1, 1, fy * fx),
        ):
            yy = (y0 + oy).astype(np.intp) % size[0]
            xx = (x0 + ox).astype(np.intp) % size[1]
            np.add.at(kernel, (index, yy, xx), weights[None] * wk)
        padded = np.pad(x[part], ((0, 0), (r, r), (r, r), (0, 0)), mode="edge")
        spectrum = np.fft.rfft2(padded, axes=(1, 2)) * np.fft.rfft2(kernel, axes=(1, 2))[..., None]
        full = np.fft.irfft2(spectrum, s=size, axes=(1, 2))
        out[part] = full[:, r : r + h, r : r + w]
    return out


MOTION_CHUNK = 512  # images per FFT batch in motion_blur


def contrast(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    """(x - mean) * c + mean, the mean per image and channel: c < 1 flattens."""
    mean = x.mean(axis=(1, 2), keepdims=True)
    return (x - mean) * c + mean


def brightness(x: np.ndarray, c: float, rng: np.random.Generator) -> np.ndarray:
    """HSV value + c (hue and saturation kept): every channel scaled by V'/V, V = max over the
    channels; a black pixel becomes grey c. For grey images that is min(x + c, 1)."""
    v = x.max(axis=-1, keepdims=True)
    v_new = np.minimum(v + c, 1.0)
    return np.where(v > 0, x * (v_new / np.where(v > 0, v, 1.0)), v_new)


def pixelate(x: np.ndarray, side: float, rng: np.random.Generator) -> np.ndarray:
    """Box-downsample to `side` px (at 28 px; scaled with the image), then box-upsample back
    (Pillow's BOX both ways, as CIFAR-C and MNIST-C)."""
    full = x.shape[1]
    small = max(1, round(side * _scale(x)))
    return _per_image(
        x,
        lambda im: im.resize((small, small), Image.Resampling.BOX).resize(
            (full, full), Image.Resampling.BOX
        ),
    )


def jpeg_compression(x: np.ndarray, quality: float, rng: np.random.Generator) -> np.ndarray:
    """Encoded and decoded as JPEG at this quality (Pillow's libjpeg; grey images as grey JPEG)."""

    def jpeg(im: Image.Image) -> Image.Image:
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=int(quality))
        buf.seek(0)
        return Image.open(buf).convert(im.mode)

    return _per_image(x, jpeg)


ELASTIC_SIGMA = 4.0  # px at 28 px: the smoothness of Simard et al.'s (2003) MNIST distortions


def elastic_transform(x: np.ndarray, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Elastic distortion (Simard et al. 2003, as CIFAR-C's and MNIST-C's elastic_transform):
    displacement fields dx, dy = alpha * G_sigma * U(-1, 1) per image (G_sigma: a Gaussian
    filter of sigma 4 px), then bilinear resampling at (y + dy, x + dx), edges nearest.
    The fields' standard deviation is about 0.041 alpha px."""
    k = _scale(x)
    n, h, w, _ = x.shape
    s = ELASTIC_SIGMA * k
    fields = rng.uniform(-1.0, 1.0, (2, n, h, w))
    dy, dx = (alpha * k * gaussian_filter(f, sigma=(0, s, s), mode="reflect") for f in fields)
    ys, xs = _grid(x)
    return _bilinear(x, ys + dy, xs + dx, fill=None)


def rotate(x: np.ndarray, angle: float, rng: np.random.Generator) -> np.ndarray:
    """Rotation by +-angle radians about the image centre, the sign drawn per image (MNIST-C's
    rotate), bilinear; corners that come from outside are black."""
    _, h, w, _ = x.shape
    phi = (angle * rng.choice([-1.0, 1.0], len(x)))[:, None, None]
    cy, cx = (h - 1) / 2, (w - 1) / 2
    ys, xs = _grid(x)
    # the source of output pixel p is R(-phi) (p - c) + c
    cos, sin = np.cos(phi), np.sin(phi)
    src_y = cos * (ys - cy) - sin * (xs - cx) + cy
    src_x = sin * (ys - cy) + cos * (xs - cx) + cx
    return _bilinear(x, src_y, src_x, fill=0.0)


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Corruption:
    fn: Callable[[np.ndarray, float, np.random.Generator], np.ndarray]
    ladder: tuple[float, ...]  # the parameter at severities 1..5
    parameter: str  # what the ladder's numbers are
    source: str  # where the corruption and its ladder come from


CIFAR_C = "Hendrycks & Dietterich 2019 (CIFAR-10-C)"
MNIST_C = "Mu & Gilmer 2019 (MNIST-C)"

CORRUPTIONS: dict[str, Corruption] = {
    "gaussian_noise": Corruption(
        gaussian_noise, (0.08, 0.12, 0.18, 0.26, 0.38), "noise std (of 1)", f"{MNIST_C} ladder"
    ),
    "shot_noise": Corruption(
        shot_noise, (60, 25, 12, 5, 3), "photons per unit intensity", f"{MNIST_C} ladder"
    ),
    "impulse_noise": Corruption(
        impulse_noise, (0.03, 0.06, 0.09, 0.17, 0.27), "fraction of values hit", f"{MNIST_C} ladder"
    ),
    "gaussian_blur": Corruption(
        gaussian_blur,
        (0.5, 0.8, 1.1, 1.5, 2.0),
        "sigma in px at 28 px",
        f"{CIFAR_C}; ladder between CIFAR-10-C's (0.4..1) and MNIST-C's (1..6)",
    ),
    "motion_blur": Corruption(
        motion_blur,
        (1.0, 1.5, 2.0, 3.0, 4.0),
        "streak sigma in px at 28 px (radius 3 sigma)",
        f"{CIFAR_C}, {MNIST_C}; ladder between CIFAR-10-C's (sigma 1..2.5) and MNIST-C's (3..15)",
    ),
    "contrast": Corruption(
        contrast, (0.75, 0.5, 0.4, 0.3, 0.15), "contrast factor c", f"{CIFAR_C} ladder"
    ),
    "brightness": Corruption(
        brightness, (0.1, 0.2, 0.3, 0.4, 0.5), "added to HSV value", f"{MNIST_C} ladder"
    ),
    # MNIST-C's factors (0.6..0.25: 16, 14, 11, 8, 7 px) step back twice (28 / 14 and 28 / 7
    # are whole: less change than the level before); these sides grow the change every level
    "pixelate": Corruption(
        pixelate,
        (20, 15, 12, 9, 7),
        "side of the small image in px at 28 px",
        f"{CIFAR_C}, {MNIST_C}; ladder ours (factors 0.71..0.25)",
    ),
    "jpeg_compression": Corruption(
        jpeg_compression, (25, 18, 15, 10, 7), "JPEG quality", f"{MNIST_C} ladder"
    ),
    "elastic_transform": Corruption(
        elastic_transform,
        (10, 20, 30, 40, 55),
        "alpha (displacement scale) at 28 px, sigma 4 px",
        f"{CIFAR_C}, {MNIST_C}; Simard et al. 2003's sigma, alpha ladder ours",
    ),
    "rotate": Corruption(
        rotate, (0.2, 0.4, 0.6, 0.8, 1.0), "angle in radians, sign random", f"{MNIST_C} ladder"
    ),
}


def check_corruption(name: str, severity: int) -> Corruption:
    """The registry entry, or one line (ConfigError) naming what is wrong and the choices."""
    if name not in CORRUPTIONS:
        raise ConfigError(f"unknown corruption {name!r}; choose from: {', '.join(CORRUPTIONS)}")
    if (
        isinstance(severity, bool)
        or not isinstance(severity, (int, np.integer))
        or not (SEVERITIES[0] <= severity <= SEVERITIES[-1])
    ):
        raise ConfigError(
            f"severity must be an integer {SEVERITIES[0]}..{SEVERITIES[-1]} (CIFAR-C's five "
            f"levels), got {severity!r}"
        )
    return CORRUPTIONS[name]


def corrupt(images: np.ndarray, name: str, severity: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [N, H, W, C] -> the same images with corruption `name` at `severity` (1..5)."""
    part = check_corruption(name, severity)
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError(
            f"corrupt expects uint8 [N, H, W, 1 or 3], got {images.dtype} {images.shape}"
        )
    x = images.astype(np.float64) / 255.0
    y = part.fn(x, float(part.ladder[severity - 1]), rng)
    return np.round(np.clip(y, 0.0, 1.0) * 255.0).astype(np.uint8)


def describe() -> dict[str, dict]:
    """{name: {parameter, ladder, source}}: what a manifest records about the corruptions."""
    return {
        name: {"parameter": c.parameter, "ladder": list(c.ladder), "source": c.source}
        for name, c in CORRUPTIONS.items()
    }
