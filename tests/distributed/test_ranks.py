"""torchrun's environment read: none set is a single process, a group of one too; a half-set
or inconsistent one is one line naming what is missing."""

from __future__ import annotations

import pytest

from retrain.distributed.ranks import RankEnv, rank_env
from retrain.errors import UserError

FULL = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_no_torchrun_and_a_group_of_one_are_todays_single_process():
    assert rank_env({}) is None
    assert rank_env({**FULL, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}) is None


def test_a_full_environment_is_this_processs_place():
    assert rank_env(FULL) == RankEnv(rank=1, world=2, local_rank=1, local_world=2)
    assert not rank_env(FULL).leader
    nodes = {**FULL, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    assert rank_env(nodes).leader and rank_env(nodes).local_world == 1


def test_a_half_set_environment_names_what_is_missing():
    with pytest.raises(UserError, match="half set: RANK, WORLD_SIZE set but LOCAL_RANK, "
                                        "MASTER_ADDR, MASTER_PORT not"):
        rank_env({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("bad", [{"RANK": "2"}, {"RANK": "x"}, {"WORLD_SIZE": "0"}])
def test_an_inconsistent_environment_is_one_line(bad):
    with pytest.raises(UserError, match="torchrun environment"):
        rank_env({**FULL, **bad})
