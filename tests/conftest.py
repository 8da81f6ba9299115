"""Test options: `--device {cpu,cuda,npu}` runs the same suite on hardware.

On the CPU, Triton kernels run through the interpreter (TRITON_INTERPRET=1, set before triton loads).
Every test either takes the `device` fixture (its subject runs on the device under test) or is marked
`cpu_only(reason=...)` (host-only by nature: config, cost fits, file io, gloo, static source checks);
`tests/package/test_device_suite.py` enforces it and the terminal summary counts the tests that ran on the device.
"""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda", "npu"],
                     help="device the suite runs on (cpu uses the Triton interpreter)")


# Modules that are CPU-only by nature as a whole (the reason per module); a test in them that takes `device`
# still runs on the device. Single CPU-only tests elsewhere carry `@pytest.mark.cpu_only(reason=...)`.
CPU_ONLY_MODULES = {
    "test_ascend_bringup.py": "the bring-up ladder's CPU report (perf/npu_check.sh runs it on an NPU)",
    "test_ascend_npu_fake.py": "the Ascend runtime and graph backend against a fake torch_npu",
    "test_calibration_metrics.py": "offline calibration metrics (numpy) over recorded rows",
    "test_calibration_recorder.py": "crash-safe shard files of the STS recorder",
    "test_config.py": "config validation: no tensors",
    "test_cost.py": "cost-model fits and JSON io (host numpy)",
    "test_distributed.py": "gloo process groups on the host: the agreement runs on CPU tensors",
    "test_engine_demo.py": "the demo command's files and argument checks (perf/device_check.sh runs it on a GPU)",
    "test_engine_profile.py": "cost fits from profiled step times (host arithmetic)",
    "test_engine_telemetry.py": "telemetry reports over recorded steps (host arithmetic)",
    "test_input_boundaries.py": "option checks of the commands before any work (host arguments and files)",
    "test_kernels_compile.py": "compiles the Triton kernels for a GPU target without launching them",
    "test_lsq.py": "non-negative least squares (numpy)",
    "test_packaging.py": "package metadata, imports without triton, the README example on the CPU",
    "test_perf_scripts.py": "perf scripts at tiny scale on the CPU (perf/device_check.sh runs the device ones)",
    "test_progress.py": "progress lines of long jobs (host text)",
    "test_profiling.py": "step timers and cost-model fits of the profiling sweeps on the CPU",
    "test_public_api.py": "the pinned names of the public API",
    "test_imports.py": "the package's import graph, read from the source",
    "test_signatures.py": "parameter counts of the public callables, read from the source",
    "test_public_boundaries.py": "argument checks of every public callable on small CPU inputs",
    "test_tiered_cost.py": "the tiered cost model's fit and io (host arithmetic)",
    "test_validate.py": "the shared boundary checks on CPU scalars and tensors",
}


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif os.environ.get("TRITON_INTERPRET") == "1":
        raise pytest.UsageError(f"--device {config.getoption('--device')} with TRITON_INTERPRET=1 would run the "
                                "Triton kernels in the interpreter; unset TRITON_INTERPRET")
    config.addinivalue_line("markers", "cpu_only(reason): CPU-only by nature; runs on the CPU under every --device")
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "dspark", max_examples=int(os.environ.get("DSPARK_HYPOTHESIS_EXAMPLES", "25")), deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=True, print_blob=True,
    )
    settings.load_profile("dspark")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs one worker per core: one intra-op thread each
        import torch

        torch.set_num_threads(1)


_KIND_PROPERTY = "dspark_kind"  # the test's kind in its reports' user_properties


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dev = config.getoption("--device")
    for item in items:
        reason = CPU_ONLY_MODULES.get(item.path.name)
        if reason and not takes_device(item):
            item.add_marker(pytest.mark.cpu_only(reason=reason))
        kind = "device" if takes_device(item) else "cpu_only" if item.get_closest_marker("cpu_only") else "unmarked"
        item.user_properties.append((_KIND_PROPERTY, kind))  # reports carry it to the xdist controller
        for mark in ("cuda", "npu"):
            if mark in item.keywords and dev != mark:
                item.add_marker(pytest.mark.skip(reason=f"needs --device {mark}"))


def takes_device(item: pytest.Item) -> bool:
    """True when the test's subject runs on the device under test (it takes the `device` fixture)."""
    return "device" in getattr(item, "fixturenames", ())


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """One line: how many tests ran (passed or failed) on the device, how many cpu_only ones on the CPU."""
    ran = {r.nodeid: dict(r.user_properties).get(_KIND_PROPERTY) for key in ("passed", "failed")
           for r in terminalreporter.stats.get(key, []) if r.when == "call"}
    count = {k: sum(1 for v in ran.values() if v == k) for k in ("device", "cpu_only", "unmarked")}
    terminalreporter.write_line(
        f"dspark: {count['device']} tests ran on --device {config.getoption('--device')}, "
        f"{count['cpu_only']} cpu_only tests on the CPU, {count['unmarked']} unmarked")


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config):
    """The torch device under test."""
    import torch

    name = pytestconfig.getoption("--device")
    if name == "npu":
        import torch_npu  # noqa: F401  (registers the npu device)
    if name == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda given but torch.cuda.is_available() is False", returncode=2)
    return torch.device(name)


@pytest.fixture
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the Triton kernels (interpreted on the CPU); skipped where triton is not installed."""
    from dspark.kernels import _triton

    if not _triton.available():
        pytest.skip("needs triton (the gpu extra)")
    monkeypatch.setenv("DSPARK_KERNEL_BACKEND", "triton")


@pytest.fixture
def torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the torch reference paths."""
    monkeypatch.setenv("DSPARK_KERNEL_BACKEND", "torch")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops on a shared 2-core machine: intra-op threads only add spin-wait."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
