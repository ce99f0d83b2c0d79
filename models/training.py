"""Pure-torch data pieces of the classifier training loop (stages/common/epochs.py): batches, on-device
augmentation and normalisation, the eval loop, the CSM sampler. The objectives: models/objectives.py.

Small datasets live on the device as uint8 [N, H, W, 3]; each step indexes a batch, augments it
there and normalises it, so no CPU data loader runs at all (airbench-style). Every random draw
comes from a `torch.Generator` the caller derives from (seed, epoch, purpose): a resumed run
replays exactly what an uninterrupted one would have drawn.

    perm_batches = epoch_batches(n, batch_size, gen)                  # index tensors
    x = normalize(random_crop_flip(images[idx], gen, pad=4), mean, std)   # [B, C, H, W]
    series, pos = sample_csm_members(labels[idx], SeriesIndex(classes, C), soft, gen)
"""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.utils.fusion import fuse_conv_bn_eval

from models.losses import dense_soft_targets

# ------------------------------------------------------------------------- batches and inputs


def epoch_batches(
    n: int, batch_size: int, generator: torch.Generator, min_last: int = 2
) -> list[Tensor]:
    """A random permutation of range(n) cut into batches (CPU int64 index tensors).

    The last, shorter batch is kept unless it has fewer than `min_last` samples (BatchNorm needs
    two per process: pass 2·world under DDP).
    """
    if n < 1 or batch_size < 1:
        raise ValueError(f"need n >= 1 and batch_size >= 1, got {n}, {batch_size}")
    perm = torch.randperm(n, generator=generator, device=generator.device).cpu()
    batches = list(perm.split(batch_size))
    if len(batches) > 1 and len(batches[-1]) < min_last:
        batches.pop()
    return batches


def random_crop_flip(
    images: Tensor, generator: torch.Generator, pad: int = 4, flip: bool = True
) -> Tensor:
    """Random crop after zero padding by `pad` + random horizontal flip, on [B, H, W, C] images.

    The torchvision CIFAR recipe (RandomCrop(H, padding=pad), RandomHorizontalFlip) done for the
    whole batch at once with index arithmetic, on whatever device `images` live (uint8 is fine:
    pad before normalising, as torchvision does). Draw order: dy, dx, then flip.
    """
    if images.ndim != 4:
        raise ValueError(f"images must be [B, H, W, C], got {tuple(images.shape)}")
    b, h, w, _ = images.shape
    dev, out = images.device, images
    if pad > 0:
        dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=generator.device)
        dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=generator.device)
        padded = F.pad(images, (0, 0, pad, pad, pad, pad))  # (C, W, H) pairs, last dim first
        rows = dy.to(dev)[:, None] + torch.arange(h, device=dev)
        cols = dx.to(dev)[:, None] + torch.arange(w, device=dev)
        out = padded[torch.arange(b, device=dev)[:, None, None], rows[:, :, None], cols[:, None, :]]
    if flip:
        mirror = torch.rand(b, generator=generator, device=generator.device).to(dev) < 0.5
        out = torch.where(mirror[:, None, None, None], out.flip(2), out)
    return out


def normalize(
    images: Tensor,
    mean: Sequence[float] | Tensor,
    std: Sequence[float] | Tensor,
    image_size: int | None = None,
    channels_last: bool = False,
) -> Tensor:
    """uint8 [B, H, W, 3] -> float32 [B, C, H, W], (x/255 − mean)/std.

    C = len(mean): one channel means grey (the RGB channel mean), as the digits models and
    `models.encoders.ModuleFeatureEncoder` use it. Images of another size than `image_size` are
    resized (bilinear, antialiased), e.g. an OOD set at another resolution.
    """
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    if images.shape[-1] != 3 or mean_t.shape[1] not in (1, 3) or std_t.shape != mean_t.shape:
        raise ValueError(
            f"need images [B, H, W, 3] and 1- or 3-channel mean/std, got {tuple(images.shape)}"
        )
    x = images.permute(0, 3, 1, 2).float().div_(255.0)  # NHWC storage: already channels_last
    if mean_t.shape[1] == 1:
        x = x.mean(dim=1, keepdim=True)
    if image_size and tuple(x.shape[-2:]) != (image_size, image_size):
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", antialias=True)
    x = (x - mean_t) / std_t
    return x.contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )


STATS_CHUNK_VALUES = 1 << 26  # uint8 values channel_stats reads at once: 64 MiB
STATS_BLOCK_VALUES = 1 << 20  # values its integer arithmetic takes at once: 4 MiB as int32


