"""The real-model perf scripts at tiny scale: `perf/verify_modes.py` and `perf/sampling_distribution.py` run
end to end with `--model tiny` (the tests' random Llama through the same code path), write the JSON fields
their README sections describe, and the sampling test has power against a wrong distribution."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

PERF = Path(__file__).resolve().parents[2] / "perf"


def _script(name: str) -> ModuleType:
    if str(PERF) not in sys.path:  # as `python perf/<name>.py` does: the script's folder (perf/labelled.py) first
        sys.path.insert(0, str(PERF))
    spec = importlib.util.spec_from_file_location(f"perf_{name}", PERF / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module



@pytest.mark.parametrize("argv, match", [
    (["--repeats", "0"], "argument --repeats: value must be an int >= 1, got 0"),
    (["--warmup", "-1"], "argument --warmup: value must be an int >= 0, got -1"),
    (["--seed", "-1"], "argument --seed: value must be an int >= 0, got -1"),
    (["--repeats", "x"], "argument --repeats: expected an int, got 'x'"),
    (["--tiers", "4,2"], "tiers must be strictly increasing"),
    (["--batches", "0"], "argument --batches: every value must be an int >= 1, got 0 in '0'"),
    (["--device", "nodevice"], "--device 'nodevice' is not usable on this machine"),
    (["--adapter", "nocolon"], "--adapter must be 'model' or 'module:factory'"),
    (["--name", "../up"], "--name is a file stem"),
    (["--out", "/proc/dspark/graphs"], "argument --out: path '/proc/dspark/graphs' cannot be written"),
])
def test_tier_sweep_rejects_bad_options_before_loading_the_target(tmp_path, capsys, monkeypatch, argv, match):
    sweep = _script("tier_sweep")
    monkeypatch.setattr(sweep, "load_target", lambda *a: pytest.fail("the target loaded before the check"))
    out = [] if "--out" in argv else ["--out", str(tmp_path / "graphs")]
    with pytest.raises(SystemExit) as e:
        sweep.main(["--model", "tiny", *out, *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


class _Parsed(Exception):
    """Raised in place of parsing: the script's parser, caught before its main does any work."""


