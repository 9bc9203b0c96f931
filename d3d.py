"""D3D: Decoupled Diffusion Drafting for Asynchronous Speculative Decoding (arXiv 2611.06425), in one module.

A standalone drafter (a causal LM with the target's tokenizer that never reads the target's hidden states) fills in a
block of B masked future tokens in one pass, so it can draft the next block while the target verifies this one.

Paper -> this file, top to bottom:
    config (B, MASK, K, lambda, gamma); the drafter      D3DConfig; make_drafter, Drafter
    packed attention, L_block + lambda L_AR (Fig. 1a)    packed_attention_mask; d3d_loss, sample_anchors
    where d_1 is read (ours: the causal head)            draft_rows, D3DConfig.d1_from: one rule for every pass
    drafting, verification, acceptance; sync decoding    draft_block, verify_block, accept_draft; _decode_sync
    async decoding (Fig. 1c): one packed pass drafts,    _decode_async: plan_branches, build_branch_pass, cache_hit,
      during verification, for each likely outcome         _Lanes (its own CUDA stream, or a CPU thread)
    layer pruning (Fig. 1b): score, remove, recover,     prune_drafter: tau_without_each_layer, least_costly_layer,
      re-measure                                           remove_layer, recover, validation_tau (offline_tau)
    selective prefilling (appendix, Fig. 5); the entry   select_chunks; generate(mode="target" | "sync" | "async")

What the loops take from runtime.py, one line each, so that this file reads alone:
    KVCache(model, max_len)    fixed-size KV cache: .run(ids (1, q), positions, mask (1, 1, q, length + q)) writes q
                               tokens after .length (host int) -> drafter hidden states (q, H) or target float logits
                               (q, V); .rewind(n) keeps the sequence's first n tokens; .reset(skipped) empties it for a
                               request whose first `skipped` prompt tokens it will not hold (positions count them)
    Caches                     .target, .drafter: KVCaches made once per run (Caches.make(target, drafter, max_len))
    causal_pass(cache, ids)    a causal pass over ids (1, q) after what the cache holds; prefill(cache, ids, positions):
                               the same for a prompt of any length, eagerly; attention_pass: the same, and it returns
                               each layer's attention weights (heads, q, cache length)
    read_round(values, *caches)  the round's one host read: every value flattened into one list of ints (and each
                               cache's own length checked against .length: a model that ignored its cache fails)
    Output(prompt, budget, eos)  .tokens: prompt + committed, ints; .commit(tokens) cuts at EOS (kept) or budget, raises
                               if nothing is committed; .commit_round(accepted, next) commits both, records tau; .done
    Clock(device)              `with clock.span(key):` (or clock.run(key, fn), no autograd) adds the time inside to
                               stats' time_<key>; CUDA events, read after the decode: no mid-round wait
    check_request, cache_len, async_lanes  generate's input checks (-> B); KV slots a request needs; default lanes
    additive_mask(mask, model) bool mask (True = may attend) -> HF's additive float mask
    keep_layers(model, ids)    a new layer list of those decoder layers only, renumbered 0..n-1 (cache slots, config)
    in_logit_chunks(V, fn, *rows)  fn over a few rows at a time, so V-wide logits never exist for all rows at once
    finite_step(optimizer, params, max_norm)  clip and step (skipped if the norm is not finite), zero the gradients
    host_copy, load_causal_lm, tokenizer_fingerprint  a deep copy in host memory; an HF causal LM; a tokenizer's hash

Shapes: b batch, L clean tokens, K anchors (blocks), B block size, V vocabulary, q packed query length, past tokens
already in a KV cache. "ours" marks a reading where the paper is silent (README.md, "Departures and readings").
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from runtime import (
    Caches,
    Clock,
    KVCache,
    Output,
    additive_mask,
    async_lanes,
    attention_pass,
    cache_len,
    causal_pass,
    check_request,
    finite_step,
    host_copy,
    in_logit_chunks,
    keep_layers,
    load_causal_lm,
    prefill,
    read_round,
    tokenizer_fingerprint,
)

MASK_TOKEN = "<|MASK|>"
CONFIG_NAME = "d3d_config.json"


# ----------------------------------------------------------------------------------------------------------------------
# Config


@dataclass
class D3DConfig:
    """The method's settings, saved as d3d_config.json next to every drafter."""

    block_size: int = (
        16  # B: MASK tokens drafted in one pass (paper default 16; Table 4 compares 8/16/32)
    )
    mask_token_id: int = -1  # id of MASK in the drafter's embedding table (set by make_drafter)
    num_anchors: int = 64  # K: blocks per training sequence (Table 5: tau saturates near 128-256)
    ar_weight: float = (
        1.0  # lambda: weight of the auxiliary autoregressive loss (Table 3: 1.0 is best)
    )
    decay_gamma: float | None = (
        None  # gamma: block position weights exp(-(i-1)/gamma); None = uniform
    )
    target_vocab_size: int = (
        0  # rows of the target's output layer; drafter logits are cut to this size
    )
    tokenizer_hash: str = (
        ""  # fingerprint of the tokenizer the drafter was made for (drivers check the target's)
    )
    layer_ids: list[int] | None = None  # which layers of the initial checkpoint the drafter kept
    d1_from: str = "causal"  # where d_1 is read (draft_rows): "causal", the next-token head at x_n; "mask", MASK 1

    def __post_init__(self):
        for name in ("block_size", "num_anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d1_from not in ("causal", "mask"):
            raise ValueError(f"d1_from must be 'causal' or 'mask', got {self.d1_from!r}")

    @classmethod
    def load(cls, path: str) -> "D3DConfig":
        with open(os.path.join(path, CONFIG_NAME)) as f:
            fields = json.load(f)
        if "first_token" in fields:  # the field's earlier name
            fields["d1_from"] = fields.pop("first_token")
        return cls(**fields)


# ----------------------------------------------------------------------------------------------------------------------
# The standalone drafter


class Drafter(nn.Module):
    """An HF causal LM plus its D3DConfig: `hidden_states` of a packed pass, `logits` over the target's vocabulary."""

    def __init__(self, model: nn.Module, config: D3DConfig):
        super().__init__()
        self.model, self.d3d_config = model, config

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def hidden_states(
        self, input_ids, position_ids, attention_mask, past_key_values=None
    ) -> torch.Tensor:
        """Last hidden states (b, q, H); attention_mask: bool (b, 1, q, past+q), True = may attend."""
        out = self.model.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=additive_mask(attention_mask, self.model),
            cache=past_key_values,
            use_cache=past_key_values is not None,
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits over the target's vocabulary, MASK excluded."""
        logits = self.model.get_output_embeddings()(hidden)[
            ..., : self.d3d_config.target_vocab_size
        ].float()
        if self.d3d_config.mask_token_id < logits.shape[-1]:
            logits[..., self.d3d_config.mask_token_id] = float("-inf")  # MASK can never be drafted
        return logits

    def forward(
        self, input_ids, position_ids, attention_mask, past_key_values=None
    ) -> torch.Tensor:
        return self.logits(
            self.hidden_states(input_ids, position_ids, attention_mask, past_key_values)
        )

    def save_pretrained(self, path: str, tokenizer=None) -> None:
        os.makedirs(path, exist_ok=True)
        self.model.save_pretrained(path)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(asdict(self.d3d_config), f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    @classmethod
    def from_pretrained(
        cls, path: str, dtype=None, device=None, attn_implementation: str = "sdpa"
    ) -> "Drafter":
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"no drafter folder at {path!r}: run python train.py, or save a d3d.make_drafter()"
            )
        if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
            raise FileNotFoundError(
                f"{path!r} lacks {CONFIG_NAME}: a plain model, not a D3D drafter; see make_drafter"
            )
        return cls(
            load_causal_lm(path, dtype, device, attn_implementation=attn_implementation),
            D3DConfig.load(path),
        )


def make_drafter(
    model: nn.Module,
    mask_token_id: int | None = None,
    *,
    tokenizer,
    layers: list[int] | None = None,
    target_vocab_size: int | None = None,
    **config,
) -> Drafter:
    """Turn any HF causal LM with the target's tokenizer into a D3D drafter. MASK: `mask_token_id` (not a text token),
    else `<|MASK|>` if the tokenizer has it, else its first unused id (embeddings grow only if that id has no row).
    `layers`: decoder layers to keep; `target_vocab_size`: default this model's; other keywords go to D3DConfig."""
    rows = model.get_output_embeddings().weight.shape[0]
    text_vocab = len(tokenizer)
    if rows < text_vocab:
        raise ValueError(
            f"the drafter's vocabulary ({rows} rows) does not cover the tokenizer's {text_vocab} "
            "tokens: initialise the drafter from a checkpoint of the target's family (same tokenizer)"
        )
    target_vocab_size = target_vocab_size or rows
    if target_vocab_size > rows:
        raise ValueError(
            f"the drafter's vocabulary ({rows} rows) does not cover the target's ({target_vocab_size}): "
            "initialise the drafter from a checkpoint with the target's tokenizer and vocabulary"
        )
    named_mask = (
        tokenizer.convert_tokens_to_ids(MASK_TOKEN) if MASK_TOKEN in tokenizer.get_vocab() else None
    )
    if mask_token_id is None:
        mask_token_id = named_mask if named_mask is not None else text_vocab
    elif mask_token_id < text_vocab and mask_token_id != named_mask:
        raise ValueError(
            f"mask_token_id {mask_token_id} is the text token "
            f"{tokenizer.convert_ids_to_tokens(mask_token_id)!r}: the target can produce it. Leave "
            f"mask_token_id=None to use a free id (>= {text_vocab})"
        )
    if (
        mask_token_id >= rows
    ):  # no free row: grow the embedding table (and a tied or separate output layer)
        model.resize_token_embeddings(mask_token_id + 1, mean_resizing=False)
    if layers is not None and not layers:
        raise ValueError("a drafter keeps at least one decoder layer, got layers=[]")
    if layers is not None:
        keep_layers(model, list(layers))
    return Drafter(
        model,
        D3DConfig(
            mask_token_id=mask_token_id,
            target_vocab_size=target_vocab_size,
            tokenizer_hash=tokenizer_fingerprint(tokenizer),
            layer_ids=list(layers) if layers is not None else None,
            **config,
        ),
    )


# ----------------------------------------------------------------------------------------------------------------------
# Packed attention: one causal stream, blocks hanging off points of it (Fig. 1a)


def packed_attention_mask(
    num_causal: int,
    anchors: torch.Tensor,
    block_size: int,
    *,
    prefix_len: int = 0,
    past_len: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and position ids of a packed sequence [causal stream | segment 1 | segment 2 | ...].

    `num_causal` causal tokens at positions past_len, past_len+1, ... follow `past_len` cached tokens that all see.
    Segment s hangs off causal index anchors[.., s] (position p): `prefix_len` causal tokens (1 for an async branch)
    then `block_size` MASKs, at positions p+1, p+2, .... It sees the causal stream up to p and no other segment; its
    MASKs see the whole segment. Visibility goes by anchor *position*, so overlapping spans cannot leak the future.
    Example: c0..c4, blocks of B=2 off c1 and c3 (x = may attend):

                     c0 c1 c2 c3 c4 | m m | m m
        c0 (pos 0)   x              |     |
        c1 (pos 1)   x  x           |     |
        c2 (pos 2)   x  x  x        |     |
        c3 (pos 3)   x  x  x  x     |     |
        c4 (pos 4)   x  x  x  x  x  |     |
        m  (pos 2)   x  x           | x x |          block off c1: predicts tokens 2, 3
        m  (pos 3)   x  x           | x x |
        m  (pos 4)   x  x  x  x     |     | x x      block off c3: predicts tokens 4, 5
        m  (pos 5)   x  x  x  x     |     | x x

    anchors: (S,) or (b, S) long. Returns mask (b, 1, q, past_len + q) bool and position_ids (b, q) long,
    q = num_causal + S * (prefix_len + block_size)."""
    anchors = anchors if anchors.dim() == 2 else anchors[None]
    device = anchors.device
    b, num_segments = anchors.shape
    seg_len = (
        prefix_len + block_size
    )  # every segment has the same shape: sizes are host ints, nothing is read back
    token = torch.arange(num_segments * seg_len, device=device)
    seg_of, idx_in_seg = (
        token // seg_len,
        token % seg_len,
    )  # (T,) segment of each token, index inside it
    is_prefix = idx_in_seg < prefix_len  # (T,)
    causal_idx = torch.arange(num_causal, device=device)
    seg_anchor = anchors[:, seg_of]  # (b, T) causal index each segment token hangs off
    cc = (causal_idx[None, :] <= causal_idx[:, None]).expand(
        b, -1, -1
    )  # (b, N, N) causal rows: j <= i
    cs = torch.zeros(
        b, num_causal, len(seg_of), dtype=torch.bool, device=device
    )  # (b, N, T) and no segment
    sc = (
        causal_idx[None, None, :] <= seg_anchor[:, :, None]
    )  # (b, T, N) segment rows: the stream up to the anchor
    same = seg_of[:, None] == seg_of[None, :]
    ss = same & (
        (idx_in_seg[None, :] <= idx_in_seg[:, None]) | ~is_prefix[:, None]
    )  # (T, T) own segment, MASK: all
    mask = torch.cat(
        [torch.cat([cc, cs], 2), torch.cat([sc, ss.expand(b, -1, -1)], 2)], 1
    )  # (b, q, q)
    mask = torch.cat(
        [torch.ones(b, mask.shape[1], past_len, dtype=torch.bool, device=device), mask], 2
    )
    positions = (
        torch.cat([causal_idx.expand(b, -1), seg_anchor + 1 + idx_in_seg], 1) + past_len
    )  # (b, q)
    return mask[:, None], positions


# ----------------------------------------------------------------------------------------------------------------------
# Training: blockwise denoising + auxiliary autoregressive supervision (Fig. 1a)


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
):
    """K anchors per row, uniformly without replacement among positions p whose next token is a response token.
    Returns anchors (b, K) sorted, and valid (b, K) (False where a row has fewer than K candidates)."""
    b, length = loss_mask.shape
    candidate = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidate[:, :-1] = loss_mask[:, 1:].bool()
    scores = torch.rand(
        b, length, generator=generator, device=generator.device if generator else "cpu"
    )
    scores = scores.to(loss_mask.device).masked_fill(~candidate, -1.0)
    top = scores.topk(min(num_anchors, length), dim=1)
    anchors, order = top.indices.sort(dim=1)
    return anchors, top.values.gather(1, order) >= 0


def _packed_hidden(drafter, input_ids, anchors, block_size):
    """Training-shape pass: hidden states of the causal stream (b, L, H) and of a MASK block per anchor (b, K, B, H)."""
    length, num_anchors = input_ids.shape[1], anchors.shape[1]
    hidden = drafter.hidden_states(
        *_packed_inputs(drafter, input_ids, anchors, block_size)
    )  # (b, L + K*B, H)
    return hidden[:, :length], hidden[:, length:].unflatten(1, (num_anchors, block_size))


def _packed_inputs(drafter, input_ids, anchors, block_size):
    """(ids, positions, mask) of the packed sequence: the causal stream, then a block of B MASKs per anchor."""
    b, length = input_ids.shape
    mask, positions = packed_attention_mask(length, anchors, block_size)
    masks = torch.full(
        (b, anchors.shape[1] * block_size),
        drafter.d3d_config.mask_token_id,
        device=input_ids.device,
    )
    return torch.cat([input_ids, masks], 1), positions, mask


def draft_rows(
    anchor: torch.Tensor, mask_start: torch.Tensor, block_size: int, d1_from: str
) -> torch.Tensor:
    """Where a block's draft d_1 .. d_B is read, one rule for validation and decoding: rows (..., B) of a packed pass,
    its B MASK rows from `mask_start` on, except d_1 when d1_from is "causal" (ours): then d_1 is the causal
    stream's next-token prediction at `anchor`, the token the block hangs off (the head L_AR trains). "mask": MASK 1.
    anchor, mask_start: row indices (...), broadcast together."""
    anchor, mask_start = torch.broadcast_tensors(anchor, mask_start)
    rows = mask_start[..., None] + torch.arange(block_size, device=mask_start.device)
    if d1_from == "causal":
        rows[..., 0] = anchor
    return rows


def cross_entropy(
    drafter: Drafter, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of the drafter's logits at `hidden` (N, H) against `labels` (N,), and its argmax (N,)."""

    def chunk(h, y):
        log_p = torch.log_softmax(drafter.logits(h), -1)  # (n, V), float32
        return -log_p.gather(-1, y[:, None])[:, 0], log_p.argmax(-1)

    return in_logit_chunks(drafter.d3d_config.target_vocab_size, chunk, hidden, labels)


def _block_labels(input_ids, loss_mask, anchors, valid, block_size):
    """Targets x_{a+i} (i = 1..B) of every block, and where they count (exist, are response, anchor valid)."""
    length = input_ids.shape[1]
    idx = anchors[:, :, None] + torch.arange(1, block_size + 1, device=anchors.device)  # (b, K, B)
    inside, idx = idx < length, idx.clamp(max=length - 1)
    labels = input_ids.gather(1, idx.flatten(1)).view_as(idx)
    counts = inside & loss_mask.bool().gather(1, idx.flatten(1)).view_as(idx) & valid[:, :, None]
    return labels, counts


def d3d_loss(
    drafter: Drafter,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    num_anchors: int | None = None,
    block_size: int | None = None,
    ar_weight: float | None = None,
    decay_gamma: float | None = None,
    generator: torch.Generator | None = None,
):
    """L = L_block + lambda * L_AR on right-padded input_ids (b, L), loss_mask (b, L) True on response tokens. L_block:
    cross-entropy of block k position i against x_{a_k+i}, weighted exp(-(i-1)/gamma) if gamma is set; L_AR: the
    causal stream's next-token loss; settings default to the config's. Returns (loss, {loss_block, loss_ar,
    block_acc (B,) per block position})."""
    cfg = drafter.d3d_config
    num_anchors, block_size = num_anchors or cfg.num_anchors, block_size or cfg.block_size
    ar_weight = cfg.ar_weight if ar_weight is None else ar_weight
    decay_gamma = cfg.decay_gamma if decay_gamma is None else decay_gamma
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
    causal_hidden, block_hidden = _packed_hidden(
        drafter, input_ids, anchors, block_size
    )  # (b, L, H), (b, K, B, H)
    labels, counts = _block_labels(input_ids, loss_mask, anchors, valid, block_size)  # (b, K, B)
    steps = torch.arange(block_size, device=input_ids.device)
    weights = (
        torch.exp(-steps / decay_gamma)
        if decay_gamma
        else torch.ones(block_size, device=input_ids.device)
    )
    token_loss, predicted = cross_entropy(
        drafter, block_hidden[counts], labels[counts]
    )  # labelled block rows
    w = (counts * weights)[counts]
    loss_block = (token_loss * w).sum() / w.sum().clamp(min=1e-8)
    loss_ar = torch.zeros((), device=input_ids.device)
    if ar_weight > 0:
        has_label = loss_mask[:, 1:].bool()  # causal row j predicts x_{j+1}: response tokens only
        ar_tok, _ = cross_entropy(
            drafter, causal_hidden[:, :-1][has_label], input_ids[:, 1:][has_label]
        )
        loss_ar = ar_tok.sum() / has_label.sum().clamp(min=1)
    with torch.no_grad():
        correct = torch.zeros_like(counts)
        correct[counts] = predicted == labels[counts]
        block_acc = correct.sum((0, 1)) / counts.sum((0, 1)).clamp(min=1)
    return loss_block + ar_weight * loss_ar, {
        "loss_block": loss_block.detach(),
        "loss_ar": loss_ar.detach(),
        "block_acc": block_acc,
    }


@torch.no_grad()
def offline_tau(
    drafter: Drafter,
    input_ids,
    loss_mask,
    *,
    num_anchors: int = 32,
    block_size: int | None = None,
    d1_from: str | None = None,
    generator: torch.Generator | None = None,
    at=None,
) -> torch.Tensor:
    """Validation tau without the target (the responses are its greedy output): a block drafted at anchor a, d_1 as
    `d1_from` says (default: the config's), is accepted as far as it matches x_{a+1} .... `at`: (anchors, valid) as
    sample_anchors returns them (default: drawn here). Returns tau (accepted + 1) per valid anchor."""
    block_size = block_size or drafter.d3d_config.block_size
    anchors, valid = at or sample_anchors(loss_mask, num_anchors, generator)
    length, num_anchors = input_ids.shape[1], anchors.shape[1]
    hidden = drafter.hidden_states(
        *_packed_inputs(drafter, input_ids, anchors, block_size)
    )  # (b, L + K*B, H)
    mask_starts = length + block_size * torch.arange(num_anchors, device=anchors.device)
    rows = draft_rows(
        anchors, mask_starts, block_size, d1_from or drafter.d3d_config.d1_from
    )  # (b, K, B)
    rows = hidden.gather(1, rows.flatten(1)[..., None].expand(-1, -1, hidden.shape[-1])).unflatten(
        1, rows.shape[1:]
    )
    labels, counts = _block_labels(input_ids, loss_mask, anchors, valid, block_size)
    (draft,) = in_logit_chunks(
        drafter.d3d_config.target_vocab_size,
        lambda h: (drafter.logits(h).argmax(-1),),
        rows[valid].flatten(0, 1),
    )  # the draft, a few rows of logits at a time
    hit = (draft.view_as(labels[valid]) == labels[valid]) & counts[
        valid
    ]  # (num_valid, B), past the end: a miss
    return (hit.long().cumprod(-1).sum(-1) + 1).float()


# ----------------------------------------------------------------------------------------------------------------------
# Drafting, verification and acceptance


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs (..., V); draws on the generator's device so seeded runs are reproducible."""
    device = generator.device if generator is not None else probs.device
    flat = probs.reshape(-1, probs.shape[-1]).to(device)
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1]).to(probs.device)


