"""Every public callable of `dspark` refuses bad input at its boundary: TypeError / ValueError naming the
argument and the value, never an AttributeError (or worse, silent acceptance) deep inside."""
from __future__ import annotations

import inspect
import json

import pytest
import torch

import dspark
from dspark import (
    AdditiveCostModel,
    BatchTerm,
    Calibration,
    ConfidenceHead,
    PlannerSettings,
    ProfileSample,
    RaggedVerifyAttention,
    RaggedVerifyLayout,
    RowTerm,
    ScheduleConfig,
    StepsPerSecondTable,
    StsRecorder,
    SurvivalLagRing,
    TieredCostModel,
    TierGraphRunner,
    TierManifest,
    TierTerm,
    TpAgreement,
    VerifyPlanner,
)
from dspark.verify.attention import AttentionShape

CFG = ScheduleConfig(gamma=2)
S = torch.tensor([[0.9, 0.5], [0.6, 0.2]])
VL = torch.tensor([2, 3], dtype=torch.int32)
DRAFT = torch.tensor([[1, 2], [3, 4]])
LOGITS = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
PROBS = torch.softmax(LOGITS, -1)
COST = StepsPerSecondTable([1, 2, 4, 6], [100.0, 90.0, 80.0, 70.0])
GENS = torch.tensor([0, 0])


def planner() -> VerifyPlanner:
    return VerifyPlanner(CFG, COST, PlannerSettings(lag=1, num_slots=4))


def layout() -> RaggedVerifyLayout:
    return RaggedVerifyLayout.from_verify_lens(VL, width=3)


