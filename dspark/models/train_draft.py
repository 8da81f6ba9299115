"""Train the draft (`dspark.models.draft`) for a transformers target: `python -m dspark.models.train_draft`.

Nothing is downloaded. Stage 1, the target's data (`dspark.models.train_data`, cached under `--cache` by
content, so a rerun or a pilot pays the target once): teacher-forced windows of the `train` split's stdlib code
and language-reference prose (one target pass labels every position with its top-1) and greedy streams of
train-split prompts of every kind (`dspark.models.kinds`: code continuation, chat-template questions,
copy-heavy edits), whose prompt rows are teacher-forced text and whose continuations are the serving event.
Stage 2 distils the draft on all of them (`dspark.models.distil`). Stage 3 re-initialises
`dspark.ConfidenceHead` from the seed and fits it alone, by L-BFGS, on the greedy conditional-acceptance
event of the finished draft (draft k matches given drafts < k matched; masked rows are not labels) over
greedy streams of every kind from the `calibration` split, files the draft never trained on. Held-out
acceptance per kind and draft position, and the head's held-out loss and mean prediction, are written to
the manifest beside the safetensors file (both atomically), with the wall time of every stage (the target's
time as recorded when its streams were generated, so a cached rerun still reports the full run time).

`--refit-head` runs only stage 3 on an existing weights file (sha256 checked): the same computation as a full
run's, so a full run's file equals full run + refit byte for byte.

The defaults are the shipped draft's recipe, sized for one GPU (`--device cuda`: the target and the draft
compute there, the streams stay in host memory); on a CPU the same run takes hours (perf/README.md), `--tiny`
seconds. The corpus is the running Python's standard library (`dspark.models.corpus`), so the shipped file is
reproduced on the Python version it was trained on (perf/README.md names it).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from dspark.models.confidence_fit import HEAD_L2, HeadFitConfig, head_stage
from dspark.models.corpus import Encode
from dspark.models.distil import DistilConfig, distil
from dspark.models.draft import DEFAULT_WEIGHTS, DraftConfig, DraftModel, load_draft, manifest_path
from dspark.models.draft_file import round_to_file, save_draft
from dspark.models.kinds import KINDS, PROMPT_LEN
from dspark.models.stream_store import Streams
from dspark.models.train_data import StreamSpec, kind_streams, text_streams
from dspark.util.options import int_list
from dspark.util.validate import check_int, check_output_path, check_real

Log = Callable[[str], None]
HEAD_SPLIT = "calibration"  # the corpus split the confidence head is fitted on
HEAD_FIELDS = ("head_streams", "heldout_streams", "gen_batch", "head_iters", "head_l2")  # --refit-head may change
COUNTS = ("train_streams", "head_streams", "heldout_streams")  # per-kind stream counts, in KINDS order
ACCELERATORS = ("cuda", "npu")  # --device kinds besides cpu
ZERO_OK = ("markov_rank", "seed", "text_windows", "prose_windows", "steps")  # int fields that may be 0


@dataclass(frozen=True)
class TrainDraftConfig:
    """Data sizes, draft shape and optimisation schedule of one training run."""

    prompt_len: int = 32          # code-kind prompt tokens of every greedy stream (the demo's prompts)
    new_tokens: int = 40          # greedy tokens after each head / held-out prompt
    text_windows: int = 12288     # teacher-forced train-split code windows
    prose_windows: int = 1024     # teacher-forced train-split language-reference windows
    window_len: int = 256
    train_streams: tuple[int, ...] = (16384, 4096, 4096)  # greedy train-split streams per kind (code, chat, edit)
    train_new_tokens: int = 64
    head_streams: tuple[int, ...] = (768, 192, 192)   # calibration-split streams the head is fitted on
    heldout_streams: tuple[int, ...] = (256, 64, 64)  # held-out streams acceptance is measured on
    gen_batch: int = 512          # prompts per target generation batch (and stream cache file)
    draft_vocab: int = DraftConfig.draft_vocab_size  # the draft's shape: DraftConfig's defaults, one source
    intermediate: int = DraftConfig.intermediate_size
    chain: int = DraftConfig.chain_size
    gamma: int = DraftConfig.gamma
    markov_rank: int = DraftConfig.markov_rank
    max_seq_len: int = DraftConfig.max_seq_len
    steps: int = 3000
    rows: int = 16384             # training rows per optimisation step
    lr: float = 2e-3
    weight_decay: float = 0.1
    soft_weight: float = 0.5      # (1 - w) hard CE on the target's top-1 + w CE on its softmax over the draft vocab
    feature_weight: float = 0.5   # + this x the relative squared error of each chain state vs the target's state
    head_iters: int = 300
    head_l2: float = HEAD_L2      # L2 weight on the confidence head's shared weights (`fit_confidence`)
    seed: int = 0
    init: str = ""                # a draft file to start from (its vocabulary and body; "" = from scratch)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in COUNTS:
                if (not isinstance(v, tuple) or len(v) != len(KINDS)
                        or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in v)):
                    raise ValueError(f"{f.name} must be {len(KINDS)} ints >= 0 (streams per kind {KINDS}), got {v!r}")
            elif isinstance(f.default, int) and f.name not in ZERO_OK + ("new_tokens",):
                check_int(f.name, v, 1)
        for name in ZERO_OK:
            check_int(name, getattr(self, name), 0)
        check_int("new_tokens (every stream needs gamma tokens after a serving start)", self.new_tokens,
                  self.gamma + 1)
        lens = [self.prompt_len if k == "code" else PROMPT_LEN[k] for k in KINDS]
        longest = max([self.window_len + 1] + [n + max(self.new_tokens, self.train_new_tokens)
                                               for n, *c in zip(lens, *(getattr(self, f) for f in COUNTS)) if any(c)])
        check_int("max_seq_len (the longest stream or window)", self.max_seq_len, longest)
        if not (self.head_streams[0] or sum(self.head_streams)) or not self.heldout_streams[0]:
            raise ValueError(f"head_streams needs a stream and heldout_streams a code stream, got "
                             f"{self.head_streams!r} and {self.heldout_streams!r}")
        check_real("lr", self.lr, 0, math.inf, low_open=True, high_open=True)
        for name in ("weight_decay", "head_l2", "feature_weight"):
            check_real(name, getattr(self, name), 0, math.inf, high_open=True)
        check_real("soft_weight", self.soft_weight, 0, 1)
        if not isinstance(self.init, str):
            raise ValueError(f"init must be a path string ('' for none), got {self.init!r}")
        if not self.steps and not self.init:
            raise ValueError("steps=0 (no distillation) needs init, the draft file whose body is kept")


TINY = dict(prompt_len=16, new_tokens=24, text_windows=16, prose_windows=8, window_len=48,
            train_streams=(16, 0, 0), train_new_tokens=24, head_streams=(16, 0, 0), heldout_streams=(8, 0, 0),
            gen_batch=16, draft_vocab=128, intermediate=64, chain=64, max_seq_len=160, steps=30, rows=256,
            head_iters=50)


def tiny_target(seed: int = 0) -> nn.Module:
    """A randomly initialised 2-layer Llama over bytes (vocab 256): CI's target, through the real code path."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rope_theta=1.0e5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def load_target(tiny: bool, seed: int, device: torch.device | str = "cpu") -> tuple[nn.Module, Encode]:
    """(transformers model with its own sdpa attention on `device`, text -> token ids): SmolLM2, or the tiny
    byte Llama."""
    if tiny:
        return tiny_target(seed).to(device), lambda text: list(text.encode("utf-8"))
    from transformers.utils import logging

    from dspark.models import load_smollm2

    logging.disable_progress_bar()  # no carriage-return bars in a log file
    lm, tok = load_smollm2()
    hf = lm.hf_model
    hf.set_attn_implementation("sdpa")  # this script runs plain transformers forwards with its own cache
    return hf.to(device).eval(), lambda text: tok(text, add_special_tokens=False)["input_ids"]