def pick_tokens(logits: torch.Tensor, temperature: float, generator=None):
    """Greedy (temperature 0) or sampled tokens from logits (..., V). Returns (tokens, probs or None)."""
    if temperature == 0:
        return logits.argmax(-1), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return _sample(probs, generator), probs


@torch.no_grad()
def draft_block(
    drafter: Drafter,
    cache: KVCache,
    new_tokens: torch.Tensor,
    block_size: int,
    width: int | None = None,
) -> torch.Tensor:
    """One drafter pass over the committed tokens it has not read, new_tokens (1, m) ending with x_n, + a MASK block
    off x_n (its KV dropped again). `width`: the causal part padded to this many tokens (one shape for every m; the
    pads come after x_n and no block sees them). Returns the draft logits (B, V): row i-1 drafts position n+i."""
    m, device, start = new_tokens.shape[1], new_tokens.device, cache.length
    width = max(width or m, m)
    last = torch.tensor([m - 1], device=device)  # x_n, the token the block hangs off
    mask, positions = packed_attention_mask(width, last, block_size, past_len=start)
    masks = torch.full((1, block_size), drafter.d3d_config.mask_token_id, device=device)
    hidden = cache.run(
        torch.cat([F.pad(new_tokens, (0, width - m)), masks], 1), positions, mask
    )  # (width + B, H)
    cache.rewind(start + m)
    return drafter.logits(
        hidden[
            draft_rows(last, last.new_full((1,), width), block_size, drafter.d3d_config.d1_from)[0]
        ]
    )


