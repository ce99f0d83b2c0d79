"""The processes of one launch (single process, torchrun or accelerate launch): ranks, the
launcher's conventions, the checks that every rank runs the same config and code on a shared
folder, collectives that fail in one line when a peer dies (`run_launched` wraps a stage in all
of it), and the CPU threads a stage computes with.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

# Launchers' environment: torchrun / accelerate's torch launcher set WORLD_SIZE and RANK, mpirun
# the others (the names accelerate reads for CPU ranks).
WORLD_VARS = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
# How long a rank waits for the others at a barrier or collective, in seconds (torch's default
# is 30 min for gloo and 10 min for NCCL). Main-process work that others wait for grows with the
# dataset: prepare of ImageNet, annotate's prototypes, evaluate. Set before the process group
# starts; SEMIX_DIST_TIMEOUT overrides it.
DIST_TIMEOUT_S = 4 * 3600


class LaunchError(ValueError):
    """The processes of one launch cannot work together (different config or code, an output
    folder that is not shared, a launcher that gave no ranks): one line, exit 1."""


def dist_timeout_s() -> float:
    return float(os.environ.get("SEMIX_DIST_TIMEOUT", DIST_TIMEOUT_S))


def launch_world() -> int:
    """Processes this launch asked for, from the launcher's environment (1 for a plain run)."""
    for var in WORLD_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_launcher() -> None:
    """A process that `accelerate launch` started for several processes without giving it a
    rank (its CPU launcher, without mpirun, starts one process per machine and no ranks):
    on one machine (MASTER_ADDR on loopback) it is the only process, and does the whole job as
    a plain run, said in one line; on several machines each would do the whole job into the
    same shared folder, so it is refused."""
    unranked = not any(var in os.environ for var in (*WORLD_VARS, *RANK_VARS))
    if not (unranked and "ACCELERATE_USE_CPU" in os.environ and "MASTER_ADDR" in os.environ):
        return
    if os.environ["MASTER_ADDR"] in LOOPBACK:
        from core.logs import log

        log.warning(
            "accelerate launch --cpu started one process without a rank (its CPU launcher does "
            "that without mpirun): semix runs as that one process; for N processes on one CPU "
            "machine use torchrun --nproc_per_node N -m pipeline ... (docs/scale.md)"
        )
        return
    raise LaunchError(
        "accelerate launch started this process for several machines but gave it no rank (its "
        "CPU launcher does that without mpirun): use torchrun --nnodes N --nproc_per_node P, or "
        "accelerate launch --multi_gpu (docs/scale.md)"
    )


@functools.cache  # once per process, whichever stage started the group
def _tear_down_at_exit() -> None:
    """Destroy the process group when the process exits, on every exit path (done, an error,
    Ctrl-C). Left to the interpreter's shutdown, gloo's threads are destroyed while still
    joinable: C++ aborts ("terminate called without an active exception", SIGABRT) after the
    work is done, about every other run, and the launcher reports a failure for complete work."""
    import atexit

    atexit.register(tear_down)


