"""Verify-budget policies: how many drafts to propose and how many rows each request verifies.

- `FixedK(k)` (`fixed`): draft k tokens, verify all of them (k = 0 is plain target-only decoding).
- `Adaptive` (`adaptive`): dspark's VerifyPlanner, plus the speculate-or-not decision.
- `Oracle(gamma)` (`oracle`): verify exactly the rows an untimed full verify accepts (an upper bound).
- `make_policy` (`registry`): a policy by name.
"""
from dspark.serve.policies.adaptive import Adaptive
from dspark.serve.policies.base import Policy, PolicyPlan
from dspark.serve.policies.fixed import FixedK
from dspark.serve.policies.oracle import Oracle
from dspark.serve.policies.registry import ADAPTIVE, make_policy

__all__ = ["ADAPTIVE", "Adaptive", "FixedK", "Oracle", "Policy", "PolicyPlan", "make_policy"]