@torch.no_grad()
def verify_block(cache: KVCache, last_token: torch.Tensor, draft: torch.Tensor):
    """One target pass on [x_n, d_1 .. d_B] (cache holds x_0 .. x_{n-1}). Returns logits (B+1, V): row i is the
    target's distribution for the token after x_n, d_1 .. d_i."""
    return causal_pass(
        cache, torch.cat([last_token.view(1), draft])[None]
    )  # [shape 2]: draft is always (B,)


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for a 0-d device index, without reading it (plain indexing with a 0-d tensor reads it back)."""
    return x.index_select(0, index.view(1))[0]


def accept_draft(
    p_logits: torch.Tensor,
    draft: torch.Tensor,
    q_draft: torch.Tensor | None,
    temperature: float,
    generator=None,
    length: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_accepted, next_token) as 0-d tensors, left on the device (the round reads them with its one host read).
    Greedy: accept d_i while it is the target's argmax, then take the argmax. Sampling (lossless): accept d_i with
    probability min(1, p(d_i) / q(d_i)); at the first rejection draw from max(p - q, 0) normalised; after full
    acceptance draw the bonus token from p. Only the first `length` tokens count (default all): pads never do."""
    block_size = draft.shape[0]
    real = torch.arange(block_size, device=draft.device) < (
        block_size if length is None else length
    )  # (B,)
    if temperature == 0:
        target_tokens = p_logits.argmax(-1)  # (B+1,)
        num_accepted = ((draft == target_tokens[:block_size]) & real).long().cumprod(0).sum()
        return num_accepted, _at(target_tokens, num_accepted)
    p_target = torch.softmax(p_logits.float() / temperature, dim=-1)  # (B+1, V)
    rows = torch.arange(block_size, device=draft.device)
    p_d, q_d = p_target[rows, draft], q_draft[rows, draft]
    device = p_d.device if generator is None else generator.device  # seeded: the generator's device
    u = torch.rand(block_size, generator=generator, device=device).to(p_d.device)
    num_accepted = (
        ((u * q_d <= p_d) & real).long().cumprod(0).sum()
    )  # u < p/q without dividing by a tiny q
    p_next = _at(p_target, num_accepted)  # (V,) the target's law after the accepted prefix
    residual = (p_next - _at(F.pad(q_draft, (0, 0, 0, 1)), num_accepted)).clamp(
        min=0
    )  # past the draft: q = 0
    residual = torch.where(
        residual.sum() > 0, residual, p_next
    )  # p == q up to rounding: rejection had prob. ~0
    law = torch.where(
        real.sum() == num_accepted, p_next, residual
    )  # all accepted: the bonus token from p
    return num_accepted, _sample(law / law.sum(), generator)


