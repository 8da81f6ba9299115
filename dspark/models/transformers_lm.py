"""Run an unmodified transformers causal LM over dspark's paged KV cache.

The model code stays transformers': dspark registers one attention function in transformers' own
registry (`AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)`) and selects it with
`model.set_attn_implementation(ATTN_IMPLEMENTATION)`. Embeddings, RoPE, the GQA projections, the MLP and
the final norm run as written; each attention layer hands its post-RoPE query [1, Hq, S, D] and key /
value [1, Hkv, S, D] to `paged_attention`, which calls the step's `attend(layer, q, k, v)` (an extra
forward keyword argument, which transformers passes through to the attention function): `write_kv` into
the paged cache (padding rows write nothing), then `RaggedVerifyAttention` over the packed rows.

One forward packs the rows of several requests (prefill, draft or ragged verify, tier padding included);
positions come from the layout as `position_ids`, and `use_cache=False` keeps transformers' own cache
out. The mask registry has no entry for this name, so transformers builds no mask: causality and
request boundaries are the layout's, enforced by the ragged attention.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Protocol

from dspark.models.extra import require

require("transformers")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from dspark.models.geometry import ModelGeometry  # noqa: E402

ATTN_IMPLEMENTATION = "dspark_paged"
# Llama-shaped decoders (RoPE, GQA, plain causal softmax attention scaled by `module.scaling`)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class Attend(Protocol):
    """The attention of one forward: `(layer, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D]`.

    `sm_scale` is the softmax scale it applies; every layer checks it against the model's own scaling.
    """

    sm_scale: float

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


def paged_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                    *, scaling: float | None = None, attend: Attend | None = None, **_: object
                    ) -> tuple[Tensor, None]:
    """transformers attention function: one layer's packed rows through `attend`; returns [1, S, Hq, D]."""
    if attend is None:
        raise RuntimeError(f"the {ATTN_IMPLEMENTATION!r} attention needs the step's attend= (run the model "
                           f"through TransformersCausalLM.forward, or set_attn_implementation('sdpa') for "
                           f"plain transformers forwards)")
    if scaling is None or not math.isclose(scaling, attend.sm_scale, rel_tol=1e-6):
        raise ValueError(f"layer {module.layer_idx} scales attention by {scaling}, but attend applies "
                         f"sm_scale={attend.sm_scale}; build RaggedVerifyAttention with "
                         f"sm_scale=geometry.sm_scale")
    out = _attend_layer(attend, module, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
    return out.unsqueeze(0), None


@torch.compiler.disable
def _attend_layer(attend: Attend, module: nn.Module, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`attend(module.layer_idx, q, k, v)`, the layer index read outside torch.compile: a compiled forward that
    read it would guard on its value, one recompile per layer (every layer runs the same code)."""
    return attend(module.layer_idx, q, k, v)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


CPU_MM_MAX_ROWS = 8  # rows up to which `logits` on a CPU multiplies W @ h^T (faster there, slower from 12)


class TransformersCausalLM(nn.Module):
    """A transformers causal LM as a dspark target: `forward(tokens, positions, attend) -> hidden`, `logits`.

    Wrapping selects dspark's attention on the model (so its own `generate` no longer runs on it) and
    puts it in eval mode; the weights and the model code are untouched.
    """

    def __init__(self, hf_model: PreTrainedModel):
        super().__init__()
        if not isinstance(hf_model, PreTrainedModel):
            raise TypeError(f"hf_model must be a transformers PreTrainedModel, got {type(hf_model).__name__}")
        check_supported(hf_model.config)
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
        if hf_model.config._attn_implementation != ATTN_IMPLEMENTATION:
            raise ValueError(f"{type(hf_model).__name__} does not route attention through transformers' "
                             f"AttentionInterface, so dspark cannot run it")
        self.hf_model = hf_model.eval()
        self.geometry = _geometry(hf_model)
        # the class the engine builds this model's attention with (RaggedVerifyAttention's arguments); None:
        # dspark's default. `dspark.ascend.use_npu_attention(model)` selects the NPU backend
        self.attention_backend: Callable[..., Any] | None = None

    @classmethod
    def from_config(cls, config: PretrainedConfig, *, dtype: torch.dtype = torch.float32) -> "TransformersCausalLM":
        """A randomly initialised model of `config` (tests, demos) through the same path as a pretrained one."""
        check_supported(config)  # before any weights are built
        return cls(AutoModelForCausalLM.from_config(config, dtype=dtype))

    @contextlib.contextmanager
    def own_attention(self, implementation: str = "sdpa") -> Iterator[PreTrainedModel]:
        """The wrapped transformers model with its own attention for the duration: its `generate` and dense
        forwards over whole sequences (references, training streams); dspark's attention is selected again
        on exit."""
        self.hf_model.set_attn_implementation(implementation)
        try:
            yield self.hf_model
        finally:
            self.hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)

    @torch.no_grad()
    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """Final-normed hidden states [N, d] of packed rows `tokens [N]` at absolute `positions [N]` (int64).

        Shapes, dtypes and devices are checked here; values are not (no device sync): positions come
        from the step's `RaggedVerifyLayout` and must stay below `geometry.max_seq_len`.
        """
        device = self.hf_model.device
        for name, t in (("tokens", tokens), ("positions", positions)):
            if not isinstance(t, Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.numel() == 0:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
                raise TypeError(f"{name} must be a non-empty 1-D int64 tensor, got {got}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device}, the model on {device}")
        if positions.shape != tokens.shape:
            raise ValueError(f"positions {list(positions.shape)} must match tokens {list(tokens.shape)}")
        if not callable(attend) or not isinstance(getattr(attend, "sm_scale", None), float):
            raise TypeError(f"attend must be callable (layer, q, k, v) -> out with a float sm_scale, "
                            f"got {type(attend).__name__}")
        out = self.hf_model.base_model(input_ids=tokens[None], position_ids=positions[None], use_cache=False,
                                       attend=attend)
        return out.last_hidden_state[0]

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """[N, d] -> [N, V] through the model's own LM head (on a CPU, for N <= `CPU_MM_MAX_ROWS`, its weight as
        one [V, d] x [d, N] product: docs/architecture.md, "The LM head on a CPU")."""
        head = self.hf_model.get_output_embeddings()
        if not isinstance(hidden, Tensor) or hidden.dim() != 2 or hidden.shape[1] != self.geometry.hidden_size:
            got = list(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
            raise ValueError(f"hidden must be [N, {self.geometry.hidden_size}], got {got}")
        if hidden.dtype != head.weight.dtype:
            raise TypeError(f"hidden has dtype {hidden.dtype}, the LM head {head.weight.dtype}")
        if hidden.device.type == "cpu" and type(head) is nn.Linear and hidden.shape[0] <= CPU_MM_MAX_ROWS:
            out = torch.mm(head.weight, hidden.t()).t()
            return (out if head.bias is None else out + head.bias).contiguous()
        return head(hidden)


def check_supported(config: PretrainedConfig) -> None:
    """ValueError naming the model type / layer type when dspark cannot run this config's attention."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; dspark runs Llama-family causal LMs "
                         f"with RoPE: {', '.join(SUPPORTED_MODEL_TYPES)}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"{model_type} config has layer_types {sorted(layer_types)}; dspark's paged attention "
                         f"runs full causal attention only (no sliding window)")


def _geometry(hf_model: PreTrainedModel) -> ModelGeometry:
    cfg = hf_model.config
    scales = {float(layer.self_attn.scaling) for layer in hf_model.base_model.layers}
    if len(scales) != 1:
        raise ValueError(f"layers of {cfg.model_type} use different attention scalings {sorted(scales)}")
    return ModelGeometry(
        num_layers=cfg.num_hidden_layers, num_q_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, max_seq_len=cfg.max_position_embeddings,
        sm_scale=scales.pop())
