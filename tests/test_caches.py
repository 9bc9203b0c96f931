"""A model that ignores the KV cache it is given, in one layer only (the first, a middle one, the
last): generate fails with one clear error in every mode (a batch too), never decodes wrong
tokens in silence.
test_d3d.py's test_a_model_that_ignores_its_cache_fails_loudly drops the cache in every layer.

Run: python -m pytest -q tests/test_caches.py
"""

import pytest
import torch

import d3d
from systems import batched
from test_d3d import batch_prompts, tiny_qwen3

torch.set_num_threads(1)

LAYERS = 3


def layer_dropping_cache(model: torch.nn.Module, index: int, cut_mask: bool) -> None:
    """Decoder layer `index` of `model` attends without the KV cache it is given (as a layer
    whose attention lost the keyword would): each pass sees only its own tokens there, while
    every other layer reads its cache. cut_mask: it also cuts a mask wider than its keys down
    to them, so nothing fails on a shape and the tokens are silently wrong."""
    attention = model.get_decoder().layers[index].self_attn
    forward = attention.forward

    def without_cache(hidden_states, *args, cache=None, attention_mask=None, **kwargs):
        if cut_mask and attention_mask is not None:
            attention_mask = attention_mask[..., : hidden_states.shape[1]]
        return forward(hidden_states, *args, attention_mask=attention_mask, **kwargs)

    attention.forward = without_cache


WHO_MODE = [
    ("target", "target"),
    ("target", "sync"),
    ("target", "async"),
    ("drafter", "sync"),
    ("drafter", "async"),
    ("target", "batch"),
    ("drafter", "batch"),
]


@pytest.mark.parametrize("cut_mask", [False, True], ids=["mask-kept", "mask-cut"])
@pytest.mark.parametrize("index", range(LAYERS), ids=["first", "middle", "last"])
@pytest.mark.parametrize("who,mode", WHO_MODE, ids=[f"{w}-{m}" for w, m in WHO_MODE])
def test_one_layer_that_ignores_its_cache_fails_loudly(tok, who, mode, index, cut_mask):
    target = tiny_qwen3(seed=1, layers=LAYERS)
    drafter = d3d.make_drafter(tiny_qwen3(seed=2, layers=LAYERS), tokenizer=tok, block_size=4)
    model = target
    if who == "drafter":
        model = drafter.model
    layer_dropping_cache(model, index, cut_mask)
    if mode == "target":
        drafter = None
    with pytest.raises(RuntimeError, match=f"in layer {index} where .*ignored the cache"):
        if mode == "batch":
            batched.generate(target, drafter, batch_prompts((3, 6)), max_new_tokens=12)
        else:
            prompt = torch.tensor([[7, 1, 9, 4]])
            d3d.generate(target, drafter, prompt, max_new_tokens=12, mode=mode)