# ----------------------------------------------------------------------------------------------------------------------
# Decoding loops: target-only (the reference) and synchronous speculative decoding


def _prefill(
    caches: Caches, input_ids, selection, out: Output, clock: Clock, temperature, generator
) -> None:
    """The target prefills the prompt (or the chunks selective prefill kept) and produces the first token itself;
    the drafter reads the prompt (selective prefill: it already has), so that its first draft starts at x_n."""
    ids, positions = input_ids, torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    if selection is not None:
        ids, positions = selection["kept_ids"], selection["kept_positions"]
    caches.target.reset(skipped=input_ids.shape[1] - ids.shape[1])
    if caches.drafter is not None and selection is None:
        caches.drafter.reset()
    if out.done:
        return
    with clock.span("prefill"):
        logits = prefill(caches.target, ids, positions)[-1]
        out.commit(read_round([pick_tokens(logits, temperature, generator)[0]], caches.target))
        if caches.drafter is not None and selection is None:
            prefill(caches.drafter, input_ids)


def _decode_target(out: Output, caches: Caches, clock: Clock, temperature, generator) -> None:
    """Plain autoregressive decoding with the target alone: the reference output and the speedup baseline."""
    token = torch.tensor([out.tokens[-1:]], device=caches.target.device)  # (1, 1)
    while not out.done:
        logits = causal_pass(caches.target, token)[-1]  # [shape 1]
        token = pick_tokens(logits, temperature, generator)[0].view(1, 1)
        out.commit(read_round([token], caches.target))  # [one read]


def _decode_sync(
    drafter, out: Output, caches: Caches, clock: Clock, block_size, temperature, generator
) -> None:
    """Draft a block, verify it, commit, repeat. At the top of a round (committed x_0 .. x_n): target cache =
    x_0 .. x_{n-1} (x_n goes with the draft); drafter cache = x_0 .. x_{d-1}, n - B <= d <= n (it reads the rest,
    padded to B + 1 tokens, in its next pass)."""
    tc, dc = caches.target, caches.drafter
    while not out.done:
        with clock.span("draft"):
            new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
            draft_logits = draft_block(
                drafter, dc, new_tokens, block_size, width=block_size + 1
            )  # [shape 3]
            draft, q_draft = pick_tokens(draft_logits, temperature, generator)
        with clock.span("verify"):
            p_logits = verify_block(tc, new_tokens[0, -1], draft)
            num_accepted, next_token = accept_draft(
                p_logits, draft, q_draft, temperature, generator
            )
        num_accepted, next_token, *tokens = read_round(
            [num_accepted, next_token, draft], tc, dc
        )  # [one read]
        out.commit_round(tokens[:num_accepted], next_token)
        tc.rewind(len(out.tokens) - 1)  # keep x_0 .. x_n, d_1 .. d_a


# ----------------------------------------------------------------------------------------------------------------------
# Asynchronous speculative decoding (Fig. 1c, Fig. 3)
#
# Two rules shape the loops, so that compiled passes (CUDA graphs on a GPU) replay and the host never waits mid-round.
# Fixed shapes: a decoding pass has one of five shapes (q tokens; tagged [shape n] where the code fixes them):
#   1  target   1                  a target-only step
#   2  target   B + 1              verify [x_n, d_1 .. d_B]; after a full-acceptance hit the next draft has B - 1
#                                  real tokens and a pad that is never accepted, so one shape serves both
#   3  drafter  B + 1 + B          sync draft: the unread committed tokens (1 .. B + 1) padded to B + 1, then B MASKs
#   4  drafter  1 + B              async fallback draft: x_n and B MASKs
#   5  drafter  1 + B + S (1 + B)  async packed pass: x_n, d_1 .. d_B, then S = C F + 1 segments [token, B MASKs];
#                                  the drafter's cache rewinds to x_0 .. x_{n-1} first, so x_n is always re-read
# One host read [one read]: a round's outcome (accepted, next token, hit, draft) comes back in one read_round; all
# before it (plan, build, verify, accept, find the hit) is queued without waiting (sampling with a generator on
# another device than the model's copies the probabilities to it: reproducible, at the cost of a wait).


