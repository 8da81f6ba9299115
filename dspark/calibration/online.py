"""Online acceptance estimator: adaptive verification for a draft without a trained confidence head.

Per draft position the estimator reads three features of the draft's own distribution, computed where the
draft logits [B, gamma, V] live (only [B, gamma, 3] ever leaves the device): the log-odds of the top-1
probability, the top-2 logit margin and the entropy (`draft_features`). The draft position selects the
model: position k has its own logistic model `z_k = w_k . (1, features)`, the conditional acceptance
P(draft k accepted | the prefix reached k) is `sigmoid(z_k)`, and the survival is
`calibrated_survival(z)`: the same contract, float32 values and planner input as a confidence head's
logits (build the planner with `temperatures=None`, the estimator is its own calibration).

Labels come from the accept results the engine already has (greedy or sampling `correct_lens` and the
verify lengths) with the STS censoring of `dspark.calibration.recorder.censored_labels`: a position is a
label only when the target verified it (k < verify_len - 1) and the accepted prefix reached it (no earlier
rejection). Every `refit_every` observed steps each position with at least `min_labels` labels in its
window (the last `window` labels) is refitted: the MAP logistic fit (Newton with backtracking, float64,
fixed order) under a Gaussian prior of strength `prior_strength` centred on the warm-up prior.

Warm-up prior: until a position has `min_labels` labels (and at start) its parameters are (0, 1, 0, 0),
i.e. the conditional acceptance is the draft's own top-1 probability.

Documented behaviour: a position whose logits hold NaN (or no finite entry) has non-finite features, so
c = 0 there (as `calibrated_survival` does for non-finite logits) and it is never a label; -inf logits
(masked vocabulary) are fine; the log-odds and the margin are capped at `FEATURE_CAP`; an empty batch gives
empty outputs.

TP: with `parallel=ParallelConfig(tp_group=...)` every refit goes through
`dspark.parallel.agreement.EstimatorAgreement`: tp_mode "broadcast" makes the group's first rank
authoritative (its parameters are sent to the others: drift in another rank's accumulators cannot reach
its survival), "verify" keeps the local fits and raises `TpDisagreementError` naming the drifted ranks
at the refit. The configuration's fingerprint is compared across the group at construction.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
from torch import Tensor

from dspark.calibration.recorder import censored_labels
from dspark.parallel.agreement import EstimatorAgreement
from dspark.parallel.tp import ParallelConfig
from dspark.plan.survival import _survival
from dspark.util.validate import check_int, check_tensor, check_type

FEATURES = ("top1_log_odds", "top2_margin", "entropy")
FEATURE_CAP = 30.0  # log-odds and margin of a single finite logit are +inf; both are capped here
NEWTON_ITERS = 50
NEWTON_TOL = 1.0e-10


def draft_features(draft_logits: Tensor) -> Tensor:
    """[B, gamma, V] draft logits -> [B, gamma, 3] float32 features (`FEATURES`) on the logits' device.

    Why these: the top-1 probability is the draft's own belief in its token, the margin and the entropy say
    how peaked the rest is; together they rank acceptance without any trained head."""
    if check_tensor("draft_logits", draft_logits).dim() != 3 or draft_logits.shape[-1] < 2:
        raise ValueError(f"draft_logits must be [B, gamma, V] with V >= 2, got {tuple(draft_logits.shape)}")
    if not draft_logits.is_floating_point():
        raise TypeError(f"draft_logits must be a floating tensor, got dtype {draft_logits.dtype}")
    x = draft_logits.detach().to(torch.float32)
    top = torch.topk(x, 2, dim=-1)
    # x_j - x_top, -inf (masked) entries clamped to -200: exp underflows to 0 either way, and 0 * -200 is 0
    # where 0 * -inf would be NaN; NaN (or no finite entry: -inf - -inf) stays NaN
    d = (x - top.values[..., :1]).clamp_min_(-200.0)
    e = torch.exp(d).scatter_(-1, top.indices[..., :1], 0.0)  # the top's own term (exactly 1) taken out
    rest = e.sum(-1)  # sum_{j != top} exp(x_j - x_top), no cancellation
    shifted = (e * d).sum(-1)
    total = 1.0 + rest
    log_odds = (-torch.log(rest)).clamp(max=FEATURE_CAP)  # p1 / (1 - p1) = 1 / rest
    entropy = (torch.log1p(rest) - shifted / total).clamp_min(0.0)
    margin = (top.values[..., 0] - top.values[..., 1]).clamp(max=FEATURE_CAP)
    return torch.stack([log_odds, margin, entropy], dim=-1)


def prior_parameters(gamma: int) -> Tensor:
    """The warm-up prior [gamma, 4] float64 (bias, top-1 log-odds, margin, entropy): c_k = top-1 probability."""
    prior = torch.zeros(check_int("gamma", gamma, 1), 1 + len(FEATURES), dtype=torch.float64)
    prior[:, 1] = 1.0
    return prior


def fit_logistic(x: np.ndarray, y: np.ndarray, prior: np.ndarray, strength: float) -> np.ndarray:
    """MAP logistic parameters [1 + F] for features x [n, F], 0/1 labels y [n], Gaussian prior N(prior, 1 /
    strength): Newton steps with backtracking on the convex objective, float64, deterministic."""
    a = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)

    def objective(theta: np.ndarray) -> float:
        z = a @ theta
        return float(np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * strength * np.sum((theta - prior) ** 2))

    theta = prior.copy()
    value = objective(theta)
    for _ in range(NEWTON_ITERS):
        c = 1.0 / (1.0 + np.exp(-(a @ theta)))
        grad = a.T @ (c - y) + strength * (theta - prior)
        hess = (a.T * (c * (1.0 - c))) @ a + strength * np.eye(a.shape[1])
        step = np.linalg.solve(hess, grad)
        t = 1.0
        while True:
            cand = theta - t * step
            new = objective(cand)
            if new <= value or t < 1.0e-8:
                break
            t *= 0.5
        if new > value:
            break
        theta, decrease, value = cand, value - new, new
        if decrease <= NEWTON_TOL * max(1.0, abs(value)):
            break
    return theta


class OnlineAcceptanceEstimator:
    """Per-position logistic acceptance model on draft features, refitted online from accept outcomes.

    Per step: `confidence_logits(draft_logits)` (or `survival`) for the planner, then, after the accept,
    `observe(verify_lens=..., correct_lens=...)` for the same B requests; it pairs with the latest call and
    refits every `refit_every` observed steps. `parameters` [gamma, 4] float64 is the model in use.
    """

    def __init__(self, gamma: int, *, refit_every: int = 16, window: int = 4096, min_labels: int = 64,
                 prior_strength: float = 1.0, parallel: ParallelConfig | None = None):
        for name, v, lo in (("gamma", gamma, 1), ("refit_every", refit_every, 1), ("window", window, 1),
                            ("min_labels", min_labels, 1)):
            check_int(name, v, lo)
        if isinstance(prior_strength, bool) or not isinstance(prior_strength, (int, float)) or not (
                math.isfinite(prior_strength) and prior_strength > 0):
            raise ValueError(f"prior_strength must be a finite number > 0, got {prior_strength!r}")
        if min_labels > window:
            raise ValueError(f"min_labels={min_labels} can never be reached with window={window}")
        self.gamma, self.refit_every, self.window, self.min_labels = gamma, refit_every, window, min_labels
        self.prior_strength = float(prior_strength)
        self.prior = prior_parameters(gamma)
        self.parameters = self.prior.clone()
        self.local_parameters = self.parameters  # this rank's own fit at the last refit, before the TP agreement
        self._x = np.zeros((gamma, window, len(FEATURES)))  # per position: ring of the last `window` labels
        self._y = np.zeros((gamma, window))
        self.labels_seen = np.zeros(gamma, dtype=np.int64)  # labels ever observed per position
        self.steps_observed = 0
        self.refits = 0
        self._pending: Tensor | None = None  # [B, gamma, 3] features of the latest confidence_logits call
        check_type("parallel", parallel, ParallelConfig, optional=True)
        self.agreement = (EstimatorAgreement(parallel, fingerprint=self.fingerprint())
                          if parallel is not None and parallel.tp_group is not None else None)

    def fingerprint(self) -> str:
        """The configuration (what every TP rank must share) as a short hash."""
        conf = (FEATURES, self.gamma, self.refit_every, self.window, self.min_labels, self.prior_strength,
                self.prior.numpy().tobytes().hex())
        return hashlib.sha256(repr(conf).encode()).hexdigest()[:16]

    def confidence_logits(self, draft_logits: Tensor) -> Tensor:
        """Confidence logits [B, gamma] float32 (on the logits' device) from draft logits [B, gamma, V]:
        `calibrated_survival` of them is the estimated survival. Keeps the features for `observe`."""
        feats = draft_features(draft_logits)
        if feats.shape[1] != self.gamma:
            raise ValueError(f"draft_logits must be [B, gamma={self.gamma}, V], got {tuple(draft_logits.shape)}")
        self._pending = feats
        return self.predict(feats)

    def predict(self, features: Tensor) -> Tensor:
        """Confidence logits [B, gamma] float32 from `draft_features` [B, gamma, 3] (nothing kept for observe)."""
        want = (self.gamma, len(FEATURES))
        if check_tensor("features", features).dim() != 3 or tuple(features.shape[1:]) != want:
            raise ValueError(f"features must be [B, {want[0]}, {want[1]}] (draft_features), "
                             f"got {tuple(features.shape)}")
        theta, f = self.parameters.to(features.device), features.to(torch.float64)
        z = theta[:, 0] + f[..., 0] * theta[:, 1]  # float64 in a fixed order, rounded once: the same bits on
        for j in range(2, theta.shape[1]):         # every device and for every batch a request sits in
            z = z + f[..., j - 1] * theta[:, j]
        return z.to(torch.float32)

    def survival(self, draft_logits: Tensor) -> Tensor:
        """Estimated survival [B, gamma] float32: `calibrated_survival(confidence_logits(draft_logits))`."""
        return _survival(self.confidence_logits(draft_logits), None)

    def observe(self, *, verify_lens: Tensor, correct_lens: Tensor | None = None, labels: Tensor | None = None,
                features: Tensor | None = None) -> None:
        """The accept outcome of the latest `confidence_logits` call (or, replaying recorded steps, of the
        given `features` [B, gamma, 3]): verify_lens [B] (rows verified, root included) and exactly one of
        correct_lens [B] (capped or not) or labels [B, gamma] (0/1 prefix mask)."""
        if features is not None:
            self.predict(features)  # validates the shape
            feats = features
        elif self._pending is None:
            raise RuntimeError("observe() needs a confidence_logits() call first (its features are the inputs)")
        else:
            feats, self._pending = self._pending, None
        b = feats.shape[0]
        if not isinstance(verify_lens, Tensor) or tuple(verify_lens.shape) != (b,):
            raise ValueError(f"verify_lens must be a tensor [B={b}] for the latest confidence_logits call, got "
                             f"{getattr(verify_lens, 'shape', verify_lens)!r}")
        y = censored_labels(verify_lens, self.gamma, correct_lens=correct_lens, labels=labels).double().numpy()
        x = feats.cpu().double().numpy()
        reached = np.isfinite(y) & np.concatenate([np.ones((b, 1), bool), y[:, :-1] == 1], axis=1)
        usable = reached & np.isfinite(x).all(-1)
        for k in range(self.gamma):  # rows in request order: the same order on every rank
            rows = np.flatnonzero(usable[:, k])
            slot = (self.labels_seen[k] + np.arange(rows.size)) % self.window
            self._x[k, slot], self._y[k, slot] = x[rows, k], y[rows, k]
            self.labels_seen[k] += rows.size
        self.steps_observed += 1
        if self.steps_observed % self.refit_every == 0:
            self.refit()

    def refit(self) -> Tensor:
        """Refit every position with >= min_labels labels (others keep the prior); TP-agreed; returns the
        parameters now in use."""
        theta = self.prior.clone()
        for k in range(self.gamma):
            n = min(int(self.labels_seen[k]), self.window)
            if n >= self.min_labels:
                theta[k] = torch.from_numpy(fit_logistic(self._x[k, :n], self._y[k, :n], self.prior[k].numpy(),
                                                         self.prior_strength))
        self.local_parameters = theta
        if self.agreement is not None:
            theta = self.agreement.agree(theta)
        self.parameters = theta
        self.refits += 1
        return theta
