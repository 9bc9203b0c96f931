"""Batched decoding for concurrent requests (the paper's Table 2), beside d3d.py: a list of prompts decodes as one
ragged batch, each row advancing by its own accepted length and computing what it would alone:

    outs, stats = batched.generate(target, drafter, [prompt_1, prompt_2, ...], max_new_tokens=128)

Modes "target" and "sync"; each row gives what d3d.generate gives that prompt alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import runtime
from d3d import Drafter, accept_draft, draft_rows, packed_attention_mask, pick_tokens
from runtime import Clock, Output, additive_mask, ignored_cache, mean


@torch.no_grad()
def generate(
    target: nn.Module,
    drafter: Drafter | None,
    prompts: list[torch.Tensor],
    *,
    max_new_tokens: int,
    mode: str = "sync",
    block_size: int | None = None,
    temperature: float = 0.0,
    eos_token_id=None,
    generator: torch.Generator | None = None,
):
    """Decode a list of 1-D prompts (prompt_len,) as one ragged batch, each row as d3d.generate decodes it alone.
    Returns (list of 1-D outputs, prompt + new, stats): the batch's totals (tau, num_rounds, num_new_tokens,
    tokens_per_s, time_*) and stats["rows"], per request tau, accept_lengths, num_rounds, num_new_tokens, time_done."""
    check_request(prompts, mode)
    block_size = runtime.check_request(
        target,
        drafter,
        prompts[0][None],
        max_new_tokens,
        mode,
        block_size,
        temperature,
        None,
        None,
        "first",
        None,
    )
    if mode == "target":
        return decode_target(target, prompts, max_new_tokens, temperature, eos_token_id, generator)
    return decode_sync(
        target, drafter, prompts, max_new_tokens, block_size, temperature, eos_token_id, generator
    )


# ----------------------------------------------------------------------------------------------------------------------
# Batched decoding: concurrent requests, each advancing by its own accepted length (the paper's Table 2)
# A ragged batch keeps a growing DynamicCache: rows leave when they finish (batch_select_indices, which a static
# layer lacks) and a static layer writes every row at one shared position, where each row here has its own.


def check_request(prompts, mode: str) -> None:
    """A clear error for a batch generate cannot decode."""
    if (
        not isinstance(prompts, (list, tuple))
        or not prompts
        or any(not torch.is_tensor(p) or p.dim() != 1 or len(p) == 0 for p in prompts)
    ):
        raise ValueError(
            "a batch of prompts must be a non-empty list of 1-D id tensors (prompt_len,), none empty"
        )
    if mode not in ("target", "sync"):
        raise ValueError(
            f"a batch decodes in modes 'target' and 'sync', not {mode!r} (batched async is not built: "
            "each row would need its own branch plan; selective prefill neither): decode such prompts "
            "one at a time with d3d.generate"
        )


def new_cache(model: nn.Module):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a DynamicCache (public API: crop with a negative count)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


class RaggedCache:
    """One DynamicCache for a ragged batch: every pass appends q columns to every row (left-padded), `valid` (b, C)
    marks a row's committed tokens. Holes (pads, rejected drafts) are masked out and each row keeps its own positions,
    so it computes what it would alone; all-hole trailing columns are cropped, finished rows leave."""

    def __init__(self, model: nn.Module, batch_size: int, device):
        self.cache = new_cache(model)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # (b, C)

    def inputs(self, new_valid, relative, inner):
        """Position ids (b, q) and mask (b, 1, q, C + q) of a pass appending q columns (new_valid (b, q): not pads);
        `relative` (1, q): positions from a row's first new column; `inner` (q, q): who sees whom."""
        offset = self.valid.sum(1) - (~new_valid).sum(
            1
        )  # (b,) a row's position at new column 0 (before its pads)
        q = new_valid.shape[1]
        mask = torch.cat(
            [self.valid[:, None].expand(-1, q, -1), inner & new_valid[:, None]], 2
        )  # nobody sees a hole
        return (relative + offset[:, None]).clamp(min=0), mask[:, None]

    def commit(self, new_valid):
        """Record the columns the last pass appended (new_valid (b, q): what each row keeps); crop all-hole ones."""
        self.valid = torch.cat([self.valid, new_valid], 1)
        if (
            len(self.valid) and self.cache.get_seq_length() < self.valid.shape[1]
        ):  # a host int here: KVCache.check
            raise ignored_cache(
                "a batch KV cache", f"{self.cache.get_seq_length()} columns", self.valid.shape[1]
            )
        used = self.valid.any(0).nonzero()
        length = int(used[-1]) + 1 if len(used) else 0
        crop_cache(self.cache, length)
        self.valid = self.valid[:, :length]

    def keep_rows(self, rows: torch.Tensor):
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]
        self.commit(
            self.valid[:, :0]
        )  # the rows that left may have held the only tokens of the last columns