def default_budget(block_size: int) -> tuple[int, int]:
    """Branch budget (coverage C, fanout F): the paper's C = 12, F = 2 at B = 16, scaled with B."""
    return max(1, min(block_size, round(0.75 * block_size))), 2


def plan_branches(
    draft_logits: torch.Tensor,
    draft: torch.Tensor,
    coverage: int,
    fanout: int,
    cover: str = "first",
):
    """The outcomes that get a branch: C positions k x F candidates (the drafter's F likeliest tokens at k but d_k).
    cover="first": k = 1 .. C; "likely": the C largest r_k = prod_{j<k} c_j * (1 - c_k), c_j the drafter's probability
    of d_j (as in D2SD). Returns positions (C,) ascending and candidates (C, F), left on the device (no wait)."""
    block_size, vocab = draft_logits.shape
    coverage, fanout = min(coverage, block_size), min(fanout, vocab - 1)
    if cover == "first":
        positions = torch.arange(1, coverage + 1, device=draft.device)
    else:  # "likely"
        c = torch.softmax(draft_logits, -1).gather(1, draft[:, None])[
            :, 0
        ]  # (B,) drafter's confidence in d_k
        reach = torch.cat([torch.ones_like(c[:1]), torch.cumprod(c, 0)[:-1]])  # prod_{j<k} c_j
        positions = torch.topk(reach * (1 - c), coverage).indices.sort().values + 1
    others = draft_logits.scatter(
        -1, draft[:, None], float("-inf")
    )  # d_k is never its own alternative
    return positions, others.topk(fanout, dim=-1).indices[positions - 1]  # (C,), (C, F)


def build_branch_pass(
    drafter: Drafter,
    last_token,
    draft,
    positions,
    candidates,
    *,
    past_len: int,
    block_size: int,
    length: int | None = None,
):
    """Input of the packed pass that drafts the next block for each planned outcome of verifying `draft` (B,).

    Causal stream: x_n (`last_token`, (1,); the cache holds x_0 .. x_{n-1}), then d_1 .. d_B (the accepted drafts get
    their KV here). Then C x F segments [t, MASK x B], t at position n+k off d_{k-1} (d_0 = x_n): "d_k rejected, the
    target said t"; last [d_L, MASK x B] off d_{L-1}, guessing the bonus token and on (L = `length`, the real draft
    tokens; default B). A segment's first draft token is read where draft_block reads it (draft_rows): the causal head
    at t (or d_L) under d1_from="causal", MASK 1 under "mask" (in the example: the row of t1, or the MASK after it).
    Example with B = L = 3, C = 2, F = 1, blocks of 2 MASKs shown; the cache is visible to all:

                     x_n d_1 d_2 d_3 | t1 m m | t2 m m | d_3 m m
        x_n (n)      x               |        |        |
        d_1 (n+1)    x   x           |        |        |               causal stream: x_n, then the draft
        d_2 (n+2)    x   x   x       |        |        |
        d_3 (n+3)    x   x   x   x   |        |        |
        t1  (n+1)    x               | x      |        |               branch (1, t1): d_1 rejected, target said t1;
        m   (n+2)    x               | x  x x |        |               drafts x_{n+2} (row t1 or this MASK), x_{n+3}
        m   (n+3)    x               | x  x x |        |
        t2  (n+2)    x   x           |        | x      |               branch (2, t2): d_1 accepted, d_2 rejected
        m   (n+3)    x   x           |        | x  x x |
        m   (n+4)    x   x           |        | x  x x |
        d_3 (n+3)    x   x   x       |        |        | x             full acceptance, off d_2: guesses the
        m   (n+4)    x   x   x       |        |        | x   x x       bonus x_{n+4} (row d_3 / this MASK), x_{n+5}
        m   (n+5)    x   x   x       |        |        | x   x x

    Built without waiting for the device; its shape depends on B, C and F only. Returns input ids (1, q), position
    ids (1, q), mask (1, 1, q, past+q) and the rows (S, B) drafting each segment's block (draft_rows), in the order of
    candidates.flatten(), then full acceptance."""
    fanout = candidates.shape[1]
    length = draft.shape[0] if length is None else length
    anchors = (
        torch.cat(
            [positions[:, None].expand(-1, fanout).flatten(), positions.new_full((1,), length)]
        )
        - 1
    )
    segments = torch.full(
        (len(anchors), 1 + block_size), drafter.d3d_config.mask_token_id, device=draft.device
    )  # [shape 5]: S = C F + 1 segments whatever the draft
    segments[:, 0] = torch.cat([candidates.flatten(), draft[length - 1 : length]])
    num_causal = 1 + draft.shape[0]
    ids = torch.cat([last_token, draft, segments.flatten()])[None]
    mask, position_ids = packed_attention_mask(
        num_causal, anchors, block_size, prefix_len=1, past_len=past_len
    )
    mask_starts = (
        num_causal + 1 + (1 + block_size) * torch.arange(len(anchors), device=draft.device)
    )
    return (
        ids,
        position_ids,
        mask,
        draft_rows(mask_starts - 1, mask_starts, block_size, drafter.d3d_config.d1_from),
    )


def cache_hit(
    drafter: Drafter,
    block_hidden,
    positions,
    candidates,
    num_accepted,
    next_token,
    length: int,
    temperature: float,
    generator=None,
) -> torch.Tensor:
    """The cache hit: which segment of the packed pass was prepared for the outcome (a = num_accepted, c = next_token),
    as a 0-d device tensor; -1 on a miss. The branch planned for position k = a+1 and token t = c if there is one,
    else the full-acceptance segment if a = length and its first draft row guessed c (the bonus token: the causal head
    at d_L under d1_from="causal", MASK 1 under "mask"; it needs B > 1: the segment's other rows are the next draft).
    Computed on the device, so the round still reads the host once."""
    num_segments, block_size = block_hidden.shape[:2]
    guess = pick_tokens(drafter.logits(block_hidden[-1, 0]), temperature, generator)[
        0
    ]  # the bonus token's guess
    branch = (
        (positions[:, None] == num_accepted + 1) & (candidates == next_token)
    ).flatten()  # (C*F,)
    full = (num_accepted == length) & (guess == next_token) & (block_size > 1)
    first = (
        torch.cat([branch, full[None]]).long().cumsum(0) == 0
    ).sum()  # index of the first match; S if none
    return torch.where(first < num_segments, first, -1)


