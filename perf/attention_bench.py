"""Verify-attention benchmark: dspark's paged ragged kernel vs torch SDPA per request, FlexAttention, torch varlen.

Every request verifies W rows against a committed prefix of P tokens (kv length P + W, causal inside the
verify block) in a paged cache (`--page-size`), filled on the device. On a GPU each method is timed by
replaying a CUDA graph of `--repeats` calls (events around the replay; per-call events where a method cannot
be captured) and the achieved bandwidth is (K + V bytes read + q + out bytes) / time, as a share of the
device's HBM bandwidth (`HBM_PEAK`, by device name; `--peak-gbps` overrides). Baselines:
  sdpa-per-request  torch scaled_dot_product_attention, one call per request on dense K/V (gathered in advance)
  flex              flex_attention on dense [B, Hkv, P+W, D] K/V with a causal-offset block mask, compiled once
                    per W with dynamic shapes (static per shape where the dynamic compile fails)
  varlen            torch.nn.attention.varlen.varlen_attn on packed dense K/V (when the installed torch has it)
  flashinfer        BatchPrefillWithPagedKVCacheWrapper (only when flashinfer is installed)
The JSON is rewritten after every row, so a run cut by a time limit keeps the rows it finished. On the CPU
every method runs uncompiled at small shapes: a functional smoke run, not a performance claim.

    python perf/attention_bench.py --device cuda
    python perf/attention_bench.py --device cuda --shapes 1,2,32768 64,4,32768 --out bench.json
    python perf/attention_bench.py --device cpu
    python perf/attention_bench.py --cpu-step   # CPU verify-step host cost: plan / write_kv / run, 1 thread
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark import RaggedVerifyAttention, RaggedVerifyLayout  # noqa: E402
from dspark.kernels import dispatch  # noqa: E402
from dspark.util.fileio import atomic_write_text  # noqa: E402
from dspark.util.options import POSITIVE_REAL, at_least, output_path  # noqa: E402
from dspark.verify.accept import accept_greedy  # noqa: E402
from dspark.verify.attention import AttentionShape  # noqa: E402
from dspark.verify.inputs import PagedKV, VerifyExecution, build_verify_inputs  # noqa: E402
from dspark.verify.kv_write import write_kv  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PACKED_OUTPUT = {"dspark", "flashinfer", "varlen"}  # [B*W, Hq, D]; the others return [B, Hq, W, D]
# peak HBM bandwidth in bytes/s by device-name fragment (vendor datasheets; the longest matching fragment wins)
HBM_PEAK = {"H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "GH200": 4.0e12, "H200": 4.8e12,
            "B200": 8.0e12, "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12,
            "L40S": 0.864e12}


def hbm_peak(device_name: str) -> tuple[str, float] | None:
    """(matched fragment, peak HBM bytes/s) of a device name (`torch.cuda.get_device_name`), or None."""
    hits = [k for k in HBM_PEAK if k.lower() in device_name.lower()]
    return (max(hits, key=len), HBM_PEAK[max(hits, key=len)]) if hits else None


def graph_timed(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of fn() captured `repeats` times into one CUDA graph and replayed (median of 3
    replays, events around each): no host launch overhead in the number."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    samples = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / repeats)
    return statistics.median(samples)


def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() over repeats (per-call CUDA events on a GPU, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def make_problem(b: int, w: int, prefix: int, hq: int, hkv: int, d: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> dict:
    """Uniform verify step: b requests, w rows each, prefix committed tokens, pages shuffled; the caches and
    queries drawn on `device` (a 32k-context cache of 64 requests is over 2^31 values: no host copy)."""
    seed = b * 1_000_003 + w * 101 + prefix
    gen = torch.Generator(device="cpu").manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    kv_len = prefix + w
    pages_per = math.ceil(kv_len / page_size)
    num_pages = b * pages_per
    table = torch.randperm(num_pages, generator=gen).to(torch.int32).reshape(b, pages_per)
    k_cache, v_cache = (torch.randn(num_pages, page_size, hkv, d, generator=dev_gen, device=device, dtype=dtype)
                        for _ in range(2))
    q = torch.randn(b * w, hq, d, generator=dev_gen, device=device, dtype=dtype)
    layout = RaggedVerifyLayout.from_verify_lens([w] * b, width=w)
    return dict(b=b, w=w, prefix=prefix, kv_len=kv_len, table=table, k_cache=k_cache, v_cache=v_cache, q=q,
                layout=layout, hq=hq, hkv=hkv, d=d, page_size=page_size, dtype=dtype, device=device)


def dense_kv(p: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Hkv, P+W, D] K and V gathered out of the pages (baselines get this layout for free)."""
    pos = torch.arange(p["kv_len"])
    pages = p["table"].long()[:, pos // p["page_size"]].to(p["device"])
    offs = (pos % p["page_size"]).to(p["device"])
    return tuple(c[pages, offs].transpose(1, 2).contiguous() for c in (p["k_cache"], p["v_cache"]))


def verify_mask(p: dict) -> torch.Tensor:
    """[W, P+W] bool: verify row j sees kv positions < prefix + j + 1."""
    j = torch.arange(p["w"], device=p["device"])[:, None]
    return torch.arange(p["kv_len"], device=p["device"])[None, :] < p["prefix"] + j + 1


def run_dspark(p: dict, splits: int | None = None) -> Callable[[], torch.Tensor]:
    """dspark's ragged verify attention; `splits`: kv chunks forced per slot (None: the plan's own choice)."""
    attn = RaggedVerifyAttention(AttentionShape(p["b"] * p["w"], p["b"], p["table"].shape[1], p["hq"], p["hkv"],
                                                p["d"], p["page_size"], max_verify_len=p["w"], num_kv_splits=splits),
                                 p["device"], p["dtype"])
    attn.plan(p["layout"], [p["prefix"]] * p["b"], p["table"])
    out = torch.empty_like(p["q"])
    return lambda: attn.run(p["q"], p["k_cache"], p["v_cache"], out=out)


def run_sdpa(p: dict) -> Callable[[], torch.Tensor]:
    k, v = dense_kv(p)
    mask = verify_mask(p)
    q = p["q"].reshape(p["b"], p["w"], p["hq"], p["d"]).transpose(1, 2)
    out = torch.empty_like(q)
    gqa = p["hq"] != p["hkv"]

    def fn() -> torch.Tensor:
        for r in range(p["b"]):
            out[r] = torch.nn.functional.scaled_dot_product_attention(
                q[r:r + 1], k[r:r + 1], v[r:r + 1], attn_mask=mask, enable_gqa=gqa)[0]
        return out
    return fn


_FLEX: dict[tuple, Callable] = {}  # one compiled flex_attention per shape class (W, dynamic), reused across rows


def run_flex(p: dict) -> Callable[[], torch.Tensor]:
    """flex_attention with a causal-offset block mask; on a GPU compiled once per W with dynamic shapes (B and
    the context vary without a recompile), retried static for a shape the dynamic compile fails on; eager on
    the CPU."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    k, v = dense_kv(p)
    q = p["q"].reshape(p["b"], p["w"], p["hq"], p["d"]).transpose(1, 2).contiguous()
    prefix = torch.tensor(p["prefix"], device=p["device"])  # a tensor: a new context is no new constant to guard

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= prefix + q_idx

    block_mask = create_block_mask(mask_mod, None, None, p["w"], p["kv_len"], device=p["device"])
    gqa = p["hq"] != p["hkv"]
    if p["device"].type != "cuda":
        return lambda: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    for dynamic in (True, False):
        flex = _FLEX.setdefault((p["w"], dynamic), torch.compile(flex_attention, dynamic=dynamic))
        try:
            flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
            p["flex_dynamic"] = dynamic
            return lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
        except Exception as exc:  # the dynamic compile's failure is kept for the row, the static one raises
            p["flex_dynamic_error"] = f"{type(exc).__name__}: {exc}"[:200]
            if not dynamic:
                raise
    raise AssertionError("unreachable")


def run_varlen(p: dict) -> Callable[[], torch.Tensor]:
    """torch.nn.attention.varlen.varlen_attn over packed dense K/V [B*(P+W), Hkv, D], causal aligned to the end
    of each request's keys (the verify rows are its last W positions); its arguments follow the installed
    torch's signature."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    k, v = (t.transpose(1, 2).reshape(-1, p["hkv"], p["d"]).contiguous() for t in dense_kv(p))
    dev, b = p["device"], p["b"]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=dev) * p["w"]
    cu_k = torch.arange(b + 1, dtype=torch.int32, device=dev) * p["kv_len"]
    params = inspect.signature(varlen_attn).parameters
    kw: dict = {"enable_gqa": True} if "enable_gqa" in params and p["hq"] != p["hkv"] else {}
    if "is_causal" in params:
        kw["is_causal"] = True
    elif "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        raise RuntimeError(f"varlen_attn{inspect.signature(varlen_attn)} has no causal option")
    return lambda: varlen_attn(p["q"], k, v, cu_q, cu_k, p["w"], p["kv_len"], **kw)


