"""Targets: what verifies a step's drafts (`Target`), and the live transformers model over dspark's paged KV
cache (`LiveTarget`).

A target prefills admitted requests, runs plain (one row per request) steps, and verifies drafts in a verify
mode: `verify` runs the forward over the step's layout, `accept` decides what is committed (greedy or
rejection sampling, capped to each request's verify length). The trace replay swaps in a simulated target
whose outcomes come from a recorded trace and whose time comes from a cost model.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.models.paged_attend import PagedAttend
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.serve.attention import batch_attention
from dspark.serve.drafters.base import Drafts
from dspark.serve.kv_cache import PagedKVCache
from dspark.serve.sampling import Sampling
from dspark.serve.scheduler import Batch
from dspark.serve.tier_step import VerifySteps, graph_slot_count
from dspark.util.validate import check_verify_lens
from dspark.verify import boundary
from dspark.verify.accept import AcceptResult, _accept_greedy, _accept_sampling
from dspark.verify.inputs import _verify_inputs, check_layout_fits
from dspark.verify.layout import RaggedVerifyLayout


@dataclass
class Verified:
    """One verify forward: its layout, the caps accept honours ([B]: verify lengths, or W in static mode) and
    the target's output rows (whatever the target's `accept` reads)."""

    layout: RaggedVerifyLayout
    caps: Tensor
    rows: Any


def mode_layout(mode: VerifyMode, verify_lens: Tensor, width: int, layout: RaggedVerifyLayout | None,
                tiers: tuple[int, ...], graph_slots: int | None) -> tuple[RaggedVerifyLayout, Tensor]:
    """(the forward's layout, the caps accept honours) of one verify step in `mode`.

    Args:
        verify_lens: [B] int32, the policy's lengths (root included); width: W = drafts + 1.
        layout: the planner's compact layout of these lengths (reused; its tier and slots are checked
            against `tiers` / `graph_slots`), or None: the lengths come from a policy without a planner and are
            checked here, once per step (one host read).
        tiers / graph_slots: the captured graph tiers (empty: eager) and graph slot count.
    Returns:
        compact: the ragged layout of `verify_lens` and caps `verify_lens`; static / cap-accept: W rows per
        request and caps W (static) or `verify_lens` (cap-accept).
    """
    if layout is None or mode is not VerifyMode.COMPACT:
        host = torch.from_numpy(boundary.to_host(verify_lens))
        check_verify_lens(host, width)
    if mode is VerifyMode.COMPACT:
        if layout is not None:
            check_layout_fits(layout, verify_lens.numel(), tiers, graph_slots)
        else:  # built from the host lengths and moved: the attention's plan reads the host copy, no device
            layout = RaggedVerifyLayout._from_lens(host.to(torch.int32), tiers, graph_slots, width,
                                                     total_rows=int(host.sum()), host=True).to(verify_lens.device)
        return layout, verify_lens
    b = verify_lens.numel()
    full = torch.full((b,), width, dtype=torch.int32)
    layout = RaggedVerifyLayout._from_lens(full, tiers, graph_slots, width, total_rows=b * width, host=True)
    layout = layout.to(verify_lens.device)
    return layout, layout.verify_lens if mode is VerifyMode.STATIC else verify_lens


class Target:
    """The plug-in point for verification (B requests of a batch's `slots`, host ids ascending)."""

    _folded: Any = None  # what `fold` left for the next forward (None: nothing)

    def start(self, batch: Batch, widths: tuple[int, ...], max_rows: int) -> None:
        """A run begins on `batch`, verifying at `widths` (ascending W = depth + 1, every width its policy may
        take; empty: plain steps only); no prefill exceeds `max_rows` rows per request."""

    def finish(self) -> None:
        """The run ended (also on error): release what `start` took."""

    def prefill(self, batch: Batch, slots: Tensor) -> None:
        """Cache the prompts of newly admitted `slots` (all but each prompt's last token, the first root)."""

    def fold(self, batch: Batch, slots: Tensor) -> None:
        """Cache the prompts of newly admitted `slots` in the next `plain` or `verify` forward, beside the rows of
        the requests it decodes (chunked prefill: no forward of their own); a target that cannot prefills now."""
        self.prefill(batch, slots)

    @contextlib.contextmanager
    def unfolded(self) -> Iterator[None]:
        """Forwards inside the block leave the folded prompts to the next forward after it (an untimed prepass)."""
        held, self._folded = self._folded, None
        try:
            yield
        finally:
            self._folded = held

    def plain(self, batch: Batch, slots: Tensor, layout: RaggedVerifyLayout, sampling: Sampling) -> Tensor:
        """Target-only step over `layout` (one row per request): [B, 1] int64 the next token of each."""
        raise NotImplementedError

    def verify(self, batch: Batch, slots: Tensor, drafts: Drafts, verify_lens: Tensor, mode: VerifyMode,
               layout: RaggedVerifyLayout | None) -> Verified:
        """The verify forward of `mode` over root + drafts (verify_lens [B] int32; `layout`: the planner's
        compact layout, reused)."""
        raise NotImplementedError

    def accept(self, verified: Verified, drafts: Drafts, sampling: Sampling) -> AcceptResult:
        """What the verified rows commit, capped to `verified.caps - 1` drafts plus the bonus token."""
        raise NotImplementedError


class LiveTarget(Target):
    """A `TransformersCausalLM` over its paged KV cache; tier-padded compact steps run the decoder's
    `VerifySteps` (one captured step per tier). Keeps the real rows' final hidden states per slot and
    position (`hidden`) for a drafter that reads them."""

    def __init__(self, model: TransformersCausalLM, cache: PagedKVCache, verify_steps: VerifySteps,
                 tiers: tuple[int, ...]) -> None:
        self.model, self.cache, self.verify_steps, self.tiers = model, cache, verify_steps, tiers
        self.device = cache.k.device
        self.hidden = torch.zeros(0, 0, model.geometry.hidden_size, device=self.device)
        self._running = False  # a started run has not finished
        self._folded: tuple[Tensor, Tensor] | None = None  # (host slots, prompt rows [A]) for the next forward

    def check_idle(self) -> None:
        """RuntimeError while a run is on this target (one run per decoder at a time)."""
        if self._running:
            raise RuntimeError("this decoder is already running a generation (one run per decoder at a time; "
                               "`fork` a decoder for each run to interleave them)")

    def start(self, batch: Batch, widths: tuple[int, ...], max_rows: int) -> None:
        self.check_idle()  # (a second run started on this decoder before this one began)
        s, cols = batch.num_slots, batch.tokens.shape[1]
        self.cache.admit(s, cols - 1)
        self._running = True
        try:
            self._steps: dict[int, tuple[int | None, Any]] = {}  # verify width -> (graph slots, its VerifyStep)
            for w in widths:  # every verify step the run may take is built (captured) here, not in a timed step
                self._width(w)
            self._attn = batch_attention(self.cache, self.model.geometry, s * max_rows, s + 1,
                                         self.model.attention_backend)
            self.hidden = torch.zeros(s, cols, self.model.geometry.hidden_size, device=self.device,
                                      dtype=self.cache.k.dtype)
        except BaseException:
            self.finish()
            raise

    def finish(self) -> None:
        self.cache.release()
        self._running = False
        self._folded = None

    def _width(self, width: int) -> tuple[int | None, Any]:
        """(graph slots, VerifyStep or None) of verify width `width` over this run's slots (built at `start` for
        the widths the policy declared, else on first use)."""
        if width not in self._steps:
            s = self.cache.block_table.shape[0]
            self._steps[width] = (graph_slot_count(s, self.tiers, width) if self.tiers else None,
                                  self.verify_steps.get(s, width))
        return self._steps[width]

    def forward(self, tokens: Tensor, layout: RaggedVerifyLayout, prefix: Tensor, slots: Tensor,
                batch: Batch | None = None) -> Tensor:
        """Logits of the packed rows `tokens` of `layout` for `slots` (device ids), the cached prefix [B]
        (host) before each, run eagerly; the real rows' hidden states are kept in `hidden`. With `batch`, the
        prompts `fold` left pending ride the same forward after those rows (their hidden states kept, no
        logits)."""
        rows = tokens.shape[0]
        if batch is not None and self._folded is not None:
            tokens, layout, prefix, slots = self._with_folded(batch, tokens, layout, prefix, slots)
        attend = PagedAttend(self._attn, self.cache.k, self.cache.v, layout, prefix, self.cache.block_table[slots])
        hidden = self.model(tokens, attend.positions, attend)
        self._keep(hidden, layout, attend.positions, slots)
        return self.model.logits(hidden[:rows])

    def _with_folded(self, batch: Batch, tokens: Tensor, layout: RaggedVerifyLayout, prefix: Tensor, slots: Tensor
                     ) -> tuple[Tensor, RaggedVerifyLayout, Tensor, Tensor]:
        """(tokens, layout, prefix, slots) of an unpadded forward followed by the pending prompts' rows (each
        prompt but its last token, from position 0)."""
        (folded, rows), self._folded = self._folded, None
        built = layout.host if layout.host is not None else layout  # a host-built layout: no device read
        lens = torch.cat([torch.from_numpy(boundary.to_host(built.verify_lens)).to(torch.int32), rows])
        merged = RaggedVerifyLayout._from_lens(lens, (), None, None, total_rows=int(lens.sum()), host=True)
        merged = merged.to(self.device)
        slots = torch.cat([slots, boundary.to_device(folded, self.device)])
        prefix = torch.cat([prefix.to(torch.int64), torch.zeros(folded.numel(), dtype=torch.int64)])
        n = tokens.shape[0]
        pos = merged.positions(boundary.to_device(prefix, self.device))
        own = merged.row_slot[n: merged.total_rows].long()
        prompts = batch.tokens[slots[own], pos[n: merged.total_rows]]
        return torch.cat([tokens, prompts]), merged, prefix, slots

    def _keep(self, hidden: Tensor, layout: RaggedVerifyLayout, positions: Tensor, slots: Tensor) -> None:
        real = layout.total_rows
        self.hidden[slots[layout.row_slot[:real].long()], positions[:real]] = hidden[:real]

    def prefill(self, batch: Batch, slots: Tensor) -> None:
        rows = (batch.prompt_lens[slots] - 1).to(torch.int32).cpu()  # the one host read of an admission
        if not bool((rows > 0).all()):  # a one-token prompt is its root alone: nothing to prefill
            slots, rows = slots[rows > 0], rows[rows > 0]
            if not slots.numel():
                return
        layout = RaggedVerifyLayout._from_lens(rows, (), None, int(rows.max()), total_rows=int(rows.sum()),
                                               host=True)
        layout = layout.to(self.device)
        dev_slots = boundary.to_device(slots, self.device)
        pos = layout.positions(torch.zeros(slots.numel(), dtype=torch.int64, device=self.device))
        ids = batch.tokens[dev_slots[layout.row_slot[: layout.total_rows].long()], pos[: layout.total_rows]]
        self.forward(ids, layout, torch.zeros(slots.numel(), dtype=torch.int64), dev_slots)

    def fold(self, batch: Batch, slots: Tensor) -> None:
        rows = (batch.prompt_lens[slots] - 1).to(torch.int32).cpu()  # the one host read of an admission
        slots, rows = slots[rows > 0], rows[rows > 0]  # a one-token prompt is its root alone: nothing to prefill
        if self._folded is not None:
            slots, rows = torch.cat([self._folded[0], slots]), torch.cat([self._folded[1], rows])
        self._folded = (slots, rows) if slots.numel() else None

    def plain(self, batch: Batch, slots: Tensor, layout: RaggedVerifyLayout, sampling: Sampling) -> Tensor:
        logits = self.forward(batch.roots(slots), layout, batch.lens[slots] - 1, boundary.to_device(slots, self.device),
                              batch)
        return sampling.tokens(logits)

    def verify(self, batch: Batch, slots: Tensor, drafts: Drafts, verify_lens: Tensor, mode: VerifyMode,
               layout: RaggedVerifyLayout | None) -> Verified:
        prefix, width = batch.lens[slots] - 1, drafts.tokens.shape[1] + 1
        graph_slots, step = self._width(width)
        tiers = self.tiers
        if self._folded is not None:  # prompts ride this forward: eager, unpadded (no captured tier holds them)
            step, layout, tiers, graph_slots = None, None, (), None
        layout, _ = mode_layout(mode, verify_lens, width, layout, tiers, graph_slots)
        vin = _verify_inputs(mode, verify_lens, batch.roots(slots), drafts.tokens,
                                  boundary.to_device(prefix, self.device), layout)
        dev_slots = boundary.to_device(slots, self.device)
        if step is None or (vin.layout.tier is None and vin.layout.eager_reason is None):
            return Verified(vin.layout, vin.caps, self.forward(vin.input_ids, vin.layout, prefix, dev_slots, batch))
        positions = step.bind(vin.layout, prefix, self.cache.block_table[dev_slots])
        out = step.runner.run(vin.layout, tokens=vin.input_ids, positions=positions)  # the tier's captured step
        self._keep(out["hidden"], vin.layout, positions, dev_slots)
        return Verified(vin.layout, vin.caps, out["logits"])

    def accept(self, verified: Verified, drafts: Drafts, sampling: Sampling) -> AcceptResult:
        if sampling.enabled:
            return _accept_sampling(drafts.tokens, drafts.probs, sampling.probs(verified.rows), verified.caps,
                                         generator=sampling.generator, layout=verified.layout)
        return _accept_greedy(drafts.tokens, verified.rows, verified.caps, layout=verified.layout)
