"""StsRecorder: labels and censoring, crash-safe shards, refusal of pickle payloads and partial files."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dspark.calibration.recorder import SHARD_FORMAT, StsOutcome, StsRecorder, load_shard, load_sts

NAN = float("nan")
ROOT = Path(__file__).resolve().parents[2]


def test_record_labels_censoring_and_roundtrip(device, tmp_path):
    g = 4
    z = torch.tensor([[1.0, 2.0, 3.0, 4.0], [-1.0, 0.5, 0.0, 2.0], [0.3, 0.2, 0.1, 0.0]], device=device)
    with StsRecorder(tmp_path, gamma=g, rank=3) as rec:
        rec.record(z, verify_lens=torch.tensor([5, 3, 1], device=device),
                   request_ids=torch.tensor([10, 11, 12], device=device),
                   outcome=StsOutcome(correct_lens=torch.tensor([2, 4, 0], device=device),
                                         soft_accept=torch.full((3, g), 0.5, device=device)),
                   draft_logits=torch.arange(3 * g * 3, dtype=torch.float32, device=device).reshape(3, g, 3))
        rec.record(z[:1], verify_lens=torch.tensor([3], device=device), request_ids=torch.tensor([10], device=device),
                   outcome=StsOutcome(labels=torch.tensor([[1, 0, 0, 0]], device=device), policy="sampling"),
                   step=9)
    assert [p.name for p in rec.shards] == ["sts-rank00003-000000.pt"]
    d = load_sts([tmp_path])
    lab = d.labels.tolist()
    assert lab[0] == [1.0, 1.0, 0.0, 0.0]                      # all four drafts verified
    assert lab[1][:2] == [1.0, 1.0] and all(x != x for x in lab[1][2:])  # censored at >= verify_len - 1 = 2
    assert all(x != x for x in lab[2])                           # verify_len 1: nothing observed
    assert lab[3][:2] == [1.0, 0.0] and all(x != x for x in lab[3][2:])
    assert torch.equal(d.logits[:3], z.cpu()) and d.steps.tolist() == [0, 0, 0, 9]
    assert d.policy.tolist() == [0, 0, 0, 1] and d.request_ids.tolist() == [10, 11, 12, 10]
    assert d.margin[0].tolist() == [1.0] * 4 and torch.isnan(d.margin[3]).all()
    assert d.soft[0].tolist() == [0.5] * 4 and torch.isnan(d.soft[1, 2:]).all()


def test_shards_split_per_rank_and_numbering_continues(tmp_path):
    z = torch.zeros(3, 2)
    kw = dict(verify_lens=torch.full((3,), 3), request_ids=torch.arange(3),
              outcome=StsOutcome(correct_lens=torch.ones(3, dtype=torch.long)))
    for rank in (0, 1):
        rec = StsRecorder(tmp_path, gamma=2, rank=rank, shard_rows=5)
        for _ in range(4):
            rec.record(z, **kw)  # flushes after 6 and 12 rows
        rec.close()
        rec.close()
    rec = StsRecorder(tmp_path, gamma=2, rank=0)
    rec.record(z, **kw)
    rec.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["sts-rank00000-000000.pt", "sts-rank00000-000001.pt", "sts-rank00000-000002.pt",
                     "sts-rank00001-000000.pt", "sts-rank00001-000001.pt"]
    assert load_sts([tmp_path]).num_rows == 27
    with pytest.raises(RuntimeError, match="after close"):
        rec.record(z, **kw)


def test_record_bad_input(tmp_path):
    rec = StsRecorder(tmp_path, gamma=3)
    z = torch.zeros(2, 3)
    ok = dict(verify_lens=torch.tensor([4, 4]), request_ids=torch.tensor([0, 1]))
    one = StsOutcome(correct_lens=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"row 1 is \[0, 1, 1\]"):
        rec.record(z, outcome=StsOutcome(labels=torch.tensor([[1, 0, 0], [0, 1, 1]])), **ok)
    with pytest.raises(ValueError, match="exactly one"):
        StsOutcome()
    with pytest.raises(TypeError, match="outcome must be a StsOutcome, got dict"):
        rec.record(z, outcome={"correct_lens": torch.tensor([1, 1])}, **ok)
    with pytest.raises(ValueError, match=r"correct_lens must lie in \[0, 3\], got \[1, 4\]"):
        rec.record(z, outcome=StsOutcome(correct_lens=torch.tensor([1, 4])), **ok)
    with pytest.raises(ValueError, match=r"verify_lens must lie in \[1, 4\], got \[0, 4\]"):
        rec.record(z, outcome=one, verify_lens=torch.tensor([0, 4]), request_ids=ok["request_ids"])
    with pytest.raises(ValueError, match="policy.*'topk'"):
        StsOutcome(correct_lens=torch.tensor([1, 1]), policy="topk")
    with pytest.raises(ValueError, match=r"\[B, 3\], got \(2, 2\)"):
        rec.record(torch.zeros(2, 2), outcome=one, **ok)
    with pytest.raises(TypeError, match="request_ids must be an integer or bool tensor, got torch.float32"):
        rec.record(z, outcome=one, verify_lens=ok["verify_lens"], request_ids=torch.zeros(2))
    with pytest.raises(ValueError, match=r"soft_accept\[1, 2\] = 1.5"):
        rec.record(z, outcome=StsOutcome(correct_lens=torch.tensor([1, 1]),
                                            soft_accept=torch.tensor([[0.5] * 3, [0.5, 0.5, 1.5]])), **ok)
    with pytest.raises(ValueError, match="gamma must be an int >= 1, got 0"):
        StsRecorder(tmp_path, gamma=0)
    rec.close()
    assert rec.shards == []  # nothing recorded, nothing written


class _Payload:
    """Pickles into a call that would create a marker directory if unpickling ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickle_payload_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "sts-rank00000-000000.pt"
    torch.save({"format": SHARD_FORMAT, "gamma": 2, "logits": _Payload(marker)}, bad)
    with pytest.raises(ValueError, match="refused to load.*pickled objects"):
        load_shard(bad)
    with pytest.raises(ValueError, match="refused"):
        load_sts([tmp_path])
    assert not marker.exists()


