"""Verifying a step: ragged layout, verify inputs per mode, attention over the paged KV cache, accept, graph tiers."""