def stats_chunk(image_shape: Sequence[int], most: int = 4096) -> int:
    """Images per channel_stats read: `most`, fewer when that many would exceed
    STATS_CHUNK_VALUES (4096 CIFAR images fit; 341 at 256 px)."""
    return max(1, min(most, STATS_CHUNK_VALUES // _values(image_shape)))


def _values(image_shape: Sequence[int]) -> int:
    values = 1
    for d in image_shape:
        values *= int(d)
    return max(1, values)


def channel_stats(
    images: Tensor, channels: int, chunk: int | None = None
) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 [N, H, W, 3] images in [0, 1] (grey when channels=1:
    the channel mean), reading `chunk` images at a time (None: `stats_chunk` of the shape).

    The sums are exact integers (of the uint8 values, or of r+g+b for grey, and of their
    squares), so the result does not depend on the chunking; they are taken over blocks of
    at most STATS_BLOCK_VALUES values, so the temporaries stay small: large ones, freed and
    allocated again per chunk, stay resident in the C heap (measured: +550 MB over 48 chunks
    of 16 MiB each when the chunks come from DataLoader workers)."""
    if chunk is None:
        chunk = stats_chunk(tuple(images.shape[1:]))
    block = max(1, STATS_BLOCK_VALUES // _values(tuple(images.shape[1:])))
    total = torch.zeros(channels, dtype=torch.int64)
    total_sq = torch.zeros(channels, dtype=torch.int64)
    count = 0
    for start in range(0, images.shape[0], chunk):
        batch = images[start : start + chunk]
        for first in range(0, batch.shape[0], block):
            x = batch[first : first + block].to(torch.int32)
            if channels == 1:
                x = x.sum(dim=-1, keepdim=True)  # 3x the grey value, still an integer
            total += x.sum(dim=(0, 1, 2), dtype=torch.int64).cpu()
            total_sq += x.square().sum(dim=(0, 1, 2), dtype=torch.int64).cpu()
            count += x.shape[0] * x.shape[1] * x.shape[2]
    scale = 255.0 * (3 if channels == 1 else 1)
    mean = total.double() / count / scale
    mean_sq = total_sq.double() / count / scale**2
    std = (mean_sq - mean.pow(2)).clamp_min(1e-12).sqrt()
    return [round(float(v), 6) for v in mean], [round(float(v), 6) for v in std]


def multistep_lr(epoch: int, base_lr: float, milestones: Sequence[int], gamma: float) -> float:
    """lr of `epoch` (0-based): base·γ^(number of milestones <= epoch), MultiStepLR's schedule."""
    return base_lr * gamma ** sum(1 for m in milestones if m <= epoch)


def is_channels_last(model: nn.Module) -> bool:
    """Whether the model's convolutions are stored channels_last (`model.to(memory_format=
    torch.channels_last)`): its inputs should be too, or every layer converts them."""
    return any(
        p.ndim == 4 and not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
        for p in model.parameters()
    )


def inference_copy(model: nn.Module) -> nn.Module:
    """An eval-mode copy of `model` for forward passes only: each Conv2d followed by a
    BatchNorm2d inside an nn.Sequential folded into one convolution (the same function, one
    pass over the activations fewer), stored channels_last when it has convolutions (oneDNN's
    fast layout on CPU as on GPU). The logits agree with the model's to float rounding."""
    copy = deepcopy(model).eval()
    for seq in [m for m in copy.modules() if isinstance(m, nn.Sequential)]:
        for i in range(len(seq) - 1):
            conv, bn = seq[i], seq[i + 1]
            if (
                type(conv) is nn.Conv2d
                and type(bn) is nn.BatchNorm2d
                and bn.track_running_stats
                and bn.num_features == conv.out_channels
            ):
                seq[i], seq[i + 1] = fuse_conv_bn_eval(conv, bn), nn.Identity()
    if any(isinstance(m, nn.Conv2d) for m in copy.modules()):
        copy = copy.to(memory_format=torch.channels_last)
    return copy


CPU_PASS = 64  # images per forward pass on a CPU (cache-sized activations)


@torch.inference_mode()
def collect_logits(
    model: nn.Module,
    images: Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    batch_size: int = 512,
    device: torch.device | str | None = None,
    image_size: int | None = None,
    features: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Eval-mode logits float32 [N, C] on the CPU (and the pooled features [N, d] if asked).

    fp32 on purpose: calibration metrics read the logits to many digits. The passes run on
    `inference_copy(model)` (BatchNorm folded, channels_last); `model` itself is not touched.
    On a CPU a pass takes at most CPU_PASS images, whatever `batch_size` allows: activations
    that stay in the core's cache run 2x faster than a pass of 512 (bench/RESULTS.md).
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    net = inference_copy(model)
    cl = is_channels_last(net)
    step = min(batch_size, CPU_PASS) if device.type == "cpu" else batch_size
    logits, feats = [], []
    for start in range(0, images.shape[0], step):
        batch = images[start : start + step].to(device)
        h = net.forward_features(normalize(batch, mean, std, image_size, channels_last=cl))
        logits.append(net.head(h).float().cpu())
        if features:
            feats.append(h.float().cpu())
    out = torch.cat(logits) if logits else torch.empty(0, 0)
    return (out, torch.cat(feats)) if features else out


# ----------------------------------------------------------- CSM sampler (docs/methods.md §3)


class SeriesIndex:
    """Which complete series contain class c: a padded table [C, M] of series ids + counts [C].

    Built once from the series' class pairs [S, 2] (k-way series: tuples [S, k]); sampling a
    series per real label is then a gather, on the device the pairs live on. Row c lists the
    series containing c in ascending order; built by one sort of the (class, series) keys, not a
    pass per class (1,000 classes x 499,500 pairs: bench/RESULTS.md, "Plan, manifest ...").
    """

    def __init__(self, classes: Tensor, num_classes: int) -> None:
        if classes.ndim != 2 or classes.shape[1] < 2:
            raise ValueError(f"series classes must be [S, k >= 2], got {tuple(classes.shape)}")
        n_series, dev = classes.shape[0], classes.device
        series = torch.arange(n_series, device=dev).repeat_interleave(classes.shape[1])
        c = classes.flatten().long()
        keep = (c >= 0) & (c < num_classes)  # ids outside the classes belong to no row
        key = torch.unique(c[keep] * n_series + series[keep])  # sorted: by class, then series
        c, s = key // max(n_series, 1), key % max(n_series, 1)
        self.counts = torch.bincount(c, minlength=num_classes)
        start = torch.cumsum(self.counts, 0) - self.counts  # where each class's row begins in key
        width = max(1, int(self.counts.max()) if num_classes else 1)
        self.table = torch.zeros(num_classes, width, dtype=torch.long, device=dev)
        self.table[c, torch.arange(len(key), device=dev) - start[c]] = s
        self.classes = classes
        self.num_classes = num_classes

    def missing(self) -> list[int]:
        """Classes no complete series contains (CSM cannot pair their real images)."""
        return [int(c) for c in torch.nonzero(self.counts == 0).flatten()]


def sample_csm_members(
    labels: Tensor,
    index: SeriesIndex,
    soft_a: Tensor,
    generator: torch.Generator,
    check: bool = True,
    interior: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Series ids and positions [B, 2] of the synthetic images for a real batch (docs/methods.md §3).

    For every real label y: a uniformly random complete series containing y; column 0 is that
    series' member with the highest target for y (t_a if y = a, else t_b = 1 − t_a; first on
    ties), column 1 a uniformly random interior member (positions 1..K−2). Draw order: series
    choice, then interior position. `check=False` skips the test that every label has a series
    (a device sync): for callers that checked `index.missing()` once up front.

    k-way series: `soft_a` holds the targets over the tuple [S, K, k] and `interior` the
    positions the random member is drawn from (the lattice points that mix at least two
    classes, see `interior_positions`); the best member is the one with the highest target
    for y, as for k = 2.
    """
    if soft_a.ndim == 2 and soft_a.shape[1] < 3:
        raise ValueError(
            f"series need K >= 3 members to have an interior, got K = {soft_a.shape[1]}"
        )
    if soft_a.ndim == 3 and (interior is None or interior.numel() == 0):
        raise ValueError("k-way series need the interior positions to draw a mixed member from")
    dev = index.table.device
    y = labels.to(dev)
    counts = index.counts[y]
    if check and bool((counts == 0).any()):
        raise ValueError(
            f"no complete series contains class(es) {sorted(set(y[counts == 0].tolist()))}"
        )
    u = torch.rand(len(y), generator=generator, device=generator.device).to(dev)
    pick = (u * counts).long().clamp_max(counts - 1)
    series = index.table[y, pick]
    gen_dev = generator.device
    if soft_a.ndim == 2:  # 2-way: t_y = t_a if y = a else 1 − t_a
        mixed = torch.randint(
            1, soft_a.shape[1] - 1, (len(y),), generator=generator, device=gen_dev
        )
        t_a = soft_a[series]  # [B, K]
        t_y = torch.where((index.classes[series, 0] == y)[:, None], t_a, 1.0 - t_a)
    else:  # k-way: the column of y in the tuple
        which = torch.randint(0, len(interior), (len(y),), generator=generator, device=gen_dev)
        mixed = interior.to(dev)[which.to(dev)]
        is_y = (index.classes[series] == y[:, None]).to(soft_a.dtype)  # [B, k], one 1 per row
        t_y = (soft_a[series] * is_y[:, None, :]).sum(dim=2)  # [B, K]
    best = t_y.argmax(dim=1)
    return torch.stack([series, series], dim=1), torch.stack([best, mixed.to(dev)], dim=1)


def interior_positions(weights: Tensor) -> Tensor:
    """Positions of a k-way series' lattice [K, k] that mix at least two classes (every point
    but the k vertices; for k = 2 the positions 1..K−2)."""
    return torch.nonzero((weights > 0).sum(dim=1) >= 2).flatten()


def csm_targets(classes: Tensor, soft_a: Tensor, num_classes: int) -> Tensor:
    """Dense targets [N, C] of mixed samples: t_a on class a, 1 − t_a on class b (docs/methods.md §2);
    k-way samples: soft [N, k] over classes [N, k]."""
    if soft_a.ndim == 2:
        return dense_soft_targets(classes, soft_a, num_classes)
    return dense_soft_targets(classes, torch.stack([soft_a, 1.0 - soft_a], dim=1), num_classes)
