"""`python -m bench.gpu --profile`: where a fast decode's time goes on the device.

torch.profiler records one fast decode (batch `profile_batch`, `profile_tokens` new tokens,
graphs captured by a warm-up first): a table of the top operators and kernels by self device
time, and the device's timeline per decoding step: how long it was busy (the union of its
kernels) and how long it sat idle between kernels, with the largest gaps and the kernels
around them. Idle time is what the host costs a step (launches, the reads every
`check_every` steps, Python), the part CUDA graphs and fewer host reads remove. The figures
cover the whole call, prefill included, divided by its steps. On the CPU (--smoke) there are
no device kernels: the table is the host operators' and the summary says so.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.gpu.sampling import fast, prompts_for, sync
from retrain.backends.base import SamplingParams


def profile_decode(backend, sampler, plan, splan) -> dict:
    """The profile of one fast decode: table, device busy and idle per step, largest gaps."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=splan.profile_tokens, temperature=1.0)
    prompts = prompts_for(splan.profile_batch // plan.group, plan, backend.model.vocab_size,
                          seed=11)
    fast(sampler, backend, prompts, params, plan)  # warm-up: allocations, graph captures
    cuda = plan.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(plan)
    with profile(activities=activities) as prof:
        fast(sampler, backend, prompts, params, plan)
        sync(plan)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    out: dict[str, Any] = {"batch": splan.profile_batch, "steps": splan.profile_tokens,
                           "table": prof.key_averages().table(sort_by=key, row_limit=15)}
    timeline = device_timeline(prof.events(), splan.profile_tokens) if cuda else None
    if timeline is None:
        out["summary"] = ("no device kernels in the trace (on the CPU: the table is the "
                          "host's operators)")
    else:
        out.update(timeline)
        out["summary"] = (f"per decoding step (prefill included): span {timeline['span_ms']:.3f}"
                          f" ms, device busy {timeline['busy_ms']:.3f} ms, idle "
                          f"{timeline['idle_ms']:.3f} ms ({timeline['kernels']} kernels in "
                          f"all); largest gaps: {timeline['largest_gaps']}")
    return out


def device_timeline(events, steps: int) -> dict | None:
    """Busy and idle device time per step from the profiler's kernel events (None without
    any): busy is the union of the kernels' intervals, idle the span's rest."""
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    if not kernels:
        return None
    busy, idle = 0.0, []
    first, end, before = kernels[0][0], kernels[0][0], ""
    for start, stop, name in kernels:
        if start > end:
            idle.append((start - end, before, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, name
    span = end - first
    largest = [f"{gap:.0f} us after {a[:40]} before {b[:40]}"
               for gap, a, b in sorted(idle, reverse=True)[:5]]
    return {"kernels": len(kernels), "span_ms": span / steps / 1e3,
            "busy_ms": busy / steps / 1e3, "idle_ms": (span - busy) / steps / 1e3,
            "gaps_over_50us": sum(1 for gap, _, _ in idle if gap > 50),
            "largest_gaps": largest}
