"""The fast paths, applied from outside d3d.py, which gives the same results without them: its
fixed-shape decoding passes through torch.compile (CUDA graphs on a GPU), and pruning's scorer
from one recorded pass per batch.

    # fixed-size KV caches, reused for every request
    caches = runtime.Caches.make(target, drafter, max_len=1024)
    fast.compile_passes(caches)  # the one line
    d3d.generate(target, drafter, ids, max_new_tokens=128, caches=caches)

The passes have the five fixed shapes of d3d.py's table (its drafting section's opening),
over all max_len slots of a cache. Prefills (any length) and the drafter's selective-prefill
scoring stay eager. Each shape compiles once (about 5-20 s a shape on a CPU for a tiny model,
longer for a deep one); `warm_up` does it before anything is timed.
`compile_passes(caches, regional=True)` compiles one decoder layer per (layer class, shape)
instead, reused by every layer of both models, the rest of each pass eager: compile time does
not grow with depth.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from tqdm.auto import tqdm

import d3d
import runtime


def compile_passes(caches: runtime.Caches, mode=None, backend="inductor", regional=False) -> None:
    """Each cache's fixed-shape pass through torch.compile(fullgraph=True, dynamic=False): one
    graph per shape, and a graph break is an error, not a silent slow path. mode:
    "reduce-overhead" (CUDA graphs) on CUDA, inductor's default elsewhere; backend "eager"
    traces the same graphs without generating code (the tests' quick check), a callable backend
    sees each graph.

    regional=True: one compiled decoder layer instead of one whole-model graph per shape. Each
    layer's call goes through one compiled function that takes the layer and its own cache
    layer as arguments (_OneLayer), so dynamo traces each (layer class, shape) once and every
    layer of both models reuses that code; embedding, mask, final norm and head stay eager
    (compiled, they ran no faster on a CPU). Compile time does not grow with depth, and
    decoding runs about as fast as eager, slower than whole-model graphs (a guard check per
    layer call): RESULTS.md, "Compile time", and `decode.py --compile regional`. mode is passed
    as given (default: none, also on CUDA): per-layer CUDA graphs would be one recording per
    layer and shape, each layer's output in a pool that the next replay overwrites. A GPU thus
    runs the layers' compiled kernels without CUDA graphs, launch-bound for small models; the
    whole-model path stays the one for decoding speed there (untested on a GPU)."""
    # one code object (KVCache.forward, or _layer_forward) serves both caches and every shape:
    # allow that many graphs
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    fixed_shape = functools.partial(torch.compile, fullgraph=True, dynamic=False, backend=backend)
    if regional:
        layer_pass = fixed_shape(_layer_forward, mode=mode)
    for cache in (caches.target, caches.drafter):
        if cache is None:
            continue
        cache.compiled = True  # runtime.async_lanes refuses two lanes of compiled passes on CUDA
        if regional:
            cache.step = functools.partial(_regional_step, cache, layer_pass)
            continue
        cuda = cache.device.type == "cuda"
        cache_mode = mode
        if cache_mode is None and cuda and backend == "inductor":
            cache_mode = "reduce-overhead"
        compiled = fixed_shape(cache.forward, mode=cache_mode)
        cache.step = compiled
        if cuda:
            # a CUDA graph's outputs live in its pool and the next replay overwrites them: hand
            # out a copy
            cache.step = functools.partial(_copied, compiled)


def _copied(compiled, *args):
    """A compiled pass's output, copied out of its CUDA graph's pool."""
    return compiled(*args).clone()


class _OneLayer:
    """One decoder layer's own cache layer, behind the call attention makes: update(keys, values,
    layer_idx, ...). The index is ignored: indexing the StaticCache's list by it inside the
    compiled layer would make it a guarded constant, one graph per layer."""

    def __init__(self, cache, index: int):
        self.layer = cache.layers[index]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layer.update(key_states, value_states, *args, **kwargs)


def _layer_forward(layer, *args, **kwargs):
    """A decoder layer's own forward (its hooks already ran in the eager call around it): what
    regional compiles."""
    return type(layer).forward(layer, *args, **kwargs)


def _through(layer_pass, layer, index: int, *args, cache=None, **kwargs):
    layer_cache = None
    if cache is not None:
        layer_cache = _OneLayer(cache, index)
    return layer_pass(layer, *args, cache=layer_cache, **kwargs)


def _regional_step(cache, layer_pass, ids, positions, mask):
    """cache.forward with decoder layer i run by layer_pass on cache layer i (the index
    keep_layers keeps equal to each attention's layer_idx); the layers are themselves again
    afterwards (prefills and scoring run eagerly)."""
    model = cache.model
    if cache.drafter:
        model = cache.model.model
    layers = model.get_decoder().layers
    for index, layer in enumerate(layers):
        layer.forward = functools.partial(_through, layer_pass, layer, index)
    try:
        return cache.forward(ids, positions, mask)
    finally:
        for layer in layers:
            del layer.forward


def warm_up(target, drafter, caches: runtime.Caches, prompt, modes, **settings) -> float:
    """Decode `prompt` (1, prompt_len) briefly in every mode of `modes` (with generate's
    `settings`), so that each pass shape they use is compiled before anything is timed. Returns
    the seconds it took (compile time, reported apart)."""
    start = time.perf_counter()
    block_size = settings.get("block_size")
    if not block_size:
        block_size = 1
        if drafter is not None:
            block_size = drafter.d3d_config.block_size
    # two rounds at least: a first draft, then a draft after a verification
    two_rounds = 2 * block_size + 3
    for mode in modes:
        config = d3d.DecodeConfig(mode=mode, max_new_tokens=two_rounds, **settings)
        d3d.generate(target, drafter, prompt, config, caches=caches)
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------------
# Pruning's scorer from one recorded pass


@contextlib.contextmanager
def _recording_layer_inputs(drafter: d3d.Drafter):
    """Record the hidden states entering each decoder layer during the passes inside: a list,
    layer by layer."""
    entering = []

    def record(_, args, kwargs):
        entering.append(args[0] if args else kwargs["hidden_states"])

    handles = [
        layer.register_forward_pre_hook(record, with_kwargs=True)
        for layer in drafter.model.get_decoder().layers
    ]
    try:
        yield entering
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _resumed_at(drafter: d3d.Drafter, start: int, hidden: torch.Tensor):
    """Run only layers start.. (and the final norm) on `hidden` instead of the embedded input,
    for the duration."""
    num_layers = len(drafter.model.get_decoder().layers)
    with d3d._only_layers(drafter, list(range(start, num_layers))) as decoder:
        first = decoder.norm
        if len(decoder.layers):
            first = decoder.layers[0]

        def swap_input(_, args, kwargs):
            if args:
                return (hidden, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": hidden}

        handle = first.register_forward_pre_hook(swap_input, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


@torch.no_grad()
def tau_without_each_layer(drafter: d3d.Drafter, batches, *, val_anchors: int = 32, seed: int = 0):
    """d3d.tau_without_each_layer's numbers, bit for bit (same anchors, same operations), at
    less cost: per batch one full pass records what enters each layer; the drafter without
    layer i then resumes from what entered layer i and runs layers i+1.. only. A greedy step
    over n layers costs n(n-1)/2 layer passes instead of 2n(n-1) (validation_tau also makes a
    second pass for the block loss)."""
    num_layers = len(drafter.model.get_decoder().layers)
    block_size = drafter.d3d_config.block_size
    # as validation_tau: one generator draws every batch's anchors
    generator = torch.Generator().manual_seed(seed)
    taus = {i: [] for i in range(num_layers)}
    bar = tqdm(total=len(batches) * num_layers, desc=f"score {num_layers} layers", leave=False)
    for input_ids, loss_mask in batches:
        anchors, valid = d3d.sample_anchors(loss_mask, val_anchors, generator)
        with _recording_layer_inputs(drafter) as entering:
            drafter.hidden_states(*d3d._packed_inputs(drafter, input_ids, anchors, block_size))
        for i in range(num_layers):
            with _resumed_at(drafter, i + 1, entering[i]):
                tau = d3d.offline_tau(drafter, input_ids, loss_mask, at=(anchors, valid))
                taus[i].append(tau)
            bar.update()
    bar.close()
    return {i: torch.cat(t).mean().item() for i, t in taus.items()}