def choose_vocab(sets: Sequence[Streams], size: int, vocab_size: int) -> Tensor:
    """The `size` target ids most frequent among the target's top-1 labels of all streams (ties: smaller id)."""
    counts = sum(torch.bincount(s.argmax.flatten(), minlength=vocab_size) for s in sets)
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(order[:size], dtype=torch.int64)


def _coverage(s: Streams, vocab: Tensor) -> float:
    return round(float(torch.isin(s.argmax, vocab.to(s.argmax.device)).float().mean()), 4)


def eval_sets(cfg: TrainDraftConfig, target: nn.Module, encode: Encode, cache: Path | None, log: Log
              ) -> tuple[dict[str, Streams], dict[str, Streams]]:
    """(head streams of the calibration split (seed + 1), held-out streams (seed)): {kind: Streams} each."""
    kw = dict(new_tokens=cfg.new_tokens, code_len=cfg.prompt_len, log=log)
    head = StreamSpec(HEAD_SPLIT, cfg.seed + 1, cfg.gen_batch, cache)
    held = StreamSpec("heldout", cfg.seed, cfg.gen_batch, cache)
    return (kind_streams(target, encode, head, cfg.head_streams, **kw),
            kind_streams(target, encode, held, cfg.heldout_streams, **kw))


def _head_fit(cfg: TrainDraftConfig) -> HeadFitConfig:
    """The head stage's fit of a run (seed + 2): the same in a full run and a refit."""
    return HeadFitConfig(cfg.seed + 2, cfg.head_iters, cfg.head_l2)