def _parser_of(name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    def capture(self, *a, **k):
        raise _Parsed(self)
    script = _script(name)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    monkeypatch.setattr(sys, "argv", [f"{name}.py"])
    with pytest.raises(_Parsed) as e:
        script.main()
    monkeypatch.undo()
    return e.value.args[0]


@pytest.mark.parametrize("name", sorted(p.stem for p in PERF.glob("*.py") if "argparse" in p.read_text()))
def test_every_numeric_option_of_every_perf_script_is_checked_while_parsing(name: str, monkeypatch, capsys) -> None:
    parser = _parser_of(name, monkeypatch)
    options = [a for a in parser._actions if a.option_strings]
    assert not [a.option_strings for a in options if a.type in (int, float)]  # an unchecked number
    bad = {"number": ("nan", "value must be"), "int list": ("1,-1", "every value must be")}
    checked = [a for a in options if getattr(a.type, "__name__", "").startswith("int >=")
               or getattr(a.type, "__name__", "") in bad]
    assert checked or name in ("ascend_bringup", "plan_call_chain", "demo_profile_check"), \
        "a perf script without a numeric option?"
    for action in checked:
        value, message = bad.get(action.type.__name__, ("-1", "value must be"))
        opt = action.option_strings[-1]
        with pytest.raises(SystemExit) as e:
            parser.parse_args([opt, *[value] * (action.nargs if isinstance(action.nargs, int) else 1)])
        assert e.value.code == 2 and f"argument {opt}: {message}" in capsys.readouterr().err, opt
    for action in (a for a in options if a.dest in ("out", "png", "capability") and a.type is not None):
        with pytest.raises(SystemExit):
            parser.parse_args([action.option_strings[-1], "/proc/dspark/x.json"])
        assert "cannot be written" in capsys.readouterr().err

@pytest.fixture
def one_thread():
    """The scripts time one intra-op thread; restore the suite's thread count afterwards."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_verify_lens_draws_have_the_asked_sum_and_bounds() -> None:
    vm = _script("verify_modes")
    gen = torch.Generator().manual_seed(0)
    for b, w, mean in ((1, 7, 2.0), (16, 7, 3.0), (5, 4, 1.0), (3, 7, 7.0), (16, 7, 2.4)):
        vl = vm.draw_verify_lens(b, w, mean, gen)
        assert vl.dtype == torch.int32 and vl.shape == (b,)
        assert int(vl.min()) >= 1 and int(vl.max()) <= w
        assert int(vl.sum()) == min(max(round(mean * b), b), b * w)
    with pytest.raises(ValueError, match="mean verify length must be in"):
        vm.draw_verify_lens(4, 7, 7.5, gen)


def test_verify_modes_tiny_run_writes_its_fields(tmp_path: Path, one_thread: None) -> None:
    vm = _script("verify_modes")
    out = tmp_path / "vm.json"
    summary = vm.main(["--model", "tiny", "--batch-sizes", "1,4", "--mean-lens", "2.5", "--repeats", "2",
                       "--prompt-len", "12", "--tiers", "8,16,32", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))
    assert set(summary["results"]) == {"1", "4"}
    for b, r in summary["results"].items():
        full = [s for s in r["sets"] if s["full"]]
        assert len(r["sets"]) == 2 and len(full) == 1 and full[0]["rows_ratio"] == 1.0
        for s in r["sets"]:
            assert set(s["ms"]) == {"static", "cap-accept", "compact"}
            assert all(len(v) == 2 for v in s["ms"].values())
            assert s["rows"] == sum(s["verify_lens"]) and s["rows_ratio"] == s["rows"] / (int(b) * 7)
            assert s["forward_rows"]["static"] >= int(b) * 7 and s["forward_rows"]["compact"] >= s["rows"]
            assert max(s["max_abs_diff"].values()) <= summary["logit_atol"]
            assert s["time_ratio"] == s["median_ms"]["compact"] / s["median_ms"]["static"]
            assert s["meets"] == (s["time_ratio"] <= 1.15 * s["rows_ratio"])
    c = summary["criterion"]
    assert c["batch"] == 4 and c["sets"] == 1 and isinstance(c["meets_all"], bool)
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0


def test_distribution_test_accepts_the_truth_and_rejects_a_shift() -> None:
    sd = _script("sampling_distribution")
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.linspace(0, 4, 50, dtype=torch.float64), 0)
    shifted = torch.softmax(torch.linspace(0, 4.8, 50, dtype=torch.float64), 0)  # TV 0.062 from probs
    same = torch.multinomial(probs, 2000, replacement=True, generator=gen)
    other = torch.multinomial(shifted, 2000, replacement=True, generator=gen)
    ok, bad = sd.distribution_test(same, probs, 400, gen), sd.distribution_test(other, probs, 400, gen)
    assert ok["n"] == 2000 and ok["tv"]["p_value"] > 0.01 and ok["chi2"]["p_value"] > 0.01
    assert bad["tv"]["p_value"] < 0.01 and bad["chi2"]["p_value"] < 0.01
    direct = 0.5 * (torch.bincount(same, minlength=50) / 2000 - probs).abs().sum()
    assert ok["tv"]["observed"] == pytest.approx(float(direct))


def test_sampling_distribution_tiny_run_is_lossless(tmp_path: Path, one_thread: None) -> None:
    sd = _script("sampling_distribution")
    out = tmp_path / "sd.json"
    summary = sd.main(["--model", "tiny", "--samples", "384", "--chunk", "192", "--ks", "1,4", "--prompt-len", "8",
                       "--candidates", "16", "--bootstrap", "200", "--out", str(out)])
    assert json.loads(out.read_text())["lossless"] is True
    assert summary["lossless"] and summary["plain_control_passes"]
    assert [r["policy"] for r in summary["runs"]] == ["plain", "fixed-1", "fixed-4"]
    assert summary["num_tests"] == 18 and summary["bootstrap"] >= 4 / summary["p_value_threshold"]
    for r in summary["runs"]:
        assert set(r["tests"]) == {"position 1", "position 2", "joint 1-2"}
        assert r["tests"]["position 1"]["n"] == 384
        if r["policy"] != "plain":  # both accept paths ran: some first drafts accepted, some rejected
            assert 0.05 < r["first_draft_accept_rate"] < 0.95


def test_labelled_runs_are_merged_under_their_labels(tmp_path: Path) -> None:
    labelled = _script("labelled")
    out = tmp_path / "sub" / "runs.json"
    labelled.save_labelled(out, "before", {"x": 1})
    data = labelled.save_labelled(out, "after", {"x": 2})
    assert data == json.loads(out.read_text()) == {"before": {"x": 1}, "after": {"x": 2}}
    assert labelled.save_labelled(out, "before", {"x": 3})["before"] == {"x": 3}  # a label run again replaces its entry
    assert sorted(p.name for p in out.parent.iterdir()) == ["runs.json"]  # no temporary file left


def test_policy_overhead_charges_each_hook_to_the_step_it_ran_in() -> None:
    """A step's record opens at its `speculate`; every hook until the next one adds its clock time to it."""
    from dspark.serve.policies import Policy

    po = _script("policy_overhead")
    now = [0.0]
    cost = {"speculate": 1.0, "confidence": 2.0, "plan": 4.0, "admit": 8.0, "observe": 16.0, "observe_seconds": 32.0}

    class Ticking(Policy):
        pass
    for name, seconds in cost.items():
        setattr(Ticking, name, lambda self, *a, _s=seconds, **k: now.__setitem__(0, now[0] + _s))
    policy = Ticking()
    clock = po.HookClock(policy, clock=lambda: now[0])
    policy.admit(None)  # before the first step: not counted
    for name in ("speculate", "confidence", "plan", "observe", "observe_seconds", "admit", "speculate", "plan"):
        getattr(policy, name)()
    assert clock.steps == [1 + 2 + 4 + 16 + 32 + 8, 1 + 4]
    assert clock.by_hook == {"speculate": 2.0, "confidence": 2.0, "plan": 8.0, "admit": 8.0, "observe": 16.0,
                             "observe_seconds": 32.0}


def test_policy_overhead_evicts_before_the_hooks_a_forward_precedes_outside_their_time() -> None:
    """`--evict-mb`: the eviction runs before each speculate / plan / observe and is charged to no hook."""
    from dspark.serve.policies import Policy

    po = _script("policy_overhead")
    now, evicted = [0.0], []

    class Ticking(Policy):
        pass
    for name in po.HOOKS:
        setattr(Ticking, name, lambda self, *a, _n=name, **k: now.__setitem__(0, now[0] + 1.0))
    policy = Ticking()

    def evict() -> None:
        evicted.append(len(clock.steps))
        now[0] += 100.0  # a slow read: none of it may land in a step
    clock = po.HookClock(policy, clock=lambda: now[0], evict=evict)
    for name in ("speculate", "confidence", "plan", "observe", "observe_seconds", "speculate", "plan"):
        getattr(policy, name)()
    assert clock.steps == [5.0, 2.0] and evicted == [0, 1, 1, 1, 2]  # before speculate, plan, observe only
    assert po.evictor(0) is None and po.evictor(1)() == 2**20 // 8  # a read of the whole buffer


def test_policy_overhead_counts_the_layouts_built_inside_a_hook_only(monkeypatch) -> None:
    from dspark.serve.policies import Policy
    from dspark.verify.layout import RaggedVerifyLayout

    po = _script("policy_overhead")
    now = [0.0]
    monkeypatch.setattr(RaggedVerifyLayout, "_from_lens", classmethod(lambda cls: now.__setitem__(0, now[0] + 100)))
    built_here = RaggedVerifyLayout.__dict__["_from_lens"]

    class Planning(Policy):
        def speculate(self, *a):
            now[0] += 1

        def plan(self, *a):
            RaggedVerifyLayout._from_lens()  # the planner's layout, inside the hook
            now[0] += 4

    policy = Planning()
    clock = po.HookClock(policy, clock=lambda: now[0])
    with po.layout_timer(clock):
        RaggedVerifyLayout._from_lens()  # before the first step: not counted
        policy.speculate()
        policy.plan()
        RaggedVerifyLayout._from_lens()  # outside every hook (a fixed k's verify phase): not counted
    assert clock.layout == 100 and clock.steps == [1 + 100 + 4]
    assert RaggedVerifyLayout.__dict__["_from_lens"] is built_here  # restored


def test_policy_lab_refuses_a_batch_size_past_a_cost_models_requests(tmp_path: Path) -> None:
    """A serving cost of 16 requests (a demo's own): --batch-sizes 64 is refused before any replay, naming the
    value, the cost and its limit; its variants run at the batch sizes it prices."""
    import dataclasses

    from dspark.cost.serving import load_serving_cost

    lab = _script("policy_lab")
    small = dataclasses.replace(load_serving_cost("cpu-measured"), name="small", max_requests=16)
    path = small.save(tmp_path / "small.json")
    with pytest.raises(SystemExit, match="--batch-sizes 64: serving cost 'small' prices at most 16 requests"):
        lab.main(["--costs", str(path), "--batch-sizes", "1,64", "--out", str(tmp_path / "lab")])
    assert not (tmp_path / "lab").exists()
    assert lab.batches_priced(lab.VARIANT_BATCHES, small) == [1, 4, 16]
    assert lab.batches_priced((1, 64, 256), load_serving_cost("cpu-measured")) == [1, 64, 256]


def test_policy_lab_refuses_every_cost_the_trace_cannot_price_before_any_replay(tmp_path: Path) -> None:
    """A table profiled with another draft, listed after a good one: refused before the first study, naming the
    draft, with nothing written; an empty entry or a demo's folder, named."""
    import dataclasses

    from dspark.cost.serving import load_serving_cost

    lab = _script("policy_lab")
    cpu = load_serving_cost("cpu-measured")
    other = dataclasses.replace(cpu, name="other", parameters={**cpu.parameters, "draft_sha256": "f" * 64})
    path = other.save(tmp_path / "other.json")
    out = tmp_path / "lab"
    with pytest.raises(SystemExit, match=f"--costs: cost 'other' was profiled with the draft of sha256 {'f' * 64}"):
        lab.main(["--costs", f"cpu-measured,{path}", "--batch-sizes", "1", "--out", str(out)])
    with pytest.raises(SystemExit, match="--costs: name_or_path must name a serving cost or a .json file, got ''"):
        lab.main(["--costs", "cpu-measured,", "--batch-sizes", "1", "--out", str(out)])
    with pytest.raises(SystemExit, match="is a folder, not a .json file"):
        lab.main(["--costs", str(tmp_path), "--batch-sizes", "1", "--out", str(out)])
    assert not out.exists()


def test_policy_overhead_counts_the_planner_steps_that_skip_the_scan() -> None:
    import torch

    from dspark import PlannerSettings, ScheduleConfig, VerifyPlanner
    from dspark.cost.serving import load_serving_cost

    po = _script("policy_overhead")
    original = VerifyPlanner.__dict__["_takes_all"]
    planner = VerifyPlanner(ScheduleConfig(gamma=3), load_serving_cost("h100-llama8b-fitted", width=4).believed(3, 0.0),
                            PlannerSettings(lag=0))
    counts = [0, 0]
    slots, gens = torch.arange(2), torch.zeros(2, dtype=torch.int64)
    with po.shortcut_counter(counts):
        planner.plan(torch.full((2, 3), 6.0), slots, gens)  # confident: every draft, no scan
        planner.plan(torch.tensor([[6.0, 6.0, 6.0], [6.0, -9.0, -9.0]]), slots, gens)  # one unsure draft: the scan
    planner.plan(torch.full((2, 3), 6.0), slots, gens)  # outside the block: not counted
    assert counts == [1, 2]
    assert VerifyPlanner.__dict__["_takes_all"] is original  # restored


def test_demo_profile_check_compares_each_fixed_k_with_what_the_planners_believed(tmp_path: Path, capsys) -> None:
    """Only full-batch steps without a prefill count; the ratio is their median over the believed step time."""
    from dspark.cost.serving import load_serving_cost
    from dspark.lab.cost_models import COST_MODELS_DIR

    check = _script("demo_profile_check")
    demo = tmp_path / "demo_out"
    demo.mkdir()
    (demo / "serving_cost.json").write_text((COST_MODELS_DIR / "cpu-measured.json").read_text())
    cost = load_serving_cost(demo / "serving_cost.json")

    def step(b: int, seconds: float, committed: int, prefill: float = 0.0) -> dict:
        return {"verify_lens": [2] * b, "t_prefill": prefill, "committed": committed, "t_draft": 0.25 * seconds,
                "t_plan": 0.0, "t_verify": 0.5 * seconds, "t_accept": 0.25 * seconds}
    steps = {"fixed-1@4": [[step(4, 0.3, 7), step(4, 0.1, 5), step(4, 9.0, 6, prefill=0.2)], [step(4, 0.2, 6)]],
             "fixed-1@2": [[{**step(2, 9.0, 1), "verify_lens": [2]}, step(2, 0.05, 3)]],  # one request left: out
             "adaptive@4": [[step(4, 5.0, 9)]]}
    (demo / "demo.json").write_text(json.dumps({"steps": steps}))
    out = tmp_path / "check.json"
    assert check.main(["--demo", str(demo), "--out", str(out)]) == 0
    rows = {(r["B"], r["policy"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(2, "fixed-1"), (4, "fixed-1")}  # fixed-k only
    believed = float(cost.believed(1, 0.0).step_seconds(4, 8))
    r = rows[(4, "fixed-1")]
    assert r["steps"] == 3 and r["live_ms"] == pytest.approx(200.0)
    assert r["believed_ms"] == pytest.approx(believed * 1e3)
    assert r["ratio"] == pytest.approx(0.2 / believed) and r["live_tok_s"] == pytest.approx(6.0 / 0.2)
    assert rows[(2, "fixed-1")]["steps"] == 1 and "fixed-1" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="demo.json is missing"):
        check.main(["--demo", str(tmp_path / "nowhere"), "--out", str(out)])


def test_per_request_rules_price_a_plain_step_at_its_marginal_seconds() -> None:
    """At B = 1 a step sent plain saves T_spec - T_plain and loses its accepted drafts; the gain is exact per-step
    accounting, a threshold that sends nothing plain gains nothing, and the best threshold is found."""
    from dspark.cost.serving import StepWork, load_serving_cost

    rules = _script("per_request_rules")
    cost = load_serving_cost("h100-llama8b-fitted", width=4)
    be = rules.break_even(cost, 1, 3, 100.0, 1.5)
    spec, plain = cost.price(StepWork(1, 4, 100, drafts=3, drafting=1)), cost.price(StepWork(1, 1, 100))
    assert be["spec_seconds"] == spec and be["marginal_seconds"] == pytest.approx(spec - plain, rel=1e-12)
    assert be["a_star"] == pytest.approx((spec - plain) * 2.5 / spec, rel=1e-12)
    accepted = np.array([0.0, 0.0, 3.0, 3.0, 1.0])
    none = np.zeros(5, dtype=bool)
    assert rules.rule_gain(accepted, none, be, 1) == pytest.approx(1.0, rel=1e-12)
    zeros = accepted == 0  # two steps plain: no token lost (1 + 0 either way), 2 x (spec - plain) saved
    expect = (12 / (5 * spec - 2 * (spec - plain))) / (12 / (5 * spec))
    assert rules.rule_gain(accepted, zeros, be, 1) == pytest.approx(expect, rel=1e-12) and expect > 1
    assert rules.rule_gain(accepted, accepted == 3, be, 1) < 1  # plain where 3 drafts would land loses
    gain, steps = rules.best_threshold(accepted, accepted, be, 1)
    assert (gain, steps) == (pytest.approx(expect, rel=1e-12), 2)
    assert rules.best_threshold(accepted, -accepted, be, 1) == (1.0, 0)  # a score that ranks the wrong way: no rule


def test_per_request_rules_read_the_shipped_trace(tmp_path: Path) -> None:
    rules = _script("per_request_rules")
    out = tmp_path / "rules.json"
    data = rules.main(["--batch-sizes", "1", "--out", str(out)])["current"]
    assert json.loads(json.dumps(data)) == json.loads(out.read_text())["current"]
    assert set(data["buckets"]) == {"prev accepted", "prev survival", "root margin", "prev 0 x root margin"}
    for rows in data["buckets"].values():
        assert sum(r["steps"] for r in rows) == data["steps"] > 10_000
        assert all(0 <= r["mean_accepted"] <= 3 and 0 <= r["p_zero"] <= 1 for r in rows)
    assert len(data["verdicts"]) == 4
    for v in data["verdicts"].values():  # the oracle is told each outcome: no rule on a predictor beats it
        assert v["per_step_oracle"][0] >= max(r[0] for r in v["rules"].values()) >= 1.0
    assert len(data["early_exit"]) == 4
    for e in data["early_exit"].values():
        assert e["depth_oracle"] >= e["early_exit"] >= 1.0 and 1 <= e["mean_depth"] <= 3


def test_per_request_rules_early_exit_against_the_best_fixed_depth() -> None:
    """Two steps at gamma 2, depth d priced seconds[d - 1]: fixed depth 1 makes 3 tokens in 2 s, depth 2 4 in 3 s;
    stopping the first step (survival 0.1) after draft 1 makes 4 in 2.5 s, as the depth oracle does."""
    rules = _script("per_request_rules")
    accepted, seconds = np.array([0, 2]), np.array([1.0, 1.5])
    e = rules.early_exit(accepted, np.array([[0.1, 0.05], [0.9, 0.8]]), seconds)
    assert e["fixed_depth"] == 1 and e["fixed_rates"] == pytest.approx([1.5, 4 / 3])
    assert e["early_exit"] == pytest.approx(1.6 / 1.5) and e["threshold"] == 0.1 and e["mean_depth"] == 1.5
    assert e["depth_oracle"] == pytest.approx(1.6 / 1.5)
    never = rules.early_exit(accepted, np.array([[0.9, 0.8], [0.1, 0.05]]), seconds)  # survival ranks the wrong way
    assert never["early_exit"] == 1.0 and never["threshold"] is None


def test_per_request_rules_walk_each_request_and_read_its_root_from_the_traces_own_layout() -> None:
    """A trace recorded at gamma 4 walked at gamma 2: each step's previous step is its own request's, and the root
    margin is read at continuation position t - 1 of that request (N_i + 4 entries per request)."""
    from dspark.plan.survival import calibrated_survival
    from tests.lab.test_replay_lab import synthetic_trace

    rules = _script("per_request_rules")
    trace, gamma, temps = synthetic_trace(6, seed=3, gamma=4), 2, [1.5, 0.5]
    steps = rules.path_steps(trace, gamma, temps)
    h = rules.history(trace, steps, gamma)
    expect = {"accepted": [], "prev_accepted": [], "prev_survival": [], "root_margin": []}
    cont = 0
    for i in range(trace.num_requests):
        start, n = int(trace.position_offsets[i]), int(trace.new_tokens[i])
        t, prev = 0, None
        while t < n:
            a = min(int(trace.accepted[start + t]), gamma)
            if prev is not None:
                s = calibrated_survival(trace.confidence_logits[prev[0]: prev[0] + 1, :gamma], temps)[0]
                expect["accepted"].append(a)
                expect["prev_accepted"].append(prev[1])
                expect["prev_survival"].append(float(s[min(prev[1], gamma - 1)]))
                expect["root_margin"].append(float(trace.target_margin[cont + t - 1]))
            prev, t = (start + t, a), t + a + 1
        cont += n + trace.gamma
    assert len(expect["accepted"]) > 10
    for key, values in expect.items():
        assert h[key].tolist() == pytest.approx(values, rel=1e-6), key