# (public name, the call, exception type, a regex the message must match: the argument and the value)
CASES = [
    ("draft_features", lambda: dspark.draft_features([[1.0]]), TypeError,
     r"draft_logits must be a torch.Tensor, got list: \[\[1.0\]\]"),
    ("OnlineAcceptanceEstimator", lambda: dspark.OnlineAcceptanceEstimator(0), ValueError,
     r"gamma must be an int >= 1, got 0"),
    ("OnlineAcceptanceEstimator", lambda: dspark.OnlineAcceptanceEstimator(2).confidence_logits(torch.ones(3, 4, 8)),
     ValueError, r"draft_logits must be \[B, gamma=2, V\], got \(3, 4, 8\)"),
    ("calibrated_survival", lambda: dspark.calibrated_survival([[0.1, 0.2]]), TypeError,
     r"logits must be a torch.Tensor, got list: \[\[0.1, 0.2\]\]"),
    ("calibrated_survival", lambda: dspark.calibrated_survival(S, temperatures="ab"), TypeError,
     r"temperatures must be a .*, got str: 'ab'"),
    ("monotone_survival", lambda: dspark.monotone_survival([[0.1]]), TypeError, r"survival must be a torch.Tensor, got list"),
    ("choose_budget", lambda: dspark.choose_budget([[0.5, 0.5]], COST, CFG), TypeError, r"survival must be a torch.Tensor"),
    ("choose_budget", lambda: dspark.choose_budget(S, COST, {"gamma": 2}), TypeError,
     r"cfg must be a ScheduleConfig, got dict: \{'gamma': 2\}"),
    ("greedy_budget", lambda: dspark.greedy_budget(S, None, CFG), TypeError, r"cost_model must be a CostModel, got NoneType"),
    ("tau_curve", lambda: dspark.tau_curve([[0.5, 0.5]], CFG), TypeError, r"survival must be a torch.Tensor"),
    ("expected_commit", lambda: dspark.expected_commit(S, [2, 3], CFG), TypeError, r"verify_lens must be a tensor, got list"),
    ("allocate_verify_lens", lambda: dspark.allocate_verify_lens(S, "1", CFG), TypeError, r"budget must be an int, got '1'"),
    ("RaggedVerifyLayout", lambda: RaggedVerifyLayout.from_verify_lens("12"), TypeError, r"verify_lens must hold ints, got '1'"),
    ("RaggedVerifyLayout", lambda: layout().pack([[1.0]]), TypeError, r"strided must be a torch.Tensor, got list"),
    ("RaggedVerifyLayout", lambda: layout().scatter([[1.0]]), TypeError, r"packed must be a torch.Tensor, got list"),
    ("RaggedVerifyLayout", lambda: layout().scatter(torch.zeros(5, 1), width="3"), ValueError, r"width must be an int >= 1, got '3'"),
    ("accept_greedy", lambda: dspark.accept_greedy(DRAFT, LOGITS.tolist(), VL), TypeError,
     r"target_logits must be a torch.Tensor, got list"),
    ("accept_greedy", lambda: dspark.accept_greedy(DRAFT, LOGITS.reshape(-1, 5), VL, layout=[0, 2, 5]), TypeError,
     r"layout must be a RaggedVerifyLayout or None, got list: \[0, 2, 5\]"),
    ("accept_sampling", lambda: dspark.accept_sampling(DRAFT, PROBS[:, :2], PROBS, VL, generator=3), TypeError,
     r"generator must be a Generator or None, got int: 3"),
    ("accept_sampling", lambda: dspark.accept_sampling(DRAFT, PROBS[:, :2].tolist(), PROBS, VL), TypeError,
     r"draft_probs must be a torch.Tensor, got list"),
    ("VerifyPlanner", lambda: VerifyPlanner({"gamma": 2}, COST), TypeError, r"cfg must be a ScheduleConfig, got dict"),
    ("VerifyPlanner", lambda: VerifyPlanner(CFG, COST, {"lag": 1}), TypeError,
     r"settings must be a PlannerSettings, got dict: \{'lag': 1\}"),
    ("PlannerSettings", lambda: PlannerSettings(lag=0, sync_free=True), ValueError,
     r"sync_free=True needs lag >= 1 \(a lagged ring row to read\), got lag=0"),
    ("VerifyPlanner", lambda: planner().plan(torch.zeros(2, 2), [0, 1], GENS), TypeError,
     r"slots must be a torch.Tensor, got list: \[0, 1\]"),
    ("VerifyPlanner", lambda: planner().plan(torch.zeros(2, 2), torch.tensor([0, 1]), [0, 0]), TypeError,
     r"generations must be a torch.Tensor, got list"),
    ("VerifyPlanner", lambda: planner().plan(torch.zeros(2, 2), torch.tensor([3, 3]), GENS), ValueError,
     r"slots must be distinct within a step, got slot 3 at positions 0 and 1"),
    ("SurvivalLagRing", lambda: SurvivalLagRing(4, 2).write(torch.tensor([1, 2, 1]), torch.zeros(3, dtype=torch.long),
                                                              torch.ones(3, 2)), ValueError,
     r"slots must be distinct within a step, got slot 1 at positions 0 and 2"),
    ("SurvivalLagRing", lambda: SurvivalLagRing(4, 2).read([1], [0]), TypeError, r"slots must be a torch.Tensor, got list"),
    ("fit_sts", lambda: dspark.fit_sts({"logits": S}), TypeError, r"data must be a StsData, got dict"),
    ("FitOptions", lambda: dspark.FitOptions(num_bins=0), ValueError, r"num_bins must be an int >= 1, got 0"),
    ("StsOutcome", lambda: dspark.StsOutcome(correct_lens=torch.tensor([1]), policy="beam"), ValueError,
     r"policy must be one of \('greedy', 'sampling'\), got 'beam'"),
    ("fit_temperatures", lambda: dspark.fit_temperatures([[0.1]], [[1.0]]), TypeError, r"logits must be a torch.Tensor, got list"),
    ("load_sts", lambda: dspark.load_sts([3]), TypeError, r"paths\[0\] must be a str or PathLike, got int: 3"),
    ("StsData", lambda: dspark.fit_sts([S]), TypeError, r"data must be a StsData, got list"),
    ("auroc", lambda: dspark.auroc("ab", [1.0]), TypeError, r"scores must be a .*, got str: 'ab'"),
    ("brier", lambda: dspark.brier([0.1], None), TypeError, r"labels must be a .*, got NoneType"),
    ("ece", lambda: dspark.ece({0.1}, [1.0]), TypeError, r"probs must be a .*, got set"),
    ("nll", lambda: dspark.nll([0.1], "1"), TypeError, r"labels must be a .*, got str: '1'"),
    ("top2_margin", lambda: dspark.top2_margin([[0.1, 0.2]]), TypeError, r"draft_logits must be a torch.Tensor, got list"),
    ("soft_accept_target", lambda: dspark.soft_accept_target([[1.0]], LOGITS), TypeError,
     r"draft_logits must be a torch.Tensor, got list"),
    ("previous_tokens", lambda: dspark.previous_tokens([1, 2], DRAFT), TypeError, r"anchor_tokens must be a torch.Tensor"),
    ("confidence_loss", lambda: dspark.confidence_loss(S, S, [[1, 0]], 2.0), TypeError, r"mask must be a torch.Tensor, got list"),
    ("ConfidenceHead", lambda: ConfidenceHead("8"), ValueError, r"hidden_size must be an int >= 1, got '8'"),
    ("ConfidenceHead", lambda: ConfidenceHead(4)([[0.0] * 4]), TypeError, r"hidden must be a torch.Tensor, got list"),
    ("Calibration", lambda: Calibration.load(3), TypeError, r"path must be a str or PathLike, got int: 3"),
    ("build_verify_inputs", lambda: dspark.build_verify_inputs(dspark.VerifyExecution("compact"), VL, [1, 2], DRAFT,
                                                             torch.tensor([0, 0]),
                                                             kv=dspark.PagedKV(torch.zeros(2, 1, dtype=torch.long), 4)),
     TypeError, r"root_tokens must be an integer \[B\] tensor, got \[1, 2\]"),
    ("VerifyExecution", lambda: dspark.VerifyExecution("ragged"), ValueError, r"unknown verify mode 'ragged'"),
    ("PagedKV", lambda: dspark.PagedKV(torch.zeros(2, 1, dtype=torch.long), "4"), ValueError,
     r"page_size must be an int >= 1, got '4'"),
    ("load_cost_model", lambda: dspark.load_cost_model(3), TypeError, r"path must be a str or PathLike, got int: 3"),
    ("check_cost_model", lambda: dspark.check_cost_model({}), TypeError, r"cost_model must be a CostModel, got dict"),
    ("check_cost_table", lambda: dspark.check_cost_table(None, 3), ValueError, r"fingerprint must be a non-empty str, got 3"),
    ("register_cost_model", lambda: dspark.register_cost_model(3), TypeError,
     r"register_cost_model takes a CostModel subclass, got 3"),
    ("StepsPerSecondTable", lambda: StepsPerSecondTable(None, [1.0]), ValueError, r"rows must be a list of ints, got None"),
    ("StepsPerSecondTable", lambda: COST.step_seconds("2", 3), ValueError, r"num_requests must be an int >= 0, got '2'"),
    ("AdditiveCostModel", lambda: AdditiveCostModel(None, BatchTerm([1], [0.0]), RowTerm([0], [1.0])), ValueError,
     r"bias must be a finite number, got None"),
    ("AdditiveCostModel", lambda: AdditiveCostModel.fit([(1, 2, 0.1)]), TypeError,
     r"samples\[0\] must be a ProfileSample, got tuple: \(1, 2, 0.1\)"),
    ("BatchTerm", lambda: BatchTerm([0, 4], [0.0, 1e-3]), ValueError, r"batch_probes\[0\] must be an int >= 1, got 0"),
    ("RowTerm", lambda: RowTerm([0, 8], [0.0]), ValueError, r"theta must have one value per probe \(2\), got 1"),
    ("TierTerm", lambda: TierTerm(64, [1e-3]), ValueError, r"tiers must be a list of ints, got 64"),
    ("TieredCostModel", lambda: TieredCostModel(1e-3, BatchTerm([1], [0.0]), ([64], [1e-3])), TypeError,
     r"tier_term must be a TierTerm, got tuple"),
    ("ProfileSample", lambda: ProfileSample("1", 2, 0.1), ValueError, r"num_requests must be an int >= 1, got '1'"),
    ("ScheduleConfig", lambda: ScheduleConfig(gamma="2"), TypeError, r"gamma must be an int, got '2'"),
    ("TierManifest", lambda: TierManifest(tiers="8", slots=(1,), width=2, platform="cpu", model_id="x"), ValueError,
     r"tiers must be positive ints, got '8'"),
    ("TpAgreement", lambda: TpAgreement(None, 3), ValueError, r"mode must be one of .*, got 3"),
    ("ParallelConfig", lambda: dspark.ParallelConfig(tp_mode=3), ValueError, r"tp_mode must be one of .*, got 3"),
    ("DpTierAgreement", lambda: dspark.DpTierAgreement([0, 1]), TypeError,
     r"cpu_group must be a ProcessGroup or None, got list: \[0, 1\]"),
    ("acceptance", lambda: dspark.acceptance([1]), TypeError, r"records\[0\] must be a StepRecord, got int: 1"),
    ("tau_bias", lambda: dspark.tau_bias([], by=("nosuchfield",)), ValueError, r"by must name StepRecord fields, got 'nosuchfield'"),
    ("write_kv", lambda: dspark.write_kv([1.0], torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1)),
     TypeError, r"k must be a torch.Tensor, got list"),
    ("verify_attention", lambda: dspark.verify_attention([1.0], (torch.zeros(1), torch.zeros(1)), layout(), [0, 0],
                                                         torch.zeros(2, 1, dtype=torch.long)), TypeError,
     r"q must be a torch.Tensor, got list"),
    ("RaggedVerifyAttention", lambda: RaggedVerifyAttention(AttentionShape(8, 4, 2, 2, 2, 8, 4), "cpu",
                                                            torch.float32).plan([2, 3], [0, 0], None),
     TypeError, r"layout must be a RaggedVerifyLayout, got list"),
    ("AttentionShape", lambda: AttentionShape(8, 4, 2, 6, 4, 8, 4), ValueError,
     r"num_q_heads=6 is not a multiple of num_kv_heads=4"),
    ("TierGraphRunner", lambda: TierGraphRunner(lambda b: b, [8], "cpu", row_inputs={}), TypeError,
     r"spec must be a TierSpec, got list: \[8\]"),
    ("TierSpec", lambda: dspark.TierSpec("8", 2, width=3), ValueError, r"tiers must be positive ints, got '8'"),
    ("StsRecorder", lambda: StsRecorder(3, gamma=2), TypeError, r"out_dir must be a str or PathLike, got int: 3"),
    ("generate", lambda: dspark.generate(["a text", ""], target=None, tokenizer=None), ValueError,
     r"prompts\[1\] must be a non-empty str, got ''"),
    ("SpecDecoder", lambda: dspark.SpecDecoder(None, None), TypeError,
     r"target must be a dspark.models.TransformersCausalLM, got NoneType"),
    ("BlockDrafter", lambda: dspark.BlockDrafter("draft"), TypeError, r"draft must be a dspark.models.DraftModel, got str"),
    ("NgramDrafter", lambda: dspark.NgramDrafter(3, 2), ValueError, r"n_min must be <= n_max, got n_min=3 > n_max=2"),
    ("CausalLMDrafter", lambda: dspark.CausalLMDrafter("model"), TypeError,
     r"model must be a dspark.models.TransformersCausalLM or a transformers PreTrainedModel, got str"),
]

