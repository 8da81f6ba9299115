"""The host/device boundary of a verify step: the one function through which a step reads device values.

A verify step needs at most two things on the host, and reads each in one call of `to_host`:

1. before the forward, the numbers that fix its verify rows, hence its tier: the planner's budget
   decision and its live candidate count (`VerifyPlanner.plan`), or with lag = 0 on a small batch the
   survival it budgets on the host; sync-free planning (`PlannerSettings(sync_free=True)`, lag >= 1) reads
   nothing here, its rows being fixed by the previous step's survival copied asynchronously;
2. after accept, the commit lengths (the next step's positions and the stop test).

Everything between (survival, curves, allocation, layout maps, pack / scatter, accept) stays on the
device and compiles under `torch.compile(fullgraph=True)`. Host values go the other way through `to_device`,
which does not wait for the device. tests/plan/test_host_boundary.py counts every host
read of a step on the CPU and proves none happens outside this function; the cuda-marked sync test in
tests/plan/test_planner.py asserts the same on a GPU.

What a step's policy reads after the commit sync (the plan it made) it takes with `to_host_later` while planning:
on CUDA the copy rides behind the step's work and the read needs no device; elsewhere it is read after the sync,
by `to_host`, or by `to_host_list` as Python numbers.
The module also owns the other host-or-device choices of a step (`on_host`, `pinned`, `copy_done`,
`synchronize`): callers ask these instead of testing device types themselves.
"""
from __future__ import annotations

import importlib

import numpy as np
import torch
from torch import Tensor


def to_host(values: Tensor) -> np.ndarray:
    """`values` as a host numpy array: one device-to-host copy that waits for the device (a sync off the
    CPU, a view on the CPU). The only host read of a verify step; see the module docstring."""
    return values.detach().cpu().numpy()


def to_host_list(values: Tensor) -> list | int | float | bool:
    """`values` read by `to_host` as Python numbers: nested lists by its shape (a 0-d tensor: one number), for host
    bookkeeping in plain Python (a policy's, between forwards)."""
    return to_host(values).tolist()


def to_host_later(values: Tensor) -> Tensor:
    """`values` for a `to_host` read after the device's next `synchronize` (a step's commit sync): on CUDA a
    pinned host copy queued behind the device's work now, not waited for, so that read waits for nothing; on the
    CPU the tensor itself (a view, not a snapshot); elsewhere the device tensor (read then, after the sync)."""
    if on_host(values) or not pinned(values.device):
        return values.detach()
    out = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    return out.copy_(values.detach(), non_blocking=True)


def to_device(values: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """`values` on `device` (as `dtype`): a host-to-device copy that does not wait for the device (the driver
    stages a pageable source at once), the same tensor where it already is. The way a step's host values
    (slot ids, prefix lengths) reach the device: a blocking copy would synchronize the stream each time."""
    return values.to(device=device, dtype=dtype, non_blocking=torch.device(device).type != "cpu")


def on_host(values: Tensor) -> bool:
    """True for a tensor in host memory (read without a copy)."""
    return values.device.type == "cpu"


def pinned(device: torch.device | str) -> bool:
    """True when host buffers staged for `device` are pinned (page-locked: CUDA copies them asynchronously)."""
    return torch.device(device).type == "cuda"


def copy_done(device: torch.device | str) -> torch.cuda.Event | None:
    """An event recorded after the copies just issued towards / from `device` (CUDA), None where none is needed:
    a staging buffer is reused only once its previous copy has finished."""
    if torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on `device` (CUDA or an Ascend NPU); nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        importlib.import_module("torch_npu")
        torch.npu.synchronize(device)
