"""Train the draft (`dspark.models.draft`) for a transformers target: `python -m dspark.models.train_draft`.

Nothing is downloaded. Prompts are token windows of the stdlib's `.py` files (`dspark.models.corpus`: the
draft distils on the `train` split, the confidence head is fitted on the `calibration` split, acceptance is
reported on the `heldout` split). The target continues each prompt greedily with its own KV cache, and its
final-normed hidden states along the way are the draft's features, so every training label is the serving
event: on the target's greedy text, head k at row t learns the token at t + k + 1, which is the target's
top-1 there given the true (= accepted) tokens before it. The draft learns from those labels (hard
cross-entropy mixed with the target's soft distribution over the draft vocabulary), then
`dspark.ConfidenceHead` is re-initialised from the seed and fitted alone, by L-BFGS, on the greedy
conditional-acceptance event of the finished draft (draft k matches given drafts < k matched; masked rows
are not labels) on calibration streams: files the draft never trained on, so the head learns the
acceptance of unseen text, not of text the draft partly memorised. Held-out acceptance per draft position
and the head's held-out loss and mean prediction are written to the manifest beside the safetensors file
(both written atomically).

`--refit-head` runs only the head stage on an existing weights file (sha256 checked): it regenerates the
head streams of a full run with the file's training config, refits, re-measures and rewrites both files.
The head stage is the same computation in both paths, so a full run's file equals full run + refit byte
for byte.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from dspark.models.corpus import Encode, prompt_windows
from dspark.models.draft import (
    DEFAULT_WEIGHTS,
    FORMAT,
    METADATA_KEY,
    DraftConfig,
    DraftModel,
    file_sha256,
    load_draft,
    manifest_path,
    target_identity,
)
from dspark.models.confidence_fit import HEAD_L2, acceptance, fit_confidence, head_report, reset_head, stream_rows
from dspark.models.streams import features, greedy_streams
from dspark.util.validate import check_int, check_output_path, check_real

Log = Callable[[str], None]
HEAD_SPLIT = "calibration"  # the corpus split the confidence head is fitted on
HEAD_FIELDS = ("head_streams", "heldout_streams", "gen_batch", "head_iters", "head_l2")  # --refit-head may change


@dataclass(frozen=True)
class TrainDraftConfig:
    """Data sizes, draft shape and optimisation schedule of one training run."""

    prompt_len: int = 32          # tokens of stdlib text before each greedy continuation (the demo's prompts)
    new_tokens: int = 40          # greedy tokens the target writes after each prompt
    train_streams: int = 4096     # streams the draft distils on
    head_streams: int = 1024      # calibration-split streams the confidence head is fitted on
    heldout_streams: int = 256    # held-out files' streams the reported acceptance is measured on
    gen_batch: int = 128          # streams per target generation batch
    draft_vocab: int = DraftConfig.draft_vocab_size  # the draft's shape: DraftConfig's defaults, one source
    intermediate: int = DraftConfig.intermediate_size
    chain: int = DraftConfig.chain_size
    gamma: int = DraftConfig.gamma
    markov_rank: int = DraftConfig.markov_rank
    max_seq_len: int = DraftConfig.max_seq_len
    steps: int = 400
    batch: int = 48               # streams per optimisation step
    lr: float = 2e-3
    weight_decay: float = 0.1
    soft_weight: float = 0.5      # loss = (1 - w) * hard CE on the greedy token + w * CE on the target's soft q
    head_iters: int = 300
    head_l2: float = HEAD_L2      # L2 weight on the confidence head's weights
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "train_streams", "head_streams", "heldout_streams", "gen_batch", "draft_vocab",
                     "intermediate", "chain", "gamma", "steps", "batch", "head_iters"):
            check_int(name, getattr(self, name), 1)
        check_int("markov_rank", self.markov_rank, 0)
        check_int("seed", self.seed, 0)
        check_int("new_tokens (every stream needs gamma tokens after a serving start)", self.new_tokens,
                  self.gamma + 1)
        check_int("max_seq_len (a whole stream: prompt_len + new_tokens)", self.max_seq_len,
                  self.prompt_len + self.new_tokens)
        check_real("lr", self.lr, 0, math.inf, low_open=True, high_open=True)
        for name in ("weight_decay", "head_l2"):
            check_real(name, getattr(self, name), 0, math.inf, high_open=True)
        check_real("soft_weight", self.soft_weight, 0, 1)


TINY = dict(prompt_len=16, new_tokens=24, train_streams=32, head_streams=16, heldout_streams=8, gen_batch=16,
            draft_vocab=128, intermediate=64, chain=64, max_seq_len=128, steps=30, batch=8, head_iters=50)


def tiny_target(seed: int = 0) -> nn.Module:
    """A randomly initialised 2-layer Llama over bytes (vocab 256): CI's target, through the real code path."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rope_theta=1.0e5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def load_target(tiny: bool, seed: int) -> tuple[nn.Module, Encode]:
    """(transformers model with its own sdpa attention, text -> token ids): SmolLM2, or the tiny byte Llama."""
    if tiny:
        return tiny_target(seed), lambda text: list(text.encode("utf-8"))
    from transformers.utils import logging

    from dspark.models import load_smollm2

    logging.disable_progress_bar()  # no carriage-return bars in a log file
    lm, tok = load_smollm2()
    hf = lm.hf_model
    hf.set_attn_implementation("sdpa")  # this script runs plain transformers forwards with its own cache
    return hf.eval(), lambda text: tok(text, add_special_tokens=False)["input_ids"]