# Result records, errors, enums and interfaces: nothing to call with bad input.
NOT_CALLED_WITH_INPUT = {"AcceptResult", "BudgetDecision", "CostModel", "CostTableMismatchError", "DpTier", "FitReport",
                         "GraphBackend", "StepBuffers", "StepRecord", "TpDisagreementError", "VerifyInputs", "VerifyMode",
                         "VerifyPlan", "StsData", "Drafter", "Generation"}


@pytest.mark.parametrize("name, call, error, message", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_refused_at_the_boundary_naming_argument_and_value(name, call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_every_public_callable_has_a_bad_input_case():
    covered = {c[0] for c in CASES}
    public = {n for n in dspark.__all__ if callable(getattr(dspark, n)) and n not in NOT_CALLED_WITH_INPUT}
    assert sorted(public - covered) == []
    assert all(inspect.isclass(getattr(dspark, n)) or callable(getattr(dspark, n)) for n in NOT_CALLED_WITH_INPUT)


def test_a_null_cost_json_field_is_named(tmp_path):
    cost = AdditiveCostModel(1e-3, BatchTerm([1], [0.0]), RowTerm([0, 8], [0.0, 1e-3]), width=8)
    path = cost.save(tmp_path / "c.json")
    for field, needle in (("bias", "bias must be a finite number, got None"),
                          ("row_probes", "row_probes must be a list of ints, got None"),
                          ("theta", "theta must be a list of numbers, got None")):
        obj = json.loads(path.read_text())
        obj[field] = None
        bad = tmp_path / f"{field}.json"
        bad.write_text(json.dumps(obj))
        with pytest.raises(ValueError, match=f"{bad}: {needle}"):
            dspark.load_cost_model(bad)
    obj = json.loads(path.read_text())
    obj["fit"] = {"residuals": [0.0], "rms": None, "r2": 1.0, "num_samples": 1}
    (tmp_path / "fit.json").write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="fit report rms must be a finite number, got None"):
        dspark.load_cost_model(tmp_path / "fit.json")


def test_a_recorder_pointed_at_a_regular_file_names_it(tmp_path):
    target = tmp_path / "not_a_dir"
    target.write_text("x")
    with pytest.raises(ValueError, match=f"out_dir '{target}' exists and is not a directory"):
        StsRecorder(target, gamma=2)