class _Lanes:
    """Runs verification and the packed pass side by side (lanes=2): on CUDA in two streams (verify's of higher
    priority), on a CPU the packed pass in a worker thread (the two share the cores: each gets half of torch's
    threads); lanes=1: one after the other. The clock gets each pass's time and the two together's ("both")."""

    def __init__(self, device: torch.device, lanes: int):
        self.streams, self.pool = device.type == "cuda" and lanes > 1, None
        if self.streams:
            self.main = torch.cuda.current_stream(device)
            self.verify_stream = torch.cuda.Stream(
                device, priority=-1
            )  # the critical path goes first
            self.draft_stream = torch.cuda.Stream(device)
        elif lanes > 1:
            self.pool, self.threads = ThreadPoolExecutor(1, "packed-pass"), torch.get_num_threads()
            torch.set_num_threads(max(1, self.threads // 2))

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()
            torch.set_num_threads(self.threads)

    def both(self, verify, packed, clock: Clock):
        with clock.span("both"):
            if (
                not self.streams
            ):  # a worker thread (kernels release the GIL), or one pass after the other
                future = self.pool.submit(clock.run, "packed_draft", packed) if self.pool else None
                p_logits = clock.run("verify", verify)
                return p_logits, future.result() if future else clock.run("packed_draft", packed)
            self.verify_stream.wait_stream(
                self.main
            )  # both read what the main stream made: the draft, the input
            self.draft_stream.wait_stream(self.main)
            with torch.cuda.stream(self.verify_stream):
                p_logits = clock.run("verify", verify)
            with torch.cuda.stream(self.draft_stream):
                block_hidden = clock.run("packed_draft", packed)
            for stream, result in (
                (self.verify_stream, p_logits),
                (self.draft_stream, block_hidden),
            ):
                self.main.wait_stream(stream)  # join: both are read on the main stream
                result.record_stream(
                    self.main
                )  # made on a side stream: the allocator must not reuse it early
            return p_logits, block_hidden


def _decode_async(
    drafter,
    out: Output,
    caches: Caches,
    clock: Clock,
    block_size,
    temperature,
    generator,
    coverage,
    fanout,
    cover,
    lanes: int,
) -> dict:
    """While the target verifies [x_n, d_1 .. d_B], one packed drafter pass prepares the next draft for the likely
    outcomes. Each round: (a) plan and build the packed pass; (b) verify while it runs; (c) commit the accepted prefix
    and the target's token c; a prepared outcome's block is the next draft (a cache hit), else the drafter drafts it
    (a miss: fallback draft). Returns hits and misses per outcome (index k-1: rejection at k; B:
    full acceptance) and pad_full_acceptances: the rounds that accepted a padded draft (B - 1
    tokens and a pad) whole."""
    tc, dc = caches.target, caches.drafter
    hits, misses = [0] * (block_size + 1), [0] * (block_size + 1)
    pad_full = 0  # padded drafts accepted whole: their bonus token is drawn at the pad's row
    lane = _Lanes(dc.device, lanes)
    draft_logits, length = (
        None,
        block_size,
    )  # the next draft (None: not prepared) and its real tokens
    try:
        while not out.done:
            n = len(out.tokens) - 1
            last = torch.tensor(out.tokens[n:], device=dc.device)  # (1,) x_n, copied to the device
            if (
                draft_logits is None
            ):  # a fallback draft (a miss, or the first round): its pass reads x_n
                with clock.span("fallback_draft"):
                    draft_logits, length = (
                        draft_block(drafter, dc, last[None], block_size),
                        block_size,
                    )  # [shape 4]
                    dc.rewind(
                        n
                    )  # x_n again in the packed pass, whose causal stream always starts there [shape 5]
            # (a) plan and build, on the device
            draft, q_draft = pick_tokens(
                draft_logits, temperature, generator
            )  # (B,), padded if length < B
            positions, candidates = plan_branches(draft_logits, draft, coverage, fanout, cover)
            ids, position_ids, mask, block_rows = build_branch_pass(
                drafter,
                last,
                draft,
                positions,
                candidates,
                past_len=dc.length,
                block_size=block_size,
                length=length,
            )
            # (b) verify while the packed pass prepares the next draft
            p_logits, block_hidden = lane.both(
                lambda: verify_block(tc, last, draft),
                lambda: dc.run(ids, position_ids, mask)[block_rows],
                clock,
            )  # (S, B, H)
            num_accepted, next_token = accept_draft(
                p_logits, draft, q_draft, temperature, generator, length
            )
            hit = cache_hit(
                drafter,
                block_hidden,
                positions,
                candidates,
                num_accepted,
                next_token,
                length,
                temperature,
                generator,
            )
            num_accepted, next_token, hit, *tokens = read_round(
                [num_accepted, next_token, hit, draft], tc, dc
            )  # [one read]
            # (c) resolve: commit, rewind both caches; on a cache hit the prepared block is the next draft
            out.commit_round(tokens[:num_accepted], next_token)
            tc.rewind(len(out.tokens) - 1)
            dc.rewind(
                n + 1 + num_accepted
            )  # keep x_0 .. x_n, d_1 .. d_a; drop rejected drafts and branches
            (hits if hit >= 0 else misses)[
                block_size if num_accepted == length else num_accepted
            ] += 1
            pad_full += length < block_size and num_accepted == length
            draft_logits = None
            if hit >= 0 and not out.done:
                # the full-acceptance segment's first draft row guessed the bonus token (d1_from="causal": the causal
                # head at d_L; "mask": MASK 1), so its other B - 1 rows are the next draft and a pad row (zero logits,
                # never accepted) makes it B [shape 2, 5]; a rejection branch's B rows are the next draft as they are
                full = hit == block_hidden.shape[0] - 1
                draft_logits = drafter.logits(block_hidden[hit, 1:] if full else block_hidden[hit])
                draft_logits, length = (
                    F.pad(draft_logits, (0, 0, 0, int(full))),
                    block_size - int(full),
                )
    finally:
        lane.close()
    return {
        "hits_per_position": hits,
        "misses_per_position": misses,
        "pad_full_acceptances": pad_full,
        "coverage": coverage,
        "fanout": fanout,
        "cover": cover,
        "lanes": lanes,
    }


# ----------------------------------------------------------------------------------------------------------------------
# Progressive layer pruning with recovery distillation (Fig. 1b)


def adjusted_teacher(
    teacher_logits: torch.Tensor, labels: torch.Tensor, beta: float
) -> torch.Tensor:
    """The recovery target (ours): q = (1 - beta) * softmax(teacher) + beta * onehot(label). Sums to one."""
    q = (1 - beta) * torch.softmax(teacher_logits.float(), -1)
    return q.scatter_add(
        -1, labels[..., None], torch.full_like(q[..., :1], beta)
    )  # + beta at the label, no one-hot


def distill_loss(
    student: Drafter,
    teacher: Drafter,
    input_ids,
    loss_mask,
    *,
    beta: float = 0.5,
    num_anchors: int | None = None,
    block_size: int | None = None,
    generator=None,
) -> torch.Tensor:
    """Cross-entropy of the student against the adjusted teacher (no gradients) on one packed batch: the blocks
    (targets x_{a+i}) and the causal stream (targets x_{j+1}), response tokens only, the two terms weighted alike."""
    cfg = student.d3d_config
    num_anchors, block_size = num_anchors or cfg.num_anchors, block_size or cfg.block_size
    anchors, valid = sample_anchors(loss_mask, num_anchors, generator)
    labels, counts = _block_labels(input_ids, loss_mask, anchors, valid, block_size)
    with torch.no_grad():
        t_causal, t_block = _packed_hidden(teacher, input_ids, anchors, block_size)
    s_causal, s_block = _packed_hidden(student, input_ids, anchors, block_size)
    has_label = loss_mask[:, 1:].bool()

    def chunk(h, y, t_h):
        with torch.no_grad():
            q = adjusted_teacher(teacher.logits(t_h), y, beta)
        log_p = torch.log_softmax(student.logits(h), -1).clamp(
            min=-1e4
        )  # MASK: q = 0, log_p = -inf; keep 0*-inf out
        return (-(q * log_p).sum(-1),)

    loss = torch.zeros((), device=input_ids.device)
    for s, t, y, where in (
        (s_block, t_block, labels, counts),
        (s_causal[:, :-1], t_causal[:, :-1], input_ids[:, 1:], has_label),
    ):
        (token_loss,) = in_logit_chunks(
            student.d3d_config.target_vocab_size, chunk, s[where], y[where], t[where]
        )
        loss = loss + token_loss.sum() / where.sum().clamp(min=1)
    return loss


@torch.no_grad()
def validation_tau(
    drafter: Drafter, batches, *, num_anchors: int = 32, seed: int = 0
) -> tuple[float, float]:
    """Mean offline tau and block cross-entropy over (input_ids, loss_mask) batches, on the same anchors every call
    (fixed seed) so that candidates are compared on identical blocks."""
    generator = torch.Generator().manual_seed(seed)
    taus, losses = [], []
    for input_ids, loss_mask in batches:
        taus.append(
            offline_tau(drafter, input_ids, loss_mask, num_anchors=num_anchors, generator=generator)
        )
        _, metrics = d3d_loss(
            drafter,
            input_ids,
            loss_mask,
            num_anchors=num_anchors,
            ar_weight=0.0,
            generator=torch.Generator().manual_seed(seed),
        )
        losses.append(metrics["loss_block"].item())
    return torch.cat(taus).mean().item(), sum(losses) / len(losses)


@contextlib.contextmanager
def _only_layers(drafter: Drafter, layer_ids: list[int]):
    """Keep only decoder layers `layer_ids` for the duration; yields the decoder."""
    decoder, config = drafter.model.get_decoder(), drafter.model.config
    layers, layer_types = decoder.layers, getattr(config, "layer_types", None)
    keep_layers(drafter.model, layer_ids)
    try:
        yield decoder
    finally:  # every layer back, numbered 0..n-1 again
        decoder.layers, config.layer_types = layers, layer_types
        keep_layers(drafter.model, list(range(len(layers))))


@torch.no_grad()
def tau_without_each_layer(
    drafter: Drafter, batches, *, num_anchors: int = 32, seed: int = 0
) -> dict[int, float]:
    """{i: offline tau of the drafter without decoder layer i}, each from validation_tau on the same anchors.
    fast.tau_without_each_layer gives the same numbers from one recorded pass per batch, at a fraction of the cost."""
    scores, num_layers = {}, len(drafter.model.get_decoder().layers)
    for i in tqdm(range(num_layers), desc="score layers", leave=False):
        with _only_layers(drafter, [j for j in range(num_layers) if j != i]):
            scores[i] = validation_tau(drafter, batches, num_anchors=num_anchors, seed=seed)[0]
    return scores


def _original_ids(drafter: Drafter) -> list[int]:
    """The drafter's decoder layers, by their index in the checkpoint it was made from."""
    return drafter.d3d_config.layer_ids or list(range(len(drafter.model.get_decoder().layers)))


def remove_layer(drafter: Drafter, index: int) -> None:
    """Remove decoder layer `index` for good (in place); d3d_config.layer_ids keeps the original indices."""
    original = _original_ids(drafter)
    keep_layers(drafter.model, [i for i in range(len(original)) if i != index])
    drafter.d3d_config.layer_ids = [layer for i, layer in enumerate(original) if i != index]


def least_costly_layer(
    drafter: Drafter, scores: dict[int, float], val_batches, *, num_anchors: int = 32, seed: int = 0
) -> int:
    """The layer whose removal costs least tau (`scores`: tau without each layer); ties, common for weak drafters, go
    to the smallest change in block loss (ours)."""
    tied = [i for i in scores if scores[i] == max(scores.values())]
    if len(tied) == 1:
        return tied[0]
    num_layers, measure = (
        len(drafter.model.get_decoder().layers),
        dict(num_anchors=num_anchors, seed=seed),
    )
    _, base_loss = validation_tau(drafter, val_batches, **measure)

    def loss_change(index):
        with _only_layers(drafter, [i for i in range(num_layers) if i != index]):
            return abs(validation_tau(drafter, val_batches, **measure)[1] - base_loss)

    return min(tied, key=loss_change)


def recover(
    drafter: Drafter,
    teacher: Drafter,
    train_batches,
    *,
    steps: int,
    lr: float = 5e-5,
    beta: float = 0.5,
    num_anchors: int = 32,
    generator=None,
    checkpointing: bool = False,
) -> int:
    """Recovery (Fig. 1b): `steps` AdamW steps distilling the pruned drafter toward the fixed unpruned one, its
    distribution adjusted toward the label (distill_loss, beta). A step whose gradient norm is not finite is skipped;
    returns how many were."""
    if steps <= 0:
        return 0
    drafter.train()
    if checkpointing:
        drafter.model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    skipped = 0
    for step in tqdm(range(steps), desc="recover", leave=False):
        input_ids, loss_mask = train_batches[step % len(train_batches)]
        loss = distill_loss(
            drafter,
            teacher,
            input_ids,
            loss_mask,
            beta=beta,
            num_anchors=num_anchors,
            generator=generator,
        )
        loss.backward()
        skipped += not finite_step(optimizer, params, 1.0)
        torch.clear_autocast_cache()  # under a caller's autocast, later passes must not read stale bf16 copies
    if checkpointing:
        drafter.model.activation_checkpointing_disable()
    drafter.eval()
    return skipped


def _undo_removal(drafter: Drafter, snapshot: Drafter, device) -> None:
    """Back to the drafter as it was before the last removal (its host copy)."""
    drafter.model, drafter.d3d_config = snapshot.model.to(device), snapshot.d3d_config


def prune_drafter(
    drafter: Drafter,
    val_batches,
    train_batches,
    *,
    min_layers: int | None = None,
    tau_floor: float | None = None,
    recovery_steps: int = 100,
    lr: float = 5e-5,
    beta: float = 0.5,
    num_anchors: int = 32,
    seed: int = 0,
    checkpointing: bool = False,
    score=None,
):
    """Greedy progressive pruning, in place (Fig. 1b). Each iteration: score every layer by the
    offline tau without it (`score`: tau_without_each_layer, or fast.py's, which is quicker),
    remove the one that costs least, recover for `recovery_steps` steps distilled from the fixed
    unpruned drafter, re-measure tau. Stops at `min_layers`, or after the first removal whose
    recovered tau falls below tau_floor x the unpruned tau (undone: "kept" False). Checks its
    arguments at the call, then returns a generator of rows for the caller to print: the unpruned
    drafter's, then one per iteration (each runs as its row is taken). The copy kept to undo a
    removal waits in host memory; `checkpointing` recomputes each layer's activations in
    recovery's backward."""
    if min_layers is None and tau_floor is None:
        raise ValueError(
            "give a stopping rule: min_layers (a target depth) or tau_floor "
            "(fraction of unpruned tau)"
        )
    if min_layers is not None and min_layers < 1:
        raise ValueError(
            f"min_layers={min_layers}: a drafter keeps at least one decoder layer; give 1 or more"
        )
    if tau_floor is not None and not tau_floor > 0:
        raise ValueError(
            f"tau_floor={tau_floor}: give a positive fraction of the unpruned tau (e.g. 0.9)"
        )
    if recovery_steps < 0:
        raise ValueError(f"recovery_steps={recovery_steps}: give 0 (no recovery) or more")

    def rows():
        teacher = copy.deepcopy(drafter).eval().requires_grad_(False)  # the fixed, unpruned drafter
        measure = dict(num_anchors=num_anchors, seed=seed)
        generator = torch.Generator().manual_seed(seed)
        tau0, _ = validation_tau(drafter, val_batches, **measure)
        yield {
            "iteration": 0,
            "removed_layer": None,
            "layers": len(drafter.model.get_decoder().layers),
            "tau_before_recovery": tau0,
            "tau_after_recovery": tau0,
            "seconds": 0.0,
            "score_seconds": 0.0,
            "kept": True,
        }
        iteration = 0
        while len(drafter.model.get_decoder().layers) > max(1, min_layers or 1):
            iteration, start, original = iteration + 1, time.perf_counter(), _original_ids(drafter)
            score_all = score or tau_without_each_layer
            scores = score_all(drafter.eval(), val_batches, **measure)  # 1. score
            best = least_costly_layer(drafter, scores, val_batches, **measure)
            score_seconds = time.perf_counter() - start
            snapshot = host_copy(drafter) if tau_floor is not None else None
            remove_layer(drafter, best)  # 2. remove
            skipped = recover(
                drafter,
                teacher,
                train_batches,
                steps=recovery_steps,
                lr=lr,
                beta=beta,
                num_anchors=num_anchors,
                generator=generator,
                checkpointing=checkpointing,
            )  # 3. recover
            # 4. re-measure (without recovery, the score is already the pruned drafter's tau)
            tau_after = scores[best]
            if recovery_steps > 0:
                tau_after = validation_tau(drafter, val_batches, **measure)[0]
            kept = tau_floor is None or tau_after >= tau_floor * tau0  # of the unpruned tau
            if not kept:  # below the floor: undo this removal and stop
                _undo_removal(drafter, snapshot, teacher.device)
            candidates = {original[i]: round(tau, 4) for i, tau in scores.items()}
            yield {
                "iteration": iteration,
                "removed_layer": original[best],
                "layers": len(original) - 1,
                "tau_before_recovery": scores[best],
                "tau_after_recovery": tau_after,
                "seconds": time.perf_counter() - start,
                "score_seconds": score_seconds,
                "kept": kept,
                "recovery_skipped": skipped,
                "candidates": candidates,
            }
            if not kept:
                break

    return rows()


# ----------------------------------------------------------------------------------------------------------------------
# Selective prefilling (paper appendix, Fig. 5, Tables 6-7)


@torch.no_grad()
def select_chunks(
    drafter: Drafter,
    input_ids: torch.Tensor,
    *,
    keep_ratio: float,
    chunk_size: int = 64,
    query_window: int = 32,
    cache: KVCache | None = None,
) -> dict:
    """The drafter reads the whole prompt into its cache (`cache`, else a new one) and picks the chunks the target
    prefills: the first, the last, then the best by score (ours: attention from the last `query_window` prompt tokens,
    mean over layers, heads and queries) up to ceil(keep_ratio * num_chunks). Returns kept_ids and kept_positions
    (1, k), drafter_cache (full prompt), chunk_scores, kept_chunks, num_chunks, chunks_kept."""
    if not 0 < keep_ratio <= 1 or chunk_size < 1:
        raise ValueError(
            f"need keep_ratio in (0, 1] and chunk_size >= 1, got {keep_ratio}, {chunk_size}"
        )
    device, length = input_ids.device, input_ids.shape[1]
    window = min(query_window, length)
    cache = cache if cache is not None else KVCache(drafter, length)
    cache.rewind(0)
    if length > window:  # the bulk of the prompt with the fast attention path
        prefill(cache, input_ids[:, : length - window])
    attentions = attention_pass(
        cache, input_ids[:, length - window :]
    )  # per layer: (heads, window, length)
    attention = torch.stack(attentions).mean((0, 1, 2))[
        :length
    ]  # (L,): attention each prompt token receives
    num_chunks = math.ceil(length / chunk_size)
    scores = torch.zeros(num_chunks, device=device).index_add_(
        0, torch.arange(length, device=device) // chunk_size, attention
    )
    num_keep = min(num_chunks, max(2, math.ceil(keep_ratio * num_chunks)))
    ranked = scores.clone()
    ranked[0] = ranked[-1] = float("inf")  # the first and the last chunk are always kept
    kept = sorted(torch.topk(ranked, num_keep).indices.tolist())
    positions = torch.cat(
        [
            torch.arange(c * chunk_size, min((c + 1) * chunk_size, length), device=device)
            for c in kept
        ]
    )
    return {
        "kept_ids": input_ids[:, positions],
        "kept_positions": positions[None],
        "drafter_cache": cache,
        "chunk_scores": scores.tolist(),
        "kept_chunks": kept,
        "num_chunks": num_chunks,
        "chunks_kept": len(kept),
    }


# ----------------------------------------------------------------------------------------------------------------------
# generate: the entry point (target-only, sync, async; selective prefill)


MODES = ("target", "sync", "async")


@torch.no_grad()
def generate(
    target: nn.Module,
    drafter: Drafter | None,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    mode: str = "sync",
    block_size: int | None = None,
    temperature: float = 0.0,
    eos_token_id=None,
    generator: torch.Generator | None = None,
    coverage: int | None = None,
    fanout: int | None = None,
    cover: str = "first",
    keep_ratio: float | None = None,
    chunk_size: int = 64,
    caches: Caches | None = None,
    lanes: int | None = None,
    trace: bool = False,
):
    """Decode input_ids (1, prompt_len) until EOS (kept) or max_new_tokens. Returns (output_ids (1, prompt + new),
    stats: tau, accept_lengths, num_rounds, time per phase, ...; README.md lists every key). mode "target": the target
    alone (drafter may be None); "sync": D3D drafts, verified; "async": the drafter drafts during verification for
    `coverage` x `fanout` outcomes (default_budget(B)) picked by `cover`, in a second lane if lanes=2 (CUDA: a stream;
    CPU: a thread), after it if lanes=1 (None: runtime.async_lanes picks). Greedy output is the target's, token for
    token; sampling is lossless. keep_ratio (lossy): the target prefills only the chunks select_chunks keeps; caches:
    fixed-size KV caches to reuse (default: per request); trace=True adds a Chrome trace. Batches: systems.batched"""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {MODES}")
    block_size = check_request(
        target,
        drafter,
        input_ids,
        max_new_tokens,
        mode,
        block_size,
        temperature,
        coverage,
        fanout,
        cover,
        keep_ratio,
    )  # a clear error for each bad input (runtime.py)
    coverage, fanout = (
        d if v is None else v for v, d in zip((coverage, fanout), default_budget(block_size or 1))
    )
    use_drafter = drafter if mode != "target" or keep_ratio is not None else None
    need = cache_len(
        input_ids.shape[1], max_new_tokens, block_size or 1, coverage * (mode == "async"), fanout
    )
    caches = (
        Caches.make(target, use_drafter, need)
        if caches is None
        else caches.check(target, use_drafter, need)
    )
    # async's lanes by the rule decode.py follows too (runtime.py); the target's size matters only to its default
    num_params = (
        sum(p.numel() for p in target.parameters()) if mode == "async" and lanes is None else 0
    )
    lanes = async_lanes(
        input_ids.device.type, caches.compiled and mode == "async", lanes, num_params
    )
    out, clock = (
        Output(input_ids[0].tolist(), max_new_tokens, eos_token_id),
        Clock(input_ids.device),
    )
    selection = None  # selective prefill: what the target prefills; the drafter's cache holds the full prompt
    if keep_ratio is not None:
        with clock.span("scoring"):
            selection = select_chunks(
                drafter,
                input_ids,
                keep_ratio=keep_ratio,
                chunk_size=chunk_size,
                cache=caches.drafter,
            )
    _prefill(caches, input_ids, selection, out, clock, temperature, generator)
    stats = {}
    if mode == "target":
        _decode_target(out, caches, clock, temperature, generator)
    elif mode == "sync":
        _decode_sync(drafter, out, caches, clock, block_size, temperature, generator)
    else:
        stats = _decode_async(
            drafter,
            out,
            caches,
            clock,
            block_size,
            temperature,
            generator,
            coverage,
            fanout,
            cover,
            lanes,
        )
    stats.update(
        out.stats(clock.totals(), mode, selection), **({"trace": clock.trace()} if trace else {})
    )
    return torch.tensor([out.tokens], device=input_ids.device), stats
