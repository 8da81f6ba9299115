"""STS data: the per-step recorder (crash-safe shards) and the validated loader.

One row per (request, step): the raw confidence logits, the realized acceptance labels as a prefix mask
(greedy match, or rejection-sampling accepts), optional soft acceptance `1 - TV`, optional top-2 draft
margin (baseline score), the verify length, the sampling policy, the request id and the step.
Draft position k is observed only when the target verified it, i.e. k < verify_len - 1; later positions
are censored and stored as NaN (missing), never as rejections.

Shards are written to a temporary file, fsynced and renamed, so a crash leaves only complete shards under
a shard name; they are loaded with `torch.load(weights_only=True)` (no pickle code execution).
"""
from __future__ import annotations

import atexit
import os
import pickle
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor

from dspark.calibration.confidence import check_prefix_mask
from dspark.calibration.metrics import top2_margin
from dspark.util.fileio import atomic_write
from dspark.util.validate import check_directory, check_int, check_path, check_type

SHARD_FORMAT = "dspark.sts/1"
_DTYPES = {"logits": torch.float32, "labels": torch.float32, "soft": torch.float32, "margin": torch.float32,
           "verify_lens": torch.int32, "policy": torch.int8, "request_ids": torch.int64, "steps": torch.int64}
POLICIES = ("greedy", "sampling")
TEMP_SUFFIX = ".tmp"  # dspark.util.fileio.atomic_write's temporary siblings
_SHARD_RE = re.compile(r"^(?P<prefix>.+)-rank(?P<rank>\d{5})-(?P<index>\d{6})\.pt$")


@dataclass(frozen=True)
class StsData:
    """Recorded STS rows (CPU tensors): N rows, gamma draft positions."""

    logits: Tensor        # [N, gamma] float32 raw confidence logits
    labels: Tensor        # [N, gamma] float32 prefix mask 0/1, NaN where censored
    soft: Tensor          # [N, gamma] float32 1 - TV(q, p), NaN where censored or not recorded
    margin: Tensor        # [N, gamma] float32 top-2 draft logit margin, NaN where not recorded
    verify_lens: Tensor   # [N] int32, in [1, gamma + 1]
    policy: Tensor        # [N] int8 index into POLICIES
    request_ids: Tensor   # [N] int64
    steps: Tensor         # [N] int64

    @property
    def num_rows(self) -> int:
        return int(self.logits.shape[0])

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])

    def validate(self, where: str = "STS data") -> "StsData":
        """Check shapes, dtypes, label values, the prefix property and censoring; returns self."""
        n, g = self.logits.shape if self.logits.dim() == 2 else (-1, -1)
        if n < 0 or g < 1:
            raise ValueError(f"{where}: logits must be [N, gamma >= 1], got {tuple(self.logits.shape)}")
        for f in fields(self):
            t = getattr(self, f.name)
            want = (n, g) if f.name in ("logits", "labels", "soft", "margin") else (n,)
            if not isinstance(t, Tensor) or tuple(t.shape) != want or t.dtype != _DTYPES[f.name]:
                got = (tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{where}: {f.name} must be a {_DTYPES[f.name]} tensor of shape {want}, "
                                 f"got {got}")
        vl = self.verify_lens.to(torch.int64)
        if n and (int(vl.min()) < 1 or int(vl.max()) > g + 1):
            raise ValueError(f"{where}: verify_lens must lie in [1, {g + 1}], got min {int(vl.min())} "
                             f"max {int(vl.max())}")
        if n and (int(self.policy.min()) < 0 or int(self.policy.max()) >= len(POLICIES)):
            raise ValueError(f"{where}: policy codes must lie in [0, {len(POLICIES)}), got "
                             f"{sorted(set(self.policy.tolist()))}")
        observed = torch.arange(g).unsqueeze(0) < (vl - 1).unsqueeze(1)
        mismatch = observed != torch.isfinite(self.labels)
        if bool(mismatch.any()):
            r = int(mismatch.nonzero()[0][0])
            raise ValueError(f"{where}: row {r} must have labels exactly at positions < verify_len - 1 = "
                             f"{int(vl[r]) - 1} (NaN = censored beyond), got {self.labels[r].tolist()}")
        check_prefix_mask(torch.nan_to_num(self.labels, nan=0.0), f"{where}: labels")
        return self

    def cpu(self) -> "StsData":
        """The same rows with every tensor on the CPU (fitting and metrics run there)."""
        return StsData(**{f.name: getattr(self, f.name).detach().cpu() for f in fields(self)})

    def select(self, rows: Tensor) -> "StsData":
        """Rows picked by a bool mask or an index tensor."""
        return StsData(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    @staticmethod
    def concat(parts: list["StsData"]) -> "StsData":
        if not parts:
            raise ValueError("no STS data to concatenate (empty list of shards)")
        gammas = sorted({p.gamma for p in parts})
        if len(gammas) != 1:
            raise ValueError(f"STS shards disagree on gamma: {gammas}")
        return StsData(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(StsData)})


