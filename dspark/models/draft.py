"""A DSpark-style block draft for a transformers target, conditioned on the target's hidden states.

Row t of the draft reads `fuse(h_{t-1}, E[token_t])`: the target's final-normed hidden state one position
back and the target's (frozen) embedding of token t, then one small pre-norm decoder block (RMSNorm, RoPE,
GQA attention through the caller's `attend`, SiLU-gated MLP). From the last row's hidden state a chain of
cheap MLP steps proposes all `gamma` drafts in one forward: step k reads the previous step's state and the
embedding of draft k-1 (the block's argmax; the true token when training, which on the target's greedy
text is exactly what draft k sees whenever drafts < k were accepted). Token logits are computed over a
reduced draft vocabulary (the training text's most frequent target-greedy tokens) with the target's own
output-embedding rows and scattered to target ids (-inf elsewhere). Draft k's confidence logit comes from
`dspark.ConfidenceHead` on step k's state, the features of step k's own distribution (top-1 log-odds, top-2
margin, entropy: `dspark.calibration.online.draft_features` of the reduced logits, `confidence_features`) and
the token before draft k, never draft k's own token.

The weights file holds only the draft's own parameters (fp16) and its vocabulary; the target's embedding
and LM head are passed in. `load_draft` checks the file's sha256 against its manifest and the target's
identity against the file's metadata before it builds anything.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dspark.calibration.confidence import ConfidenceHead, previous_tokens
from dspark.calibration.online import FEATURES, draft_features
from dspark.models.geometry import ModelGeometry
from dspark.util.validate import check_int

Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]  # (layer, q [N,Hq,D], k [N,Hkv,D], v) -> [N,Hq,D]

WEIGHTS_DIR = Path(__file__).parent / "weights"
DEFAULT_WEIGHTS = WEIGHTS_DIR / "smollm2_135m_draft.safetensors"
FORMAT = "dspark-draft-v1"
METADATA_KEY = "dspark_draft"  # the safetensors metadata entry: JSON of format, config, target
RETRAIN = "python -m dspark.models.train_draft"


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (first half, second half) of the head dim, as Llama does; cos/sin broadcast over heads."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


@dataclass(frozen=True)
class DraftConfig:
    """Shape of the draft; `hidden_size` / `vocab_size` are the target's, the rest the draft's own."""

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int = 8192
    num_q_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1024
    chain_size: int = 512
    gamma: int = 6
    markov_rank: int = 8
    confidence_features: int = len(FEATURES)  # 0: the seed's head (state + previous token only)
    max_seq_len: int = 2048
    rope_theta: float = 1.0e5
    rms_eps: float = 1.0e-5

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("rope_theta", "rms_eps", "markov_rank", "confidence_features"):
                check_int(f.name, getattr(self, f.name), 1)
        check_int("markov_rank", self.markov_rank, 0)
        if self.confidence_features not in (0, len(FEATURES)):
            raise ValueError(f"confidence_features must be 0 or {len(FEATURES)} ({', '.join(FEATURES)}), got "
                             f"{self.confidence_features!r}")
        if self.num_q_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError(f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads="
                             f"{self.num_kv_heads} and head_dim={self.head_dim} even")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}")
        for name in ("rope_theta", "rms_eps"):
            v = getattr(self, name)
            if not isinstance(v, float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite float > 0, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that casts its weight to the input's dtype, so bf16 autocast keeps the fused kernel."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


class DraftModel(nn.Module):
    """The draft. `embed` [V, d] and `lm_head` [V, d] are the target's frozen weights (not copied, not saved);
    `vocab_ids` [draft_vocab_size] are the target ids the draft can propose (saved with the weights). Its own
    weights are made on `embed`'s device."""

    def __init__(self, cfg: DraftConfig, embed: Tensor, lm_head: Tensor, vocab_ids: Tensor):
        super().__init__()
        d, v = cfg.hidden_size, cfg.vocab_size
        for name, w in (("embed", embed), ("lm_head", lm_head)):
            if not isinstance(w, Tensor) or tuple(w.shape) != (v, d):
                got = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
                raise ValueError(f"{name} must be the target's [{v}, {d}] matrix, got {got}")
        vocab_ids = vocab_ids.to(torch.int64)
        if (vocab_ids.shape != (cfg.draft_vocab_size,) or int(vocab_ids.min()) < 0 or int(vocab_ids.max()) >= v
                or vocab_ids.unique().numel() != vocab_ids.numel()):
            raise ValueError(f"vocab_ids must be {cfg.draft_vocab_size} distinct ids in [0, {v}), "
                             f"got shape {tuple(vocab_ids.shape)}")
        self.cfg, self.gamma = cfg, cfg.gamma
        self.geometry = ModelGeometry(num_layers=1, num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                                      head_dim=cfg.head_dim, hidden_size=d, vocab_size=v,
                                      max_seq_len=cfg.max_seq_len, sm_scale=cfg.head_dim ** -0.5)
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("vocab_ids", vocab_ids)
        self.register_buffer("out_rows", lm_head.detach()[vocab_ids].clone(), persistent=False)
        eps, hq, hkv, hd = cfg.rms_eps, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        self.feat_norm, self.emb_norm = RMSNorm(d, eps=eps), RMSNorm(d, eps=eps)
        self.fuse = nn.Linear(2 * d, d, bias=False)
        self.attn_norm, self.mlp_norm = RMSNorm(d, eps=eps), RMSNorm(d, eps=eps)
        self.q_proj, self.kv_proj = nn.Linear(d, hq * hd, bias=False), nn.Linear(d, 2 * hkv * hd, bias=False)
        self.o_proj = nn.Linear(hq * hd, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)
        self.chain_norm, self.chain_emb_norm = RMSNorm(d, eps=eps), RMSNorm(d, eps=eps)
        self.chain_in = nn.Linear(2 * d, 2 * cfg.chain_size, bias=False)
        self.chain_pos = nn.Parameter(torch.zeros(max(cfg.gamma - 1, 1), 2 * cfg.chain_size))
        self.chain_out = nn.Linear(cfg.chain_size, d, bias=False)
        self.out_norm = RMSNorm(d, eps=eps)
        nf = cfg.confidence_features
        self.confidence = ConfidenceHead(d + nf, cfg.markov_rank, v if cfg.markov_rank else None, num_features=nf,
                                         positions=cfg.gamma if nf else 0)
        half = hd // 2
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        ang = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("rope_cos", torch.cos(ang).float(), persistent=False)
        self.register_buffer("rope_sin", torch.sin(ang).float(), persistent=False)
        self.to(embed.device)  # its own weights where the target's shared matrices are

    # -- the decoder block -------------------------------------------------------------------------------
    def _inputs(self, tokens: Tensor, features: Tensor) -> Tensor:
        return self.fuse(torch.cat([self.feat_norm(features), self.emb_norm(self.embed[tokens])], dim=-1))

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        c = self.cfg
        h = self.attn_norm(x)
        q = self.q_proj(h).unflatten(-1, (c.num_q_heads, c.head_dim))
        k, v = self.kv_proj(h).unflatten(-1, (2 * c.num_kv_heads, c.head_dim)).chunk(2, dim=-2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish(self, x: Tensor, o: Tensor) -> Tensor:
        x = x + self.o_proj(o.flatten(-2))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def forward(self, tokens: Tensor, positions: Tensor, features: Tensor, attend: Attend) -> Tensor:
        """Hidden states [N, d] of packed rows (several requests): `tokens [N]` at absolute `positions [N]`,
        `features [N, d]` = the target's final-normed hidden state at each row's position - 1 (zeros at 0);
        attention through `attend(0, q, k, v)` (the engine's paged cache: one layer)."""
        n, d = tokens.shape[0], self.cfg.hidden_size
        if tokens.dim() != 1 or positions.shape != tokens.shape or tuple(features.shape) != (n, d):
            raise ValueError(f"tokens and positions must be [N] and features [N, {d}], got {tuple(tokens.shape)}, "
                             f"{tuple(positions.shape)} and {tuple(features.shape)}")
        cos = self.rope_cos.index_select(0, positions)[:, None, :]
        sin = self.rope_sin.index_select(0, positions)[:, None, :]
        x = self._inputs(tokens, features)
        q, k, v = self._qkv(x, cos, sin)
        return self._finish(x, attend(0, q, k, v))

    def forward_dense(self, tokens: Tensor, features: Tensor) -> Tensor:
        """Training path: hidden states [b, T, d] of whole causal sequences `tokens [b, T]` (positions 0..T-1)
        with `features [b, T, d]` aligned as in `forward`."""
        t = tokens.shape[1]
        if tokens.dim() != 2 or tuple(features.shape) != (*tokens.shape, self.cfg.hidden_size):
            raise ValueError(f"tokens must be [b, T] and features [b, T, {self.cfg.hidden_size}], got "
                             f"{tuple(tokens.shape)} and {tuple(features.shape)}")
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self._inputs(tokens, features)
        q, k, v = self._qkv(x, self.rope_cos[:t, None, :], self.rope_sin[:t, None, :])
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)
        return self._finish(x, o.transpose(1, 2))

    # -- the block of drafts ----------------------------------------------------------------------------
    def chain(self, hidden: Tensor, k: int, teacher: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(hk [..., k, d], reduced logits [..., k, draft_vocab_size]) from the last row's hidden [..., d].

        Step j > 0 reads the embedding of draft j-1: `teacher[..., j-1]` (target ids, training: one logits
        matmul at the end) or the argmax of step j-1 (serving)."""
        check_int("k", k, 0)
        if k > self.gamma:
            raise ValueError(f"k={k} exceeds gamma={self.gamma}")
        x, states, logits = hidden, [], []
        for j in range(k):
            if j:
                prev = teacher[..., j - 1] if teacher is not None else self.vocab_ids[logits[-1].argmax(-1)]
                gate, up = (self.chain_in(torch.cat([self.chain_norm(x), self.chain_emb_norm(self.embed[prev])], -1))
                            + self.chain_pos[j - 1]).chunk(2, dim=-1)
                x = x + self.chain_out(F.silu(gate) * up)
            states.append(self.out_norm(x))
            if teacher is None:
                logits.append(self._reduced_logits(states[-1]))
        hk = torch.stack(states, -2) if k else hidden.new_zeros(hidden.shape[:-1] + (0, hidden.shape[-1]))
        return hk, (torch.stack(logits, -2) if teacher is None and k else self._reduced_logits(hk))

    def _reduced_logits(self, hk: Tensor) -> Tensor:
        return hk @ self.out_rows.t().to(hk.dtype)

    def block_hidden(self, hidden: Tensor, k: int) -> Tensor:
        """[..., d] -> [..., k, d]: the states of the first k draft positions (greedy chain)."""
        return self.chain(hidden, k)[0]

    def scatter_logits(self, reduced: Tensor) -> Tensor:
        """[..., Vd] draft-vocabulary logits -> [..., V] target-vocabulary logits, -inf outside the draft vocab."""
        full = reduced.new_full(reduced.shape[:-1] + (self.cfg.vocab_size,), -math.inf)
        return full.index_copy_(-1, self.vocab_ids, reduced)

    def logits(self, hk: Tensor) -> Tensor:
        """[..., k, d] -> [..., k, V] token logits over the target vocabulary (-inf outside the draft vocab)."""
        return self.scatter_logits(self._reduced_logits(hk))

    def head_inputs(self, hk: Tensor, reduced: Tensor | None = None) -> Tensor:
        """The confidence head's input [..., k, d + confidence_features]: hk [..., k, d] and the features of its
        reduced logits [..., k, draft_vocab_size] (computed from hk when not given)."""
        if not self.cfg.confidence_features:
            return hk
        reduced = self._reduced_logits(hk) if reduced is None else reduced
        lead, k = hk.shape[:-2].numel(), hk.shape[-2]
        nf = self.cfg.confidence_features
        feats = draft_features(reduced.reshape(lead, k, reduced.shape[-1])).reshape(*hk.shape[:-1], nf)
        return torch.cat([hk, feats.to(hk.dtype)], -1)

    def confidence_logits(self, hk: Tensor, anchor: Tensor, drafts: Tensor, reduced: Tensor | None = None) -> Tensor:
        """[..., k] confidence logits from hk [..., k, d]; draft j also sees the token before it (anchor [...]
        = the last committed token for j = 0, then drafts [..., k]), never its own. reduced: the chain's
        draft-vocabulary logits [..., k, draft_vocab_size] (`chain`'s second output; computed from hk if None)."""
        return self._confidence(self.head_inputs(hk, reduced), anchor, drafts)

    def _confidence(self, inputs: Tensor, anchor: Tensor, drafts: Tensor) -> Tensor:
        lead, k = inputs.shape[:-2].numel(), inputs.shape[-2]
        prev = (previous_tokens(anchor.reshape(lead), drafts.reshape(lead, k)) if self.confidence.markov_rank
                else None)
        return self.confidence(inputs.reshape(lead, k, inputs.shape[-1]), prev).reshape(inputs.shape[:-1])

    def propose(self, hidden: Tensor, k: int, anchor: Tensor) -> tuple[Tensor, Tensor]:
        """Greedy block in one pass: draft logits [..., k, V] and confidence logits [..., k] from the last
        row's hidden [..., d] and the last committed token anchor [...]."""
        hk, reduced = self.chain(hidden, k)
        conf = self.confidence_logits(hk, anchor, self.vocab_ids[reduced.argmax(-1)], reduced)
        return self.scatter_logits(reduced), conf


# -- the weights file ---------------------------------------------------------------------------------
def target_identity(target: nn.Module) -> dict:
    """What a draft file records about the target it was trained for: config dims and an embedding probe."""
    hf = getattr(target, "hf_model", target)
    c = hf.config
    embed = hf.get_input_embeddings().weight.detach().float()
    step = max(1, embed.shape[0] // 16)
    return {"model_type": c.model_type, "hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads or c.num_attention_heads,
            "embed_probe": [round(float(x), 6) for x in embed[::step].sum(-1)]}


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest_path(path: Path) -> Path:
    """The JSON manifest next to a weights file (same name, `.json`)."""
    return Path(path).with_suffix(".json")


def _check_target(path: Path, stored: dict, actual: dict) -> None:
    """ValueError naming the first identity field where the file's target and this one differ (the embedding
    probe to 1 %, so a float16 / bfloat16 copy of the same target passes)."""
    for key, want in stored.items():
        got = actual.get(key)
        if key == "embed_probe":
            same = len(want) == len(got) and all(math.isclose(a, b, rel_tol=1e-2, abs_tol=1e-2)
                                                 for a, b in zip(want, got))
        else:
            same = want == got
        if not same:
            raise ValueError(f"draft weights {path} were trained for another target: {key} is {want!r} in the "
                             f"file but {got!r} for this model; retrain with {RETRAIN}")


def load_draft(target: nn.Module, path: Path | str = DEFAULT_WEIGHTS) -> DraftModel:
    """The draft stored at `path` for `target` (a transformers model or a `TransformersCausalLM`), in eval mode,
    on the device and in the dtype of the target's embedding.

    Raises FileNotFoundError when the file or its manifest is missing, ValueError when the file's sha256
    differs from the manifest's (both named) or the file was trained for another target."""
    from safetensors import safe_open

    path = Path(path)
    man = manifest_path(path)
    for p, what in ((path, "draft weights"), (man, "draft manifest")):
        if not p.is_file():
            raise FileNotFoundError(f"{what} {p} is missing; reinstall dspark or retrain with {RETRAIN}")
    want = json.loads(man.read_text())["sha256"]
    got = file_sha256(path)
    if got != want:
        raise ValueError(f"draft weights {path} are corrupt or were replaced: sha256 {got}, but the manifest "
                         f"{man} says {want}; reinstall dspark or retrain with {RETRAIN}")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(METADATA_KEY, "{}"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file (format {meta.get('format')!r})")
        state = {name: f.get_tensor(name) for name in f.keys()}
    _check_target(path, meta["target"], target_identity(target))
    hf = getattr(target, "hf_model", target)
    cfg = DraftConfig(**{"confidence_features": 0, **meta["config"]})  # files from before the features: 0
    embed = hf.get_input_embeddings().weight
    model = DraftModel(cfg, embed, hf.get_output_embeddings().weight, state["vocab_ids"])
    model.load_state_dict({k: v.to(torch.int64 if k == "vocab_ids" else embed.dtype) for k, v in state.items()})
    return model.to(device=embed.device, dtype=embed.dtype).eval()