def left_pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists as ids (b, m) left-padded with 0, and where they are real tokens (b, m)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    return ids, torch.tensor(
        [[False] * (width - len(r)) + [True] * len(r) for r in rows], device=device
    )


def target_pass(
    target: nn.Module, ragged: RaggedCache, ids, new_valid, logits_to_keep=0
) -> torch.Tensor:
    """A causal target pass over a batch, ids (b, q) left-padded. Returns float logits (b, kept, V)."""
    q, device = ids.shape[1], ids.device
    positions, mask = ragged.inputs(
        new_valid,
        torch.arange(q, device=device)[None],
        torch.ones(q, q, dtype=torch.bool, device=device).tril(),
    )
    return target(
        input_ids=ids,
        position_ids=positions,
        attention_mask=additive_mask(mask, target),
        cache=ragged.cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
    ).logits.float()


def draft_batch(
    drafter: Drafter, ragged: RaggedCache, new_tokens: list[list[int]], block_size: int
):
    """draft_block for a batch, left-padded so that every row's x_n is the last causal column. Returns (b, B, V)."""
    device = ragged.valid.device
    ids, new_valid = left_pad(new_tokens, device)  # (b, m)
    b, m = ids.shape
    last = torch.tensor([m - 1], device=device)
    inner, relative = packed_attention_mask(m, last, block_size)  # (1, 1, q, q), (1, q)
    positions, mask = ragged.inputs(
        F.pad(new_valid, (0, block_size), value=True), relative, inner[0, 0]
    )
    masks = torch.full((b, block_size), drafter.d3d_config.mask_token_id, device=device)
    rows = draft_rows(last, last + 1, block_size, drafter.d3d_config.d1_from)[
        0
    ]  # (B,) shared by all rows
    logits = drafter.logits(
        drafter.hidden_states(torch.cat([ids, masks], 1), positions, mask, ragged.cache)[:, rows]
    )
    crop_cache(ragged.cache, ragged.valid.shape[1] + m)
    ragged.commit(new_valid)
    return logits


def prefill(target, prompts, max_new_tokens, eos_token_id, temperature, generator):
    """_prefill for a batch: the target prefills the left-padded prompts and gives every row its first token."""
    device = prompts[0].device
    outs = [Output(p.tolist(), max_new_tokens, eos_token_id) for p in prompts]
    cache = RaggedCache(target, len(outs), device)
    times = {"clock": Clock(device), "rounds": 0, "done": {}}
    if max_new_tokens > 0:
        with times["clock"].span("prefill"):
            ids, new_valid = left_pad([out.tokens for out in outs], device)
            logits = target_pass(target, cache, ids, new_valid, logits_to_keep=1)[:, -1]  # (b, V)
            cache.commit(new_valid)
            for out, token in zip(outs, pick_tokens(logits, temperature, generator)[0].tolist()):
                out.commit([token])
    return outs, cache, times


def drop_finished(outs, active: list[int], caches, times) -> list[int]:
    """Finished rows leave the batch and every cache. active: indices into outs, in batch order. Returns those left."""
    keep = [i for i, row in enumerate(active) if not outs[row].done]
    if len(keep) < len(active):
        clock = times["clock"]
        times["done"].update({row: clock.now() - clock.start for row in active if outs[row].done})
        for cache in caches:
            cache.keep_rows(torch.tensor(keep, dtype=torch.long, device=cache.valid.device))
    return [active[i] for i in keep]


