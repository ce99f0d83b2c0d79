"""Which data path a stage reads through: decoded into memory, or streamed from the shards.

The in-memory path (`shards.datasets.load_real` / `load_series_table`) decodes every image
once and indexes device tensors: the fastest there is, and impossible once the decoded set
outgrows memory (ImageNet at 224 px: ~190 GB of uint8). The streaming path (`shards.store` +
`shards.prefetch`) keeps only metadata in memory and decodes each step's images in DataLoader
workers, with the same draws and the same bytes. A stage picks with `choose_data_path`, from
its config's `data` section (`Data`, below: train, finetune and evaluate hold one):

    data.path = "auto" | "memory" | "stream"   auto: memory iff the decoded size fits the budget
    data.memory_budget_gb = 0.0                0 = derived from this machine (default_budget)
    data.stream_workers = 2                    DataLoader workers per process (streaming path)
    data.stream_prefetch = 2                   steps each worker decodes ahead

The decoded size is estimated from the manifests alone (num_samples x H x W x 3), before
anything is read.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import check_choice, check_range
from shards.manifest import read_manifest
from shards.offsets import read_member, shard_members

DATA_PATHS = ("auto", "memory", "stream")
DEFAULT_DATA_PATH = "auto"
DEFAULT_MEMORY_BUDGET_GB = 0.0
DEFAULT_STREAM_WORKERS = 2
DEFAULT_STREAM_PREFETCH = 2
# load_split holds the list of decoded images and their stacked copy at once: the host needs
# twice the decoded size while loading, whatever device the tensors end on
HOST_PEAK_FACTOR = 2
GB = 1e9
# the config.json names of the fields that say how to read, never what is computed: not part
# of a folder's identity
DATA_FIELDS = ("data_path", "memory_budget_gb", "stream_workers", "stream_prefetch")


@dataclass(frozen=True)
class Data:
    """how the images are read (stages/common/data.py); not part of a run's identity"""

    path: str = DEFAULT_DATA_PATH  # auto | memory | stream
    memory_budget_gb: float = DEFAULT_MEMORY_BUDGET_GB  # auto's budget; 0 = from free memory
    stream_workers: int = DEFAULT_STREAM_WORKERS  # DataLoader workers per process (stream)
    stream_prefetch: int = DEFAULT_STREAM_PREFETCH  # steps each worker decodes ahead

    def __post_init__(self) -> None:
        check_choice("data.path", self.path, DATA_PATHS)
        check_range("data.memory_budget_gb", self.memory_budget_gb, 0.0)
        check_range("data.stream_workers", self.stream_workers, 0)
        check_range("data.stream_prefetch", self.stream_prefetch, 1)


def image_size_of(folder: Path) -> tuple[int, int]:
    """(H, W) of a folder's images: the manifest's `info.image_size` (prepare, generate and
    annotate record it), else the PNG header (IHDR) of its first image."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    size = manifest.info.get("image_size")
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size, size
    rec = manifest.shards[0]
    name, offset, length = next(m for m in shard_members(folder, rec) if m[0].endswith(".png"))
    with open(folder / rec.name, "rb") as f:
        png = read_member(f.fileno(), folder / rec.name, name, offset, length, max_bytes=24)
    width, height = struct.unpack(">II", png[16:24])
    return height, width


def decoded_bytes(folder: Path) -> int:
    """Bytes of a folder decoded to uint8 RGB: num_samples x H x W x 3."""
    h, w = image_size_of(folder)
    return read_manifest(folder).num_samples * h * w * 3


def host_available_bytes() -> int:
    """Memory this process may still take: MemAvailable, capped by a cgroup limit (a SLURM
    job's or a container's) when one is set."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: sysconf's free pages stand
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),  # v1
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" / a huge number: no limit
            available = min(available, max(0, int(limit) - usage))
    return available


def default_budget(device: str | torch.device = "cpu", local_processes: int | None = None) -> int:
    """Bytes one process may fill with decoded images: the available host memory shared by
    the node's processes (each loads its own copy) over the load's 2x peak, and on a GPU at
    most half its memory (the rest is the model's, its activations' and the optimizer's)."""
    if local_processes is None:  # torchrun and accelerate launch set it
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    budget = host_available_bytes() // (HOST_PEAK_FACTOR * max(1, local_processes))
    device = torch.device(device)
    if device.type == "cuda":
        budget = min(budget, torch.cuda.get_device_properties(device).total_memory // 2)
    return budget


@dataclass(frozen=True)
class DataPathChoice:
    path: str  # "memory" | "stream"
    decoded: int  # estimated decoded bytes of the folders
    budget: int  # bytes; 0 when the path was forced

    def record(self) -> dict[str, Any]:
        """What a run writes to its host.json (the budget depends on this machine's memory)."""
        return {"path": self.path, "decoded_bytes": self.decoded, "budget_bytes": self.budget}

    def describe(self) -> str:
        fits = "<=" if self.decoded <= self.budget else ">"
        why = f"{fits} budget {self.budget / GB:.2f} GB" if self.budget else "forced"
        return f"data path {self.path}: decoded size {self.decoded / GB:.2f} GB ({why})"


def choose_data_path(
    choice: str,
    folders: Sequence[Path],
    budget_gb: float = DEFAULT_MEMORY_BUDGET_GB,
    device: str | torch.device = "cpu",
    local_processes: int | None = None,
) -> DataPathChoice:
    """The path, "memory" or "stream", for reading `folders` (every folder the stage would hold in
    memory). `auto` streams when their decoded size exceeds the budget (`budget_gb` > 0, else
    `default_budget`). Reads only manifests (and a PNG header where a manifest has no size)."""
    if choice not in DATA_PATHS:
        raise ValueError(f"data_path must be one of {', '.join(DATA_PATHS)}, got {choice!r}")
    if budget_gb < 0:
        raise ValueError(f"memory_budget_gb must be >= 0 (0 = derived), got {budget_gb}")
    decoded = sum(decoded_bytes(f) for f in folders)
    if choice != "auto":
        return DataPathChoice(choice, decoded, 0)
    budget = int(budget_gb * GB) if budget_gb > 0 else default_budget(device, local_processes)
    return DataPathChoice("memory" if decoded <= budget else "stream", decoded, budget)
