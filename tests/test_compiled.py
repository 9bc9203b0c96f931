"""The fast path outside the method: passes compiled at fixed shapes, eager and regional.

Run: python -m pytest -q tests/test_compiled.py
"""

import pytest
import torch

import d3d
import runtime
from systems import fast
from test_d3d import tiny_qwen3

torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------------
# Compiled fixed-shape passes (systems/fast.py)


@pytest.fixture
def no_recompiles():
    """Inside: a recompile (a pass whose shape or guards changed) is an error."""
    torch._dynamo.reset()
    yield lambda: setattr(torch._dynamo.config, "error_on_recompile", True)
    torch._dynamo.config.error_on_recompile = False
    torch._dynamo.reset()


@pytest.mark.parametrize("block_size", [1, 4])
def test_every_pass_traces_as_one_graph_and_compiles_once(tok, target, no_recompiles, block_size):
    """fullgraph=True over every fixed-shape pass of every mode (dynamo's tracing, without code
    generation: a graph break raises), then new prompts of other lengths reuse those graphs (a
    recompile raises); outputs equal target-only decoding. (A padded draft after a full-acceptance
    hit differs from others in data only, not in shape.)"""
    from systems import fast

    prompts = [
        torch.tensor([[7, 1, 9, 4, 4]]),
        torch.tensor([[3, 2, 1, 5, 6, 7, 8, 9, 10, 11, 12]]),
    ]
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=block_size)
    caches = runtime.Caches.make(target, drafter, 128)
    fast.compile_passes(caches, backend="eager")
    fast.warm_up(target, drafter, caches, prompts[0], d3d.MODES)
    no_recompiles()
    for prompt in prompts:
        expected, _ = d3d.generate(target, None, prompt, max_new_tokens=40, mode="target")
        for mode in d3d.MODES:
            out, _ = d3d.generate(
                target, drafter, prompt, max_new_tokens=40, mode=mode, caches=caches
            )
            assert out.tolist() == expected.tolist(), mode


def test_inductor_compiled_decoding_equals_eager(tok, target, no_recompiles):
    """The real compiler (inductor's generated code, on a CPU): sync and async equal target-only,
    greedy and sampled with the same seed as eager decoding, with no recompile after the warm-up."""
    from systems import fast

    prompt = torch.tensor([[7, 1, 9, 4, 4]])
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=3)
    eager = {
        (mode, t): d3d.generate(
            target,
            drafter,
            prompt,
            max_new_tokens=30,
            mode=mode,
            temperature=t,
            generator=torch.Generator().manual_seed(5),
        )[0].tolist()
        for mode in ("sync", "async")
        for t in (0, 1.0)
    }
    caches = runtime.Caches.make(target, drafter, 64)
    fast.compile_passes(caches)
    fast.warm_up(target, drafter, caches, prompt, ("sync", "async"))
    no_recompiles()
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=30, mode="target")
    for (mode, t), tokens in eager.items():
        out, _ = d3d.generate(
            target,
            drafter,
            prompt,
            max_new_tokens=30,
            mode=mode,
            temperature=t,
            caches=caches,
            generator=torch.Generator().manual_seed(5),
        )
        assert out.tolist() == tokens and (t or tokens == expected.tolist()), (mode, t)


# --------------------------------------------------------------------------------------------------
# Regional compilation (fast.compile_passes(regional=True)): one compiled layer serves them all


@pytest.mark.parametrize("per_layer", [False, True])
def test_regional_compilation_traces_each_layer_class_and_shape_once(
    tok, target, no_recompiles, monkeypatch, per_layer
):
    """The fullgraph test above (every mode, new prompts without a recompile, outputs equal
    target-only) compiled regionally, counting dynamo's graphs: one per pass width, shared by every
    layer of both models (one layer class). per_layer: the compiled layer handed the whole
    StaticCache, whose list index is then a guarded constant, traces one graph per layer and width
    (all inside the warm-up), and the count catches it."""
    graphs, widths = [], set()
    compile_passes = fast.compile_passes

    def counting(graph, inputs):
        graphs.append(graph)
        return graph.forward

    def recorded(step):
        return lambda ids, *args: (widths.add(ids.shape[1]), step(ids, *args))[1]

    def regional(caches, backend):
        compile_passes(caches, backend=counting, regional=True)
        for cache in (caches.target, caches.drafter):
            cache.step = recorded(cache.step)

    monkeypatch.setattr(fast, "compile_passes", regional)
    if per_layer:
        monkeypatch.setattr(fast, "_OneLayer", lambda cache, index: cache)
    test_every_pass_traces_as_one_graph_and_compiles_once(tok, target, no_recompiles, block_size=4)
    # target 1 and B + 1, drafter 2B + 1, 1 + B (the target's B + 1) and the packed pass
    assert len(widths) == 4
    assert len(graphs) == len(widths) * (len(target.model.layers) if per_layer else 1)


def test_regional_inductor_decoding_equals_eager(tok, target, no_recompiles, monkeypatch):
    """The inductor test above (sync and async, greedy equal to target-only, sampled equal to eager
    with the same seed, no recompile after the warm-up), with each layer compiled regionally."""
    compile_passes = fast.compile_passes
    monkeypatch.setattr(
        fast, "compile_passes", lambda caches: compile_passes(caches, regional=True)
    )
    test_inductor_compiled_decoding_equals_eager(tok, target, no_recompiles)