def tear_down() -> None:
    """Leave the launch's process group, if this process is in one (safe to call twice)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class Processes:
    """Rank/world view of the current launch (single process, torchrun or accelerate launch).

    Uses accelerate's PartialState so that `accelerate launch` and `torchrun` are picked up
    the same way; a plain `python -m pipeline ...` is rank 0 of 1 without any process group.
    Ranks are global (RANK, across nodes): "the main process" is rank 0 of the whole launch,
    while accelerate picks each process's GPU by its rank on its node (LOCAL_RANK).
    """

    def __init__(self, cpu: bool | None = None):
        from accelerate import PartialState

        # Without CUDA, accelerate must be told so: otherwise it ignores torchrun's ranks on a
        # CPU machine and every process believes it is rank 0.
        if cpu is None:
            cpu = not torch.cuda.is_available()
        # the timeout only counts for the first PartialState of the process (it starts the group)
        timeout = datetime.timedelta(seconds=dist_timeout_s())
        self.state = PartialState(cpu=cpu, timeout=timeout)
        if self.state.num_processes > 1:
            _tear_down_at_exit()

    @property
    def rank(self) -> int:
        return self.state.process_index

    @property
    def world(self) -> int:
        return self.state.num_processes

    @property
    def is_main(self) -> bool:
        return self.state.is_main_process

    @property
    def device(self) -> torch.device:
        return self.state.device

    def owns(self, shard_index: int) -> bool:
        """Shard i belongs to rank i mod world (docs/architecture.md)."""
        return shard_index % self.world == self.rank

    def my_shards(self, num_shards: int) -> list[int]:
        return [i for i in range(num_shards) if self.owns(i)]

    def barrier(self) -> None:
        if self.world > 1:
            with peers_alive():
                self.state.wait_for_everyone()

    def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        """Every rank's payload, in rank order. Tensors through accelerate's gather, not
        `all_gather_object`: that one unpickles what the other processes send."""
        if self.world == 1:
            return [payload]
        from accelerate.utils import gather, pad_across_processes

        dev = self.device
        # one byte at least: torch.frombuffer refuses an empty buffer (the size says it is empty)
        data = torch.frombuffer(bytearray(payload or b"\0"), dtype=torch.uint8).to(dev)
        with peers_alive():
            sizes = gather(torch.tensor([len(payload)], device=dev)).tolist()
            width = max(max(sizes), 1)
            rows = gather(pad_across_processes(data, dim=0)).view(self.world, width).cpu()
        return [bytes(rows[r, :n].tolist()) for r, n in enumerate(sizes)]

    def check_same(self, fields: Mapping[str, Any], what: str) -> None:
        """Every rank holds the same `fields` (JSON values), else LaunchError (see
        `disagreement`). Called before anything is written: with another seed or model on one
        node, its shards would differ from the others' and the folder would end up holding two
        runs under one config.json."""
        record = {"host": socket.gethostname(), "fields": dict(fields)}
        payload = json.dumps(record, sort_keys=True, default=str).encode()
        problem = disagreement([json.loads(b) for b in self.all_gather_bytes(payload)], what)
        if problem:
            raise LaunchError(problem)

    def check_shared_folder(self, folder: Path) -> None:
        """Every rank sees the files rank 0 writes in `folder`: the output must live on a
        filesystem shared by every node (rank 0 writes manifests from the others' shards).
        Rank 0 writes a uniquely named file, every rank opens it, rank 0 removes it. A new name
        never hits an NFS client's cache of failed lookups, and opening after the writer closed
        is what NFS guarantees to see (close-to-open)."""
        if self.world == 1:
            return
        folder = Path(folder)
        token = ""
        if self.is_main:
            token = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f".semix-launch-{token}").write_text(token)
            except OSError:
                token = ""  # e.g. read-only media holding complete outputs: nothing to check
        token = self.all_gather_bytes(token.encode())[0].decode()
        if not token:
            return
        path = folder / f".semix-launch-{token}"
        try:
            seen = path.read_text() == token
        except OSError:
            seen = False
        answer = [seen, socket.gethostname(), str(folder.resolve())]
        try:
            answers = [json.loads(a) for a in self.all_gather_bytes(json.dumps(answer).encode())]
        finally:
            if self.is_main:
                path.unlink(missing_ok=True)
        blind = [(r, host, where) for r, (ok, host, where) in enumerate(answers) if not ok]
        if blind:
            ranks = ", ".join(f"{r} (on {host}, looking in {where})" for r, host, where in blind)
            raise LaunchError(
                f"rank(s) {ranks} do not see the files rank 0 (on {answers[0][1]}) writes in "
                f"{answers[0][2]}: out= must be on a filesystem every node mounts, the same "
                "folder for every rank (use an absolute path; docs/scale.md)"
            )


def share_from_main(state: Any) -> Callable[[Any], Any] | None:
    """`value -> the main process's value`, on every process of `state` (an Accelerator or
    PartialState): for decisions that must be made once, where the ranks could see different
    things (free memory, a shared filesystem's cached listings). None for a single process."""
    if state.num_processes == 1:
        return None
    from accelerate.utils import broadcast_object_list

    return lambda value: broadcast_object_list([value], from_process=0)[0]


def is_peer_failure(error: BaseException) -> bool:
    """A collective failed because another rank left: c10d and NCCL raise torch.distributed's
    DistError, gloo a plain RuntimeError naming the closed connection."""
    dist_error = getattr(torch.distributed, "DistError", ())  # () matches nothing
    return isinstance(error, dist_error) or "Connection closed by peer" in str(error)


@contextlib.contextmanager
def peers_alive(only_peer_failures: bool = False) -> Iterator[None]:
    """A collective that fails because another rank died is no bug here: say so in one line,
    the cause is in that rank's log (torchrun prints it as the "root cause" on its node).
    Around semix's own collectives any RuntimeError is that; around a whole stage only what
    `is_peer_failure` recognises (`only_peer_failures`)."""
    try:
        yield
    except RuntimeError as e:
        if only_peer_failures and not is_peer_failure(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[.../pair.cc:561] " prefix
        raise LaunchError(
            "another process of this launch stopped, or kept this one waiting longer than "
            f"SEMIX_DIST_TIMEOUT = {dist_timeout_s():g} s; its log names the cause ({first[:100]})"
        ) from e


def disagreement(records: list[dict[str, Any]], what: str) -> str | None:
    """One line naming the ranks (and their hosts) whose `fields` differ from rank 0's, the
    fields and the first few values; None when every rank agrees. records[r] = {"host",
    "fields"} of rank r."""
    ref = records[0]["fields"]
    odd = {}
    for rank, rec in enumerate(records[1:], 1):
        theirs = rec["fields"]
        keys = sorted(k for k in set(ref) | set(theirs) if ref.get(k) != theirs.get(k))
        if keys:
            odd[rank] = (rec["host"], keys)
    if not odd:
        return None
    keys = sorted({k for _, ks in odd.values() for k in ks})
    ranks = ", ".join(f"{r} (on {host})" for r, (host, _) in odd.items())
    first = next(iter(odd))
    theirs = records[first]["fields"]
    values = "; ".join(
        f"{k} = {_short(ref.get(k))} on rank 0, {_short(theirs.get(k))} on rank {first}"
        for k in keys[:4]
    )
    return (
        f"the processes of this launch disagree on {what}: rank(s) {ranks} differ from rank 0 "
        f"(on {records[0]['host']}) in {', '.join(keys)} ({values}); start every node with the "
        "same code and the same --set values"
    )


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def run_launched(
    run: Callable[[], Path],
    fields: Mapping[str, Any],
    root: Path,
    *,
    device: str = "",
    main_only: bool = False,
) -> Path:
    """Run one stage under torchrun / accelerate launch on any number of nodes.

    Before: every rank has the same config and code (`fields`), and sees the same run root.
    `main_only` stages (prepare, publish, ... : one writer, no rank split) run on global rank 0
    while the others wait. After: every rank leaves together, so a chain's next stage never
    reads an output whose manifest rank 0 is still writing (generate and annotate let the
    other ranks return before rank 0 finishes the manifest).
    """
    # the CPU choice the stages make (they find this process group already started)
    procs = Processes(cpu=device == "cpu" or not torch.cuda.is_available())
    procs.check_same(fields, "the config")
    procs.check_shared_folder(root)
    if main_only:
        out = run() if procs.is_main else None
        procs.barrier()
        return Path(procs.all_gather_bytes(str(out or "").encode())[0].decode())
    with peers_alive(only_peer_failures=True):  # the stage's own barriers and DDP
        out = run()
    procs.barrier()
    return out


@contextlib.contextmanager
def cpu_threads(n: int) -> Iterator[None]:
    """Run the block with n torch threads on a CPU-only machine, then restore the old count
    (a chain runs several stages in one process)."""
    before = torch.get_num_threads()
    if n > 0 and not torch.cuda.is_available():
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
