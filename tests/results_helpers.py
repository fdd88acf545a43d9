"""Campaign folders with known metrics, written the way the trainer and runner write them,
for the `retrain compare` and campaign-plot tests."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path


def write_run(folder: Path, rewards: list[float], *, state: str = "completed",
              evals: dict[int, float] | None = None, step_time_s: float = 2.0,
              tokens_per_second: float = 100.0, error: str = "",
              extra: dict[int, dict] | None = None) -> Path:
    """A run folder: one metrics row per reward (steps 1..n), state.json saying `state`;
    `extra`: more keys for a step's row."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w") as fh:
        for step, reward in enumerate(rewards, 1):
            row = {"step": step, "mean_reward": reward, "step_time_s": step_time_s,
                   "tokens_per_second": tokens_per_second}
            if evals and step in evals:
                row["eval_accuracy"] = evals[step]
            row |= (extra or {}).get(step, {})
            fh.write(json.dumps(row) + "\n")
    alive = state == "running"
    (folder / "state.json").write_text(json.dumps({
        "status": state, "step": len(rewards), "max_steps": len(rewards) if not alive else 99,
        "pid": os.getpid() if alive else 0, "host": socket.gethostname() if alive else "",
        "error": error}))
    return folder


def write_campaign(folder: Path, runs: dict[tuple[str, int], dict],
                   overrides: dict[str, dict] | None = None) -> Path:
    """manifest.json for runs {(condition, seed): write_run kwargs (rewards=...)} and their
    folders `<condition>_s<seed>`."""
    folder.mkdir(parents=True, exist_ok=True)
    entries, conditions, seeds = [], [], []
    for (cond, seed), spec in runs.items():
        name = f"{cond}_s{seed}"
        write_run(folder / name, **spec)
        entries.append({"name": name, "condition": cond, "seed": seed, "log_dir": name,
                        "status": spec.get("state", "completed"),
                        "overrides": (overrides or {}).get(cond, {}),
                        "last_step": len(spec["rewards"]), "max_steps": len(spec["rewards"])})
        conditions += [cond] if cond not in conditions else []
        seeds += [seed] if seed not in seeds else []
    (folder / "manifest.json").write_text(json.dumps({
        "campaign": folder.name, "config_file": "x.toml", "config_hash": "h",
        "status": "completed", "conditions": conditions, "seeds": seeds, "runs": entries}))
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (to check a command changed nothing)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}