def run_flashinfer(p: dict) -> Callable[[], torch.Tensor]:
    import flashinfer

    dev = p["device"]
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    pages_per = p["table"].shape[1]
    qo_indptr = torch.arange(p["b"] + 1, dtype=torch.int32, device=dev) * p["w"]
    kv_indptr = torch.arange(p["b"] + 1, dtype=torch.int32, device=dev) * pages_per
    last = p["kv_len"] - (pages_per - 1) * p["page_size"]
    last_page_len = torch.full((p["b"],), last, dtype=torch.int32, device=dev)
    wrapper.plan(qo_indptr, kv_indptr, p["table"].reshape(-1).to(dev), last_page_len, p["hq"], p["hkv"], p["d"],
                 p["page_size"], causal=True, q_data_type=p["dtype"])
    return lambda: wrapper.run(p["q"], (p["k_cache"], p["v_cache"]))


def bytes_moved(p: dict) -> int:
    elt = torch.tensor([], dtype=p["dtype"]).element_size()
    kv = 2 * p["b"] * p["kv_len"] * p["hkv"] * p["d"] * elt
    return kv + 2 * p["q"].numel() * elt


STEP_CALLS = ("build_verify_inputs", "accept_greedy", "plan", "write_kv", "run")


def cpu_step(args: argparse.Namespace) -> None:
    """Per-call CPU cost of an engine-like verify step (1 thread, fp32), medians of each call in STEP_CALLS
    (accept_greedy on [B * W, 256] packed logits; run = one layer's attention)."""
    torch.set_num_threads(1)
    batches, widths, prefixes = args.batch or [4, 64], args.width or [7], args.prefix or [100]
    hq, hkv, d, ps, span = args.q_heads, args.kv_heads, args.head_dim, args.page_size, args.table_pages
    print(f"CPU verify step: 1 thread, float32, Hq={hq} Hkv={hkv} D={d} page={ps} block-table span={span} pages")
    print(f"{'B':>4} {'W':>3} {'prefix':>6} " + " ".join(f"{k + ' us':>{len(k) + 3}}" for k in STEP_CALLS))
    rows = []
    for b in batches:
        for w in widths:
            for prefix in prefixes:
                p = make_problem(b, w, prefix, hq, hkv, d, ps, torch.float32, torch.device("cpu"))
                table = torch.cat([p["table"], p["table"][:, :1].expand(b, span - p["table"].shape[1])], 1)
                attn = RaggedVerifyAttention(AttentionShape(b * w, b, span, hq, hkv, d, ps,
                                                            num_pages=p["k_cache"].shape[0]), "cpu", torch.float32)
                prefix_lens = torch.full((b,), prefix, dtype=torch.int32)
                new_k = torch.randn(b * w, hkv, d)
                drafts = torch.randint(0, 256, (b, w - 1))
                lens = torch.full((b,), w, dtype=torch.int32)
                logits = torch.randn(b * w, 256)
                static, kv = VerifyExecution("static"), PagedKV(table, ps)  # a run's settings: built once
                times = dict(
                    build_verify_inputs=timed(lambda: build_verify_inputs(static, lens, drafts[:, 0], drafts,
                                                                          prefix_lens, kv=kv),
                                              p["device"], args.repeats),
                    accept_greedy=timed(lambda: accept_greedy(drafts, logits, lens, p["layout"]), p["device"],
                                        args.repeats),
                    plan=timed(lambda: attn.plan(p["layout"], prefix_lens, table), p["device"], args.repeats),
                    write_kv=timed(lambda: write_kv(new_k, new_k, p["k_cache"], p["v_cache"], attn.kv_slots),
                                   p["device"], args.repeats),
                    run=timed(lambda: attn.run(p["q"], p["k_cache"], p["v_cache"]), p["device"], args.repeats),
                )
                rows.append(dict(batch=b, width=w, prefix=prefix, seconds=times))
                print(f"{b:>4} {w:>3} {prefix:>6} " + " ".join(f"{v * 1e6:>{len(k) + 3}.1f}" for k, v in times.items()))
    result = dict(device="cpu", threads=1, dtype="float32", q_heads=hq, kv_heads=hkv, head_dim=d, page_size=ps,
                  table_pages=span, repeats=args.repeats, torch=torch.__version__, command=" ".join(sys.argv),
                  rows=rows)
    print(f"wrote {atomic_write_text(args.out or RESULTS / 'attention_cpu_step.json', json.dumps(result, indent=2))}")


