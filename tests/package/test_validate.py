"""dspark.util.validate: the shared boundary checks name the offending value."""
import pytest
import torch

from dspark.util.validate import (
    check_directory,
    check_int,
    check_kv_fits,
    check_nonnegative,
    check_output_path,
    check_path,
    check_real,
    check_tensor,
    check_type,
    check_verify_lens,
    first_duplicate,
    int_tensor,
)


def test_check_int():
    assert check_int("n", 3, 1) == 3 and check_int("n", 0) == 0
    for bad in (0, -2, 1.0, True, "1", None):
        with pytest.raises(ValueError, match=f"n must be an int >= 1, got {bad!r}"):
            check_int("n", bad, 1)


def test_check_real_closed_and_open_ends():
    assert check_real("x", 0, 0, 1) == 0.0 and check_real("x", 1, 0, 1) == 1.0 and check_real("x", 0.5, 0, 1,
                                                                                              low_open=True) == 0.5
    for bad, kw, interval in ((0, dict(low_open=True), r"\(0, 1\]"), (1, dict(high_open=True), r"\[0, 1\)"),
                              (float("nan"), {}, r"\[0, 1\]"), (True, {}, r"\[0, 1\]"), ("0.5", {}, r"\[0, 1\]"),
                              (1.5, {}, r"\[0, 1\]"), (-1e-9, {}, r"\[0, 1\]")):
        with pytest.raises(ValueError, match=rf"x must be a number in {interval}, got {bad!r}"):
            check_real("x", bad, 0, 1, **kw)
    with pytest.raises(ValueError, match=r"\(0, inf\), got inf"):
        check_real("x", float("inf"), 0, float("inf"), low_open=True, high_open=True)


def test_check_output_path_probes_without_leaving_anything(tmp_path):
    deep = tmp_path / "a" / "b" / "out.json"
    assert check_output_path("out", deep) == deep and not (tmp_path / "a").exists()
    assert sorted(tmp_path.iterdir()) == []  # the probe folder is gone
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="out '.*f' exists and is not a folder"):
        check_output_path("out", tmp_path / "f", folder=True)
    with pytest.raises(ValueError, match="exists and is not a file"):
        check_output_path("out", tmp_path, folder=False)
    with pytest.raises(ValueError, match=r"cannot be written \('.*f': .*\); choose another path"):
        check_output_path("out", tmp_path / "f" / "under_a_file.json")  # a file is no folder to write in


def test_check_output_path_probes_where_the_run_will_write(tmp_path, monkeypatch):
    import tempfile

    probed = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **k: probed.append(k["dir"]) or real(**k))
    (tmp_path / "out").mkdir()
    check_output_path("out", tmp_path / "out", folder=True)               # writes inside the folder
    check_output_path("out", tmp_path / "out", folder=True, beside=True)  # a temp folder renamed onto it
    check_output_path("out", tmp_path / "new" / "deeper", folder=True)   # the nearest existing ancestor
    check_output_path("out", tmp_path / "out" / "x.json")
    assert probed == [tmp_path / "out", tmp_path, tmp_path, tmp_path / "out"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not any((tmp_path / "out").iterdir())


def test_int_tensor():
    assert int_tensor("x", [3, -1]).tolist() == [3, -1] and int_tensor("x", [2], torch.int32).dtype == torch.int32
    assert int_tensor("x", torch.tensor([5], dtype=torch.int16)).dtype == torch.int64
    with pytest.raises(TypeError, match="x must hold ints, got 2.0"):
        int_tensor("x", [1, 2.0])
    with pytest.raises(TypeError, match="x must hold ints, got True"):
        int_tensor("x", [True])
    with pytest.raises(TypeError, match="x must be an integer tensor, got dtype torch.float32"):
        int_tensor("x", torch.ones(2))


def test_tensor_value_checks_name_the_first_offender():
    check_verify_lens(torch.tensor([1, 4, 2]), 4)
    with pytest.raises(ValueError, match=r"verify_lens\[1\] = 5 is outside \[1, W=4\]"):
        check_verify_lens(torch.tensor([1, 5, 0]), 4)
    with pytest.raises(ValueError, match=r"lens\[2\] = 0 is outside \[1, W=4\]"):
        check_verify_lens(torch.tensor([1, 2, 0]), 4, name="lens")
    check_nonnegative("p", torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"p\[1\] = -3 is negative"):
        check_nonnegative("p", torch.tensor([0, -3, -1]))
    check_kv_fits(torch.tensor([8, 3]), 2, 4)
    with pytest.raises(ValueError, match="request 1 writes positions up to 8 but its block table row holds 2 pages "
                                         "of 4 = 8 positions"):
        check_kv_fits(torch.tensor([8, 9]), 2, 4)


def test_type_path_and_duplicate_helpers(tmp_path):
    assert check_type("g", None, torch.Generator, optional=True) is None
    with pytest.raises(TypeError, match=r"g must be a Generator or None, got int: 3"):
        check_type("g", 3, torch.Generator, optional=True)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list: \[1\]"):
        check_tensor("x", [1])
    with pytest.raises(TypeError, match="p must be a str or PathLike, got int: 3"):
        check_path("p", 3)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="d '.*f' exists and is not a directory"):
        check_directory("d", tmp_path / "f")
    assert check_directory("d", tmp_path / "new" / "dir").is_dir()
    assert first_duplicate(torch.tensor([4, 1, 7])) is None
    assert first_duplicate(torch.tensor([4, 7, 1, 7, 4])) == (4, 0, 4)
