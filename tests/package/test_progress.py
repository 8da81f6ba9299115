"""Progress lines for long jobs: one plain line per unit (or a bounded number per stage), never a
carriage-return wall in a log file, never a counter past its total."""
from __future__ import annotations

import io
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dspark.lab.progress import Progress, StageProgress


@settings(max_examples=30, deadline=None)
@given(total=st.integers(1, 60))
def test_progress_prints_one_line_per_unit_and_refuses_a_unit_past_the_total(total: int) -> None:
    lines: list[str] = []
    bar = Progress(total, lines.append)
    for i in range(total):
        bar(f"unit {i}")
    w = len(str(total))
    assert [re.match(rf"\[ *(\d+)/{total} +\d+ s, eta +\d+ s\] unit (\d+)$", x).groups() for x in lines] == [
        (str(i + 1), str(i)) for i in range(total)] and all(len(x.split("/")[0]) == w + 1 for x in lines)
    with pytest.raises(RuntimeError, match=rf"counted {total + 1} units of {total}"):
        bar("one too many")


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 400), lines=st.integers(1, 20))
def test_stage_progress_prints_a_bounded_number_of_plain_lines_ending_at_the_total(total: int, lines: int) -> None:
    out = io.StringIO()
    bar = StageProgress(lines=lines, stream=out)
    for stage in ("load", "fit"):
        for done in range(1, total + 1):
            bar(stage, done, total)
    text = out.getvalue()
    assert "\r" not in text
    rows = [re.match(r" *(\w+) +(\d+)/(\d+) +\d+\.\d s$", x).groups() for x in text.splitlines()]
    for stage in ("load", "fit"):
        counts = [int(d) for s, d, t in rows if s == stage and int(t) == total]
        assert counts == sorted(set(counts)) and counts[-1] == total  # increasing, ends at the total
        assert len(counts) <= lines + 1 and len(counts) >= min(lines, total)
        assert all(c <= total for c in counts)
