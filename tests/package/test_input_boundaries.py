"""Every command's options are checked before any work: a bad value fails in seconds, names the option and the
value, and leaves nothing on disk (the demo, `dspark calibrate`, the draft trainer, the KV cache's size)."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from pathlib import Path

import pytest

from dspark.cli import main as cli_main
from dspark.lab.demo import run as demo_mod
from dspark.lab.demo.config import DemoConfig, check_config, length_range
from dspark.models import train_draft
from dspark.models.draft import DEFAULT_WEIGHTS, manifest_path
from dspark.models.train_draft import TrainDraftConfig
from dspark.serve.kv_cache import PagedKVCache

INT_MINIMUM = {"prompt_len": 3, "lag": 0, "seed": 0, "gamma": 1}  # the rest of DemoConfig's ints: 1


def _fields(cls: type, kind: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if type(f.default) is kind]


def _cfg(tmp_path: Path, **kw) -> DemoConfig:
    return DemoConfig(**({"out": str(tmp_path / "out")} | kw))


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the model or looking for its package is work: a check that runs after it fails the test."""
    def fail(*a, **k):
        raise AssertionError("the demo started work before rejecting its input")
    monkeypatch.setattr(demo_mod, "load_models", fail)
    monkeypatch.setattr("dspark.models.smollm2_gguf_path", fail)


@pytest.mark.parametrize("name", _fields(DemoConfig, int))
def test_every_int_option_of_the_demo_rejects_values_below_its_minimum(tmp_path: Path, name: str) -> None:
    low = INT_MINIMUM.get(name, 1)
    for bad in (low - 1, -7, True, 2.5):
        with pytest.raises(ValueError, match=rf"^{name}\b.*got {bad!r}"):
            check_config(_cfg(tmp_path, **{name: bad}))
    check_config(_cfg(tmp_path, **{name: max(low, getattr(DemoConfig, name))}))  # the premise: one bad field


@pytest.mark.parametrize("name", _fields(DemoConfig, float))
def test_every_real_option_of_the_demo_rejects_nan_inf_and_out_of_range(tmp_path: Path, name: str) -> None:
    for bad in (math.nan, math.inf, -math.inf, -0.5, True):
        with pytest.raises(ValueError, match=rf"^{name}\b.*got {bad!r}"):
            check_config(_cfg(tmp_path, **{name: bad}))


@pytest.mark.parametrize("name", ["batch_sizes", "policies", "tiers"])
def test_a_string_where_the_demo_wants_a_sequence_is_refused_not_split_into_characters(tmp_path: Path,
                                                                                      name: str) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be a sequence such as .*not the string '1,4'"):
        check_config(_cfg(tmp_path, **{name: "1,4"}))


def test_the_demo_refuses_sequences_longer_than_the_models_allow(tmp_path: Path) -> None:
    top = length_range(12, 0.5)[1]  # 18: the longest request at the defaults
    check_config(_cfg(tmp_path, prompt_len=100 - top - 4), max_seq_len=100)  # exactly fits (gamma 3: width 4)
    for kw in (dict(prompt_len=100 - top - 3), dict(max_new_tokens=10**6)):
        with pytest.raises(ValueError, match=r"exceeds the models' max_seq_len 100: lower --prompt-len"):
            check_config(_cfg(tmp_path, **kw), max_seq_len=100)


def test_the_demo_never_replaces_a_folder_it_did_not_write(tmp_path: Path) -> None:
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="no demo.json from an earlier demo"):
        check_config(_cfg(tmp_path, out=str(mine)))
    assert (mine / "notes.txt").read_text() == "keep"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "demo.json").write_text("{}")
    check_config(_cfg(tmp_path, out=str(tmp_path / "old")))  # an earlier demo's output is replaced
    check_config(_cfg(tmp_path, out=str(tmp_path / "empty")))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        check_config(_cfg(tmp_path, out=str(tmp_path / "file")))


@pytest.mark.parametrize("argv, match", [
    (["--lag", "-1"], "lag must be an int >= 0, got -1"),
    (["--seed", "-1"], "seed must be an int >= 0, got -1"),
    (["--temperature", "inf"], r"temperature .*got inf"),
    (["--max-new-tokens", "100000"], "exceeds the models' max_seq_len"),
    (["--out", "/proc/dspark/out"], "cannot be written"),
])
def test_the_demo_command_rejects_bad_values_before_loading_the_model(no_work, tmp_path: Path, capsys,
                                                                      argv: list[str], match: str) -> None:
    argv = argv if "--out" in argv else argv + ["--out", str(tmp_path / "o")]
    assert cli_main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dspark demo: error: ") and re.search(match, err), err
    assert not any(tmp_path.iterdir())


