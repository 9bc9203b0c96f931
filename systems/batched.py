"""Batched decoding for concurrent requests (the paper's Table 2), beside d3d.py: a list of
prompts decodes as one ragged batch, each row advancing by its own accepted length and
computing what it would alone:

    outs, stats = batched.generate(target, drafter, [prompt_1, prompt_2], max_new_tokens=128)

Modes "target" and "sync"; each row gives what d3d.generate gives that prompt alone."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

import runtime
from d3d import DecodeConfig, Drafter, Sampler, accept_draft, draft_rows, packed_attention_mask
from runtime import Clock, Output, additive_mask, ignored_cache, mean, with_settings


@torch.no_grad()
def generate(target, drafter, prompts: list, config=None, *, generator=None, **settings):
    """Decode a list of 1-D prompts (prompt_len,) as one ragged batch, each row as
    d3d.generate decodes it alone, with the same DecodeConfig (and keyword `settings`; modes
    "target" and "sync", no selective prefill, no trace). Returns (list of 1-D outputs,
    prompt + new, stats).

    stats, the batch's totals (times in seconds):
        tau                 mean tokens committed per round, over every row's rounds
        num_rounds          batched rounds (target passes after the prefill)
        num_new_tokens      new tokens of all rows
        tokens_per_s        new tokens of all rows / time_total
        time_prefill        the target's prefill of the left-padded prompts
        time_draft          the drafter's passes (mode "sync")
        time_verify         the target's passes after the prefill
        time_total          the whole decode
        rows                per request, in prompt order: tau, accept_lengths, num_rounds,
                            num_new_tokens (as in d3d.generate's stats, runtime.Output.stats)
                            and time_done, when the row finished (from the clock's start)"""
    config = with_settings(config, DecodeConfig, settings)
    check_request(prompts, config)
    # the longest row reaches the furthest position
    longest = max(prompts, key=len)
    block_size = runtime.check_request(target, drafter, longest[None], config)
    sampler = Sampler(config.temperature, generator)
    if config.mode == "target":
        return decode_target(target, prompts, config, sampler)
    return decode_sync(target, drafter, prompts, replace(config, block_size=block_size), sampler)


# --------------------------------------------------------------------------------------------------
# Batched decoding: concurrent requests, each advancing by its own accepted length (the paper's
# Table 2). A ragged batch keeps a growing DynamicCache: rows leave when they finish
# (batch_select_indices, which a static layer lacks), and a static layer writes every row at
# one shared position, where each row here has its own.


def check_request(prompts, config: DecodeConfig) -> None:
    """A clear error for a batch generate cannot decode."""
    is_list = isinstance(prompts, (list, tuple)) and len(prompts) > 0
    if not is_list or any(not _is_prompt(p) for p in prompts):
        raise ValueError(
            "a batch of prompts must be a non-empty list of 1-D id tensors (prompt_len,), "
            "none empty"
        )
    if config.mode not in ("target", "sync") or config.keep_ratio is not None:
        raise ValueError(
            f"a batch decodes in modes 'target' and 'sync', not {config.mode!r}, and without "
            "keep_ratio (batched async is not built: each row would need its own branch plan; "
            "selective prefill neither): decode such prompts one at a time with d3d.generate"
        )
    if config.trace:
        raise ValueError("a batch records no trace: give trace=False, or use d3d.generate")


def _is_prompt(prompt) -> bool:
    """A 1-D id tensor with at least one token."""
    return torch.is_tensor(prompt) and prompt.dim() == 1 and len(prompt) > 0


class RaggedCache:
    """One DynamicCache for a ragged batch: every pass appends q columns to every row
    (left-padded), `valid` (b, C) marks a row's committed tokens. Holes (pads, rejected
    drafts) are masked out and each row keeps its own positions, so it computes what it
    would alone; all-hole trailing columns are cropped, finished rows leave."""

    def __init__(self, model: nn.Module, batch_size: int, device):
        self.cache = DynamicCache(config=model.config)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # (b, C)

    def inputs(self, new_valid, relative, inner):
        """Position ids (b, q) and mask (b, 1, q, C + q) of a pass appending q columns
        (new_valid (b, q): not pads); `relative` (1, q): positions from a row's first new
        column; `inner` (q, q): who sees whom."""
        # (b,) a row's position at new column 0 (before its pads)
        offset = self.valid.sum(1) - (~new_valid).sum(1)
        q = new_valid.shape[1]
        past = self.valid[:, None].expand(-1, q, -1)
        # nobody sees a hole
        mask = torch.cat([past, inner & new_valid[:, None]], 2)
        positions = (relative + offset[:, None]).clamp(min=0)
        return positions, mask[:, None]

    def commit(self, new_valid):
        """Record the columns the last pass appended (new_valid (b, q): what each row keeps);
        crop all-hole ones, and the columns the cache holds past `valid` (a draft's MASKs)."""
        self.valid = torch.cat([self.valid, new_valid], 1)
        # host ints here, one a layer: KVCache.check
        cached = self.cache.get_seq_length()
        for index in range(len(self.cache.layers)):
            held = self.cache.get_seq_length(index)
            if len(self.valid) and held < self.valid.shape[1]:
                holds = f"{held} columns in layer {index}"
                raise ignored_cache("a batch KV cache", holds, self.valid.shape[1])
        used = self.valid.any(0).nonzero()
        length = 0
        if len(used):
            length = int(used[-1]) + 1
        # keep the first `length` columns (public API: crop with a negative count)
        if cached > length:
            self.cache.crop(length - cached)
        self.valid = self.valid[:, :length]

    def keep_rows(self, rows: torch.Tensor):
        """Keep only `rows` (indices into the batch) in the cache and in `valid`."""
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        # the rows that left may have held the only tokens of the last columns
        self.commit(self.valid[:, :0])


def left_pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists as ids (b, m) left-padded with 0, and where they are real tokens
    (b, m)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    real = [[False] * (width - len(r)) + [True] * len(r) for r in rows]
    return ids, torch.tensor(real, device=device)


def target_pass(target, ragged: RaggedCache, ids, new_valid, logits_to_keep=0) -> torch.Tensor:
    """A causal target pass over a batch, ids (b, q) left-padded (new_valid (b, q): not pads).
    Returns float logits (b, kept, V)."""
    q = ids.shape[1]
    device = ids.device
    relative = torch.arange(q, device=device)[None]
    causal = torch.ones(q, q, dtype=torch.bool, device=device).tril()
    positions, mask = ragged.inputs(new_valid, relative, causal)
    out = target(
        input_ids=ids,
        position_ids=positions,
        attention_mask=additive_mask(mask, target),
        cache=ragged.cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    )
    return out.logits.float()


def draft_batch(drafter: Drafter, ragged: RaggedCache, new_tokens, block_size: int):
    """draft_block for a batch: new_tokens, each row's unread tokens (a list of lists of ints),
    left-padded so that every row's x_n is the last causal column. Returns (b, B, V)."""
    device = ragged.valid.device
    ids, new_valid = left_pad(new_tokens, device)  # (b, m)
    b, m = ids.shape
    last = torch.tensor([m - 1], device=device)
    inner, relative = packed_attention_mask(m, last, block_size)  # (1, 1, q, q), (1, q)
    # the B MASKs after each row's tokens are never holes
    with_masks = F.pad(new_valid, (0, block_size), value=True)
    positions, mask = ragged.inputs(with_masks, relative, inner[0, 0])
    config = drafter.d3d_config
    masks = torch.full((b, block_size), config.mask_token_id, device=device)
    # (B,) shared by all rows
    rows = draft_rows(last, last + 1, block_size, config.d1_from)[0]
    pass_ids = torch.cat([ids, masks], 1)  # (b, m + B)
    hidden = drafter.hidden_states(pass_ids, positions, mask, ragged.cache)
    logits = drafter.logits(hidden[:, rows])
    # the MASK columns go too: they lie past `valid`
    ragged.commit(new_valid)
    return logits


def target_step(target, cache: RaggedCache, outs, rows, new_tokens, sampler: Sampler) -> None:
    """One target pass over each row's new tokens (left-padded), and each row's next token
    committed: the prefill, or a round of target-only decoding. rows: indices into outs."""
    ids, new_valid = left_pad(new_tokens, cache.valid.device)
    logits = target_pass(target, cache, ids, new_valid, logits_to_keep=1)[:, -1]  # (b, V)
    cache.commit(new_valid)
    tokens = sampler.pick(logits)[0].tolist()
    for row, token in zip(rows, tokens):
        outs[row].commit([token])


def prefill(target, prompts, config: DecodeConfig, sampler: Sampler):
    """_prefill for a batch: the target prefills the left-padded prompts and gives every row
    its first token."""
    device = prompts[0].device
    outs = [Output(p.tolist(), config.max_new_tokens, config.eos_token_id) for p in prompts]
    cache = RaggedCache(target, len(outs), device)
    times = {"clock": Clock(device), "rounds": 0, "done": {}}
    if config.max_new_tokens > 0:
        with times["clock"].span("prefill"):
            prompt_tokens = [out.tokens for out in outs]
            target_step(target, cache, outs, range(len(outs)), prompt_tokens, sampler)
    return outs, cache, times


def drop_finished(outs, active: list[int], caches, times) -> list[int]:
    """Finished rows leave the batch and every cache. active: indices into outs, in batch
    order. Returns those left."""
    keep = [i for i, row in enumerate(active) if not outs[row].done]
    if len(keep) < len(active):
        clock = times["clock"]
        for row in active:
            if outs[row].done:
                times["done"][row] = clock.now() - clock.start
        for cache in caches:
            kept = torch.tensor(keep, dtype=torch.long, device=cache.valid.device)
            cache.keep_rows(kept)
    return [active[i] for i in keep]


def finish(outs, times) -> tuple[list[torch.Tensor], dict]:
    """The outputs as 1-D tensors and the batch's stats (see generate)."""
    seconds = times["clock"].totals()
    total = seconds["total"]
    rows = []
    for i, out in enumerate(outs):
        rows.append({**out.summary(), "time_done": times["done"].get(i, total)})
    num_new = sum(row["num_new_tokens"] for row in rows)
    stats = {
        "rows": rows,
        "num_rounds": times["rounds"],
        "num_new_tokens": num_new,
        "tau": mean([n for out in outs for n in out.accept_lengths]),
        "time_prefill": seconds.get("prefill", 0.0),
        "time_draft": seconds.get("draft", 0.0),
        "time_verify": seconds.get("verify", 0.0),
        "time_total": total,
        # throughput: new tokens of all rows / wall time
        "tokens_per_s": num_new / total,
    }
    device = times["clock"].device
    return [torch.tensor(out.tokens, device=device) for out in outs], stats


def decode_target(target, prompts, config: DecodeConfig, sampler: Sampler):
    """_decode_target for a batch: one target pass gives every unfinished row its next
    token."""
    outs, cache, times = prefill(target, prompts, config, sampler)
    active = drop_finished(outs, list(range(len(outs))), [cache], times)
    while active:
        with times["clock"].span("verify"):
            last = [outs[row].tokens[-1:] for row in active]
            target_step(target, cache, outs, active, last, sampler)
        times["rounds"] += 1
        active = drop_finished(outs, active, [cache], times)
    return finish(outs, times)


def decode_sync(target, drafter, prompts, config: DecodeConfig, sampler: Sampler):
    """_decode_sync for a batch: one drafter pass and one target pass per round; a row's
    rejected tail is a hole. config: its B resolved."""
    device = prompts[0].device
    block_size = config.block_size
    outs, target_cache, times = prefill(target, prompts, config, sampler)
    drafter_cache = RaggedCache(drafter.model, len(outs), device)
    caches = [target_cache, drafter_cache]
    active = drop_finished(outs, list(range(len(outs))), caches, times)
    while active:
        with times["clock"].span("draft"):
            seen = drafter_cache.valid.sum(1).tolist()
            new_tokens = [outs[row].tokens[n:] for row, n in zip(active, seen)]
            draft_logits = draft_batch(drafter, drafter_cache, new_tokens, block_size)
            # (b, B), (b, B, V) or None
            draft, q_draft = sampler.pick(draft_logits)
        with times["clock"].span("verify"):
            # (b, 1): each row's x_n
            last = torch.tensor([outs[row].tokens[-1:] for row in active], device=device)
            ids = torch.cat([last, draft], 1)  # (b, B+1)
            all_valid = torch.ones_like(ids, dtype=torch.bool)
            p_logits = target_pass(target, target_cache, ids, all_valid)  # (b, B+1, V)
        q_rows = [None] * len(active)
        if q_draft is not None:
            q_rows = q_draft
        verdicts = []
        for p_row, draft_row, q_row in zip(p_logits, draft, q_rows):
            verdicts.append(torch.stack(accept_draft(p_row, draft_row, q_row, sampler)))
        accepted = torch.stack(verdicts)  # (b, 2): each row's verdict (a, t)
        # (b, B+1): x_n, d_1 .. d_a stay; the rejected tail is a hole
        kept = torch.arange(ids.shape[1], device=device) <= accepted[:, :1]
        # the round's one host read
        read = torch.cat([accepted, draft], 1).tolist()
        for row, (num_accepted, next_token, *tokens) in zip(active, read):
            outs[row].commit_round(tokens[:num_accepted], next_token)
        target_cache.commit(kept)
        times["rounds"] += 1
        active = drop_finished(outs, active, caches, times)
    return finish(outs, times)