def _save_synced(payload: dict, path: Path) -> None:
    """torch.save then fsync, so a renamed shard is on disk, not only in the page cache."""
    with open(path, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())


def _as_rows(name: str, x: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    if x is None:
        return torch.full(shape, float("nan"), dtype=dtype)
    if not isinstance(x, Tensor) or tuple(x.shape) != shape:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a tensor of shape {shape}, got {got}")
    if x.is_floating_point() and not dtype.is_floating_point:
        raise TypeError(f"{name} must be an integer or bool tensor, got {x.dtype}")
    return x.detach().to("cpu", dtype)


def censored_labels(verify_lens: Tensor, gamma: int, *, correct_lens: Tensor | None = None,
                    labels: Tensor | None = None) -> Tensor:
    """STS labels [B, gamma] float32 on the CPU: the accepted-prefix mask, from exactly one of correct_lens [B]
    (drafts accepted, capped or not) or labels [B, gamma] (0/1 prefix mask), at the positions the target
    verified (k < verify_len - 1), NaN (censored, never a rejection) beyond. verify_lens [B] in [1, gamma + 1]."""
    if not isinstance(verify_lens, Tensor) or verify_lens.dim() != 1:
        raise ValueError(f"verify_lens must be a 1-D tensor [B], got {getattr(verify_lens, 'shape', verify_lens)!r}")
    b, g = verify_lens.shape[0], gamma
    if (correct_lens is None) == (labels is None):
        raise ValueError("give exactly one of correct_lens [B] or labels [B, gamma]")
    vl = _as_rows("verify_lens", verify_lens, (b,), torch.int64)
    if b and (int(vl.min()) < 1 or int(vl.max()) > g + 1):
        raise ValueError(f"verify_lens must lie in [1, {g + 1}], got {vl.tolist()}")
    positions = torch.arange(g).unsqueeze(0)
    if labels is not None:
        mask = check_prefix_mask(_as_rows("labels", labels, (b, g), torch.float32), "labels")
    else:
        cl = _as_rows("correct_lens", correct_lens, (b,), torch.int64)
        if b and (int(cl.min()) < 0 or int(cl.max()) > g):
            raise ValueError(f"correct_lens must lie in [0, {g}], got {cl.tolist()}")
        mask = positions < cl.unsqueeze(1)
    observed = positions < (vl - 1).unsqueeze(1)
    return torch.where(observed, mask.to(torch.float32), torch.tensor(float("nan")))


@dataclass(frozen=True)
class StsOutcome:
    """What the target accepted of a step's drafts, as `StsRecorder.record` labels it, checked when built.

    Exactly one of correct_lens [B] (drafts accepted, capped or not) or labels [B, gamma] (0/1 prefix mask); policy:
    how they were accepted (`POLICIES`: greedy match or rejection sampling); soft_accept [B, gamma]: optional
    1 - TV(q, p). Their values are checked against the step's verify lengths when recorded.
    """

    correct_lens: Tensor | None = None
    labels: Tensor | None = None
    policy: str = "greedy"
    soft_accept: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.correct_lens is None) == (self.labels is None):
            raise ValueError("give exactly one of correct_lens [B] or labels [B, gamma]")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


