"""The fast path: d3d.py's fixed-shape passes through torch.compile (CUDA graphs on a GPU), applied from outside the
decode loops. Without this file d3d.py decodes the same tokens, eagerly.

    caches = d3d.Caches.make(target, drafter, max_len=1024)   # fixed-size KV caches, reused for every request
    fast.compile_passes(caches)                                # the one line
    d3d.generate(target, drafter, ids, max_new_tokens=128, caches=caches)

The passes, for block size B (q tokens each, over all max_len slots of a cache; d3d.py builds them so):
    target    1              a target-only step
              B + 1          verify [x_n, d_1 .. d_B]; after a full-acceptance hit the draft has B - 1 real tokens and
                             a pad that is never accepted, so one shape serves both
    drafter   2B + 1         sync draft: the unread committed tokens (1 .. B + 1) padded to B + 1, then B MASKs
              1 + B          async fallback draft: x_n and B MASKs (at the top of an async round only x_n is unread)
              1 + B + S(1+B) async packed pass: x_n, d_1 .. d_B, then S = C F + 1 segments [token, B MASKs]
Prefills (any length) and the drafter's selective-prefill scoring stay eager. Each shape compiles once (about 5-20 s a
shape on a CPU for a tiny model, longer for a deep one); `warm_up` does it before anything is timed.
"""
from __future__ import annotations

import time

import torch

import d3d


def compile_passes(caches: d3d.Caches, mode: str | None = None, backend: str = "inductor") -> None:
    """Each cache's fixed-shape pass through torch.compile(fullgraph=True, dynamic=False): one graph per shape, and a
    graph break is an error, not a silent slow path. mode: "reduce-overhead" (CUDA graphs) on CUDA, inductor's
    default elsewhere; backend "eager" traces the same graphs without generating code (the tests' quick check)."""
    # one code object (KVCache.forward) serves both caches and every shape: allow that many graphs, no more
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    for cache in (caches.target, caches.drafter):
        if cache is None:
            continue
        cuda = next(cache.model.parameters()).device.type == "cuda"
        compiled = torch.compile(cache.forward, fullgraph=True, dynamic=False, backend=backend,
                                 mode=mode or ("reduce-overhead" if cuda and backend == "inductor" else None))
        # a CUDA graph's outputs live in its pool and the next replay overwrites them: hand out a copy
        cache.step = (lambda *args, _f=compiled: _f(*args).clone()) if cuda else compiled


def warm_up(target, drafter, caches: d3d.Caches, prompt: torch.Tensor, modes, **settings) -> float:
    """Decode `prompt` briefly in every mode of `modes` (with generate's `settings`), so that each pass shape they use
    is compiled before anything is timed. Returns the seconds it took (compile time, reported apart)."""
    start = time.perf_counter()
    block_size = settings.get("block_size") or (drafter.d3d_config.block_size if drafter is not None else 1)
    for mode in modes:  # two rounds at least: a first draft, then a draft after a verification
        d3d.generate(target, drafter, prompt, mode=mode, max_new_tokens=2 * block_size + 3, caches=caches,
                     **settings)
    return time.perf_counter() - start