def _draft_config(cfg: TrainDraftConfig, target: nn.Module) -> DraftConfig:
    c = target.config
    emb = target.get_input_embeddings().weight
    return DraftConfig(hidden_size=emb.shape[1], vocab_size=emb.shape[0], draft_vocab_size=cfg.draft_vocab,
                       num_q_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads or c.num_attention_heads,
                       head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                       intermediate_size=cfg.intermediate, chain_size=cfg.chain, gamma=cfg.gamma,
                       markov_rank=cfg.markov_rank, max_seq_len=cfg.max_seq_len)


def train(cfg: TrainDraftConfig, target: nn.Module, encode: Encode, out: Path, cache: Path | None, log: Log) -> dict:
    """The whole run: target streams (stage 1), vocabulary, distillation, head stage, save; returns the manifest."""
    wall, t0 = {}, time.perf_counter()
    train_spec = StreamSpec("train", cfg.seed, cfg.gen_batch, cache)
    sets = {} if not cfg.steps else {  # steps 0 keeps the init's body: no training streams
        **text_streams(target, encode, train_spec, cfg.text_windows, cfg.prose_windows, length=cfg.window_len,
                       log=log),
        **kind_streams(target, encode, train_spec, cfg.train_streams, new_tokens=cfg.train_new_tokens,
                       code_len=cfg.prompt_len, log=log)}
    head, held = eval_sets(cfg, target, encode, cache, log)
    wall["stage1_read"] = time.perf_counter() - t0
    wall["target_streams"] = sum(s.seconds for d in (sets, head, held) for s in d.values())
    emb, lm_head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    start = load_draft(target, cfg.init) if cfg.init else None
    vocab = start.vocab_ids if start is not None else choose_vocab(list(sets.values()), cfg.draft_vocab, emb.shape[0])
    coverage = {"train": {k: _coverage(s, vocab) for k, s in sets.items()},
                "heldout": {k: _coverage(s, vocab) for k, s in held.items()}}
    log(f"draft vocabulary {cfg.draft_vocab}: covers {coverage} of the target's top-1 labels")
    torch.manual_seed(cfg.seed + 1)
    draft = DraftModel(_draft_config(cfg, target), emb.detach(), lm_head.detach(), vocab).to(emb.device)
    init = {} if start is None else warm_start(draft, start, Path(cfg.init))
    t1 = time.perf_counter()
    if cfg.steps:
        distil(draft, sets, DistilConfig(steps=cfg.steps, rows=cfg.rows, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                         soft_weight=cfg.soft_weight, feature_weight=cfg.feature_weight,
                                         seed=cfg.seed + 1), log=log)
    round_to_file(draft)
    wall["distil"] = time.perf_counter() - t1
    entries, head_wall = head_stage(draft, head, held, _head_fit(cfg), log=log, split=HEAD_SPLIT)
    wall.update(head_wall)
    wall["total"] = wall["target_streams"] + wall["distil"] + sum(head_wall.values())
    if init:
        wall["total_with_init"] = wall["total"] + init["wall_s"]
    return save_draft(draft, target, out, {
        "training": asdict(cfg), "threads": torch.get_num_threads(), "device": _device_name(emb.device),
        "init": init or None, "vocab_coverage": coverage,
        **entries, "wall_s": {k: round(v, 1) for k, v in wall.items()}})


