"""Drafters: what proposes the k tokens a step verifies (`base.Drafter`); the block draft, n-gram lookup and a
small causal LM."""
