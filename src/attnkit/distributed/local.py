"""Run a function on several local processes joined by a gloo process group.

For examples, tests and benchmarks on one machine; clusters use ``torchrun``.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnkit._validate import AttnkitValueError

__all__ = ["RankFailure", "run_local"]


class RankFailure:
    """What a rank raised (or how it ended), as returned by ``run_local(..., return_exceptions=True)``."""

    def __init__(self, rank: int, kind: str, message: str, text: str = ""):
        self.rank, self.kind, self.message, self.text = rank, kind, message, text

    def __repr__(self) -> str:
        return f"RankFailure(rank={self.rank}, {self.kind}: {self.message})"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the ranks' parent process imports once (``forkserver``): each rank then starts as a fork of it,
#: in tens of milliseconds, instead of a new interpreter importing torch (seconds a rank).
PRELOAD = ["torch", "torch.distributed", "attnkit", "attnkit.call", "attnkit.distributed"]


def _context():
    """Ranks start from a fork server that has imported torch and attnkit (single-threaded: nothing ran
    there, so forking it is safe); where there is none (Windows), from new interpreters (``spawn``)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first run_local of a process
    return ctx


def _worker(rank, world_size, port, threads, timeout, fn, args, results):
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as e:  # report everything, then end
        results.put((rank, False, pickle.dumps((type(e).__name__, str(e), traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    *,
    threads: int = 1,
    timeout: float = 120.0,
    return_exceptions: bool = False,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` new processes (gloo on 127.0.0.1).

    ``fn`` must be importable (defined at a module's top level). Returns the ranks'
    return values in rank order. A rank that raises or dies makes this raise
    ``RuntimeError`` with its error, unless ``return_exceptions=True``, which returns a
    :class:`RankFailure` in its place. Ranks still running after ``timeout`` seconds are
    killed and reported.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise AttnkitValueError(f"world_size must be a positive int, but got {world_size!r}.")
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, threads, timeout, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    found: dict[int, object] = {}
    deadline = time.monotonic() + timeout + 30  # start-up included
    while len(found) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if rank not in found and p.exitcode is not None and p.exitcode != 0:
                    time.sleep(0.5)  # a last message may still be in the pipe
                    if rank not in found:
                        found[rank] = RankFailure(rank, "died", f"exited with code {p.exitcode}")
            continue
        if ok:
            found[rank] = pickle.loads(payload)
        else:
            name, message, text = pickle.loads(payload)
            found[rank] = RankFailure(rank, name, message, text)
    for rank, p in enumerate(procs):
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        if rank not in found:
            found[rank] = RankFailure(rank, "timeout", f"did not finish within {timeout:g} s")
    out = [found[r] for r in range(world_size)]
    failures = [r for r in out if isinstance(r, RankFailure)]
    if failures and not return_exceptions:
        first = failures[0]
        raise RuntimeError(
            f"{len(failures)} of {world_size} ranks failed; rank {first.rank}: {first.kind}: "
            f"{first.message}\n{first.text}"
        )
    return out
