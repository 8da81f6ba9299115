"""Train the tiny target and draft on the Python standard library's own source; cache the weights.

Nothing is downloaded: the corpus is the `.py` files under `sysconfig.get_paths()["stdlib"]`. Every
tenth file (sorted by name) is held out for prompts. The draft (a block drafter: head k predicts k + 1
bytes ahead) is distilled from the target and its ConfidenceHead learns the soft target `1 - TV(q, p)`.
"""
from __future__ import annotations

import hashlib
import math
import json
import os
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from dspark.engine.model import DraftLM, ModelConfig, TinyLM
from dspark.confidence import confidence_loss, soft_accept_target

Progress = Callable[[str, int, int, float], None]  # (phase, step, total, loss)


def stdlib_files(split: str) -> list[Path]:
    """Top-level stdlib `.py` files: `train` (9 of 10) or `heldout` (every tenth, sorted by name)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise RuntimeError(f"no .py files found under {sysconfig.get_paths()['stdlib']}")
    keep = (lambda i: i % 10 == 0) if split == "heldout" else (lambda i: i % 10 != 0)
    return [f for i, f in enumerate(files) if keep(i)]


def corpus(split: str, max_bytes: int = 2_000_000) -> torch.Tensor:
    """The split's bytes concatenated, as a uint8 tensor (at most max_bytes)."""
    chunks, total = [], 0
    for f in stdlib_files(split):
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()


@dataclass(frozen=True)
class TrainConfig:
    """Model shapes and optimisation schedule for both models."""

    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig = field(default_factory=lambda: ModelConfig(d_model=64, n_layers=1, n_heads=2))
    target_steps: int = 300
    draft_steps: int = 200
    gamma: int = 6                     # draft heads: the largest gamma the engine can run
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0

    def target_key(self) -> str:
        """Cache key of the target's weights (what they depend on)."""
        return _hash({"target": self.target.to_dict(), "target_steps": self.target_steps,
                      "batch_size": self.batch_size, "lr": self.lr, "seed": self.seed})

    def key(self) -> str:
        """Cache key of the draft's weights (they depend on the target too)."""
        return _hash({"target": self.target_key(), "draft": self.draft.to_dict(), "draft_steps": self.draft_steps,
                      "gamma": self.gamma, "batch_size": self.batch_size, "lr": self.lr, "seed": self.seed})


def _hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _batches(data: torch.Tensor, seq: int, batch: int, gen: torch.Generator):
    while True:
        start = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
        idx = start[:, None] + torch.arange(seq + 1)[None, :]
        win = data[idx].long()
        yield win[:, :-1], win[:, 1:]


def _lr(step: int, total: int, peak: float) -> float:
    warm = max(1, total // 20)
    return peak * min(1.0, (step + 1) / warm) * max(0.05, 1 - step / total)


def _optimize(model: torch.nn.Module, cfg: TrainConfig, steps: int, phase: str,
              loss_fn: Callable[[], tuple[torch.Tensor, torch.Tensor]], progress: Progress | None) -> None:
    """AdamW with warm-up and linear decay; loss_fn() -> (loss to minimise, loss to report)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, cfg.lr)
        loss, shown = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress:
            progress(phase, step + 1, steps, float(shown.detach()))


def train_target(cfg: TrainConfig, data: torch.Tensor, progress: Progress | None = None) -> TinyLM:
    """Next-byte cross-entropy on random windows of the corpus."""
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = TinyLM(cfg.target)
    batches = _batches(data, cfg.target.max_seq_len, cfg.batch_size, gen)

    def loss_fn() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(batches)
        loss = F.cross_entropy(model.logits(model.forward_dense(x)).flatten(0, 1), y.flatten())
        return loss, loss

    _optimize(model, cfg, cfg.target_steps, "target", loss_fn, progress)
    return model.eval()


def train_draft(cfg: TrainConfig, target: TinyLM, data: torch.Tensor, progress: Progress | None = None) -> DraftLM:
    """Distil the target: head k at position t learns the target's next-byte distribution at t + k.

    The confidence head learns the soft acceptance `1 - TV(q_k, p)` of each head (DeepSpec's target).
    """
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    torch.manual_seed(cfg.seed + 1)
    model = DraftLM(cfg.draft, cfg.gamma)
    g = cfg.gamma
    batches = _batches(data, cfg.draft.max_seq_len, cfg.batch_size, gen)

    def loss_fn() -> tuple[torch.Tensor, torch.Tensor]:
        x, _ = next(batches)
        t = x.shape[1] - g + 1
        with torch.no_grad():
            p_logits = target.logits(target.forward_dense(x))
            p_block = torch.stack([p_logits[:, k: k + t] for k in range(g)], dim=2)  # [b, t, g, V]
        hk = model.block_hidden(model.forward_dense(x)[:, :t], g)                   # [b, t, g, d]
        q_block = model.logits(hk)
        distil = F.cross_entropy(q_block.flatten(0, 2), torch.softmax(p_block, -1).flatten(0, 2))
        soft = soft_accept_target(q_block.detach(), p_block).flatten(0, 1)          # [b*t, g]
        conf_logits = model.confidence(hk.detach().flatten(0, 1))
        # teacher forcing: each position's label is its own overlap given the true prefix, no decay
        conf = confidence_loss(conf_logits, soft, torch.ones_like(soft, dtype=torch.bool), math.inf)
        return distil + conf, distil

    _optimize(model, cfg, cfg.draft_steps, "draft", loss_fn, progress)
    return model.eval()


def _save_atomic(obj: dict, path: Path) -> None:
    """torch.save to a temp file in the same folder, then rename: never a half-written cache file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def default_cache_dir() -> Path:
    return Path(os.path.expanduser("~")) / ".cache" / "dspark"


def load_or_train(cfg: TrainConfig, cache_dir: Path | None = None, progress: Progress | None = None
                  ) -> tuple[TinyLM, DraftLM, bool]:
    """(target, draft, trained_now): weights from `cache_dir`, trained and saved (atomically) if absent."""
    root = Path(cache_dir or default_cache_dir())
    tpath, dpath = root / f"target-{cfg.target_key()}.pt", root / f"draft-{cfg.key()}.pt"
    target, draft = TinyLM(cfg.target), DraftLM(cfg.draft, cfg.gamma)
    trained = False
    data = None
    if tpath.exists():
        target.load_state_dict(torch.load(tpath, weights_only=True))
    else:
        data = corpus("train")
        target = train_target(cfg, data, progress)
        _save_atomic(target.state_dict(), tpath)
        trained = True
    target.eval()
    if dpath.exists():
        draft.load_state_dict(torch.load(dpath, weights_only=True))
    else:
        draft = train_draft(cfg, target, data if data is not None else corpus("train"), progress)
        _save_atomic(draft.state_dict(), dpath)
        trained = True
    return target, draft.eval(), trained
