"""The speculative decode loop: draft -> plan -> layout -> verify forward -> accept -> commit.

Per step and request, with `L` committed tokens (the last one is the root, whose target KV is not yet
written): the draft proposes a block of k tokens in one forward, the policy picks verify lengths, the target
runs one forward over the verify rows (root at position L-1, drafts after it), accept decides the
committed tokens, and only the lengths move: KV rows of rejected drafts are simply overwritten later.

The target is any `dspark.models.TransformersCausalLM` (transformers' own model code over dspark's paged
KV cache); the draft reads the target's final hidden state one position back (`dspark.models.DraftModel`),
so every target forward stores its rows' hidden states per slot and position, and the draft's catch-up rows
(positions it has not seen, up to the root) read them from there.

Host syncs per step, counted in the telemetry: the verify lengths (to build the layout) and the commit
lengths (next positions, stop test); a target-only step needs only the second. Validation at dspark's API
boundaries also reads device values: free on the CPU, the next thing to trim on a GPU.
"""
from __future__ import annotations

import copy
import time
from typing import Sequence

import torch
from torch import Tensor

from dspark.config import VerifyMode
from dspark.engine.checks import check_device, check_new_tokens, check_positive_or_none, check_prompts, check_seq_len
from dspark.engine.kv_cache import PagedKVCache
from dspark.engine.policies import FixedK, Oracle, PolicyPlan
from dspark.engine.results import DecodeRun, GenerateResult, StepOutcome, StepTimes, finish
from dspark.engine.step_attention import batch_attention
from dspark.engine.sweep import CLOCKS
from dspark.engine.verify_step import VerifySteps, graph_slots
from dspark.models.draft import DraftModel
from dspark.models.paged_attend import PagedAttend
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.verify import boundary
from dspark.verify.accept import accept_greedy, accept_sampling
from dspark.verify.inputs import build_verify_inputs
from dspark.verify.layout import RaggedVerifyLayout, check_tiers


