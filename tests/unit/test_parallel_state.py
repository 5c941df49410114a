import dataclasses

import pytest

from dcp_plugin import ParallelState


def test_from_tp_derives_dcp_rank_from_consecutive_tp_ranks():
    parallel = ParallelState.from_tp(tp_rank=5, tp_size=8, dcp_size=4)
    assert (parallel.dcp_rank, parallel.dcp_size, parallel.dcp_group_first_tp_rank) == (1, 4, 4)
    assert [ParallelState.from_tp(tp_rank=r, tp_size=8, dcp_size=2).dcp_rank for r in range(8)] == [0, 1] * 4


def test_trivial_and_overrides():
    assert ParallelState.trivial() == ParallelState(tp_rank=0, tp_size=1, dcp_rank=0, dcp_size=1)
    draft = ParallelState.trivial(tp_rank=3, tp_size=4)  # a draft in a TP4 process: KV not DCP-sharded
    assert (draft.tp_rank, draft.dcp_size) == (3, 1)


def test_frozen_and_keyword_only():
    parallel = ParallelState.trivial()
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallel.tp_size = 2
    with pytest.raises(TypeError):
        ParallelState(0, 1, 0, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp_size=0), "tp_size must be an int >= 1"),
        (dict(tp_rank=4, tp_size=4), r"tp_rank must be an int in \[0, 3\]"),
        (dict(tp_size=6, dcp_size=4), r"dcp_size=4 must divide tp_size=6.*\[1, 2, 3, 6\]"),
        (dict(tp_rank=1, tp_size=4, dcp_rank=0, dcp_size=2), "must be tp_rank % dcp_size = 1"),
        (dict(dcp_rank=-1), "dcp_rank must be an int"),
        (dict(pp_rank=1), "pp_rank"),
        (dict(tp_size=2.0), "tp_size must be an int"),
    ],
)
def test_errors_name_the_field_and_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelState(**kwargs)


def test_from_tp_rejects_bad_dcp_size():
    with pytest.raises(ValueError, match="dcp_size must be an int >= 1"):
        ParallelState.from_tp(tp_rank=0, tp_size=2, dcp_size=0)
    with pytest.raises(ValueError, match="must divide tp_size=2"):
        ParallelState.from_tp(tp_rank=0, tp_size=2, dcp_size=4)
