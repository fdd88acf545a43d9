"""FSDP2 full fine-tuning (retrain/distributed/fsdp.py) on two real gloo ranks, 1 thread each,
against one process's FullBackend of the tiny model, never FSDP against FSDP: a step
(micro-batches of one sequence: rank 0 runs 2 passes and an idle one while rank 1 runs 3)
updates the weights as one process does, with the same global gradient norm and clipping;
the checkpoint rank 0 writes is the one-process checkpoint (weights and AdamW states); the
one-process checkpoint loaded into the shards resumes as one process does, a rank with no
loss tokens in its share included. And `distributed.shard`'s choices."""

from __future__ import annotations

import json
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from retrain.algorithms import aggregation  # noqa: E402
from retrain.backends.base import AdamParams, Datum, LossConfig  # noqa: E402
from retrain.config.shard_choice import sharded  # noqa: E402
from retrain.distributed import shares  # noqa: E402
from retrain.errors import UserError  # noqa: E402

# Clipped: the norm is global. lr 1e-3, eps 1e-6: AdamW moves a weight by lr x g / (|g| + eps),
# which would turn the rounding of a gradient element near eps into more than float32's
# tolerance (test_fsdp_run.py); a wrong sign still moves a weight 2e-3.
ADAM = AdamParams(learning_rate=1e-3, grad_clip_norm=1.0, eps=1e-6)
WORLD = 2


