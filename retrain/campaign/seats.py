"""What the runs in flight hold: a run of N ranks ([distributed] nproc_per_node) is N
processes, each with its own device or cores, so it counts N against `max_workers`; and the
cores a local machine shares between the processes that run at once.

A run with more ranks than `max_workers` could never start beside nothing: it is refused
before anything is made. One at a time (parallel = false), a run always starts alone.
"""

from __future__ import annotations

from retrain.campaign.plan import CampaignPlan
from retrain.config.distributed_section import AUTO, ranks, visible_gpus
from retrain.config.sections import Config, ConfigError, ConfigIssue
from retrain.machine.cpu import AUTO_THREADS_ENV, available_cores


def run_ranks(cfg: Config) -> int:
    """The processes one run starts ("auto": this machine's visible GPUs on cuda, else 1)."""
    if cfg.distributed.nproc_per_node == AUTO:
        return ranks(cfg.distributed, visible_gpus(cfg.model.device) or 0)
    return ranks(cfg.distributed)


def capacity(c: CampaignPlan, run_ranks: list[int]) -> int:
    """Ranks alive at once: max_workers when parallel (0 = every run at once), else 1 (one
    run at a time, whatever its ranks: `fits` starts a run alone)."""
    return (c.max_workers or sum(run_ranks)) if c.parallel else 1


def fits(ranks: int, busy: list[int], capacity: int) -> bool:
    """Whether a run of `ranks` ranks may start beside runs holding `busy` ranks."""
    return not busy or sum(busy) + ranks <= capacity


def check_ranks(c: CampaignPlan, configs: dict[str, Config], source: str) -> None:
    """Refuse, in one line, a run whose ranks can never be held: more than max_workers, or
    "auto" ranks that Ray would have to reserve GPUs for before knowing the node."""
    for name, cfg in configs.items():
        n = cfg.distributed.nproc_per_node
        if n == AUTO and c.executor == "ray" and cfg.model.device not in ("cpu", "mps"):
            raise ConfigError(source, [ConfigIssue(
                "distributed.nproc_per_node", f"= \"auto\" in run {name} with campaign.executor "
                "= \"ray\": Ray reserves a run's GPUs before it reaches a node; set a number "
                "of ranks, or model.device = \"cpu\"")])
        count = run_ranks(cfg)
        if c.parallel and c.max_workers and count > c.max_workers:
            raise ConfigError(source, [ConfigIssue(
                "distributed.nproc_per_node", f"({count}) of run {name} is more than "
                f"campaign.max_workers ({c.max_workers}): each rank counts as a worker, so it "
                f"could never start; raise max_workers to {count} or lower nproc_per_node")])


def thread_share_env(cfg: Config, workers: int) -> dict[str, str]:
    """Split the cores between local workers that run at once (each `threads = 0` worker).

    Oversubscribed torch threads spin-wait for each other: measured on 2 cores, a second
    busy process made a 2-thread SmolLM2 sampling step 10x slower, a 1-thread one not at all.
    """
    if cfg.backend.backend != "local" or workers <= 1:
        return {}
    return {AUTO_THREADS_ENV: str(max(1, available_cores() // workers))}
