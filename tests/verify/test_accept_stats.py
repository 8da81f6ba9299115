"""Statistics of capped rejection sampling (fixed seeds, vectorized Monte Carlo: one accept call per test).

Each test batches many independent steps as one large batch of requests. The synthetic target is
context-free (row i's distribution does not depend on the accepted prefix), so the acceptance of draft
i given that the prefix survived has probability alpha_i = sum_v min(p_i(v), q_i(v)).
"""
import torch

from dspark import ScheduleConfig, StepsPerSecondTable, accept_sampling, choose_budget


def _dists(shape, vocab, gen, mix=None, base=None):
    x = torch.rand(*shape, vocab, generator=gen) ** 2 + 0.02
    x = x / x.sum(-1, keepdim=True)
    return x if base is None else mix * base + (1 - mix) * x


def _sample(q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draft token per row of q [..., V] (inverse CDF, vectorized)."""
    u = torch.rand(*q.shape[:-1], 1, generator=gen)
    return torch.searchsorted(q.cumsum(-1), u).clamp(max=q.shape[-1] - 1)[..., 0]


def _run(p, q, vl, n, seed, device):
    """n independent steps of B requests with fixed p [B, W, V], q [B, gamma, V] and caps vl [B]."""
    gen = torch.Generator().manual_seed(seed)
    b, gamma, _ = q.shape
    qn = q.repeat(n, 1, 1)
    draft = _sample(qn, gen)
    res = accept_sampling(draft.to(device), qn.to(device), p.repeat(n, 1, 1).to(device),
                          vl.repeat(n).to(device), generator=torch.Generator(device=device).manual_seed(seed))
    return res


def test_sum_commit_lens_matches_tau(device):
    """E[sum(commit_lens)] = tau = sum_r (1 + sum_{k < verify_len-1} prod_{i<=k} alpha_i), within 3 s.e."""
    gen = torch.Generator().manual_seed(0)
    b, gamma, vocab, n = 6, 5, 7, 6000
    p = _dists((b, gamma + 1), vocab, gen)
    q = _dists((b, gamma), vocab, gen, mix=0.6, base=p[:, :gamma])
    vl = torch.tensor([1, 6, 3, 6, 2, 5], dtype=torch.int32)
    alpha = torch.minimum(p[:, :gamma], q).sum(-1).double()
    survival = alpha.cumprod(1)
    verified = torch.arange(gamma)[None, :] < (vl[:, None] - 1)
    tau = float((1 + (survival * verified).sum(1)).sum())
    res = _run(p, q, vl, n, 1, device)
    per_step = res.commit_lens.view(n, b).sum(1).double().cpu()
    mean, se = float(per_step.mean()), float(per_step.std() / n**0.5)
    assert abs(mean - tau) < 3 * se, (mean, tau, se)
    # per position too: the accept rate of draft k equals its survival
    acc = res.accepted.view(n, b, gamma).double().mean(0).cpu()
    ok = verified
    assert torch.allclose(acc[ok], survival[ok], atol=4 * (0.25 / n) ** 0.5)


def _tv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 0.5 * (a - b).abs().sum(-1)


def _emitted(res, b, w, vocab, n):
    """Counts [B, W, V] of the token emitted at output position j (given commit_len > j), per request."""
    tokens = res.tokens.view(n, b, w).cpu()
    emitted = tokens >= 0
    onehot = torch.nn.functional.one_hot(tokens.clamp(min=0), vocab) * emitted[..., None]
    return onehot.cumsum(0)  # running counts: [n, B, W, V]


def test_capped_rejection_sampling_reproduces_the_target(device):
    """Each emitted token follows the target row it came from, for random p, q and caps: the total
    variation to p shrinks like 1/sqrt(n) and stays far below the distance to perturbed references."""
    gen = torch.Generator().manual_seed(2)
    b, gamma, vocab, n = 5, 4, 6, 40000
    w = gamma + 1
    p = _dists((b, w), vocab, gen)
    q = _dists((b, gamma), vocab, gen, mix=0.5, base=p[:, :gamma])
    vl = torch.tensor([5, 3, 1, 4, 2], dtype=torch.int32)
    res = _run(p, q, vl, n, 3, device)
    counts = _emitted(res, b, w, vocab, n).double()
    reached = torch.arange(w)[None, :] < vl[:, None]
    checkpoints = [n // 64, n // 16, n // 4, n]
    scaled, dists = [], []
    for m in checkpoints:
        c = counts[m - 1][reached]
        k = c.sum(-1, keepdim=True)
        d = _tv(c / k, p[reached].double())
        dists.append(float(d.mean()))
        scaled.append(float((d * k[:, 0].sqrt()).mean()))
    # ~1/sqrt(n): the n-scaled distance stays O(1) while the distance falls ~8x over a 64x range
    assert all(0.1 < s < 2.0 for s in scaled), scaled
    assert dists[-1] < 0.3 * dists[0], dists
    # far below the distance to references perturbed by TV 0.05
    final = counts[-1][reached]
    emp = final / final.sum(-1, keepdim=True)
    ref = p[reached].double()
    hi, lo = ref.argmax(-1, keepdim=True), ref.argmin(-1, keepdim=True)
    bump = torch.zeros_like(ref).scatter(1, hi, -0.05).scatter_add(1, lo, torch.full_like(lo, 0.05, dtype=ref.dtype))
    assert float(_tv(emp, ref).max()) < 0.2 * float(_tv(emp, ref + bump).min())


def test_non_anticipation_counterexample(device):
    """DESIGN.md 4.4: choosing the budget from the current drafts' own survival biases the output.

    One request, gamma = 2, vocabulary {0, 1}; target p = (0.7, 0.3) and draft q = (0.5, 0.5) at every
    position; steps/s {1 row: 1.0, 2: 0.5, 3: 0.45}, so theta(b) = tau(b) * sps(1 + b). A draft token's
    acceptance probability is min(1, p/q): 1 for token 0, 0.6 for token 1.

    Anticipating: survival from the sampled drafts' own acceptance probabilities. d1 = 0 gives
    s = (1, s2) and theta = (1, 1, (2 + s2) * 0.45 >= 1.17): b = 2, d1 is verified and always accepted,
    so the first token is 0. d1 = 1 gives s = (0.6, <= 0.6), theta = (1, 0.8, <= 0.99): b = 0, the first
    token is the bonus drawn from p. P(first = 0) = 0.5 * 1 + 0.5 * 0.7 = 0.85: biased.
    Lagged (the planner's rule): the budget comes from the previous step's survival, independent of the
    current drafts, so the first token follows p = (0.7, 0.3) whatever the budget.
    """
    cfg = ScheduleConfig(gamma=2)
    cost = StepsPerSecondTable([1, 2, 3], [1.0, 0.5, 0.45])
    accept_prob = torch.tensor([1.0, 0.6])
    # the planner's budget for each possible draft pair (d1, d2): a lookup table of 4 decisions
    budget_of = torch.zeros(2, 2, dtype=torch.int32)
    for d1 in range(2):
        for d2 in range(2):
            s = torch.tensor([[accept_prob[d1], accept_prob[d1] * accept_prob[d2]]])
            budget_of[d1, d2] = choose_budget(s, cost_model=cost, cfg=cfg).budget
    assert budget_of.tolist() == [[2, 2], [0, 0]]

    n = 40000
    gen = torch.Generator().manual_seed(4)
    p = torch.tensor([0.7, 0.3]).expand(n, 3, 2).contiguous()
    q = torch.tensor([0.5, 0.5]).expand(n, 2, 2).contiguous()
    draft = _sample(q, gen)
    previous = _sample(q, gen)  # last step's drafts: what a lagged survival was computed from
    first = {}
    for name, source in (("anticipating", draft), ("lagged", previous)):
        vl = 1 + budget_of[source[:, 0], source[:, 1]]
        res = accept_sampling(draft.to(device), q.to(device), p.to(device), vl.to(device),
                              generator=torch.Generator(device=device).manual_seed(5))
        first[name] = float((res.tokens[:, 0] == 0).double().mean())
    se = (0.7 * 0.3 / n) ** 0.5
    assert abs(first["lagged"] - 0.7) < 3 * se, first
    assert abs(first["anticipating"] - 0.85) < 3 * (0.85 * 0.15 / n) ** 0.5, first
    assert first["anticipating"] - 0.7 > 20 * se, first
