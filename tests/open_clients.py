"""The tinker SDK clients a test left open. Each `tinker.ServiceClient` that opened a session
keeps a heartbeat task on the SDK's one event-loop thread until it is closed (`with`, or
`.close(...)`); left open, it outlives its test's server and, two minutes on, prints
"Session heartbeat failed ... APIConnectionError" into whatever runs next."""

from __future__ import annotations

import asyncio
import sys


def live_tinker_sessions() -> list:
    """The SDK's session holders whose heartbeat still runs and that nobody closed."""
    holders = sys.modules.get("tinker.lib.internal_client_holder")
    loop = holders._internal_client_holder_thread_singleton.loop_if_started() \
        if holders is not None else None
    if loop is None or loop.is_closed() or not loop.is_running():
        return []

    async def beating() -> list:  # all_tasks is read on the loop's own thread
        found = []
        for task in asyncio.all_tasks():
            coro = task.get_coro()
            frame = getattr(coro, "cr_frame", None)
            if getattr(coro, "__name__", "") == "_session_heartbeat" and frame is not None:
                holder = frame.f_locals.get("self")
                if holder is not None and not getattr(holder, "_closed", True):
                    found.append(holder)
        return found

    return asyncio.run_coroutine_threadsafe(beating(), loop).result(timeout=30)
