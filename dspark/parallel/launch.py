"""Run a function on N local CPU processes joined in a gloo group (tests and benchmarks).

Each launch gets its own FileStore in a fresh temp dir, so parallel runs never collide on a port. The
parent enforces a hard wall-clock timeout: a hung collective kills the workers and raises, it never
blocks the caller.
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from dspark.util.fileio import atomic_write
from dspark.util.validate import check_int


def run_local_gloo(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    timeout: float = 60.0,
    collective_timeout: float = 30.0,
) -> list[Any]:
    """Return `[fn(rank, world_size, *args) for rank in range(world_size)]`, each run in its own process.

    fn must be a module-level function (the spawn start method pickles it by name). Raises
    `TimeoutError` naming the ranks still running after `timeout` seconds, and `RuntimeError` with the
    worker's traceback when a rank raised.
    """
    check_int("world_size", world_size, 1)
    if timeout <= 0 or collective_timeout <= 0:
        raise ValueError(f"timeouts must be positive, got {timeout!r}, {collective_timeout!r}")
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dspark_gloo_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, rank, world_size, store, os.path.join(tmp, f"rank{rank}.pkl"), args,
                      collective_timeout),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.0))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for rank in hung:
            procs[rank].kill()
            procs[rank].join()
        if hung:
            raise TimeoutError(f"ranks {hung} of {world_size} still running after {timeout:g} s (killed)")
        results = []
        for rank, p in enumerate(procs):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited with code {p.exitcode} without a result")
            with open(path, "rb") as f:
                ok, value = pickle.load(f)
            if not ok:
                raise RuntimeError(f"rank {rank} raised:\n{value}")
            results.append(value)
        return results


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, store: str, out: str, args: tuple,
    collective_timeout: float,
) -> None:
    try:
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        result = (True, fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - the parent reports the worker's traceback
        result = (False, traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    atomic_write(out, lambda path: path.write_bytes(pickle.dumps(result)))
