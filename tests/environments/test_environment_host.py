"""The environment worker: calls under a deadline, junk and hangs end one episode, and the
other live episodes survive a restart with their state (replayed by seed and replies)."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.config.sections import EnvironmentConfig
from retrain.environments.host import EnvError, EnvironmentFailure, Opened, WorkerHost
from retrain.environments.kinds import KindContext
from retrain.errors import UserError

ENVS = Path(__file__).parents[1] / "data" / "envs"


def host(factory: str = "Stateful", timeout: float = 0.5) -> WorkerHost:
    cfg = EnvironmentConfig(kind="python", factory=f"counter_env.py:{factory}",
                            step_timeout_s=timeout)
    return WorkerHost(cfg, KindContext("train", ENVS, 0))


def test_a_hang_ends_its_episode_and_the_others_keep_their_state():
    h = host()
    try:
        opened = h.reset([(0, 2), (1, 3), (2, 6)])
        assert all(isinstance(o, Opened) for o in opened)
        assert opened[1].messages == [{"role": "user", "content": "go 3"}]
        first = h.step([(0, "a"), (1, "b"), (2, "c")])
        assert [s.reward for s in first] == [1.0, 1.0, 1.0]
        second = h.step([(0, "a"), (1, "b"), (2, "c")])
        assert isinstance(second[1], EnvError) and "timed out after 0.5s" in second[1].message
        # Episodes 0 and 2 were replayed into the new process: their turn counters went on.
        assert [second[0].reward, second[2].reward] == [2.0, 2.0]
        assert [s.reward for s in h.step([(0, "a"), (2, "c")])] == [3.0, 3.0]
        assert h.deaths == 1
        assert h.finish([0, 1, 2]) == [0.0, 0.0, 0.0]
    finally:
        h.close()


def test_junk_from_step_is_an_error_of_that_episode_only():
    h = host()
    try:
        h.reset([(0, 4), (1, 2)])
        junk, fine = h.step([(0, "x"), (1, "y")])
        assert isinstance(junk, EnvError) and "must return a retrain.environments.Step" in \
            junk.message
        assert fine.reward == 1.0 and h.deaths == 0
    finally:
        h.close()


def test_more_than_three_deaths_in_a_step_fail_the_run():
    h = host(factory="Hangs", timeout=0.2)
    try:
        h.new_step()
        h.reset([(i, 1) for i in range(5)])
        with pytest.raises(EnvironmentFailure, match="died or hung 4 times in one step"):
            h.step([(i, "x") for i in range(5)])
    finally:
        h.close()


def test_a_factory_that_cannot_be_built_is_a_user_error_at_start():
    with pytest.raises(UserError, match="environment.factory = 'counter_env.py:Nope'"):
        host(factory="Nope")


def test_a_worker_killed_between_calls_is_replaced_with_every_episode_replayed(capsys):
    import signal

    h = host()
    try:
        h.new_step()
        h.reset([(0, 2), (1, 6)])
        assert [s.reward for s in h.step([(0, "a"), (1, "b")])] == [1.0, 1.0]
        h._worker.proc.send_signal(signal.SIGKILL)  # the OOM killer, while it waits
        h._worker.proc.wait(timeout=10)
        # Both episodes went on in the new process: their turn counters say 2.
        assert [s.reward for s in h.step([(0, "a"), (1, "b")])] == [2.0, 2.0]
        assert h.deaths == 1
        assert "environment worker process died between calls (killed by SIGKILL" in \
            capsys.readouterr().err
    finally:
        h.close()
