"""Every kernel launcher compiles one Triton variant whatever the data's sizes.

Triton keys a compiled kernel on its constexprs and, for each int argument not marked `do_not_specialize`,
on whether it equals 1 and whether it is divisible by 16. A launcher that passes a row / request / item count
as a specialised int, or a block size that follows the data, compiles new variants mid-run (hundreds of ms
each on a GPU). The interpreter compiles nothing, so these tests record every launch and compute the key the
GPU JIT would (`create_function_from_signature` with triton's own `native_specialize_impl`), then assert one
key per kernel over many sizes (1, multiples of 16, odd counts).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from dspark import AttentionShape, RaggedVerifyAttention, RaggedVerifyLayout
from dspark.kernels import accept as A
from dspark.kernels import kv_write as KV
from dspark.kernels import layout as L
from dspark.kernels import ragged_attention as RA
from dspark.kernels import topk as T

SIZES = (1, 2, 3, 15, 16, 17, 32, 33, 48)


def _key(kernel, args, kwargs) -> tuple:
    """The JIT's specialisation key of one launch (what selects / triggers a compiled variant)."""
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    bind = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    _, spec, options = bind(*args, **kwargs)
    return tuple(spec), tuple(sorted(options.items()))


@contextlib.contextmanager
def recording(*kernels):
    """{kernel name: set of specialisation keys} of the launches inside the block."""
    keys = defaultdict(set)
    with pytest.MonkeyPatch.context() as mp:
        for kernel in kernels:
            def run(*args, grid, warmup, _kernel=kernel, _run=kernel.run, **kwargs):
                keys[_kernel.fn.__name__].add(_key(_kernel, args, kwargs))
                return _run(*args, grid=grid, warmup=warmup, **kwargs)
            mp.setattr(kernel, "run", run)
        yield keys


def _one_variant(keys, *names):
    for name in names:
        assert len(keys[name]) == 1, f"{name} compiles {len(keys[name])} variants over sizes {SIZES}"


def test_topk_one_variant_for_every_batch(device, triton_backend):
    gen = torch.Generator().manual_seed(0)
    with recording(T._threshold_kernel, T._lens_kernel) as keys:
        for b in SIZES:
            s = torch.rand(b, 6, generator=gen).sort(1, descending=True).values.to(device)
            for budget in (1, b, 2 * b + 1):
                got = T.verify_lens_triton(s, budget, 2, 7, 1e-6)
                assert torch.equal(got.cpu(), T.verify_lens_ref(s, budget, 2, 7, 1e-6).cpu())
    _one_variant(keys, "_threshold_kernel", "_lens_kernel")


def test_accept_one_variant_for_every_batch(device, triton_backend):
    gen = torch.Generator().manual_seed(1)
    gamma, vocab = 4, 37
    with recording(A._row_argmax_kernel, A._sampling_kernel) as keys:
        for b in SIZES:
            draft = torch.randint(0, vocab, (b, gamma), generator=gen).to(device)
            vl = torch.randint(1, gamma + 2, (b,), generator=gen, dtype=torch.int32).to(device)
            logits = torch.randn(b, gamma + 1, vocab, generator=gen).to(device)
            out = (torch.empty(b, dtype=torch.int32, device=device), torch.empty(b, dtype=torch.int64, device=device))
            got = A.greedy_triton(draft, logits, vl, None, *out)
            ref = A.greedy_ref(draft, logits, vl, None)
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            q = torch.softmax(torch.randn(b, gamma, vocab, generator=gen), -1).to(device)
            u = torch.rand(b, gamma + 1, generator=gen).to(device)
            A.sampling_triton(draft, q, logits.softmax(-1), vl, None, u, *out)
    _one_variant(keys, "_row_argmax_kernel", "_sampling_kernel")


def test_layout_and_kv_write_one_variant_for_every_size(device, triton_backend):
    gen = torch.Generator().manual_seed(2)
    kernels = (L._qo_indptr_kernel, L._row_maps_kernel, L._pack_kernel, L._scatter_kernel, KV._write_kv_kernel)
    with recording(*kernels) as keys:
        for b in SIZES:
            lens = torch.randint(1, 5, (b,), generator=gen, dtype=torch.int32).to(device)
            layout = RaggedVerifyLayout.from_verify_lens(lens, width=4)
            strided = torch.randn(b, 4, 8, generator=gen).to(device)
            packed = layout.pack(strided)
            assert torch.equal(packed, L.pack_ref(strided, layout.row_slot, layout.row_within, layout.total_rows, 0))
            assert torch.equal(layout.scatter(packed, width=4),
                               L.scatter_ref(packed, layout.qo_indptr, 4, layout.total_rows, 0))
            rows = layout.total_rows
            k = torch.randn(rows, 2, 16, generator=gen).to(device)
            cache = torch.zeros(rows, 1, 2, 16, device=device)
            KV.write_kv_triton(k, k, cache, cache.clone(), torch.arange(rows, device=device))
            assert torch.equal(cache[:, 0], k)
    _one_variant(keys, *(k.fn.__name__ for k in kernels))


def test_attention_one_variant_for_every_tier_and_batch(device, triton_backend, monkeypatch):
    """One instance planned for batches of 1..6 requests padded to tiers of 1..48 rows: the attention and
    merge kernels keep one key each (the split count is read on the device), and every plan matches the
    float64 reference."""
    monkeypatch.setattr(RA, "sm_count", lambda _device: 4)  # splits from live slots, as on a small GPU
    gen = torch.Generator().manual_seed(3)
    hq, hkv, d, page_size, width = 4, 2, 16, 4, 8
    max_rows, max_slots, pages = 48, 12, 128
    attn = RaggedVerifyAttention(AttentionShape(max_rows, max_slots, pages, hq, hkv, d, page_size,
                                                max_verify_len=width, num_pages=64), device, torch.float32)
    kc = torch.randn(64, page_size, hkv, d, generator=gen).to(device)
    vc = torch.randn(64, page_size, hkv, d, generator=gen).to(device)
    counts = set()
    with recording(RA._ragged_attention_kernel, RA._merge_splits_kernel) as keys:
        for tier in SIZES:
            b = min(max(1, tier // 8), 6)
            lens = torch.full((b,), 1, dtype=torch.int32)
            lens[: (tier - b) // (width - 1)] = width
            layout = RaggedVerifyLayout.from_verify_lens(lens.to(device), tiers=[tier], graph_slots=max_slots,
                                                         width=width)
            prefix = torch.randint(300, 480, (b,), generator=gen)
            table = torch.randint(0, 64, (b, pages), generator=gen, dtype=torch.int32).to(device)
            attn.plan(layout, prefix, table)
            counts.add(int(attn.meta.chunks[0]))
            q = torch.randn(tier, hq, d, generator=gen).to(device)
            out = attn.run(q, kc, vc)
            ref, _ = RA.ragged_attention_ref(q, kc, vc, attn.meta, attn.sm_scale)
            total = layout.total_rows
            torch.testing.assert_close(out[:total].double(), ref[:total], rtol=1e-5, atol=1e-5)
    _one_variant(keys, "_ragged_attention_kernel", "_merge_splits_kernel")
    assert len(counts) > 1, f"the kv chunks must follow the live slots, got {counts}"
