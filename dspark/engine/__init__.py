"""A minimal reference speculative-decoding engine that exercises dspark end to end.

- `model`: tiny byte-level target (`TinyLM`) and block draft (`DraftLM`, per-position heads + ConfidenceHead);
  one forward for prefill, draft and ragged verify over a paged KV cache.
- `train`: training on the standard library's own source, weights cached atomically.
- `kv_cache`: paged K/V buffers and the page allocator.
- `step_attention`: per-forward `dspark.RaggedVerifyAttention` plan + KV writes.
- `policies`: fixed-k, adaptive (`dspark.VerifyPlanner`), oracle.
- `decode`: the decode loop (draft -> plan -> verify inputs -> verify forward -> accept -> commit).
- `profile`, `sts`, `records`, `plots`, `demo`: the pieces of `dspark demo`.
"""
