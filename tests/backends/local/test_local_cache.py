"""The sampler's reserved KV cache decodes exactly what transformers' growing cache does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.backends.local.backend import LocalBackend  # noqa: E402
from retrain.backends.local.sampling import exact  # noqa: E402
from retrain.backends.local.sampling.reserved_cache import ReservedLayer, reserve  # noqa: E402


def _sample(model, backend, params, monkeypatch=None, capacity=None):
    ps = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8]]
    if monkeypatch is not None:
        monkeypatch.setattr(exact, "reserve",
                            (lambda c, _cap: c) if capacity is None
                            else (lambda c, _cap: reserve(c, capacity)))
    groups = backend.sample(ps, 3, params)
    return [[(c.tokens, c.logprobs, c.finish_reason) for c in g] for g in groups]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_reserved_cache_matches_the_growing_cache(model, monkeypatch, temperature):
    backend = LocalBackend.new_adapter(model, f"c{int(temperature)}", lora_rank=4, seed=1)
    try:
        params = SamplingParams(max_tokens=10, temperature=temperature, seed=4)
        reserved = _sample(model, backend, params)
        grown = _sample(model, backend, params, monkeypatch)
        small = _sample(model, backend, params, monkeypatch, capacity=2)  # must grow
    finally:
        model.delete_adapter(f"c{int(temperature)}")
    for a, b in ((reserved, grown), (small, grown)):
        for ga, gb in zip(a, b, strict=True):
            for (ta, la, fa), (tb, lb, fb) in zip(ga, gb, strict=True):
                assert ta == tb and fa == fb
                assert max(abs(x - y) for x, y in zip(la, lb, strict=True)) < 1e-5


def test_reserve_replaces_only_plain_layers(model):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.base.config)
    cache.layers[0] = DynamicSlidingWindowLayer(sliding_window=4)
    reserve(cache, 16)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer)
    assert all(isinstance(layer, ReservedLayer) for layer in cache.layers[1:])
    layer = cache.layers[1]
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).reshape(2, 1, 3, 2)
    keys, _ = layer.update(k, k + 100)
    keys, values = layer.update(k[:, :, :1] * -1, k[:, :, :1] * -1)
    assert layer.get_seq_length() == 4 and keys.shape == (2, 1, 4, 2)
    assert torch.equal(keys[:, :, :3], k) and torch.equal(values[:, :, 3], -k[:, :, 0])
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys[0, :, :3], k[1])
    layer.batch_repeat_interleave(3)
    assert layer.keys.shape == (3, 1, 4, 2) and torch.equal(layer.keys[2, :, :3], k[1])


def test_a_reserved_layer_takes_back_its_last_positions():
    layer = ReservedLayer(8)
    k = torch.arange(1 * 1 * 3 * 2, dtype=torch.float32).reshape(1, 1, 3, 2)
    layer.update(k, k + 100)
    layer.crop(-1)
    assert layer.get_seq_length() == 2 and torch.equal(layer.keys, k[:, :, :2])
    keys, values = layer.update(-k[:, :, :1], -k[:, :, :1])  # overwrites the taken-back one
    assert keys.shape == (1, 1, 3, 2) and torch.equal(keys[:, :, 2], -k[:, :, 0])
    with pytest.raises(ValueError, match="negated"):
        layer.crop(2)
