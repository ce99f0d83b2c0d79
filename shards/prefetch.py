"""Pixels for planned training steps, from device memory or decoded ahead by DataLoader workers.

The training loop decides *what* a step reads on the main process, with the seeded draws it
always made (`StepPlan`: the epoch's shuffled batch of real/train samples, and for CSM each
image's two series members from `sample_csm_members`). This module only fetches the pixels:

    source = PixelSource(train.images, mixed.images, rank, world)    # once, before the model
    for plan, px in zip(plans, source.batches(plans)):                # each epoch
        images = random_crop_flip(px.real, augment, ...)       # as before: train.images[idx]
        syn = random_crop_flip(px.syn, augment, ...)           # mixed.images[series, pos]...

With uint8 tensors (the in-memory path) `PixelSource` indexes them, exactly today's
expressions. With an `ImageStore` / `SeriesImages` (the streaming path, `shards.store`) a torch
DataLoader decodes each planned step in worker processes, `prefetch` steps per worker ahead,
in plan order. A rank decodes only its rows (real images rank::world and their series
members) and the rest of the global batch is zeros: augmentation draws over the whole global
batch and the rank keeps its slice, so its rows are bit-identical to the in-memory path's.
Whole steps go to workers round-robin (per-worker splitting), and the seeded shuffle is the
plan's, so the draws do not depend on the number of workers or ranks.

`SequentialImages` serves one in-order pass (channel statistics, evaluation logits) with
workers decoding the next slices ahead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from shards.manifest import ShardError
from shards.store import ImageStore, SeriesImages

# a worker that sends nothing for this long has died or hangs: stop with one line, not wait
WORKER_TIMEOUT_S = 600


@dataclass(frozen=True)
class StepPlan:
    """What one training step reads (the global batch, every rank's rows)."""

    idx: torch.Tensor  # int64 [B]: real/train sample numbers
    series: torch.Tensor | None = None  # int64 [B, 2]: each real image's two series (CSM)
    pos: torch.Tensor | None = None  # int64 [B, 2]: their members' positions


@dataclass
class Pixels:
    """uint8 images of one step, on the device: real [B, H, W, 3] and, for CSM, syn
    [2B, H, W, 3] (rows 2i, 2i+1: the members of real image i), as make_batch indexed them."""

    real: torch.Tensor
    syn: torch.Tensor | None = None


def rank_rows(batch: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's real rows (rank::world) and the rows of their series members in syn."""
    mine = np.arange(batch)[rank::world]
    return mine, np.stack([2 * mine, 2 * mine + 1], axis=1).reshape(-1)


class PixelSource:
    """The pixels of planned steps from one data path (see the module docstring).

    Build it right after opening the data, before the model: DataLoader workers are forked
    here, once, and kept for every epoch (`persistent_workers`), so they copy a small process
    and the parent's later writes (weights, activations) do not leave private copies behind
    in each worker.
    """

    def __init__(
        self,
        real: torch.Tensor | ImageStore,
        series: torch.Tensor | SeriesImages | None = None,
        rank: int = 0,
        world: int = 1,
        *,
        workers: int = 2,
        prefetch: int = 2,
        device: str | torch.device | None = None,
    ):
        self.real, self.series, self.rank, self.world = real, series, rank, world
        self.device = torch.device(device or "cpu")
        self.in_memory = isinstance(real, torch.Tensor)
        if not self.in_memory:
            series_store = series.store if isinstance(series, SeriesImages) else None
            pin = self.device.type == "cuda"
            self._workers = _Workers(real, series_store, workers, prefetch, pin)

    def batches(self, plans: Sequence[StepPlan]) -> Iterator[Pixels]:
        """The pixels of each plan, in order."""
        if self.in_memory:  # today's indexing, on the tensors' device
            for plan in plans:
                syn = None
                if plan.series is not None:
                    syn = self.series[plan.series, plan.pos].flatten(0, 1)  # type: ignore[index]
                yield Pixels(self.real[plan.idx], syn)  # type: ignore[index]
            return
        requests = _requests(plans, self.series, self.rank, self.world)
        for plan, (mine_real, mine_syn) in zip(plans, self._workers.run(requests)):
            b = len(plan.idx)
            px = Pixels(mine_real, mine_syn)
            if self.world > 1:  # the global batch with this rank's rows filled
                mine, rows = rank_rows(b, self.rank, self.world)
                px = Pixels(mine_real.new_zeros((b, *mine_real.shape[1:])))
                px.real[torch.from_numpy(mine)] = mine_real
                if mine_syn is not None:
                    px.syn = mine_syn.new_zeros((2 * b, *mine_syn.shape[1:]))
                    px.syn[torch.from_numpy(rows)] = mine_syn
            cuda = self.device.type == "cuda"
            yield Pixels(
                px.real.to(self.device, non_blocking=cuda),
                px.syn.to(self.device, non_blocking=cuda) if px.syn is not None else None,
            )

    def close(self) -> None:
        """Let the workers go (they also go when the source is garbage-collected)."""
        if not self.in_memory:
            self._workers.close()


class _Fetch(Dataset):
    """Map-style dataset whose "index" is a request (real numbers, member numbers): worker
    processes decode them. A damaged shard comes back as its one-line message, which the
    main process raises (a worker's exception would arrive wrapped in a traceback).

    Pixels travel as numpy arrays, pickled through the workers' pipe, not as torch tensors:
    torch moves tensors through shared memory, whose file descriptors go over an AF_UNIX
    socket under TMPDIR. A TMPDIR path over 107 bytes (or a small /dev/shm, e.g. a
    container's 64 MB) breaks that inside the queue's feeder thread, where the error is only
    printed: the batch never arrives and the training process waits forever (seen with two
    torchrun node agents, each with its own TMPDIR)."""

    def __init__(self, store: ImageStore, series_store: ImageStore | None):
        self.store, self.series_store = store, series_store

    def __getitem__(self, request: tuple[np.ndarray, np.ndarray | None]) -> Any:
        try:
            real = self.store.read(request[0])
            syn = None
            if request[1] is not None and self.series_store is not None:
                syn = self.series_store.read(request[1])
            return real, syn
        except ShardError as e:
            return str(e)


def _as_is(sample: Any) -> Any:
    return sample


class _Requests:
    """The sampler: this pass's requests, replaced before each pass."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class _Workers:
    """DataLoader workers decoding requests in order, `prefetch` per worker ahead; forked at
    construction and kept across passes (workers = 0: decoded in this process, no prefetch)."""

    def __init__(
        self, store: ImageStore, series: ImageStore | None, workers: int, prefetch: int, pin: bool
    ):
        self.requests, self.pin = _Requests(), pin
        self.loader: DataLoader | None = DataLoader(
            _Fetch(store, series),
            batch_size=None,
            sampler=self.requests,
            num_workers=workers,
            prefetch_factor=prefetch if workers else None,
            persistent_workers=workers > 0,
            collate_fn=_as_is,
            timeout=WORKER_TIMEOUT_S if workers else 0,
        )
        if workers:
            iter(self.loader)  # start the workers now, with nothing to do yet

    def run(self, requests: list[Any]) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """(real, syn) uint8 tensors per request, in order (pinned when the source is for a GPU)."""
        if self.loader is None:
            raise RuntimeError("the pixel source is closed")
        self.requests.items = requests
        try:
            for fetched in self.loader:
                if isinstance(fetched, str):
                    raise ShardError(fetched)
                yield tuple(self._tensor(a) for a in fetched)  # type: ignore[misc]
        except RuntimeError as e:
            if "timed out" not in str(e):
                raise
            raise ShardError(
                f"no pixels from the DataLoader workers for {WORKER_TIMEOUT_S} s (a worker "
                "died or hangs; its error, if any, is above); data.stream_workers=0 decodes in the "
                "training process"
            ) from e

    def _tensor(self, array: np.ndarray | None) -> torch.Tensor | None:
        if array is None:
            return None
        tensor = torch.from_numpy(array)
        return tensor.pin_memory() if self.pin else tensor

    def close(self) -> None:
        self.loader = None  # the persistent iterator goes with it and shuts its workers down


def _requests(
    plans: Sequence[StepPlan], series: Any, rank: int, world: int
) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """Per plan, the sample numbers this rank decodes: its real rows, their series members."""
    out = []
    for plan in plans:
        mine, _ = rank_rows(len(plan.idx), rank, world)
        idx = plan.idx.cpu().numpy()[mine]
        members = None
        if plan.series is not None and isinstance(series, SeriesImages):
            s, p = plan.series.cpu()[mine], plan.pos.cpu()[mine]  # type: ignore[union-attr]
            members = series.members[s, p].reshape(-1).numpy()  # rows 2i, 2i+1 per real image
        out.append((idx, members))
    return out


class SequentialImages:
    """An ImageStore read as consecutive slices [i·chunk, (i+1)·chunk), decoded ahead by
    DataLoader workers: for code that walks images in order, unchanged (`channel_stats`
    with chunk 4096, `collect_logits` with chunk = its batch size). Any other index is read
    directly; a slice starting at 0 starts a new pass. Workers start here, kept for every
    pass (build it before the models)."""

    def __init__(self, store: ImageStore, chunk: int, workers: int = 2, prefetch: int = 2):
        self.store, self.chunk = store, chunk
        self._workers = _Workers(store, None, workers, prefetch, pin=False)
        self._next: int | None = None
        self._it: Iterator[Any] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.store.shape

    dtype = torch.uint8

    def __len__(self) -> int:
        return len(self.store)

    def __getitem__(self, index: Any) -> torch.Tensor:
        n = len(self.store)
        if not isinstance(index, slice) or index.step not in (None, 1):
            return self.store[index]
        start, stop, _ = index.indices(n)
        if stop != min(start + self.chunk, n):
            return self.store[index]
        if start == 0:
            starts = range(0, n, self.chunk)
            requests = [(np.arange(s, min(s + self.chunk, n)), None) for s in starts]
            self._it, self._next = self._workers.run(requests), 0
        if start != self._next or self._it is None:
            return self.store[index]
        real, _ = next(self._it)
        self._next = stop
        if stop == n:  # pass complete: the workers are idle until the next one
            self._it = self._next = None
        return real

    def close(self) -> None:
        self._workers.close()