def _datums(seed: int, masked_tail: int = 0) -> list[Datum]:
    """5 sequences of different lengths (prompt 3-5 tokens, completion 4-9); the last
    `masked_tail` carry no loss (rank 1's share of 5 on 2 ranks is the last 3)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(5):
        prompt, done = 3 + i % 3, 4 + (i * 5) % 6
        tokens = torch.randint(5, 200, (prompt + done,), generator=g).tolist()
        mask = [0.0] * (prompt - 1) + [0.0 if i >= 5 - masked_tail else 1.0] * done
        old = (-4.0 - torch.rand(len(mask), generator=g)).tolist()
        out.append(Datum(tokens[:-1], tokens[1:], [o * m for o, m in zip(old, mask, strict=True)],
                         [(-1.0) ** i * m for m in mask], mask))
    return out


def _share_step(backend, datums: list[Datum], rank: int) -> dict:
    """Rank `rank`'s share of one forward_backward (the whole call's normaliser), then the
    optimizer step every rank takes."""
    tokens = [sum(1 for x in d.mask if x > 0) for d in datums]
    whole = aggregation.normaliser(tokens, "token_mean", 0)
    b = shares.blocks(len(datums), WORLD)[rank]
    out = backend.forward_backward(datums[b.start:b.stop], LossConfig(),
                                   norm=aggregation.Normaliser(whole.weights[b.start:b.stop],
                                                               whole.denominator),
                                   total_tokens=sum(tokens))
    step = backend.optim_step(ADAM)
    return {"loss": out.loss, "grad_norm": step.grad_norm, "skipped": step.metrics["skipped"],
            "micro_batches": out.metrics.get("grad_micro_batches", 0.0)}


def _rank(rank: int, init: str, model: str, folder: str) -> None:
    """One rank: step 1, save (every rank), the one-process step-1 checkpoint loaded, step 2."""
    import torch.distributed as dist

    from retrain.backends.local.full import FullBackend
    from retrain.backends.local.model import LocalModel
    from retrain.distributed.fsdp import shard
    from retrain.distributed.group import Group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))  # a hang fails, not waits
    try:
        group = Group(rank, WORLD, rank, dist.group.WORLD, dist.group.WORLD)
        full = FullBackend(LocalModel.load(model, "float32", "cpu", 1), micro_batch_size=1,
                           seed=7, checkpoint_dir=Path(folder) / "sharded")
        backend = shard(full, group)
        first = _share_step(backend, _datums(1), rank)
        saved = backend.save_state("step-1")
        backend.load_state(str(Path(folder) / "one" / "step-1"))
        second = _share_step(backend, _datums(2, masked_tail=3), rank)
        if rank == 0:
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous() for k, v in backend.whole.items()},
                      str(Path(folder) / "after-2.safetensors"))
        local = {k: v.to_local().clone() for k, v in backend.params.items()}
        torch.save(local, Path(folder) / f"shards-{rank}.pt")
        (Path(folder) / f"rank-{rank}.json").write_text(json.dumps(
            {"first": first, "second": second, "saved": saved}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """The one-process steps (checkpoint after step 1), then the two ranks'."""
    import torch.multiprocessing as mp

    from retrain.backends.local.full import FullBackend
    from retrain.backends.local.model import LocalModel

    folder = tmp_path_factory.mktemp("fsdp")
    one = FullBackend(LocalModel.load(tiny_model, "float32", "cpu", 1), seed=7,
                      checkpoint_dir=folder / "one")
    first = _one_step(one, _datums(1))
    one.save_state("step-1")
    second = _one_step(one, _datums(2, masked_tail=3))
    after = {k: v.detach().clone() for k, v in one.params.items()}
    init = "file://" + tempfile.mktemp(dir=folder)
    mp.start_processes(_rank, args=(init, tiny_model, str(folder)), nprocs=WORLD,
                       start_method="spawn")
    ranks = [json.loads((folder / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    return {"folder": folder, "one": (first, second), "ranks": ranks, "after": after}


def _one_step(backend, datums: list[Datum]) -> dict:
    out = backend.forward_backward(datums, LossConfig())
    step = backend.optim_step(ADAM)
    return {"loss": out.loss, "grad_norm": step.grad_norm}


def _close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-4, atol=1e-5, msg=name)


def test_a_sharded_step_equals_one_process(runs):
    from safetensors.torch import load_file

    (one1, one2), ranks = runs["one"], runs["ranks"]
    for step, one in (("first", one1), ("second", one2)):
        assert sum(r[step]["loss"] for r in ranks) == pytest.approx(one["loss"], rel=1e-4,
                                                                     abs=1e-6)
        for r in ranks:  # the global norm (clipped to 1.0 by every rank alike)
            assert r[step]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
            assert r[step]["grad_norm"] > ADAM.grad_clip_norm and r[step]["skipped"] == 0.0
    # micro-batches of one sequence: 2 and 3 in step 1; in step 2 rank 1 has no loss tokens
    assert [r["first"]["micro_batches"] for r in ranks] == [2.0, 3.0]
    assert [r["second"]["micro_batches"] for r in ranks] == [2.0, 0.0]
    _close(load_file(runs["folder"] / "after-2.safetensors"), runs["after"])


def test_each_rank_holds_half_of_every_weight(runs):
    after = runs["after"]
    shards = [torch.load(runs["folder"] / f"shards-{r}.pt") for r in range(WORLD)]
    for name, whole in after.items():
        parts = [s[name] for s in shards]
        assert sum(p.numel() for p in parts) == whole.numel()
        assert parts[0].shape[0] == -(-whole.shape[0] // WORLD)  # dim 0 split, rank 0 first
        torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-5, msg=name)


def test_rank_0_writes_the_one_process_checkpoint(runs):
    from safetensors.torch import load_file

    one, mine = runs["folder"] / "one" / "step-1", runs["folder"] / "sharded" / "step-1"
    assert [r["saved"] for r in runs["ranks"]] == [str(mine), ""]  # rank 1 writes nothing
    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in one.iterdir())
    _close(load_file(mine / "model.safetensors"), load_file(one / "model.safetensors"))
    want, got = (torch.load(f / "optimizer.pt", weights_only=True) for f in (one, mine))
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys() and len(want["state"]) > 10
    for i, st in want["state"].items():
        _close({f"{i}.{k}": v for k, v in got["state"][i].items()},
               {f"{i}.{k}": v for k, v in st.items()})
    rng = [torch.load(f / "rng.pt", weights_only=True)["generator"] for f in (one, mine)]
    assert torch.equal(rng[0], rng[1])


# ---------------------------------------------------------------------------- the choice

@pytest.mark.parametrize(("shard", "finetune", "world", "want"), [
    ("none", "full", 2, False), ("fsdp", "full", 2, True), ("fsdp", "full", 1, False),
    ("auto", "full", 2, True), ("auto", "full", 1, False), ("auto", "lora", 2, False),
    ("none", "lora", 2, False)])
def test_the_shard_choice(shard, finetune, world, want):
    assert sharded(shard, finetune, world) is want


def test_fsdp_with_lora_is_refused_naming_both_keys(tmp_path):
    from retrain.config.loader import load
    from retrain.config.schema import ConfigError

    with pytest.raises(UserError, match="distributed.shard.*model.finetune"):
        sharded("fsdp", "lora", 2)
    path = tmp_path / "run.toml"
    path.write_text('[model]\nfinetune = "lora"\n\n[distributed]\nshard = "fsdp"\n')
    with pytest.raises(ConfigError) as err:
        load(path, {})
    assert err.value.exit_code == 2
    [line] = str(err.value).splitlines()
    assert "distributed.shard" in line and "model.finetune" in line