class SpecDecoder:
    """Target + draft with their paged KV caches; runs one policy over a batch of equal-length prompts.

    clock: how step phases are timed. `wall` (perf_counter) or, on the CPU with one intra-op thread,
    `thread` (this thread's CPU time): the same number on an idle machine, and not charged while other
    processes hold the core on a shared one. It still moves with neighbours sharing caches or an SMT
    sibling (back-to-back runs here: up to 1.6x apart, `perf/engine_timing_noise.py`), which is why
    comparisons run in `lockstep`.
    """

    def __init__(self, target: TransformersCausalLM, draft: DraftModel, *, cache_tokens: int = 65536,
                 page_size: int = 16, device: str | torch.device = "cpu", tiers: Sequence[int] | None = None,
                 clock: str = "wall"):
        if not isinstance(target, TransformersCausalLM):
            raise TypeError(f"target must be a dspark.models.TransformersCausalLM, got {type(target).__name__}")
        if not isinstance(draft, DraftModel):
            raise TypeError(f"draft must be a dspark.models.DraftModel, got {type(draft).__name__}")
        if draft.geometry.hidden_size != target.geometry.hidden_size or draft.cfg.vocab_size != target.geometry.vocab_size:
            raise ValueError(f"the draft reads hidden size {draft.geometry.hidden_size} / vocab {draft.cfg.vocab_size} "
                             f"but the target has {target.geometry.hidden_size} / {target.geometry.vocab_size}: "
                             f"load the draft trained for this target")
        self.device = check_device(device)
        if clock not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {clock!r}")
        if clock == "thread" and self.device.type != "cpu":
            raise ValueError(f"clock 'thread' (this thread's CPU time) times CPU work only; device is {self.device}")
        self.clock = clock
        self._now = time.perf_counter if clock == "wall" else time.thread_time
        self.tiers = check_tiers(tiers)
        self.target = target.to(self.device).eval()
        self.draft = draft.to(self.device).eval()
        pages = -(-cache_tokens // page_size)
        self.tcache = self._cache(target, pages, page_size)
        self.dcache = self._cache(draft, pages, page_size)
        self._verify_steps = VerifySteps(self.target, self.tcache, self.tiers)
        self._generation = 0
        self._running = False  # a started run has not finished

    def fork(self, tiers: Sequence[int] | None = None) -> SpecDecoder:
        """A decoder with this one's models, device, clock and tiers (or their subset `tiers`: `serving_tiers`)
        and its own KV caches: one decoder per run lets runs be interleaved step by step (`lockstep`)."""
        twin = copy.copy(self)
        twin.tiers = self.tiers if tiers is None else check_tiers(tiers, within=self.tiers)
        pages = self.tcache.allocator.num_pages
        twin.tcache = self._cache(self.target, pages, self.tcache.page_size)
        twin.dcache = self._cache(self.draft, pages, self.dcache.page_size)
        twin._verify_steps = VerifySteps(self.target, twin.tcache, twin.tiers)
        twin._generation, twin._running = 0, False
        return twin

    def _cache(self, model: TransformersCausalLM | DraftModel, pages: int, page_size: int) -> PagedKVCache:
        g = model.geometry
        return PagedKVCache(num_layers=g.num_layers, num_heads=g.num_kv_heads, head_dim=g.head_dim, num_pages=pages,
                            page_size=page_size, device=self.device)

    # -- forwards -------------------------------------------------------------------------------------
    def _attend(self, cache: PagedKVCache, layout: RaggedVerifyLayout, prefix: Tensor, reqs: Tensor) -> PagedAttend:
        return PagedAttend(self._attn[id(cache)], cache.k, cache.v, layout, prefix, cache.block_table[reqs])

    def _target(self, tokens: Tensor, layout: RaggedVerifyLayout, prefix: Tensor, reqs: Tensor) -> Tensor:
        """Target logits of packed rows for requests `reqs` (device ids into the admitted batch); the real
        rows' hidden states are kept for the draft (`_hidden[slot, position]`). A layout built with the tiers
        (padded to one, or past the largest) runs the run's `VerifyStep`, which replays its tier."""
        if self._verify_step is not None and (layout.tier is not None or layout.eager_reason is not None):
            hidden, logits, positions = self._verify_step(tokens, layout, prefix, self.tcache.block_table[reqs])
        else:
            attend = self._attend(self.tcache, layout, prefix, reqs)
            hidden = self.target(tokens, attend.positions, attend)
            logits, positions = self.target.logits(hidden), attend.positions
        real = layout.total_rows
        self._hidden[reqs[layout.row_slot[:real].long()], positions[:real]] = hidden[:real]
        return logits

    def graph_slots(self, b: int, width: int) -> int | None:
        """Slot count of a tier-padded compact step (`verify_step.graph_slots`); None without tiers."""
        return graph_slots(b, self.tiers, width) if self.tiers else None

    def _uniform(self, b: int, rows: int) -> RaggedVerifyLayout:
        return RaggedVerifyLayout.from_verify_lens(torch.full((b,), rows, dtype=torch.int32), width=rows)

    # -- decoding --------------------------------------------------------------------------------------
    def generate(self, prompts: Tensor, max_new_tokens: int | Tensor, policy: FixedK | Oracle | object, *,
                 mode: VerifyMode | str = VerifyMode.COMPACT, sampling: bool = False, temperature: float = 1.0,
                 seed: int = 0, reserve_new_tokens: int | None = None, slots: int | None = None) -> GenerateResult:
        """Decode `max_new_tokens` after each prompt ([N, P] int64, P >= 3) with one policy.

        max_new_tokens: one count for every request, or an int64 tensor [N] of per-request counts (a
        serving workload's varied output lengths); result.tokens is [N, max] with zeros past each count.

        slots: continuous batching. At most `slots` requests (default: all N) decode at once; when a
        request reaches max_new_tokens its slot is refilled at once with the next queued prompt (prefilled,
        timed, with a new generation number so the lag ring never hands it the old request's survival).
        The run ends when the queue is drained. Request i always gets prompt i, so result.tokens[i] is
        comparable across policies and slot counts.
        reserve_new_tokens: size the KV pages (and so the attention's per-request page span, which the
        CPU attention path reads whole every layer) for this many new tokens when larger; profiling
        uses it to time short runs with the geometry of the timed ones.
        """
        return finish(self.start(prompts, max_new_tokens, policy, mode=mode, sampling=sampling,
                                 temperature=temperature, seed=seed, reserve_new_tokens=reserve_new_tokens,
                                 slots=slots))

    def start(self, prompts: Tensor, max_new_tokens: int | Tensor, policy: FixedK | Oracle | object, *,
              mode: VerifyMode | str = VerifyMode.COMPACT, sampling: bool = False, temperature: float = 1.0,
              seed: int = 0, reserve_new_tokens: int | None = None, slots: int | None = None) -> DecodeRun:
        """`generate` one step at a time: checks the arguments now and returns the run, a generator that
        yields each StepOutcome and returns the GenerateResult (`finish` drains it). Runs on different
        decoders (`fork`) can be interleaved step by step (`dspark.engine.lockstep`)."""
        mode = VerifyMode.parse(mode)
        n, p = check_prompts(prompts)
        new_tokens = check_new_tokens(max_new_tokens, n)
        max_new_tokens = int(new_tokens.max())
        check_positive_or_none("slots", slots)
        b = min(n, slots or n)
        k = policy.num_drafts
        if k > self.draft.gamma:
            raise ValueError(f"policy {policy.name!r} drafts {k} tokens but the draft model has only "
                             f"{self.draft.gamma} heads (gamma must be in [0, {self.draft.gamma}])")
        w = k + 1
        check_positive_or_none("reserve_new_tokens", reserve_new_tokens)
        max_len = check_seq_len((self.target, self.draft), p, max(max_new_tokens, reserve_new_tokens or 0), w)
        self._check_idle()
        return self._run(prompts, new_tokens, policy, mode, sampling, temperature, seed, b, p, w, max_len)

    @torch.no_grad()
    def _run(self, prompts: Tensor, new_tokens: Tensor, policy: object, mode: VerifyMode, sampling: bool,
             temperature: float, seed: int, b: int, p: int, w: int, max_len: int) -> DecodeRun:
        self._check_idle()  # (a second run started on this decoder before this one began)
        self.tcache.admit(b, max_len)
        self.dcache.admit(b, max_len)
        self._running = True
        n, max_new_tokens = prompts.shape[0], int(new_tokens.max())
        # target prefill (P - 1 rows) or full verify (tiered verify steps plan their own); the draft's first
        # forward of a request is its prompt plus what plain steps committed before it (<= max_probe_every + W rows)
        catch_up = w + getattr(policy, "max_probe_every", 0) if getattr(policy, "speculate", None) else w
        self._slots, self._verify_step = self.graph_slots(b, w), self._verify_steps.get(b, w)
        self._attn = {id(c): batch_attention(c, m.geometry, b * (p + catch_up), b + 1)
                      for c, m in ((self.tcache, self.target), (self.dcache, self.draft))}
        self._hidden = torch.zeros(b, max_len + w, self.target.geometry.hidden_size, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(seed)
        buf = torch.zeros(b, max_len + w, dtype=torch.long, device=self.device)
        lens = torch.zeros(b, dtype=torch.int64)  # host copy of the committed lengths per slot
        dlen = torch.zeros(b, dtype=torch.int64)  # host: positions < dlen hold draft KV
        gens = torch.zeros(b, dtype=torch.int64, device=self.device)
        owner = torch.full((b,), -1, dtype=torch.int64)  # request id decoding in each slot (-1: idle)
        result = GenerateResult(tokens=torch.zeros(n, max_new_tokens, dtype=torch.long, device=self.device))
        end = torch.zeros(b, dtype=torch.int64)  # host: each slot's request stops at this length
        observe = getattr(policy, "observe", None)
        observe_seconds = getattr(policy, "observe_seconds", None)
        estimator = getattr(policy, "estimator", None)
        queued = 0  # next request id to admit
        prefill = 0.0
        try:
            while True:
                done = ((owner >= 0) & (lens >= end)).nonzero().squeeze(1)
                for slot in done.tolist():
                    count = int(end[slot]) - p
                    result.tokens[int(owner[slot]), :count] = buf[slot, p: p + count]
                owner[done] = -1
                free = (owner < 0).nonzero().squeeze(1)[: n - queued]
                if free.numel():
                    t0 = self._now()
                    self._admit(buf, lens, dlen, gens, free, prompts[queued: queued + free.numel()], policy)
                    owner[free] = torch.arange(queued, queued + free.numel())
                    end[free] = p + new_tokens[queued: queued + free.numel()]
                    queued += free.numel()
                    self._sync()
                    prefill = self._now() - t0
                reqs = (owner >= 0).nonzero().squeeze(1)
                if not reqs.numel():
                    break
                out = self._step(buf, lens, dlen, reqs, policy, mode, sampling, temperature, gen, gens)
                commit = torch.from_numpy(boundary.to_host(out.commit_lens))  # the step's commit read
                out.useful = int((torch.minimum(lens[reqs] + commit, end[reqs]) - lens[reqs]).sum())
                out.times.prefill, prefill = prefill, 0.0
                lens[reqs] += commit
                if observe is not None:  # the adaptive policy's realised-acceptance feedback, charged to plan
                    t0 = self._now()
                    observe(commit)
                    if estimator is not None and out.draft_logits is not None:  # ... and its estimator's labels
                        estimator.observe(verify_lens=out.caps, correct_len=out.correct_len)
                    out.times.plan += self._now() - t0
                if observe_seconds is not None:  # ... and its realised-cost feedback
                    observe_seconds(out.times.draft + out.times.plan + out.times.verify + out.times.accept)
                out.host_syncs += 1
                result.steps.append(out)
                yield out
            result.slots = b
            result.startup_seconds = result.steps[0].times.prefill
            result.steps[0].times.prefill = 0.0
            result.seconds = result.startup_seconds + sum(s.times.total for s in result.steps)
        finally:
            self.tcache.release()
            self.dcache.release()
            self._running = False
        return result

    def _sync(self) -> None:
        """End of a timed step or prefill on an accelerator: wait for its kernels, so the step is charged its own
        device time (else the next step's first read, maybe another lockstep run's, would be charged for it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_idle(self) -> None:
        if self._running:
            raise RuntimeError("this decoder is already running a generation (one run per decoder at a time; "
                               "`fork` a decoder for each run to interleave them)")

    def _admit(self, buf: Tensor, lens: Tensor, dlen: Tensor, gens: Tensor, slots: Tensor, prompts: Tensor,
               policy: object) -> None:
        """Admit new requests into free `slots` (host ids): write their prompts, prefill the target's KV over
        positions 0..P-2 and give them a fresh generation number.

        The draft is not prefilled here: its KV starts empty (dlen 0), so the next draft forward takes the
        prompt as the request's catch-up rows, batched with every other request's rows in that one ragged
        forward (a refill costs no draft forward of its own, and nothing when the policy never drafts).
        """
        dev_slots, p = slots.to(self.device), prompts.shape[1]
        buf[dev_slots] = 0
        buf[dev_slots, :p] = prompts.to(self.device)
        rows = buf[dev_slots, : p - 1].reshape(-1)
        zeros = torch.zeros(slots.numel(), dtype=torch.int64)
        self._target(rows, self._uniform(slots.numel(), p - 1), zeros, dev_slots)
        lens[slots], dlen[slots] = p, 0
        self._generation += 1  # new requests: lagged survival of the slot's earlier requests must not leak in
        gens[dev_slots] = self._generation
        admit = getattr(policy, "admit", None)
        if admit is not None:
            admit(slots)

    def _step(self, buf: Tensor, all_lens: Tensor, all_dlen: Tensor, reqs: Tensor, policy, mode: VerifyMode,
              sampling: bool, temperature: float, gen: torch.Generator, all_gens: Tensor) -> StepOutcome:
        """One step for the requests `reqs` (host ids of the unfinished requests)."""
        b, k = reqs.numel(), policy.num_drafts
        lens, dev_reqs = all_lens[reqs], reqs.to(self.device)
        prefix = lens - 1  # the root sits at position prefix
        root = buf[dev_reqs, prefix.to(self.device)]
        if k == 0:
            return self._plain_step(buf, reqs, lens, root, sampling, temperature, gen, 0.0)
        speculate = getattr(policy, "speculate", None)
        t0 = self._now()
        if speculate is not None and not speculate(dev_reqs, all_gens[dev_reqs]):
            decided = self._now() - t0
            return self._plain_step(buf, reqs, lens, root, sampling, temperature, gen, decided)
        times = StepTimes(plan=self._now() - t0)
        t0 = self._now()
        drafts, draft_probs, conf, draft_logits = self._draft(buf, lens, all_dlen, reqs, root, k, sampling,
                                                              temperature, gen, getattr(policy, "estimator", None))
        t1 = self._now()
        times.draft = t1 - t0
        if isinstance(policy, Oracle):
            full = torch.full((b,), k + 1, dtype=torch.int32, device=self.device)
            pre = self._verify(VerifyMode.STATIC, full, root, drafts, draft_probs, prefix, dev_reqs, sampling,
                               temperature, gen)
            plan = PolicyPlan(pre.commit_lens.to(torch.int32))
            t1 = self._now()  # the prepass is not charged to the oracle
        else:
            plan = policy.plan(conf, dev_reqs, all_gens[dev_reqs])
        times.plan += self._now() - t1
        acc, layout, caps, times.verify, times.accept = self._verify(
            mode, plan.verify_lens, root, drafts, draft_probs, prefix, dev_reqs, sampling, temperature, gen,
            timed=True, layout=plan.layout if mode is VerifyMode.COMPACT else None)
        if isinstance(policy, Oracle):
            acc = pre  # sampling: the outcome the prepass drew (greedy: identical anyway)
        t3 = self._now()
        self._commit(buf, dev_reqs, lens, acc.tokens, acc.commit_lens)
        self._sync()
        times.accept += self._now() - t3
        return StepOutcome(requests=reqs, plan=plan, layout=layout, caps=caps, confidence_logits=conf,
                           commit_lens=acc.commit_lens, correct_len=acc.correct_len, times=times, host_syncs=1,
                           draft_logits=draft_logits)

    def _plain_step(self, buf: Tensor, reqs: Tensor, lens: Tensor, root: Tensor, sampling: bool,
                    temperature: float, gen: torch.Generator, plan_seconds: float) -> StepOutcome:
        """Target-only decoding (fixed-0, or the adaptive policy's choice, whose decision took
        `plan_seconds`): one row per request, its argmax or a sample is committed."""
        b, dev_reqs = reqs.numel(), reqs.to(self.device)
        t0 = self._now()
        layout = self._uniform(b, 1)
        logits = self._target(root, layout, lens - 1, dev_reqs)
        t1 = self._now()
        if sampling:
            token = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
        else:
            token = logits.argmax(-1, keepdim=True)
        ones = torch.ones(b, dtype=torch.int32, device=self.device)
        self._commit(buf, dev_reqs, lens, token, ones)
        self._sync()
        times = StepTimes(plan=plan_seconds, verify=t1 - t0, accept=self._now() - t1)
        return StepOutcome(requests=reqs, plan=PolicyPlan(ones), layout=layout, caps=ones,
                           confidence_logits=torch.zeros(b, 0, device=self.device), commit_lens=ones,
                           correct_len=ones - 1, times=times, host_syncs=0)

    def _draft(self, buf: Tensor, lens: Tensor, all_dlen: Tensor, reqs: Tensor, root: Tensor, k: int,
               sampling: bool, temperature: float, gen: torch.Generator, estimator: object | None = None
               ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """k draft tokens [B, k], their distributions [B, k, V] (sampling), confidence logits [B, k] and the
        draft token logits [B, k, V] (None when k = 0). root [B]: the last committed tokens (the anchor the
        confidence head's previous-token input starts from). An online `estimator` replaces the head: it reads
        the draft-vocabulary logits (the scattered [B, k, V]'s features, its other entries are -inf: 1/35 the cost).
        One draft forward over the tokens committed since the draft last ran (positions dlen..L-1,
        ragged), then the block heads propose all k drafts.
        """
        b, dev = lens.numel(), self.device
        if k == 0:
            return torch.zeros(b, 0, dtype=torch.long, device=dev), None, torch.zeros(b, 0, device=dev), None
        rows = lens - all_dlen[reqs]
        prefix = lens - rows
        layout = RaggedVerifyLayout.from_verify_lens(rows.to(torch.int32).to(dev))
        real = layout.total_rows
        pos = layout.positions(prefix.to(dev))[:real]
        dev_reqs = reqs.to(dev)
        ids = buf[dev_reqs[layout.row_slot[:real].long()], pos]
        slot = dev_reqs[layout.row_slot[:real].long()]
        feats = self._hidden[slot, (pos - 1).clamp(min=0)] * (pos > 0)[:, None]  # h_{t-1}; zeros at position 0
        attend = self._attend(self.dcache, layout, prefix, dev_reqs)
        h = self.draft(ids, attend.positions, feats, attend)
        all_dlen[reqs] = lens
        hk, reduced = self.draft.chain(h.index_select(0, layout.qo_indptr[1:].long() - 1), k)
        logits = self.draft.scatter_logits(reduced)  # the chain's own draft-vocabulary logits, not recomputed
        q = torch.softmax(logits / temperature, -1) if sampling else None
        drafts = torch.multinomial(q.flatten(0, 1), 1, generator=gen).reshape(b, k) if sampling else logits.argmax(-1)
        conf = (self.draft.confidence_logits(hk, root, drafts) if estimator is None else
                estimator.confidence_logits(reduced / temperature if sampling else reduced))
        return drafts, q, conf, logits

    def _verify(self, mode: VerifyMode, verify_lens: Tensor, root: Tensor, drafts: Tensor,
                draft_probs: Tensor | None, prefix: Tensor, reqs: Tensor, sampling: bool, temperature: float,
                gen: torch.Generator, timed: bool = False, layout: RaggedVerifyLayout | None = None):
        """Verify forward in `mode` (dspark.build_verify_inputs) and accept on its packed rows.

        Returns the AcceptResult, or with `timed` also the layout, the caps and the verify / accept
        seconds. Building the layout reads the verify lengths on the host (the step's first sync); a compact
        `layout` the planner already built is reused.
        """
        t0 = self._now()
        vin = build_verify_inputs(mode, verify_lens, root, drafts, prefix.to(self.device),
                                  tiers=self.tiers or None, slots=self._slots, layout=layout)
        logits = self._target(vin.input_ids, vin.layout, prefix, reqs)
        t1 = self._now()
        if sampling:
            p = torch.softmax(logits / temperature, -1)
            acc = accept_sampling(drafts, draft_probs, p, vin.caps, generator=gen, layout=vin.layout, check=False)
        else:
            acc = accept_greedy(drafts, logits, vin.caps, layout=vin.layout, check=False)
        if not timed:
            return acc
        return acc, vin.layout, vin.caps, t1 - t0, self._now() - t1

    def _commit(self, buf: Tensor, reqs: Tensor, lens: Tensor, tokens: Tensor, commit_lens: Tensor) -> None:
        """Write each request's committed tokens after its length (columns past commit go to the spare
        last column, which is never read)."""
        w = tokens.shape[1]
        cols = torch.arange(w, device=self.device)
        idx = lens.to(self.device)[:, None] + cols[None, :]
        idx = torch.where(cols[None, :] < commit_lens[:, None], idx, buf.shape[1] - 1)
        buf[reqs[:, None].expand(-1, w), idx] = tokens
