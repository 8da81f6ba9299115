"""The serving runtime: requests in, committed tokens out, one speculative step at a time.

- `config`: `Sampling` (how tokens are drawn) and the engine's checked arguments.
- `engine`: `SpecDecoder` (a target + a drafter over paged KV caches, serving a queue with one policy);
  `generate`: text in, text out through a tokenizer.
- `scheduler`: `Batch` (per-slot request state) and `Scheduler` (admit, refill, finish).
- `step`: one decode step (draft, plan, verify, accept, commit) and the run loop around it.
- `runner`: the model runner (`LiveTarget`): KV cache, attention plan, tier graphs; prefill / plain / verify.
- `drafters/`: block draft, n-gram, causal LM. `policies/`: fixed-k, oracle, adaptive.

Nothing here imports `dspark.lab`.
"""
