"""Recorded greedy requests for replaying verify policies without running either model.

Under greedy acceptance the committed text is the target's greedy text whatever the policy does, so what a
step sees at a request's position t (t = tokens committed after the prompt; the root is the last committed
token) depends on the prefix alone: the draft's block `drafts[t]` (proposals for continuation positions
t..t+gamma-1), `confidence_logits[t]` (the head's raw logits: what the live engine hands the planner),
`features[t]` (`dspark.draft_features` of the draft-vocabulary logits: what the online estimator reads) and
`accepted[t]` = a(t), the leading matches of drafts[t] against the continuation (the live `correct_lens` of a
step at t; a policy that verifies fewer rows caps it at verify_len - 1). `soft[t, j]` is the training-style
proxy sum_v min(p_target, q_draft) of draft j on the greedy path (the seed note's 1 - TV, VII.A) and
`target_margin[c]` the target's top-1 minus top-2 logit at continuation position c: near 0 is a near-tie,
where a live run's numerics may commit the other token.

Layout: requests are ragged, stored flat with int64 offsets [R + 1] from 0: prompts by `prompt_offsets`,
position rows (drafts, confidence_logits, features, accepted, soft) by `position_offsets` (N_i rows for
request i, its max_new_tokens); `continuation` and `target_margin` hold N_i + gamma entries per request (the
live engine overshoots N_i within a step), request i's from position_offsets[i] + i * gamma. On disk: one
safetensors file (token ids int32, accepted uint8, soft and target_margin float16, confidence_logits and
features float32 exactly as computed) and a JSON manifest beside it (`.json`): the file's sha256, the
target identity, the draft's sha256, the workload, per-kind statistics and the command that re-records it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from dspark.models.draft import file_sha256
from dspark.util.fileio import atomic_write, read_json, write_json_atomic
from dspark.util.validate import check_int, check_path, check_tensor, check_type

FORMAT = "dspark-trace-v1"
METADATA_KEY = "dspark_trace"  # the one safetensors metadata entry (several would be written in hash order)
RECORD = "python -m dspark.lab.replay.record"
TRACES_DIR = Path(__file__).parent / "traces"
DEFAULT_TRACE = TRACES_DIR / "default.safetensors"
NEAR_TIE = 1e-3  # target margins below this count as near-ties in the summary
SOFT_SLACK = 1e-2  # soft <= 1 up to float16 rounding of sums of probabilities
STORED = {"kind_ids": torch.int32, "prompt_offsets": torch.int64, "prompt_tokens": torch.int32,
          "position_offsets": torch.int64, "continuation": torch.int32, "drafts": torch.int32,
          "confidence_logits": torch.float32, "features": torch.float32, "accepted": torch.uint8,
          "soft": torch.float16, "target_margin": torch.float16}  # on disk; in memory int64 / float32
NUM_FEATURES = 3


class TraceBlock(NamedTuple):
    """The recorded values at one position of B requests (`Trace.block`: leading [B]; `Trace.position`: none)."""

    drafts: Tensor             # [B, gamma] int64 target token ids
    confidence_logits: Tensor  # [B, gamma] float32
    features: Tensor           # [B, gamma, 3] float32
    accepted: Tensor           # [B] int64 in [0, gamma]
    soft: Tensor               # [B, gamma] float32 in [0, 1]


@dataclass(eq=False)
class Trace:
    """R recorded greedy requests (module docstring: the fields, their layout and meaning).

    gamma: drafts per block; vocab_size: the target's; kinds: request kind names, `kind_ids` [R] indexes them.
    prompt_offsets [R + 1] / prompt_tokens [sum P_i]; position_offsets [R + 1]; drafts, confidence_logits,
    soft [sum N_i, gamma]; features [sum N_i, gamma, 3]; accepted [sum N_i]; continuation and target_margin
    [sum (N_i + gamma)]. meta: JSON-serialisable recording facts (the manifest's `meta`; a loaded trace's
    also holds the file's `sha256`). Every field is checked on construction (ValueError naming the field and
    the first bad entry). Derived: `new_tokens` [R] (N_i) and `prompt_lens` [R] (P_i), int64. Lookups return
    views into the flat tensors: read them, do not write.
    """

    gamma: int
    vocab_size: int
    kinds: tuple[str, ...]
    kind_ids: Tensor
    prompt_offsets: Tensor
    prompt_tokens: Tensor
    position_offsets: Tensor
    continuation: Tensor
    drafts: Tensor
    confidence_logits: Tensor
    features: Tensor
    accepted: Tensor
    soft: Tensor
    target_margin: Tensor
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int("gamma", self.gamma, 1)
        check_int("vocab_size", self.vocab_size, 2)
        kinds = tuple(check_type("kinds", self.kinds, (tuple, list)))
        if not kinds or len(set(kinds)) != len(kinds) or not all(isinstance(k, str) and k for k in kinds):
            raise ValueError(f"kinds must be distinct non-empty strings, got {self.kinds!r}")
        self.kinds = kinds
        check_type("meta", self.meta, dict)
        for name, stored in STORED.items():
            value = check_tensor(name, getattr(self, name))
            if value.dtype.is_floating_point != stored.is_floating_point or value.dtype == torch.bool:
                raise TypeError(f"{name} must be a {'floating' if stored.is_floating_point else 'integer'} "
                                f"tensor, got dtype {value.dtype}")
            setattr(self, name, value.detach().to("cpu", torch.float32 if stored.is_floating_point
                                                  else torch.int64).contiguous())
        _check_layout(self)
        self.new_tokens = self.position_offsets.diff()  # [R] N_i
        self.prompt_lens = self.prompt_offsets.diff()  # [R] P_i
        self._cont_start = self.position_offsets[:-1] + torch.arange(self.num_requests) * self.gamma
        _check_values(self)

    # -- per request ------------------------------------------------------------------------------------
    @property
    def num_requests(self) -> int:
        """R, the number of recorded requests."""
        return self.kind_ids.shape[0]

    def _request(self, request: int) -> int:
        check_int("request", request, 0)
        if request >= self.num_requests:
            raise ValueError(f"request must be in [0, {self.num_requests}), got {request}")
        return request

    def kind(self, request: int) -> str:
        """The kind name of `request`."""
        return self.kinds[int(self.kind_ids[self._request(request)])]

    def prompt(self, request: int) -> Tensor:
        """The prompt token ids [P_i] int64 of `request`."""
        i = self._request(request)
        return self.prompt_tokens[self.prompt_offsets[i]: self.prompt_offsets[i + 1]]

    def greedy(self, request: int, t: int, n: int) -> Tensor:
        """The target's greedy continuation tokens [n] int64 of `request` at positions t..t+n-1
        (t + n <= N_i + gamma)."""
        i = self._request(request)
        check_int("t", t, 0)
        check_int("n", n, 0)
        if t + n > int(self.new_tokens[i]) + self.gamma:
            raise ValueError(f"t + n = {t + n} exceeds request {i}'s recorded continuation of N_i + gamma = "
                             f"{int(self.new_tokens[i]) + self.gamma} tokens")
        start = int(self._cont_start[i]) + t
        return self.continuation[start: start + n]

    def margins(self, request: int) -> Tensor:
        """The target's top-1 minus top-2 logit [N_i + gamma] float32 at each continuation position of `request`."""
        i = self._request(request)
        start = int(self._cont_start[i])
        return self.target_margin[start: start + int(self.new_tokens[i]) + self.gamma]

    # -- vectorised lookups (the replay reads B blocks per step) ---------------------------------------
    def block(self, requests: Tensor, t: Tensor) -> TraceBlock:
        """The recorded values of requests [B] (int64) at positions t [B] (each in [0, N_i)), each [B, ...]."""
        self._rows(requests, t, 0)
        return self._block(requests, t)

    def _block(self, requests: Tensor, t: Tensor) -> TraceBlock:
        """`block` without its checks (the replay's own positions)."""
        rows = self.position_offsets[requests] + t
        return TraceBlock(self.drafts[rows], self.confidence_logits[rows], self.features[rows], self.accepted[rows],
                          self.soft[rows])

    def position(self, request: int, t: int) -> TraceBlock:
        """`block` of one request at one position, without the leading B dimension."""
        check_int("t", t, 0)
        out = self.block(torch.tensor([self._request(request)]), torch.tensor([t]))
        return TraceBlock(*(v[0] for v in out))

    def greedy_block(self, requests: Tensor, t: Tensor, width: int) -> Tensor:
        """Greedy continuation tokens [B, width] int64 of requests [B] at positions t..t+width-1 (t + width <=
        N_i + gamma): the tokens a verify of `width` rows from position t commits at most."""
        self._check_window(requests, t, width)
        return self._greedy_block(requests, t, width)

    def _greedy_block(self, requests: Tensor, t: Tensor, width: int) -> Tensor:
        """`greedy_block` without its checks (the replay's own positions)."""
        return self.continuation[self._cont_index(requests, t, width)]

    def margin_block(self, requests: Tensor, t: Tensor, width: int) -> Tensor:
        """`target_margin` [B, width] float32 at the positions `greedy_block` reads."""
        self._check_window(requests, t, width)
        return self.target_margin[self._cont_index(requests, t, width)]

    def _check_window(self, requests: Tensor, t: Tensor, width: int) -> None:
        check_int("width", width, 0)
        self._rows(requests, t, width)

    def _cont_index(self, requests: Tensor, t: Tensor, width: int) -> Tensor:
        start = self._cont_start[requests] + t
        return start[:, None] + torch.arange(width)

    def _rows(self, requests: Tensor, t: Tensor, width: int) -> Tensor:
        """Position rows of (requests, t), checked: t in [0, N_i) (width 0) or t + width <= N_i + gamma."""
        for name, v in (("requests", requests), ("t", t)):
            if check_tensor(name, v).dim() != 1 or v.dtype != torch.int64:
                raise ValueError(f"{name} must be a 1-D int64 tensor, got {v.dtype} {list(v.shape)}")
        if t.shape != requests.shape:
            raise ValueError(f"t {list(t.shape)} must match requests {list(requests.shape)}")
        bad = (requests < 0) | (requests >= self.num_requests)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            raise ValueError(f"requests[{j}] = {int(requests[j])} is outside [0, {self.num_requests})")
        limit = self.new_tokens[requests] + (self.gamma - width + 1 if width else 0)
        bad = (t < 0) | (t >= limit)
        if bool(bad.any()):
            j = int(bad.nonzero()[0])
            want = (f"t + width <= N_i + gamma = {int(limit[j]) + width - 1}" if width else
                    f"[0, N_i = {int(limit[j])})")
            raise ValueError(f"t[{j}] = {int(t[j])} for request {int(requests[j])} is outside {want}")
        return self.position_offsets[requests] + t

    # -- statistics ---------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Per kind and over all requests: counts, mean N_i and P_i, mean a(t), P(a(t) >= 1), the conditional
        acceptance per draft position, the mean soft proxy per position and the near-tie count."""
        row_kind = self.kind_ids.repeat_interleave(self.new_tokens)
        cont_kind = self.kind_ids.repeat_interleave(self.new_tokens + self.gamma)
        out = {name: self._stats(self.kind_ids == k, row_kind == k, cont_kind == k)
               for k, name in enumerate(self.kinds)}
        out["all"] = self._stats(self.kind_ids >= 0, row_kind >= 0, cont_kind >= 0)
        return out

    def _stats(self, reqs: Tensor, rows: Tensor, cont: Tensor) -> dict:
        a = self.accepted[rows]
        if not a.numel():
            return {"requests": 0, "positions": 0}
        reached = torch.stack([(a >= j).sum() for j in range(self.gamma + 1)]).double()
        return {"requests": int(reqs.sum()), "positions": int(a.numel()),
                "mean_new_tokens": round(float(self.new_tokens[reqs].double().mean()), 3),
                "mean_prompt_len": round(float(self.prompt_lens[reqs].double().mean()), 3),
                "mean_accepted": round(float(a.double().mean()), 4),
                "p_accept_ge1": round(float((a >= 1).double().mean()), 4),
                "conditional_rate": [round(float(reached[j + 1] / reached[j]), 4) if reached[j] else None
                                     for j in range(self.gamma)],
                "mean_soft": [round(float(v), 4) for v in self.soft[rows].double().mean(0)],
                "near_ties": int((self.target_margin[cont] < NEAR_TIE).sum())}


def _first(bad: Tensor) -> int:
    return int(bad.reshape(bad.shape[0], -1).any(-1).nonzero()[0])


def _check_offsets(name: str, off: Tensor, r: int, total: int, what: str) -> None:
    if tuple(off.shape) != (r + 1,):
        raise ValueError(f"{name} must be [R + 1 = {r + 1}] offsets, got shape {list(off.shape)}")
    if int(off[0]) != 0:
        raise ValueError(f"{name}[0] = {int(off[0])} must be 0")
    steps = off.diff()
    if bool((steps < 1).any()):
        i = _first(steps < 1)
        raise ValueError(f"{name} gives request {i} {int(steps[i])} {what} (each request needs at least 1)")
    if int(off[-1]) != total:
        raise ValueError(f"{name} add up to {int(off[-1])} {what} but the flat tensor holds {total}")


def _check_layout(t: Trace) -> None:
    """Shapes and offsets agree (ValueError naming the field)."""
    if t.kind_ids.dim() != 1 or t.kind_ids.numel() == 0:
        raise ValueError(f"kind_ids must be [R >= 1], got shape {list(t.kind_ids.shape)}")
    r, g = t.kind_ids.shape[0], t.gamma
    for name in ("prompt_tokens", "continuation", "accepted", "target_margin"):
        if getattr(t, name).dim() != 1:
            raise ValueError(f"{name} must be 1-D (flat over requests), got shape {list(getattr(t, name).shape)}")
    _check_offsets("prompt_offsets", t.prompt_offsets, r, t.prompt_tokens.shape[0], "prompt tokens")
    _check_offsets("position_offsets", t.position_offsets, r, t.accepted.shape[0], "positions")
    n = t.accepted.shape[0]
    for name, want in (("drafts", (n, g)), ("confidence_logits", (n, g)), ("features", (n, g, NUM_FEATURES)),
                       ("soft", (n, g)), ("continuation", (n + r * g,)), ("target_margin", (n + r * g,))):
        if tuple(getattr(t, name).shape) != want:
            raise ValueError(f"{name} has shape {list(getattr(t, name).shape)}, but position_offsets and gamma = "
                             f"{g} say {list(want)}")


def _check_values(t: Trace) -> None:
    """Values in range and accepted = the leading matches of drafts against the continuation."""
    row_req = torch.arange(t.num_requests).repeat_interleave(t.new_tokens)

    def where(name: str, row: int) -> str:
        if name in ("drafts", "confidence_logits", "features", "accepted", "soft"):
            i = int(row_req[row])
            return f"{name}[{row}] (request {i}, position {row - int(t.position_offsets[i])})"
        return f"{name}[{row}]"

    checks = (("kind_ids", t.kind_ids, 0, len(t.kinds) - 1), ("prompt_tokens", t.prompt_tokens, 0, t.vocab_size - 1),
              ("continuation", t.continuation, 0, t.vocab_size - 1), ("drafts", t.drafts, 0, t.vocab_size - 1),
              ("accepted", t.accepted, 0, t.gamma), ("soft", t.soft, 0.0, 1.0 + SOFT_SLACK),
              ("target_margin", t.target_margin, 0.0, float("inf")))
    for name, v, lo, hi in checks:
        bad = ~((v >= lo) & (v <= hi))  # NaN is bad
        if bool(bad.any()):
            row = _first(bad)
            raise ValueError(f"{where(name, row)} = {v[row].tolist()} is outside [{lo}, {hi}]")
    for name in ("confidence_logits", "features"):
        bad = ~getattr(t, name).isfinite()
        if bool(bad.any()):
            row = _first(bad)
            raise ValueError(f"{where(name, row)} = {getattr(t, name)[row].tolist()} is not finite")
    truth = t.continuation[(t._cont_start[row_req] + (torch.arange(row_req.numel()) - t.position_offsets[row_req]))
                           [:, None] + torch.arange(t.gamma)]
    leading = torch.cumprod((t.drafts == truth).to(torch.int64), dim=1).sum(1)
    bad = leading != t.accepted
    if bool(bad.any()):
        row = _first(bad)
        raise ValueError(f"{where('accepted', row)} = {int(t.accepted[row])} but its drafts match the continuation "
                         f"for {int(leading[row])} leading tokens")


def manifest_path(path: Path) -> Path:
    """The JSON manifest next to a trace file (same name, `.json`)."""
    return Path(path).with_suffix(".json")


def _check_suffix(path: Path) -> Path:
    if path.suffix != ".safetensors":
        raise ValueError(f"path must name a .safetensors file (the manifest goes beside it), got {str(path)!r}")
    return path


def save_trace(trace: Trace, path: Path | str) -> dict:
    """Write `trace` to `path` (.safetensors) and its manifest beside it, each atomically (a temp file renamed:
    an interrupted save leaves the old pair or a pair `load_trace` refuses, never a half-written file); soft
    and target_margin are stored as float16. Returns the manifest."""
    from safetensors.torch import save_file

    check_type("trace", trace, Trace)
    path = _check_suffix(check_path("path", path))
    tensors = {name: getattr(trace, name).to(dtype).contiguous() for name, dtype in STORED.items()}
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={METADATA_KEY: FORMAT}))
    manifest = {"format": FORMAT, "file": path.name, "sha256": file_sha256(path), "bytes": path.stat().st_size,
                "gamma": trace.gamma, "vocab_size": trace.vocab_size, "kinds": list(trace.kinds),
                "num_requests": trace.num_requests, "positions": int(trace.accepted.numel()),
                "prompt_tokens": int(trace.prompt_tokens.numel()),
                "continuation_tokens": int(trace.continuation.numel()), "summary": trace.summary(),
                "meta": {k: v for k, v in trace.meta.items() if k != "sha256"}}
    write_json_atomic(manifest_path(path), manifest)
    return manifest


def load_trace(path: Path | str = DEFAULT_TRACE, *, draft_sha256: str | None = None) -> Trace:
    """The trace at `path` (.safetensors, manifest beside it), checked whole.

    draft_sha256: the sha256 of the draft weights the caller replays with; a trace recorded with another
    draft is refused (both named). Raises FileNotFoundError when the file or manifest is missing and
    ValueError for a corrupt or truncated file (sha256 against the manifest, missing keys, offsets that do
    not add up, values out of range); every message names the command that re-records the trace."""
    path = _check_suffix(check_path("path", path))
    check_type("draft_sha256", draft_sha256, str, optional=True)
    man = manifest_path(path)
    for p, what in ((path, "trace file"), (man, "trace manifest")):
        if not p.is_file():
            raise FileNotFoundError(f"{what} {p} is missing; record the trace with {RECORD} --out {path}")
    try:
        manifest = check_type("manifest", read_json(man), dict)
    except (ValueError, TypeError) as e:
        raise ValueError(f"trace manifest {man} is unreadable ({e}); re-record with {RECORD} --out {path}") from None
    meta = manifest.get("meta") if isinstance(manifest.get("meta"), dict) else {}
    redo = meta.get("command") or f"{RECORD} --out {path}"
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{man} is not a {FORMAT} manifest (format {manifest.get('format')!r}); re-record with {redo}")
    if draft_sha256 is not None and meta.get("draft_sha256") != draft_sha256:
        raise ValueError(f"trace {path} was recorded with the draft of sha256 {meta.get('draft_sha256')}, but "
                         f"draft_sha256 is {draft_sha256}: its proposals and confidences are another draft's; "
                         f"re-record it with this draft: {redo}")
    got = file_sha256(path)
    if got != manifest.get("sha256"):
        raise ValueError(f"trace {path} is corrupt, truncated or was replaced: sha256 {got}, but the manifest {man} "
                         f"says {manifest.get('sha256')}; re-record with {redo}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        missing = [k for k in STORED if k not in tensors]
        if missing:
            raise ValueError(f"keys {missing} are missing")
        for name, dtype in STORED.items():
            if tensors[name].dtype != dtype:
                raise ValueError(f"{name} is stored as {tensors[name].dtype}, expected {dtype}")
        return Trace(gamma=manifest.get("gamma"), vocab_size=manifest.get("vocab_size"),
                     kinds=tuple(manifest.get("kinds") or ()), meta={**meta, "sha256": got},
                     **{k: tensors[k] for k in STORED})
    except (ValueError, TypeError, SafetensorError) as e:
        raise ValueError(f"trace {path} is corrupt ({e}); re-record with {redo}") from None
