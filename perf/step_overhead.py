"""The decode step's Python overhead on the CPU: a speculative step's time minus the time inside its model forwards.

A 30-layer Llama (SmolLM2-135M's layer count) with hidden size 64 keeps the arithmetic small, so the step is
mostly dspark's own host work: validation, layout, planning, accept and commit, and the per-layer attention
dispatch. Per B: the adaptive policy (VerifyPlanner, lag 0, compact, always speculating) and fixed-gamma run
the same continuous-batching queue; printed are the medians over speculative steps of the step time, the
time inside the target's and draft's forwards (wrapped), and their difference. Runs on any checkout of
dspark (put it on PYTHONPATH), so two commits can be compared side by side:

    PYTHONPATH=. python perf/step_overhead.py [--batch-sizes 1,16,64] [--label after] [--out perf/results/step_overhead.json]
    git worktree add /tmp/before <rev> && PYTHONPATH=/tmp/before python perf/step_overhead.py --label before
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import time
from pathlib import Path

import torch
from labelled import save_labelled  # perf/labelled.py: a script's own folder is first on sys.path
from transformers import AutoModelForCausalLM, LlamaConfig

import dspark
from dspark.config import ScheduleConfig
from dspark.cost import AdditiveCostModel, BatchTerm, RowTerm
from dspark.models.draft import DraftConfig, DraftModel
from dspark.models.transformers_lm import TransformersCausalLM
from dspark.plan.planner import PlannerSettings, VerifyPlanner
from dspark.serve.config import EngineConfig
from dspark.serve.engine import SpecDecoder
from dspark.serve.policies import Adaptive, FixedK
from dspark.util.options import at_least, int_list, output_path

VOCAB, GAMMA, LAYERS = 256, 3, 30


def models() -> tuple[TransformersCausalLM, DraftModel]:
    """A random 30-layer, hidden-64 Llama target and a random block draft over it (seeded)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=True,
                      attn_implementation="sdpa")
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    dcfg = DraftConfig(hidden_size=64, vocab_size=VOCAB, draft_vocab_size=VOCAB, num_q_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=64, chain_size=64, gamma=GAMMA, markov_rank=4, max_seq_len=512)
    emb = hf.get_input_embeddings().weight.detach()
    return TransformersCausalLM(hf), DraftModel(dcfg, emb, emb, torch.arange(VOCAB)).eval()


class Timed:
    """Wraps a module's forward and sums the wall seconds spent in it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds, self._inner = 0.0, module.forward
        module.forward = self

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def measure(decoder: SpecDecoder, policy, b: int, new_tokens: int, timers: list[Timed]) -> dict:
    """Median step / forward / overhead milliseconds over the speculative steps of one queue of 2B requests."""
    prompts = torch.randint(3, VOCAB, (2 * b, 16), generator=torch.Generator().manual_seed(b))
    steps, forwards = [], []
    batch_kw = "max_batch" if "max_batch" in inspect.signature(decoder.start).parameters else "slots"  # before 2026-12
    run = decoder.start(prompts, new_tokens, policy, mode="compact", **{batch_kw: b})
    while True:
        before = sum(t.seconds for t in timers)
        try:
            step = next(run)
        except StopIteration:
            break
        if step.confidence_logits.shape[-1] and step.requests.numel() == b:
            t = step.times
            steps.append((t.draft + t.plan + t.verify + t.accept) * 1e3)
            forwards.append((sum(x.seconds for x in timers) - before) * 1e3)
    over = [s - f for s, f in zip(steps, forwards)]
    return {"steps": len(steps), "step_ms": statistics.median(steps), "forward_ms": statistics.median(forwards),
            "overhead_ms": statistics.median(over)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int_list(1), default=(1, 16, 64))
    ap.add_argument("--new-tokens", type=at_least(2), default=24)
    ap.add_argument("--label", default="current")
    ap.add_argument("--out", type=output_path(), default="perf/results/step_overhead.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target, draft = models()
    timers = [Timed(target), Timed(draft)]
    decoder = SpecDecoder(target, draft, config=EngineConfig(cache_tokens=2 * max(args.batch_sizes) * 128))
    cost = AdditiveCostModel(2e-3, BatchTerm([1, 256], [0.0, 2e-3]), RowTerm([0, 2048], [0.0, 1e-3]), width=GAMMA + 1)
    rows = {}
    with torch.no_grad():
        for b in args.batch_sizes:
            planner = VerifyPlanner(ScheduleConfig(gamma=GAMMA), cost, PlannerSettings(lag=0, num_slots=b))
            for name, policy in (("adaptive", lambda: Adaptive(planner)), (f"fixed-{GAMMA}", lambda: FixedK(GAMMA))):
                measure(decoder, policy(), b, 4, timers)  # warm-up
                rows[f"{name}@{b}"] = measure(decoder, policy(), b, args.new_tokens, timers)
    print(f"{args.label} (dspark at {Path(dspark.__file__).parent}): median ms per speculative step")
    print(f"{'policy@B':>14} {'steps':>6} {'step':>9} {'forwards':>9} {'overhead':>9}")
    for key, r in rows.items():
        print(f"{key:>14} {r['steps']:>6} {r['step_ms']:>9.2f} {r['forward_ms']:>9.2f} {r['overhead_ms']:>9.2f}")
    return save_labelled(args.out, args.label, {"dspark": str(Path(dspark.__file__).parent), "layers": LAYERS,
                                                "gamma": GAMMA, "rows": rows})


if __name__ == "__main__":
    main()