def finish(outs, times, device) -> tuple[list[torch.Tensor], dict]:
    seconds = times["clock"].totals()
    total = seconds["total"]
    rows = [
        {**out.summary(), "time_done": times["done"].get(i, total)} for i, out in enumerate(outs)
    ]
    num_new = sum(row["num_new_tokens"] for row in rows)
    return [torch.tensor(out.tokens, device=device) for out in outs], {
        "rows": rows,
        "num_rounds": times["rounds"],
        "num_new_tokens": num_new,
        "tau": mean([n for out in outs for n in out.accept_lengths]),
        "time_prefill": seconds.get("prefill", 0.0),
        "time_draft": seconds.get("draft", 0.0),
        "time_verify": seconds.get("verify", 0.0),
        "time_total": total,
        "tokens_per_s": num_new / total,
    }  # throughput: new tokens of all rows / wall time


def decode_target(target, prompts, max_new_tokens, temperature, eos_token_id, generator):
    """_decode_target for a batch: one target pass gives every unfinished row its next token."""
    device = prompts[0].device
    outs, cache, times = prefill(
        target, prompts, max_new_tokens, eos_token_id, temperature, generator
    )
    active = drop_finished(outs, list(range(len(outs))), [cache], times)
    while active:
        with times["clock"].span("verify"):
            ids = torch.tensor([outs[row].tokens[-1:] for row in active], device=device)  # (b, 1)
            new_valid = torch.ones_like(ids, dtype=torch.bool)
            logits = target_pass(target, cache, ids, new_valid, logits_to_keep=1)[:, -1]  # (b, V)
            cache.commit(new_valid)
            for row, token in zip(active, pick_tokens(logits, temperature, generator)[0].tolist()):
                outs[row].commit([token])
        times["rounds"] += 1
        active = drop_finished(outs, active, [cache], times)
    return finish(outs, times, device)


def decode_sync(
    target, drafter, prompts, max_new_tokens, block_size, temperature, eos_token_id, generator
):
    """_decode_sync for a batch: one drafter pass and one target pass per round; a row's rejected tail is a hole."""
    device = prompts[0].device
    outs, target_cache, times = prefill(
        target, prompts, max_new_tokens, eos_token_id, temperature, generator
    )
    drafter_cache = RaggedCache(drafter.model, len(outs), device)
    caches = [target_cache, drafter_cache]
    active = drop_finished(outs, list(range(len(outs))), caches, times)
    while active:
        with times["clock"].span("draft"):
            new_tokens = [
                outs[row].tokens[seen:]
                for row, seen in zip(active, drafter_cache.valid.sum(1).tolist())
            ]
            draft, q_draft = pick_tokens(
                draft_batch(drafter, drafter_cache, new_tokens, block_size), temperature, generator
            )  # (b, B), (b, B, V) or None
        with times["clock"].span("verify"):
            last = torch.tensor(
                [outs[row].tokens[-1:] for row in active], device=device
            )  # (b, 1): each row's x_n
            ids = torch.cat([last, draft], 1)  # (b, B+1)
            p_logits = target_pass(
                target, target_cache, ids, torch.ones_like(ids, dtype=torch.bool)
            )  # (b, B+1, V)
        kept = torch.zeros_like(
            ids, dtype=torch.bool
        )  # (b, B+1): x_n, d_1 .. d_a stay; the rejected tail is a hole
        accepted = torch.stack(
            [
                torch.stack(
                    accept_draft(
                        p_logits[i],
                        draft[i],
                        None if q_draft is None else q_draft[i],
                        temperature,
                        generator,
                    )
                )
                for i in range(len(active))
            ]
        )
        for i, (row, (num_accepted, next_token, *tokens)) in enumerate(
            zip(active, torch.cat([accepted, draft], 1).tolist())
        ):  # the round's one host read
            outs[row].commit_round(tokens[:num_accepted], next_token)
            kept[i, : num_accepted + 1] = True
        target_cache.commit(kept)
        times["rounds"] += 1
        active = drop_finished(outs, active, caches, times)
    return finish(outs, times, device)