class StsRecorder:
    """Collects STS rows from a decode loop (one `record` call per step) and writes crash-safe shards.

    Shards are `<out_dir>/<prefix>-rank<RRRRR>-<IIIIII>.pt`, written every `shard_rows` rows, on `flush`,
    on `close` and at interpreter exit. Numbering continues after shards already in `out_dir`.
    """

    def __init__(self, out_dir: str | os.PathLike, *, gamma: int, rank: int = 0, shard_rows: int = 65536,
                 prefix: str = "sts"):
        for name, v, lo in (("gamma", gamma, 1), ("rank", rank, 0), ("shard_rows", shard_rows, 1)):
            check_int(name, v, lo)
        if not prefix or not re.fullmatch(r"[A-Za-z0-9_.]+", prefix):
            raise ValueError(f"prefix must be a non-empty [A-Za-z0-9_.] name, got {prefix!r}")
        self.out_dir = check_directory("out_dir", out_dir)
        self.gamma, self.rank, self.shard_rows, self.prefix = gamma, rank, shard_rows, prefix
        taken = [int(m["index"]) for p in self.out_dir.iterdir()
                 if (m := _SHARD_RE.match(p.name)) and m["prefix"] == prefix and int(m["rank"]) == rank]
        self._next_index = max(taken, default=-1) + 1
        self._pending: list[StsData] = []
        self._pending_rows = 0
        self._step = 0
        self.shards: list[Path] = []
        self.closed = False
        atexit.register(self.close)

    def record(self, confidence_logits: Tensor, *, verify_lens: Tensor, request_ids: Tensor, outcome: StsOutcome,
               draft_logits: Tensor | None = None, step: int | None = None) -> None:
        """Record one decode step for B requests.

        Args:
            confidence_logits: [B, gamma].
            verify_lens: [B] rows verified, root included; request_ids: [B] ints.
            outcome: what was accepted (correct_lens [B] or labels [B, gamma]), under which policy, and the
                optional soft acceptance [B, gamma].
            draft_logits: [B, gamma, V] optional (for the margin baseline).
            step: the step recorded (default: one more than the last).
        """
        if self.closed:
            raise RuntimeError("StsRecorder.record called after close()")
        check_type("outcome", outcome, StsOutcome)
        policy, soft_accept = outcome.policy, outcome.soft_accept
        z = confidence_logits
        if not isinstance(z, Tensor) or z.dim() != 2 or z.shape[1] != self.gamma:
            got = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
            raise ValueError(f"confidence_logits must be [B, {self.gamma}], got {got}")
        b, g = z.shape
        vl = _as_rows("verify_lens", verify_lens, (b,), torch.int64)
        censored = censored_labels(vl, g, correct_lens=outcome.correct_lens, labels=outcome.labels)
        observed = torch.isfinite(censored)
        nan = torch.tensor(float("nan"))
        soft = _as_rows("soft_accept", soft_accept, (b, g), torch.float32)
        bad = observed & ~((soft >= 0) & (soft <= 1))  # NaN fails the range check too
        if soft_accept is not None and bool(bad.any()):
            r, k = (int(v) for v in bad.nonzero()[0])
            raise ValueError(f"soft_accept must lie in [0, 1] at verified positions, got soft_accept[{r}, {k}] = "
                             f"{soft[r, k].item()}")
        if draft_logits is not None:
            if not isinstance(draft_logits, Tensor) or tuple(draft_logits.shape[:2]) != (b, g):
                raise ValueError(f"draft_logits must be [{b}, {g}, V], got "
                                 f"{tuple(getattr(draft_logits, 'shape', ()))}")
            margin = top2_margin(draft_logits.detach()).to("cpu")
        else:
            margin = torch.full((b, g), float("nan"))
        rids = _as_rows("request_ids", request_ids, (b,), torch.int64)
        step_val = self._step if step is None else step
        self._step = step_val + 1
        row = StsData(
            logits=z.detach().to("cpu", torch.float32),
            labels=censored,
            soft=torch.where(observed, soft, nan),
            margin=margin,
            verify_lens=vl.to(torch.int32),
            policy=torch.full((b,), POLICIES.index(policy), dtype=torch.int8),
            request_ids=rids,
            steps=torch.full((b,), int(step_val), dtype=torch.int64),
        )
        self._pending.append(row)
        self._pending_rows += b
        if self._pending_rows >= self.shard_rows:
            self.flush()

    def flush(self) -> Path | None:
        """Write the pending rows as one shard (temp file, fsync, rename); returns its path or None."""
        if not self._pending_rows:
            return None
        data = StsData.concat(self._pending)
        payload = {"format": SHARD_FORMAT, "gamma": self.gamma, "rank": self.rank}
        payload.update({f.name: getattr(data, f.name) for f in fields(StsData)})
        path = atomic_write(self.out_dir / f"{self.prefix}-rank{self.rank:05d}-{self._next_index:06d}.pt",
                            lambda tmp: _save_synced(payload, tmp))
        self._next_index += 1
        self._pending, self._pending_rows = [], 0
        self.shards.append(path)
        return path

    def close(self) -> None:
        """Flush what is pending and stop accepting rows (idempotent; also runs at interpreter exit)."""
        if self.closed:
            return
        self.flush()
        self.closed = True
        atexit.unregister(self.close)

    def __enter__(self) -> "StsRecorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_shard(path: str | os.PathLike) -> StsData:
    """Load and validate one shard; refuses temporary files, pickled objects and corrupt files."""
    p = check_path("path", path)
    if p.name.endswith(TEMP_SUFFIX):
        raise ValueError(f"{p}: a temporary (incomplete) shard file, not a recorded shard")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{p}: refused to load: the shard holds pickled objects beyond plain tensors "
                         f"(weights_only=True): {e}") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{p}: not a readable STS shard (truncated or corrupt): {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != SHARD_FORMAT:
        fmt = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise ValueError(f"{p}: not an STS shard (expected format {SHARD_FORMAT!r}, got {fmt!r})")
    missing = [f.name for f in fields(StsData) if f.name not in obj]
    if missing:
        raise ValueError(f"{p}: STS shard is missing fields {missing}")
    data = StsData(**{f.name: obj[f.name] for f in fields(StsData)})
    if data.logits.dim() != 2 or data.gamma != obj.get("gamma"):
        raise ValueError(f"{p}: logits shape {tuple(data.logits.shape)} disagrees with gamma={obj.get('gamma')}")
    return data.validate(str(p))


def shard_paths(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Expand directories into their shard files (sorted); explicit files are kept as given."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]  # one file or folder
    out: list[Path] = []
    for i, raw in enumerate(check_type("paths", paths, Iterable)):
        p = check_path(f"paths[{i}]", raw)
        if p.is_dir():
            out.extend(sorted(q for q in p.iterdir() if _SHARD_RE.match(q.name)))
        elif p.exists():
            out.append(p)
        else:
            raise ValueError(f"STS shard path does not exist: {p}")
    if not out:
        raise ValueError(f"no STS shards found in {[str(p) for p in paths]}")
    return out


def load_sts(paths: Iterable[str | os.PathLike],
             progress: Callable[[int, int, Path], None] | None = None) -> StsData:
    """Load shards (files or directories of shards) into one validated StsData."""
    files = shard_paths(list(paths))
    parts = []
    for i, p in enumerate(files):
        parts.append(load_shard(p))
        if progress is not None:
            progress(i + 1, len(files), p)
    return StsData.concat(parts)
