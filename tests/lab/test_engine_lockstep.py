"""Step-interleaved runs (`lockstep`) on forked decoders: same results as one run at a time, least-charged-first."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dspark.lab.timing import lockstep
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.outcome import finish
from dspark.serve.policies import Adaptive, FixedK, Oracle
from dspark.serve.policies.gate import GateSettings
from tests.serve.test_engine import _prompts
from tests.serve.test_engine_speculate import GAMMA, _planner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def decoder(device) -> SpecDecoder:
    from tests.engine_models import tiny_models

    target, draft = tiny_models(gamma=GAMMA)
    return SpecDecoder(target, draft, config=EngineConfig(cache_tokens=4096, page_size=8, device=device))


def _policies(device: torch.device):
    return {"plain": FixedK(0), "k2": FixedK(2), "oracle": Oracle(GAMMA),
            "adaptive": Adaptive(_planner(device=device), lambda b: 0.004 * b, gate=GateSettings(probe_every=2))}


def test_interleaved_runs_equal_one_at_a_time(decoder: SpecDecoder) -> None:
    prompts, counts = _prompts(7, 6, seed=3), torch.tensor([5, 9, 12, 3, 7, 11, 6])
    alone = {k: decoder.generate(prompts, counts, p, max_batch=3) for k, p in _policies(decoder.device).items()}
    forks = {k: decoder.fork() for k in alone}
    together = lockstep({k: forks[k].start(prompts, counts, p, max_batch=3) for k, p in _policies(decoder.device).items()})
    assert list(together) == list(alone)
    for k in alone:
        assert torch.equal(together[k].tokens, alone[k].tokens), k
        if k != "adaptive":  # (adaptive's speculate-or-not reads measured step times: its steps may differ)
            steps = [s.commit_lens.tolist() for s in together[k].steps]
            assert steps == [s.commit_lens.tolist() for s in alone[k].steps], k
        assert together[k].max_batch == 3
        assert together[k].seconds == pytest.approx(together[k].startup_seconds
                                                    + sum(s.times.total for s in together[k].steps))


def test_fork_shares_models_not_caches(decoder: SpecDecoder) -> None:
    twin = decoder.fork()
    assert twin.target is decoder.target and twin.draft is decoder.draft
    assert twin.tcache is not decoder.tcache and twin.tcache.k.data_ptr() != decoder.tcache.k.data_ptr()
    mine, theirs = decoder._drafter.cache, twin._drafter.cache  # the bound block drafters' own KV caches
    assert theirs is not mine and theirs.capacity_tokens == mine.capacity_tokens


def test_one_run_per_decoder_at_a_time(decoder: SpecDecoder) -> None:
    twin = decoder.fork()
    run = twin.start(_prompts(2, 6, seed=1), 4, FixedK(1))
    next(run)
    with pytest.raises(RuntimeError, match="already running"):
        twin.start(_prompts(2, 6, seed=1), 4, FixedK(1))
    finish(run)
    assert twin.generate(_prompts(2, 6, seed=1), 4, FixedK(1)).tokens.shape == (2, 4)  # free again
    run = twin.start(_prompts(2, 6, seed=1), 4, FixedK(1))
    next(run)
    run.close()  # an abandoned run frees the decoder and its KV pages
    assert twin.tcache.allocator.num_free == twin.tcache.allocator.num_pages
    twin.generate(_prompts(2, 6, seed=1), 4, FixedK(1))


def _fake_run(times: list[float], log: list[tuple[str, int]], name: str):
    for i, t in enumerate(times):
        log.append((name, i))
        yield SimpleNamespace(times=SimpleNamespace(total=t))
    return name.upper()


@pytest.mark.cpu_only(reason="the lockstep scheduler's order over fake runs: no tensors")
def test_least_charged_run_goes_next() -> None:
    log: list[tuple[str, int]] = []
    out = lockstep({"a": _fake_run([3.0, 1.0, 1.0], log, "a"), "b": _fake_run([1.0, 1.0, 5.0], log, "b"),
                    "c": _fake_run([2.0], log, "c")})
    assert out == {"a": "A", "b": "B", "c": "C"}
    # charged a/b/c: 0/0/0 -> a (ties to the earlier key) 3/0/0 -> b 3/1/0 -> c 3/1/2 -> b 3/2/2 -> b 3/7/2
    # -> c ends -> a 4/7 -> a 5/7 -> a ends -> b ends
    assert log == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("b", 2), ("a", 1), ("a", 2)]
