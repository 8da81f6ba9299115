import math

import pytest

from dspark import ScheduleConfig, VerifyMode


def test_defaults_and_derived():
    cfg = ScheduleConfig(gamma=7)
    assert (cfg.width, cfg.floor, cfg.cap, cfg.num_candidate_columns) == (8, 1, 8, 7)
    cfg = ScheduleConfig(gamma=7, min_verify_len=3, max_verify_len=5)
    assert (cfg.floor, cfg.cap, cfg.num_candidate_columns) == (3, 5, 2)
    assert ScheduleConfig(gamma=3, min_verify_len=0).floor == 1


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        (dict(gamma=0), ValueError, "gamma must be >= 1, got 0"),
        (dict(gamma=2.0), TypeError, "gamma must be an int"),
        (dict(gamma=True), TypeError, "gamma must be an int"),
        (dict(gamma=3, min_verify_len=-1), ValueError, "got -1"),
        (dict(gamma=3, min_verify_len=5), ValueError, "got 5"),
        (dict(gamma=3, max_verify_len=5), ValueError, "got 5"),
        (dict(gamma=3, min_verify_len=3, max_verify_len=2), ValueError, "max_verify_len=2"),
        (dict(gamma=3, survival_eps=math.nan), ValueError, "nan"),
        (dict(gamma=3, survival_eps=-0.1), ValueError, "-0.1"),
        (dict(gamma=3, survival_eps="x"), TypeError, "'x'"),
    ],
)
def test_bad_config_names_the_value(kwargs, exc, needle):
    with pytest.raises(exc, match=None) as info:
        ScheduleConfig(**kwargs)
    assert needle in str(info.value)


def test_verify_mode_parse():
    assert VerifyMode.parse("compact") is VerifyMode.COMPACT
    assert VerifyMode.parse(VerifyMode.STATIC) is VerifyMode.STATIC
    with pytest.raises(ValueError, match="'ragged'.*static, cap-accept, compact"):
        VerifyMode.parse("ragged")