def _accelerator(kind: str):
    """torch's module for an accelerator kind ("cuda", or "npu" once torch_npu is imported) when one is
    available here, else None."""
    module = getattr(torch, kind, None)
    return module if module is not None and module.is_available() else None


def _device_name(device: torch.device) -> str:
    """What the manifest records of where a run computed: "cpu", or the accelerator's name."""
    if device.type == "cpu":
        return "cpu"
    return f"{device.type}: {_accelerator(device.type).get_device_name(device)}"


def warm_start(draft: DraftModel, start: DraftModel, path: Path) -> dict:
    """Copy `start`'s body (every parameter but the confidence head's) into `draft`; returns what the manifest
    records of it (file, sha256, its total training seconds, its own init chain included). ValueError when the
    shapes differ."""
    if {k: v for k, v in start.cfg.to_dict().items() if k != "confidence_features"} != {
            k: v for k, v in draft.cfg.to_dict().items() if k != "confidence_features"}:
        raise ValueError(f"init {path} has draft config {start.cfg.to_dict()}, this run builds {draft.cfg.to_dict()}")
    body = {k: v for k, v in start.state_dict().items() if not k.startswith("confidence.")}
    draft.load_state_dict(body, strict=False)
    man = json.loads(manifest_path(path).read_text())
    own = man["wall_s"]
    return {"file": path.name, "sha256": man["sha256"], "wall_s": float(own.get("total_with_init", own["total"]))}


def refit_head(cfg: TrainDraftConfig, target: nn.Module, encode: Encode, out: Path, cache: Path | None,
               log: Log) -> dict:
    """The head stage alone on the draft at `out` (sha256 checked), which a run with `cfg` wrote: rewrites
    `out` and its manifest (training wall times kept, head-stage ones replaced, `head_refit` added)."""
    old = json.loads(manifest_path(out).read_text())
    stored = TrainDraftConfig(**_tuples(old["training"]))
    changed = [k for k in asdict(cfg) if k not in HEAD_FIELDS and getattr(cfg, k) != getattr(stored, k)]
    if changed:
        was = ", ".join(f"{k}={getattr(stored, k)!r}" for k in changed)
        raise ValueError(f"refit_head: {out} was trained with {was}; a refit may change only {', '.join(HEAD_FIELDS)}")
    draft = load_draft(target, out)
    t0 = time.perf_counter()
    head, held = eval_sets(cfg, target, encode, cache, log)
    streams_s = time.perf_counter() - t0
    entries, head_wall = head_stage(draft, head, held, _head_fit(cfg), log=log, split=HEAD_SPLIT)
    wall = {**old["wall_s"], **{k: round(v, 1) for k, v in head_wall.items()}}
    coverage = {**old["vocab_coverage"], "heldout": {k: _coverage(s, draft.vocab_ids) for k, s in held.items()}}
    return save_draft(draft, target, out, {
        "training": asdict(cfg), "threads": old["threads"], "device": old.get("device", "cpu"),
        "vocab_coverage": coverage, **entries, "wall_s": wall,
        "head_refit": {"from_sha256": old["sha256"], "threads": torch.get_num_threads(),
                       "device": _device_name(draft.vocab_ids.device),
                       "wall_s": round(streams_s + sum(head_wall.values()), 1)}})


