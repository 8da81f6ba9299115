"""Test options: `--device {cpu,cuda,npu}` runs the same suite on hardware.

On the CPU, Triton kernels run through the interpreter (TRITON_INTERPRET=1, set before triton loads).
"""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda", "npu"],
                     help="device the suite runs on (cpu uses the Triton interpreter)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--device") == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "dspark", max_examples=int(os.environ.get("DSPARK_HYPOTHESIS_EXAMPLES", "25")), deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        derandomize=True, print_blob=True,
    )
    settings.load_profile("dspark")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dev = config.getoption("--device")
    for item in items:
        for mark in ("cuda", "npu"):
            if mark in item.keywords and dev != mark:
                item.add_marker(pytest.mark.skip(reason=f"needs --device {mark}"))


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