def test_plan_demo_checks_its_output_folder_first(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    for out, match in (("/proc/dspark/out", "cannot be written"), (str(tmp_path / "file"), "is not a folder")):
        assert cli_main(["plan-demo", "--out", out]) == 2
        assert match in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("option", ["--batch-sizes", "--tiers"])
def test_list_options_name_themselves_when_malformed(option: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["demo", option, "1,x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: expected a comma list of ints" in err and "'x'" in err and "lambda" not in err


def test_a_kv_cache_too_large_for_memory_says_how_large_and_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MemoryError, match=r"KV cache of \d+ tokens \(\d+\.\d GiB for K and V\).*serve fewer"):
        PagedKVCache(num_layers=64, num_heads=64, head_dim=128, num_pages=2**30, page_size=64)

    def broken(*a, **k):
        raise RuntimeError("no kernel image is available")  # not an allocation failure: passed on as it is
    monkeypatch.setattr("dspark.serve.kv_cache.torch.zeros", broken)
    with pytest.raises(RuntimeError, match="no kernel image"):
        PagedKVCache(num_layers=1, num_heads=1, head_dim=8, num_pages=2, page_size=4)


def test_the_demo_and_the_plan_demo_write_to_different_default_folders() -> None:
    from dspark.cli.commands import build_parser

    outs = {cmd: build_parser().parse_args([cmd]).out for cmd in ("demo", "plan-demo")}
    assert outs == {"demo": "demo_out", "plan-demo": "plan_demo_out"}  # the demo replaces its folder whole


@pytest.mark.parametrize("argv, match", [
    (["--bins", "0"], "num_bins must be an int >= 1, got 0"),
    (["--holdout", "1.5"], r"holdout_fraction must be a number in \(0, 1\), got 1.5"),
    (["--holdout", "nan"], "holdout_fraction .*got nan"),
    (["--bootstrap", "-1"], "bootstrap must be an int >= 0, got -1"),
    (["--seed", "-1"], "seed must be an int >= 0, got -1"),
    (["--bounds", "5", "1"], "bounds must be finite with 0 < low < high"),
    (["--plots", "/proc/dspark/plots"], "--plots '/proc/dspark/plots' cannot be written"),
])
def test_calibrate_checks_its_options_before_reading_any_shard(tmp_path: Path, capsys, argv: list[str],
                                                               match: str) -> None:
    missing = tmp_path / "no_such_shards"  # reading it would fail with another message
    assert cli_main(["calibrate", str(missing), "--out", str(tmp_path / "c.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and "no_such_shards" not in err, err
    assert not any(tmp_path.iterdir())


def test_calibrate_plots_need_matplotlib_before_any_shard_is_read(tmp_path: Path, capsys, monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli_main(["calibrate", str(tmp_path / "none"), "--out", str(tmp_path / "c.json"), "--plots",
                     str(tmp_path / "p")]) == 2
    assert "--plots needs matplotlib: pip install 'dspark[plot]'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_tiny_training_run_never_overwrites_the_shipped_draft(tmp_path: Path, capsys) -> None:
    before = (_sha(DEFAULT_WEIGHTS), _sha(manifest_path(DEFAULT_WEIGHTS)))
    for argv in (["--tiny"], ["--tiny", "--out", str(DEFAULT_WEIGHTS)]):
        with pytest.raises(SystemExit):
            train_draft.main(argv)
        assert "--tiny needs --out elsewhere than the shipped draft" in capsys.readouterr().err
    assert (_sha(DEFAULT_WEIGHTS), _sha(manifest_path(DEFAULT_WEIGHTS))) == before


@pytest.mark.parametrize("name", _fields(TrainDraftConfig, int) + _fields(TrainDraftConfig, float))
def test_every_training_option_rejects_out_of_range_values_by_name(name: str) -> None:
    bads = (-1, True) if type(getattr(TrainDraftConfig, name)) is int else (math.nan, math.inf, -1.0)
    for bad in bads:
        with pytest.raises(ValueError, match=rf"^{name}\b.*got {bad!r}"):
            TrainDraftConfig(**{name: bad})


def test_the_trainer_reports_a_bad_option_without_a_traceback(tmp_path: Path, capsys) -> None:
    for argv, match in ((["--lr", "-1"], "lr must be a number in (0, inf), got -1.0"),
                        (["--soft-weight", "2"], "soft_weight must be a number in [0, 1], got 2.0"),
                        (["--out", "/proc/dspark/x.safetensors"], "cannot be written"),
                        (["--device", "meta"], "--device 'meta': this machine has cpu"),
                        (["--device", "nonsense"], "--device 'nonsense': ")):
        with pytest.raises(SystemExit) as e:
            train_draft.main(["--tiny", "--out", str(tmp_path / "d.safetensors"), *argv])
        assert e.value.code == 2 and match in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_option_types_check_while_parsing_and_name_the_option(tmp_path: Path, capsys) -> None:
    import argparse

    from dspark.util.options import POSITIVE_REAL, at_least, int_list, output_path, real

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=at_least(2), default=2)
    ap.add_argument("--t", type=POSITIVE_REAL, default=1.0)
    ap.add_argument("--p", type=real(0.0, 1.0, low_open=True), default=0.5)
    ap.add_argument("--out", type=output_path(), default=str(tmp_path / "a" / "x.json"))
    ap.add_argument("--bs", type=int_list(1), default="1,4")
    args = ap.parse_args(["--n", "3", "--t", "1e-9", "--p", "1"])
    assert (args.n, args.t, args.p, args.out, args.bs) == (3, 1e-9, 1.0, str(tmp_path / "a" / "x.json"), (1, 4))
    assert not any(tmp_path.iterdir())  # checking an output path writes nothing
    for argv, msg in ((["--n", "1"], "argument --n: value must be an int >= 2, got 1"),
                      (["--n", "2.5"], "argument --n: expected an int, got '2.5'"),
                      (["--t", "0"], r"argument --t: value must be a number in (0, inf), got 0.0"),
                      (["--t", "inf"], "argument --t: value must be a number in (0, inf), got inf"),
                      (["--p", "nan"], "argument --p: value must be a number in (0, 1], got nan"),
                      (["--p", "x"], "argument --p: expected a number, got 'x'"),
                      (["--out", "/proc/dspark/x.json"], "argument --out: path '/proc/dspark/x.json' cannot be"),
                      (["--bs", "1,0"], "argument --bs: every value must be an int >= 1, got 0 in '1,0'"),
                      (["--bs", "1,x"], "argument --bs: expected a comma list of ints such as 1,4,16, got 'x'")):
        with pytest.raises(SystemExit):
            ap.parse_args(argv)
        assert msg in capsys.readouterr().err
