"""A minimal reference speculative-decoding engine that exercises dspark end to end.

- `model`: tiny byte-level target (`TinyLM`) and block draft (`DraftLM`, per-position heads + ConfidenceHead);
  one forward for prefill, draft and ragged verify over a paged KV cache.
- `train`: training on the standard library's own source, weights cached atomically.
- `kv_cache`: paged K/V buffers and the page allocator.
- `step_attention`: per-forward `dspark.RaggedVerifyAttention` plan + KV writes.
- `policies`: fixed-k, adaptive (`dspark.VerifyPlanner`, plus the speculate-or-not decision), oracle.
- `decode`: the decode loop (draft -> plan -> verify inputs -> verify forward -> accept -> commit).
- `profile`: speculative step cost T(B, M) and plain step cost T_plain(B) of this machine.
- `sts`, `records`, `plots`, `demo`: the other pieces of `dspark demo`.
"""
