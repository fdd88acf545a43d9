"""Rank 0 sends each rank its message and gathers the replies; the other ranks serve
messages until Close. Messages travel as pickled objects over the group's gloo group."""

from __future__ import annotations

import contextlib
import signal
from typing import Any

import torch.distributed as dist

from retrain.distributed import messages as m
from retrain.distributed.group import Group
from retrain.distributed.worker import execute


def exchange(backend: Any, group: Group, msgs: list[Any]) -> list[m.Reply]:
    """Rank 0: `msgs[r]` to rank r (its own run here), every rank's reply, in rank order."""
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, msgs, src=0, group=group.objects)
    reply = execute(backend, mine[0], group)
    replies: list[Any] = [None] * group.world
    dist.gather_object(reply, replies, dst=0, group=group.objects)
    return replies


def close(group: Group) -> None:
    """Rank 0: tell the other ranks the run is over (once)."""
    if not group.closed:
        group.closed = True
        with contextlib.suppress(RuntimeError):  # a rank already gone: the launcher says so
            exchange(None, group, [m.Close()] * group.world)


def serve(backend: Any, group: Group) -> None:
    """A rank other than 0: run rank 0's messages until it closes the run. Ctrl-C and the
    launcher's SIGTERM are rank 0's to act on (it finishes the step, then closes); this
    rank follows, or fails with rank 0's collectives if rank 0 is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        got: list[Any] = [None]
        dist.scatter_object_list(got, None, src=0, group=group.objects)
        reply = execute(backend, got[0], group)
        dist.gather_object(reply, None, dst=0, group=group.objects)
        if isinstance(got[0], m.Close):
            return
