"""A verify step reads the device on the host only through `dspark.verify.boundary.to_host`, at most twice
(the planner's decision that fixes the rows, then the commit lengths), and once with sync-free planning.

On the CPU a host read is no sync, so the test counts the operations that would be one on a device: every
`.item / .tolist / .cpu / .numpy / __bool__ / __int__ / __float__ / __index__` on a tensor (a
TorchFunctionMode) and every `aten._local_scalar_dense` (a TorchDispatchMode, for reads made in C++).
Reads of `slots` / `generations` (host-side scheduling data) and the cost model's own tables (`dspark.cost`
keeps them on the host) are not device reads and are not counted.
The device path is forced on the CPU with `DSPARK_KERNEL_BACKEND=torch` (the torch references).
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from dspark import AdditiveCostModel, BatchTerm, PlannerSettings, RowTerm, ScheduleConfig, VerifyPlanner
from dspark.kernels import dispatch
from dspark.verify import boundary
from dspark.verify.accept import _accept_greedy

GAMMA, SLOTS = 5, 16
TIERS = (8, 16, 32, 64, 96)
READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
         torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


def _in_cost_model() -> bool:
    """True when the read is made by `dspark.cost`: cost models keep their tables on the host by design."""
    frame = sys._getframe(2)
    return frame is not None and f"dspark{os.sep}cost{os.sep}" in frame.f_code.co_filename


def _dspark_caller() -> str:
    """file:line of the innermost dspark frame on the stack (where a stray read was made)."""
    marker = f"{os.sep}dspark{os.sep}"
    frames = [f for f in traceback.extract_stack() if marker in f.filename]
    return f"{frames[-1].filename.split(marker)[-1]}:{frames[-1].lineno}" if frames else "outside dspark"


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors outside `exempt` (function level); `inside` suppresses nested counts. On an
    accelerator (`device` not the CPU) a read of a CPU tensor is no device read and is not counted."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.count, self.where, self.inside, self.exempt = 0, [], 0, set()
        self.host_is_free = torch.device(device).type != "cpu"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_host = bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu"
        if func in READS and not self.inside and not any(a is e for a in args[:1] for e in self.exempt) \
                and not _in_cost_model() and not (self.host_is_free and on_host):
            self.count += 1
            self.where.append(f"{getattr(func, '__name__', func)} at {_dspark_caller()}")
        self.inside += func in READS
        try:
            return func(*args, **kwargs)
        finally:
            self.inside -= func in READS


class ScalarReads(TorchDispatchMode):
    """Counts `aten._local_scalar_dense` calls that no counted (or exempt) function-level read made."""

    def __init__(self, functions: HostReads) -> None:
        super().__init__()
        self.functions, self.count = functions, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.functions.inside:
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(monkeypatch, device: torch.device | str = "cpu"):
    """(HostReads, ScalarReads, boundary calls list) with `boundary.to_host` wrapped: its own reads are the
    boundary's, counted there, not as stray reads."""
    calls = []
    real = boundary.to_host
    functions = HostReads(device)

    def to_host(values):
        calls.append(tuple(values.shape))
        functions.inside += 1
        try:
            return real(values)
        finally:
            functions.inside -= 1

    monkeypatch.setattr(boundary, "to_host", to_host)
    scalars = ScalarReads(functions)
    with functions, scalars:
        yield functions, scalars, calls


def cost() -> AdditiveCostModel:
    return AdditiveCostModel(2e-3, BatchTerm([1, 16], [0.0, 1e-3]), RowTerm([0, 8, 40], [0.0, 0.4e-3, 8e-3]))