def test_foreign_and_empty_inputs_are_refused(tmp_path):
    other = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, other)
    with pytest.raises(ValueError, match="not an STS shard"):
        load_shard(other)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no STS shards"):
        load_sts([empty])
    with pytest.raises(ValueError, match="does not exist"):
        load_sts([tmp_path / "missing"])


_CHILD = textwrap.dedent("""
    import io, sys, time, torch
    import dspark.calibration.recorder as cr
    mode, out = sys.argv[1], sys.argv[2]
    real_save, saves = torch.save, [0]
    def slow_save(obj, f):
        saves[0] += 1
        if saves[0] < 3:
            return real_save(obj, f)
        buf = io.BytesIO(); real_save(obj, buf); data = buf.getvalue()
        f.write(data[: len(data) // 2]); f.flush()
        print("mid-write", flush=True)
        time.sleep(600)
    if mode == "kill":
        cr.torch.save = slow_save
    rec = cr.StsRecorder(out, gamma=3, shard_rows=50)
    g = torch.Generator().manual_seed(0)
    for step in range(3 if mode == "kill" else 1):
        rec.record(torch.randn(50, 3, generator=g), verify_lens=torch.full((50,), 4),
                   request_ids=torch.arange(50),
                   outcome=cr.StsOutcome(correct_lens=torch.randint(0, 4, (50,), generator=g)))
    if mode == "exit":
        rec.record(torch.randn(7, 3, generator=g), verify_lens=torch.full((7,), 2),
                   request_ids=torch.arange(7), outcome=cr.StsOutcome(correct_lens=torch.zeros(7, dtype=torch.long)))
    print("done", flush=True)  # "exit": leaves without close(); atexit must flush the 7 pending rows
""")


def _child(mode, out):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", _CHILD, mode, str(out)], stdout=subprocess.PIPE, text=True,
                            env=env)


@pytest.mark.slow
def test_kill_mid_write_leaves_only_complete_shards(tmp_path):
    proc = _child("kill", tmp_path)
    try:
        assert proc.stdout.readline().strip() == "mid-write"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    files = sorted(p.name for p in tmp_path.iterdir())
    shards = [n for n in files if n.endswith(".pt")]
    partial = [n for n in files if n not in shards]
    assert shards == ["sts-rank00000-000000.pt", "sts-rank00000-000001.pt"] and len(partial) == 1
    assert load_sts([tmp_path]).num_rows == 100  # every completed shard loads; the partial one is skipped
    with pytest.raises(ValueError, match="temporary"):
        load_shard(tmp_path / partial[0])
    renamed = tmp_path / "sts-rank00000-000009.pt"  # even under a shard name the torn bytes never load
    (tmp_path / partial[0]).rename(renamed)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_shard(renamed)


@pytest.mark.slow
def test_interpreter_exit_flushes_pending_rows(tmp_path):
    proc = _child("exit", tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == "done"
    d = load_sts([tmp_path])
    assert d.num_rows == 57 and torch.isnan(d.labels[50:, 1:]).all() and (d.labels[50:, 0] == 0).all()