def target_streams(target: nn.Module, prompts: Tensor, new_tokens: int, batch: int, log: Log,
                   what: str) -> tuple[Tensor, Tensor]:
    """`greedy_streams` (tokens [n, P + new_tokens], hidden [n, P + new_tokens - 1, d]) logging as `what`."""
    return greedy_streams(target, prompts, new_tokens, batch=batch, log=lambda msg: log(f"{what} {msg}"))


def choose_vocab(tokens: Tensor, prompt_len: int, size: int, vocab_size: int) -> Tensor:
    """The `size` target ids most frequent among the greedy tokens (ties: smaller id first)."""
    counts = torch.bincount(tokens[:, prompt_len:].flatten(), minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(order[:size], dtype=torch.int64)


def _windows(x: Tensor, start: int, g: int, fill: float) -> Tensor:
    """[n, T, ...] -> [n, T - start, g, ...]: element t + j of x at row t (from `start`), `fill` past the end."""
    pad = torch.full((x.shape[0], g - 1, *x.shape[2:]), fill, dtype=x.dtype)
    w = torch.cat([x, pad], 1)[:, start:].unfold(1, g, 1)
    return w.movedim(-1, 2) if x.dim() > 2 else w


def distil(draft: DraftModel, tokens: Tensor, hidden: Tensor, cfg: TrainDraftConfig, log: Log) -> None:
    """AdamW (warm-up, cosine decay) on the greedy rows of the streams, autocast to bf16 on the CPU."""
    p, g, vd = cfg.prompt_len, cfg.gamma, cfg.draft_vocab
    to_draft = torch.full((draft.cfg.vocab_size + 1,), -100, dtype=torch.int64)  # index -1 (past end) -> ignored
    to_draft[draft.vocab_ids] = torch.arange(vd)
    labels = to_draft[_windows(tokens, p, g, -1)]                  # [n, C, g] draft-vocab ids of t + k + 1
    teacher = _windows(tokens, p, g, 0)[..., :-1]                  # target ids of t + 1 .. t + g - 1
    params = [q for q in draft.parameters() if q.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    warm, t0, shown = max(1, cfg.steps // 20), time.perf_counter(), []
    draft.train()
    for step in range(cfg.steps):
        lr = cfg.lr * min(1.0, (step + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / cfg.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, tokens.shape[0], (cfg.batch,), generator=gen)
        lab = labels[idx]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = draft.forward_dense(tokens[idx], features(hidden[idx]))[:, p - 1: tokens.shape[1] - 1]
            reduced = draft.chain(x, g, teacher[idx])[1].float()
        valid = lab >= 0
        logq = torch.log_softmax(reduced, -1)
        per_row = -logq.gather(-1, lab.clamp_min(0)[..., None])[..., 0]
        if cfg.soft_weight:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the target's logits at t + k
                soft = torch.softmax((_windows(hidden[idx], p - 1, g, 0.0) @ draft.out_rows.t()).float(), -1)
            per_row = (1 - cfg.soft_weight) * per_row - cfg.soft_weight * (soft * logq).sum(-1)
        loss = (per_row * valid).sum() / valid.sum().clamp_min(1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        shown.append(((reduced.argmax(-1) == lab) & valid).sum((0, 1)).float() / valid.sum((0, 1)).clamp_min(1))
        if (step + 1) % max(1, cfg.steps // 40) == 0 or step + 1 == cfg.steps:
            acc, el = torch.stack(shown).mean(0), time.perf_counter() - t0
            eta = el / (step + 1) * (cfg.steps - step - 1)
            log(f"distil step {step + 1}/{cfg.steps}  loss {loss.item():.3f}  train top-1 "
                f"{' '.join(f'{a:.2f}' for a in acc.tolist())}  {el:.0f} s (eta {eta:.0f} s)")
            shown = []
    draft.eval()


def _as_stored(draft: DraftModel) -> None:
    """Round the parameters to the file's float16 in place: what is measured is what ships."""
    with torch.no_grad():
        for weight in draft.parameters():
            weight.copy_(weight.half())


def _write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """write(temp path) in the destination folder, then rename: never a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make a shipped file unreadable to other users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_draft(draft: DraftModel, target: nn.Module, out: Path, manifest: dict) -> dict:
    """fp16 safetensors (vocab ids int32) with the config and target identity as metadata, then the manifest
    with the file's sha256; both atomic. Returns the manifest."""
    from safetensors.torch import save_file

    state = {k: (v.to(torch.int32) if k == "vocab_ids" else v.detach().to(torch.float16)).contiguous()
             for k, v in draft.state_dict().items()}
    # one metadata key: safetensors writes several in hash order, which would change the file's bytes
    meta = {METADATA_KEY: json.dumps({"format": FORMAT, "config": draft.cfg.to_dict(),
                                      "target": target_identity(target)}, sort_keys=True)}
    _write_atomic(out, lambda tmp: save_file(state, tmp, metadata=meta))
    manifest = {"weights": out.name, "sha256": file_sha256(out), "bytes": out.stat().st_size, **manifest}
    _write_atomic(manifest_path(out), lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=1) + "\n"))
    return manifest


def head_streams(cfg: TrainDraftConfig, target: nn.Module, encode: Encode, log: Log) -> tuple[Tensor, Tensor]:
    """The confidence head's streams: `head_streams` calibration-split prompts (seed + 1), the target's
    greedy continuations. The same call in a full run and a refit."""
    prompts = prompt_windows(HEAD_SPLIT, encode, cfg.head_streams, cfg.prompt_len, cfg.seed + 1)
    return target_streams(target, prompts, cfg.new_tokens, cfg.gen_batch, log, "head")


def heldout_streams(cfg: TrainDraftConfig, target: nn.Module, encode: Encode, log: Log) -> tuple[Tensor, Tensor]:
    """`heldout_streams` held-out-split prompts (seed) and their greedy continuations: evaluation only."""
    prompts = prompt_windows("heldout", encode, cfg.heldout_streams, cfg.prompt_len, cfg.seed)
    return target_streams(target, prompts, cfg.new_tokens, cfg.gen_batch, log, "held-out")


def head_stage(draft: DraftModel, cfg: TrainDraftConfig, head: tuple[Tensor, Tensor], held: tuple[Tensor, Tensor],
               log: Log) -> tuple[dict, dict]:
    """Reset and fit the head on the head streams, round to the file's float16, then measure on the held-out
    streams: (manifest entries, wall seconds). The whole head stage of a full run and of a refit."""
    p, wall = cfg.prompt_len, {}
    t0 = time.perf_counter()
    reset_head(draft, cfg.seed + 2)
    fit_rows = stream_rows(draft, *head, p)
    fit_confidence(draft, fit_rows, cfg.head_iters, cfg.head_l2)
    _as_stored(draft)
    fit = head_report(draft, fit_rows)
    wall["confidence_head"] = time.perf_counter() - t0
    log(f"confidence head fitted on {cfg.head_streams} {HEAD_SPLIT} streams: loss {fit['loss']:.4f}")
    t0 = time.perf_counter()
    rows = stream_rows(draft, *held, p)
    held_rep, acc = head_report(draft, rows), acceptance(rows[2], rows[3])
    wall["heldout_eval"] = time.perf_counter() - t0
    log(f"held-out greedy conditional acceptance per position {acc['rate']} (reached {acc['reached']}); "
        f"mean accepted drafts per start {acc['mean_accepted']}; head loss {held_rep['loss']:.4f}, "
        f"mean p {held_rep['mean_p']}")
    return {"heldout_acceptance": acc,
            "confidence_loss": {"fit": fit["loss"], "heldout": held_rep["loss"]},
            "confidence_head": {"split": HEAD_SPLIT, "streams": cfg.head_streams, "l2": cfg.head_l2,
                                "fit": fit, "heldout": held_rep}}, wall


def _coverage(tokens: Tensor, vocab: Tensor, prompt_len: int) -> float:
    return round(float(torch.isin(tokens[:, prompt_len:], vocab).float().mean()), 4)


def train(cfg: TrainDraftConfig, target: nn.Module, encode: Encode, out: Path, log: Log) -> dict:
    """The whole run: streams, vocabulary, distillation, head stage, save."""
    wall, t0 = {}, time.perf_counter()
    p, c = cfg.prompt_len, cfg.new_tokens
    tokens, hidden = target_streams(target, prompt_windows("train", encode, cfg.train_streams, p, cfg.seed), c,
                                    cfg.gen_batch, log, "train")
    head = head_streams(cfg, target, encode, log)
    held = heldout_streams(cfg, target, encode, log)
    wall["target_streams"] = time.perf_counter() - t0
    emb, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    vocab = choose_vocab(tokens, p, cfg.draft_vocab, emb.shape[0])
    coverage = {"train": _coverage(tokens, vocab, p), "heldout": _coverage(held[0], vocab, p)}
    log(f"draft vocabulary {cfg.draft_vocab}: covers {coverage['train']:.3f} of train / "
        f"{coverage['heldout']:.3f} of held-out greedy tokens")
    dcfg = DraftConfig(hidden_size=emb.shape[1], vocab_size=emb.shape[0], draft_vocab_size=cfg.draft_vocab,
                       num_q_heads=target.config.num_attention_heads,
                       num_kv_heads=target.config.num_key_value_heads or target.config.num_attention_heads,
                       head_dim=getattr(target.config, "head_dim", None)
                       or target.config.hidden_size // target.config.num_attention_heads,
                       intermediate_size=cfg.intermediate, chain_size=cfg.chain, gamma=cfg.gamma,
                       markov_rank=cfg.markov_rank, max_seq_len=cfg.max_seq_len)
    torch.manual_seed(cfg.seed + 1)
    draft = DraftModel(dcfg, emb.detach(), lm_head.detach(), vocab)
    t1 = time.perf_counter()
    distil(draft, tokens, hidden, cfg, log)
    _as_stored(draft)
    wall["distil"] = time.perf_counter() - t1
    entries, head_wall = head_stage(draft, cfg, head, held, log)
    wall.update(head_wall)
    wall["total"] = time.perf_counter() - t0
    return save_draft(draft, target, out, {
        "training": asdict(cfg), "threads": torch.get_num_threads(), "vocab_coverage": coverage, **entries,
        "wall_s": {k: round(v, 1) for k, v in wall.items()}})


def refit_head(cfg: TrainDraftConfig, target: nn.Module, encode: Encode, out: Path, log: Log) -> dict:
    """The head stage alone on the draft at `out` (sha256 checked), which a run with `cfg` wrote: rewrites
    `out` and its manifest (training wall times kept, head-stage ones replaced, `head_refit` added)."""
    old = json.loads(manifest_path(out).read_text())
    stored = TrainDraftConfig(**old["training"])
    changed = [k for k in asdict(cfg) if k not in HEAD_FIELDS and getattr(cfg, k) != getattr(stored, k)]
    if changed:
        was = ", ".join(f"{k}={getattr(stored, k)!r}" for k in changed)
        raise ValueError(f"refit_head: {out} was trained with {was}; a refit may change only {', '.join(HEAD_FIELDS)}")
    draft = load_draft(target, out)
    t0 = time.perf_counter()
    head = head_streams(cfg, target, encode, log)
    held = heldout_streams(cfg, target, encode, log)
    streams_s = time.perf_counter() - t0
    entries, head_wall = head_stage(draft, cfg, head, held, log)
    wall = {**old["wall_s"], **{k: round(v, 1) for k, v in head_wall.items()}}
    coverage = {**old["vocab_coverage"], "heldout": _coverage(held[0], draft.vocab_ids, cfg.prompt_len)}
    return save_draft(draft, target, out, {
        "training": asdict(cfg), "threads": old["threads"], "vocab_coverage": coverage, **entries, "wall_s": wall,
        "head_refit": {"from_sha256": old["sha256"], "threads": torch.get_num_threads(),
                       "wall_s": round(streams_s + sum(head_wall.values()), 1)}})


def main(argv: Sequence[str] | None = None) -> dict:
    """Command line: every TrainDraftConfig field is an option (`--train-streams 1024`), plus the target."""
    ap = argparse.ArgumentParser(prog="python -m dspark.models.train_draft", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random byte Llama target and tiny sizes (CI)")
    ap.add_argument("--out", type=Path, default=None,
                    help="weights file (manifest: same name .json; default: the shipped SmolLM2 draft, which a "
                         "--tiny run must not overwrite, so --tiny needs --out)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--refit-head", action="store_true",
                    help=f"only refit the confidence head of the draft at --out (options: {', '.join(HEAD_FIELDS)})")
    defaults = TrainDraftConfig()
    for name, value in asdict(defaults).items():
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.tiny and (args.out is None or args.out.resolve() == DEFAULT_WEIGHTS.resolve()):
        ap.error(f"--tiny needs --out elsewhere than the shipped draft {DEFAULT_WEIGHTS}")
    args.out = args.out or DEFAULT_WEIGHTS
    try:
        check_output_path("--out", args.out)
    except ValueError as e:
        ap.error(str(e))
    given = {k: getattr(args, k) for k in asdict(defaults) if getattr(args, k) is not None}
    if args.refit_head:
        if not manifest_path(args.out).is_file():
            ap.error(f"--refit-head needs an existing draft: manifest {manifest_path(args.out)} is missing")
        other = [k for k in given if k not in HEAD_FIELDS]
        if other:
            ap.error(f"--refit-head may change only {', '.join(HEAD_FIELDS)}, got --{other[0].replace('_', '-')}")
        base = json.loads(manifest_path(args.out).read_text())["training"]
    else:
        base = {**asdict(defaults), **(TINY if args.tiny else {})}
    try:
        cfg = TrainDraftConfig(**{**base, **given})
    except ValueError as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    torch.manual_seed(cfg.seed)
    target, encode = load_target(args.tiny, cfg.seed)
    log(f"target loaded; config {asdict(cfg)}")
    if cfg.draft_vocab > target.config.vocab_size:  # the one option the target itself bounds
        ap.error(f"--draft-vocab {cfg.draft_vocab} exceeds the target's vocabulary of {target.config.vocab_size}")
    manifest = (refit_head if args.refit_head else train)(cfg, target, encode, args.out, log)
    log(f"wrote {args.out} ({manifest['bytes'] / 1e6:.1f} MB, sha256 {manifest['sha256']})")
    return manifest


if __name__ == "__main__":
    main()