def batches(steps: int, device, seed: int = 0):
    """Per step: (logits [B, gamma], slots, generations, draft tokens, strided target logits) of a random batch."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        b = int(torch.randint(1, 12, (1,), generator=g))
        slots = torch.randperm(SLOTS, generator=g)[:b]
        gens = torch.randint(0, 2, (b,), generator=g)
        z = (torch.randn(b, GAMMA, generator=g) * 3 + 1).to(device)
        draft = torch.randint(0, 9, (b, GAMMA), generator=g).to(device)
        target = torch.randn(b, GAMMA + 1, 9, generator=g).to(device)
        yield z, slots, gens, draft, target


def one_step(planner, z, slots, gens, draft, target, reads):
    """Plan, pack the target rows as the forward would leave them, accept, read the commit lengths."""
    reads.exempt = {slots, gens}
    plan = planner.plan(z, slots, gens)
    layout = plan.layout
    packed = target.reshape(-1, target.shape[-1]).index_select(
        0, (layout.row_slot.clamp(max=z.shape[0] - 1) * (GAMMA + 1) + layout.row_within).to(torch.int64))
    result = _accept_greedy(draft, packed, plan.verify_lens, layout=layout)
    return boundary.to_host(result.commit_lens)


@pytest.mark.parametrize("lag,sync_free,tiers,per_step", [
    (1, False, None, 2), (1, False, TIERS, 2), (0, False, TIERS, 2), (2, False, TIERS, 2),
    (1, True, TIERS, 1), (2, True, TIERS, 1)])
def test_a_step_reads_the_host_only_through_the_boundary(lag, sync_free, tiers, per_step, device, monkeypatch):
    if device.type == "cpu":
        monkeypatch.setenv(dispatch.BACKEND_ENV, "torch")  # the device path, on the CPU
    planning = PlannerSettings(lag=lag, num_slots=SLOTS, sync_free=sync_free, tiers=tiers,
                               graph_slots=12 + 96 // (GAMMA + 1))
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost(), planning, device=device)
    steps = list(batches(40, device))
    for step in steps:  # warm-up: the cost model's platform check; each batch size's seconds curve, read once
        one_step(planner, *step, HostReads())  # from the host-side cost table and cached on the device
    for z, slots, gens, draft, target in steps:
        with counting(monkeypatch, device) as (functions, scalars, calls):
            commit = one_step(planner, z, slots, gens, draft, target, functions)
        assert functions.count == 0 and scalars.count == 0, functions.where
        assert len(calls) == per_step, calls
        assert calls[-1] == (z.shape[0],) and commit.shape == (z.shape[0],)


def test_the_counter_sees_a_stray_read(device, monkeypatch):
    """The counting modes are not blind: a `.item()` and an `int()` outside the boundary are both caught."""
    x = torch.arange(3, device=device)
    with counting(monkeypatch, device) as (functions, scalars, calls):
        x.sum().item()
        int(x[1])
        boundary.to_host(x)
    assert functions.count == 2 and scalars.count == 0 and calls == [(3,)], functions.where


@pytest.mark.cuda
@pytest.mark.parametrize("sync_free,per_step", [(False, 2), (True, 1)])
def test_cuda_step_syncs_only_at_the_boundary(sync_free, per_step, device, monkeypatch):
    """On a GPU the same steps synchronize exactly as often as they call the boundary."""
    planning = PlannerSettings(lag=1, num_slots=SLOTS, sync_free=sync_free, tiers=TIERS,
                               graph_slots=12 + 96 // (GAMMA + 1))
    planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost(), planning, device=device)
    steps = list(batches(12, device))
    for step in steps:
        one_step(planner, *step, HostReads())
    torch.cuda.synchronize()
    for z, slots, gens, draft, target in steps:
        with warnings.catch_warnings(record=True) as seen, counting(monkeypatch, device) as (functions, _, calls):
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                one_step(planner, z, slots, gens, draft, target, functions)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchronizing CUDA operation" in str(w.message) for w in seen)
        assert len(calls) == per_step and syncs <= per_step, [f"{w.filename}:{w.lineno}: {w.message}" for w in seen]


@pytest.mark.cpu_only(reason="the copy flags of the boundary's host-to-device helper")
def test_host_values_reach_the_device_without_a_wait(monkeypatch):
    """`boundary.to_device` copies host values to an accelerator non-blocking (a blocking copy synchronizes the
    stream: the GPU run counted 4 such syncs per planned step from the lag ring's slot ids) and never so
    towards the host."""
    seen = []
    real = torch.Tensor.to

    def spy(self, *args, **kwargs):
        seen.append((str(kwargs.get("device")), kwargs.get("non_blocking")))
        return real(self, *args, **kwargs)

    x = torch.arange(5)
    want = x.to(torch.int32)
    monkeypatch.setattr(torch.Tensor, "to", spy)
    assert boundary.to_device(x, "meta", torch.int32).dtype == torch.int32
    assert torch.equal(boundary.to_device(x, "cpu", torch.int32), want)
    assert seen == [("meta", True), ("cpu", False)]
    monkeypatch.undo()
    assert boundary.on_host(x) and not boundary.on_host(x.to("meta"))
    assert boundary.pinned("cuda") and not boundary.pinned("cpu") and not boundary.pinned("meta")
    assert boundary.copy_done("cpu") is None
    boundary.synchronize("cpu")  # nothing to wait for


def test_a_later_host_copy_is_queued_behind_the_device_and_read_after_its_sync(device):
    """`boundary.to_host_later`: on the CPU the tensor itself (no copy); on an accelerator a host copy (pinned on
    CUDA) whose values are the device's once the device is synchronized, the copy issued non-blocking."""
    x = torch.arange(7, dtype=torch.float32, device=device) * 1.5 - 2.0
    later = boundary.to_host_later(x)
    boundary.synchronize(device)
    assert later.device.type == "cpu" and later.dtype == x.dtype and later.shape == x.shape
    assert torch.equal(later, x.cpu())
    if device.type == "cpu":
        assert later.data_ptr() == x.data_ptr()  # a view: nothing copied
    else:
        assert later.data_ptr() != x.data_ptr() and later.is_pinned() == boundary.pinned(device)


def test_a_host_list_read_gives_the_values_as_python_numbers(device):
    """`boundary.to_host_list`: the `to_host` read as nested Python lists (exact float32 values, ints as ints)."""
    x = (torch.arange(6, dtype=torch.float32, device=device) / 3.0 - 0.7).reshape(2, 3)
    lens = torch.tensor([3, 1], dtype=torch.int32, device=device)
    got = boundary.to_host_list(x)
    assert got == boundary.to_host(x).tolist() and type(got[1][2]) is float and len(got) == 2
    assert boundary.to_host_list(lens) == [3, 1] and all(type(v) is int for v in boundary.to_host_list(lens))
