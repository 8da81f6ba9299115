"""The reference speculative-decoding engine that drives `dspark.models` end to end.

- `kv_cache`: paged K/V buffers and the page allocator.
- `step_attention`: one model's persistent `dspark.RaggedVerifyAttention` (GQA heads, softmax scale).
- `policies`: fixed-k, adaptive (`dspark.VerifyPlanner`, plus the speculate-or-not decision), oracle.
- `decode`: the decode loop (draft -> plan -> verify inputs -> verify forward -> accept -> commit) over a
  `dspark.models.TransformersCausalLM` target and its `dspark.models.DraftModel`.
- `lockstep`: runs interleaved step by step, least-charged first (fair comparisons on a noisy machine).
- `profile`: speculative step cost T(B, M) and plain step cost T_plain(B) of this machine.
- `sts`, `records`, `report`, `plots`, `demo`: the other pieces of `dspark demo`.
"""