def _tuples(d: dict) -> dict:
    """A manifest's training config (JSON lists) as TrainDraftConfig keywords (tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


def main(argv: Sequence[str] | None = None) -> dict:
    """Command line: every TrainDraftConfig field is an option (`--text-windows 256`, `--train-streams
    256,128,128`), plus the target, threads, the stream cache and --refit-head."""
    ap = argparse.ArgumentParser(prog="python -m dspark.models.train_draft", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random byte Llama target and tiny sizes (CI)")
    ap.add_argument("--out", type=Path, default=None,
                    help="weights file (manifest: same name .json; default: the shipped SmolLM2 draft, which a "
                         "--tiny run must not overwrite, so --tiny needs --out)")
    ap.add_argument("--cache", type=Path, default=None,
                    help="folder of cached target streams (stage 1), read and written; default: none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the target and the draft compute (cpu, cuda, cuda:1, npu)")
    ap.add_argument("--refit-head", action="store_true",
                    help=f"only refit the confidence head of the draft at --out (options: {', '.join(HEAD_FIELDS)})")
    defaults = TrainDraftConfig()
    for name, value in asdict(defaults).items():
        kind = int_list(0) if isinstance(value, tuple) else type(value)
        ap.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        ap.error(f"--device {args.device!r}: {e}")
    have = ["cpu"] + [kind for kind in ACCELERATORS if _accelerator(kind) is not None]
    if device.type not in have:
        ap.error(f"--device {args.device!r}: this machine has {', '.join(have)}")
    if args.tiny and (args.out is None or args.out.resolve() == DEFAULT_WEIGHTS.resolve()):
        ap.error(f"--tiny needs --out elsewhere than the shipped draft {DEFAULT_WEIGHTS}")
    args.out = args.out or DEFAULT_WEIGHTS
    try:
        check_output_path("--out", args.out)
        if args.cache is not None:
            check_output_path("--cache", args.cache, folder=True)
    except ValueError as e:
        ap.error(str(e))
    given = {k: getattr(args, k) for k in asdict(defaults) if getattr(args, k) is not None}
    if args.refit_head:
        if not manifest_path(args.out).is_file():
            ap.error(f"--refit-head needs an existing draft: manifest {manifest_path(args.out)} is missing")
        other = [k for k in given if k not in HEAD_FIELDS]
        if other:
            ap.error(f"--refit-head may change only {', '.join(HEAD_FIELDS)}, got --{other[0].replace('_', '-')}")
        base = _tuples(json.loads(manifest_path(args.out).read_text())["training"])
    else:
        base = {**asdict(defaults), **(TINY if args.tiny else {})}
    try:
        cfg = TrainDraftConfig(**{**base, **given})
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", flush=True)

    torch.manual_seed(cfg.seed)
    target, encode = load_target(args.tiny, cfg.seed, device)
    log(f"target loaded; config {asdict(cfg)}")
    if cfg.draft_vocab > target.config.vocab_size:  # the one option the target itself bounds
        ap.error(f"--draft-vocab {cfg.draft_vocab} exceeds the target's vocabulary of {target.config.vocab_size}")
    run = refit_head if args.refit_head else train
    manifest = run(cfg, target, encode, args.out, args.cache, log)
    log(f"wrote {args.out} ({manifest['bytes'] / 1e6:.1f} MB, sha256 {manifest['sha256']})")
    return manifest


if __name__ == "__main__":
    main()
