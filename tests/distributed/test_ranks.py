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


def test_the_launcher_names_the_rank_that_failed_first(capsys):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from retrain.distributed.launch import _failed

    def failure(rank: int, code: int) -> ProcessFailure:
        f = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        f.timestamp = 7  # the same second, as the agent often records them
        return f

    # rank 1 killed: rank 0 then fails on its collectives, the agent SIGTERMs the rest
    assert _failed({0: failure(0, 1), 1: failure(1, -9)}) == 1
    assert "rank 1 (pid 101) was killed by signal 9" in capsys.readouterr().err
    assert _failed({0: failure(0, -15), 1: failure(1, -9)}) == 1
    assert "rank 1" in capsys.readouterr().err
    # rank 0's own error (a bad file, a held lock): its status, and it said why itself
    assert _failed({0: failure(0, 2), 1: failure(1, -15)}) == 2
    assert _failed({0: failure(0, 2), 1: failure(1, 2)}) == 2  # every rank read the file
    assert capsys.readouterr().err == ""
    # rank 1's own exception, rank 0 failing on its collectives after it
    assert _failed({0: failure(0, 1), 1: failure(1, 1)}) == 1
    assert "rank 1 (pid 101) exited with status 1" in capsys.readouterr().err