def shape_list(text: str) -> tuple[int, int, int]:
    """`B,W,P` -> (B, W, P), each >= 1 (P >= 0)."""
    try:
        b, w, prefix = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is B,W,P (three integers), got {text!r}") from None
    if b < 1 or w < 1 or prefix < 0:
        raise argparse.ArgumentTypeError(f"a shape needs B >= 1, W >= 1, P >= 0, got {text!r}")
    return b, w, prefix


def bench_row(p: dict, methods: dict, repeats: int, gpu: bool) -> tuple[dict, dict, dict]:
    """(seconds, max |diff| vs dspark or the error, timing method) of every method on one problem."""
    times, errors, how = {}, {}, {}
    ref = None
    for name, make in methods.items():
        try:
            fn = make(p)
            got = fn()
            got = got.reshape(p["b"], p["w"], p["hq"], p["d"]) if name in PACKED_OUTPUT else \
                got.reshape(p["b"], p["hq"], p["w"], p["d"]).transpose(1, 2)
            ref = got if ref is None else ref
            errors[name] = float((got.float() - ref.float()).abs().max())
            how[name] = "cuda-graph" if gpu else "perf_counter"
            try:
                times[name] = graph_timed(fn, repeats) if gpu else timed(fn, p["device"], repeats)
            except Exception as exc:  # not capturable (host syncs inside): per-call events instead
                torch.cuda.synchronize()
                how[name] = f"events ({type(exc).__name__}: {exc})"[:160]
                times[name] = timed(fn, p["device"], repeats)
        except Exception as exc:  # a baseline that cannot run this shape is reported, not fatal
            times[name], errors[name] = None, f"{type(exc).__name__}: {exc}"[:200]
        if gpu:
            torch.cuda.empty_cache()
    if "flex_dynamic" in p or "flex_dynamic_error" in p:
        how["flex_compile"] = {"dynamic": p.get("flex_dynamic"), "dynamic_error": p.get("flex_dynamic_error")}
    return times, errors, how


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=at_least(1), nargs="+", default=None)
    ap.add_argument("--width", type=at_least(1), nargs="+", default=None, help="verify rows per request (W)")
    ap.add_argument("--prefix", type=at_least(0), nargs="+", default=None)
    ap.add_argument("--shapes", type=shape_list, nargs="+", default=None,
                    help="explicit B,W,P shapes, run in the order given (instead of --batch x --width x --prefix)")
    ap.add_argument("--q-heads", type=at_least(1), default=32)
    ap.add_argument("--kv-heads", type=at_least(1), default=8)
    ap.add_argument("--head-dim", type=at_least(1), default=128)
    ap.add_argument("--page-size", type=at_least(1), default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--repeats", type=at_least(1), default=20)
    ap.add_argument("--kv-splits", type=at_least(1), nargs="*", default=[],
                    help="also time dspark with this many kv chunks forced per slot (one column each)")
    ap.add_argument("--max-kv-tokens", type=at_least(1), default=4_000_000, help="skip shapes with more cached tokens")
    ap.add_argument("--peak-gbps", type=POSITIVE_REAL, default=None,
                    help="peak HBM bandwidth in GB/s (default: HBM_PEAK by the device's name)")
    ap.add_argument("--out", type=output_path(), default=None, help="JSON path (default perf/results/attention_bench.json, "
                                                 "or attention_cpu_step.json with --cpu-step)")
    ap.add_argument("--cpu-step", action="store_true",
                    help="time plan / write_kv / run of an engine-like CPU verify step (defaults: B 4 64, W 7, "
                         "prefix 100; use --q-heads 4 --kv-heads 4 --head-dim 32 for the engine's tiny model)")
    ap.add_argument("--table-pages", type=at_least(1), default=32, help="--cpu-step: block-table columns per request")
    args = ap.parse_args(argv)
    if args.cpu_step:
        cpu_step(args)
        return
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    shapes = args.shapes or [(b, w, prefix) for b in args.batch or ([1, 8, 32, 128, 256] if gpu else [1, 4])
                             for w in args.width or ([2, 4, 8, 16] if gpu else [2, 8])
                             for prefix in args.prefix or ([512, 4096, 32768] if gpu else [512, 2048])]
    methods: dict[str, Callable[[dict], Callable[[], torch.Tensor]]] = {
        "dspark": run_dspark, **{f"dspark-splits{n}": functools.partial(run_dspark, splits=n) for n in args.kv_splits},
        "sdpa-per-request": run_sdpa, "flex": run_flex}
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        methods["varlen"] = run_varlen
    except ImportError:
        print(f"torch {torch.__version__} has no torch.nn.attention.varlen: skipped")
    try:
        import flashinfer  # noqa: F401
        methods["flashinfer"] = run_flashinfer
    except ImportError:
        print("flashinfer not installed: skipped")
    device_name = torch.cuda.get_device_name(device) if gpu else "cpu"
    peak = hbm_peak(device_name) if gpu else None
    peak_bps = args.peak_gbps * 1e9 if args.peak_gbps else peak[1] if peak else None
    if not gpu:
        print("CPU run: every method uncompiled at small shapes; a functional smoke run, and these numbers say "
              "nothing about a GPU.")
    print(f"device={device} ({device_name}, peak HBM {peak_bps / 1e9 if peak_bps else 'unknown'} GB/s) "
          f"backend={'triton' if dispatch.use_triton(torch.empty(0, device=device)) else 'torch'} "
          f"dtype={args.dtype} Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} page={args.page_size}")
    print(f"{'B':>4} {'W':>3} {'prefix':>6} " + " ".join(f"{m + ' us':>22}" for m in methods) +
          f" {'dspark GB/s':>11} {'%peak':>6} {'vs best':>7}")
    result = dict(
        device=str(device), device_name=device_name, gpu_timed=gpu,
        note=None if gpu else "CPU: every method uncompiled, functional smoke run",
        timing="CUDA-graph replay of `repeats` calls (per-call events where capture fails)" if gpu else "perf_counter",
        torch=torch.__version__, dtype=args.dtype, q_heads=args.q_heads, kv_heads=args.kv_heads,
        head_dim=args.head_dim, page_size=args.page_size, repeats=args.repeats, methods=list(methods),
        peak_bytes_per_s=peak_bps, peak_source="--peak-gbps" if args.peak_gbps else peak[0] if peak else None,
        command=" ".join(sys.argv), rows=[])
    out = args.out or RESULTS / "attention_bench.json"
    for b, w, prefix in shapes:
        if b * (prefix + w) > args.max_kv_tokens:
            print(f"B={b} W={w} P={prefix}: over --max-kv-tokens {args.max_kv_tokens}, skipped")
            continue
        p = make_problem(b, w, prefix, args.q_heads, args.kv_heads, args.head_dim, args.page_size, dtype, device)
        times, errors, how = bench_row(p, methods, args.repeats, gpu)
        t = times["dspark"]
        gbps = bytes_moved(p) / t / 1e9 if t else None
        timed_ok = {k: v for k, v in times.items() if v}
        best = min((k for k in timed_ok if not k.startswith("dspark")), key=timed_ok.get, default=None)
        row = dict(batch=b, width=w, prefix=prefix, cache_elements=p["k_cache"].numel(), seconds=times,
                   max_abs_diff_vs_dspark=errors, timing=how, bytes=bytes_moved(p), dspark_gbps=gbps,
                   dspark_pct_peak=100 * gbps * 1e9 / peak_bps if gbps and peak_bps else None,
                   best_baseline=best, dspark_vs_best=t / timed_ok[best] if t and best else None)
        result["rows"].append(row)
        atomic_write_text(out, json.dumps(result, indent=2))  # every finished row survives a time limit
        cells = " ".join(f"{v * 1e6:>22.1f}" if v else f"{'n/a':>22}" for v in times.values())
        pct = f"{row['dspark_pct_peak']:>6.1f}" if row["dspark_pct_peak"] else f"{'-':>6}"
        ratio = f"{row['dspark_vs_best']:>7.2f}" if row["dspark_vs_best"] else f"{'-':>7}"
        print(f"{b:>4} {w:>3} {prefix:>6} {cells} {gbps or 0:>11.1f} {pct} {ratio}", flush=True)
        del p
    print(f"wrote {atomic_write_text(out, json.dumps(result, indent=2))}")


if __name__ == "__main__":
    main()
