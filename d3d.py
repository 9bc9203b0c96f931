"""D3D: Decoupled Diffusion Drafting for Asynchronous Speculative Decoding (arXiv 2611.06425).

A standalone drafter (a causal LM with the target's tokenizer that never reads the target's
hidden states) fills in a block of B masked future tokens in one pass, so it can draft the next
block while the target verifies this one. (Side by side at lanes = 2; on CUDA the default is one
lane, the two passes one after the other: _decode_async says why.)

Paper -> this file, top to bottom (read it in this order; what can wait: the configs' fields,
make_drafter, Sampler's devices, generate's checks):
    the settings: D3DConfig (the method's: B, MASK, K, lambda), DecodeConfig (decoding's)
    the drafter: make_drafter, Drafter
    packed attention (Fig. 1a): packed_attention_mask
    L_block + lambda L_AR (Fig. 1a): d3d_loss (sample_anchors; where a block is read: draft_rows)
    drafting, verification, acceptance: "Two habits", draft_block, verify_block, accept_draft
    target-only and synchronous decoding: _decode_target, _decode_sync
    asynchronous decoding (Fig. 1c, Fig. 3): the section's box of one round; _decode_async,
        the box as code, and its worked trace; then its steps, plan_branches .. prepared_draft,
        and _Overlap
    layer pruning (Fig. 1b): prune_drafter and what it calls, above it
    selective prefilling (appendix, Fig. 5): select_chunks
    the entry point: generate(mode="target" | "sync" | "async")

Our readings, where the paper is silent (README.md, "Departures and readings"), by function:
    packed_attention_mask    blocks are keyed on positions; overlapping blocks never see
                             each other
    draft_rows               d_1 from the causal row just before a block's MASKs (d1_from)
    make_drafter             MASK: the first id the tokenizer does not use
    d3d_loss                 "blockwise denoising" is one step: a training block is all
                             MASKs (no noise level), as a drafted block is
    default_budget           async branches: C = 0.75 B positions x F = 2 tokens (the paper
                             gives 12 x 2 at B = 16 only)
    first_rejection_chance   cover="likely" ranks positions at temperature 1 when greedy
    prepared_draft           a full-acceptance hit's draft: B - 1 real tokens and a pad
    "Two habits"             fixed shapes: the sync draft pass pads its committed tokens
                             to B + 1; async's drafter reads x_n again in every packed pass
    cross_entropy            the loss projects only labelled rows to V, a few at a time
    adjusted_teacher         pruning recovers toward (1 - beta) softmax(unpruned)
                             + beta onehot(label)
    least_costly_layer       ties in pruning go to the smallest change in block loss
    select_chunks            selective prefill scores a chunk by the attention the last 32
                             prompt tokens give it; the first and last chunks stay

The symbols every section uses -> the code's names (each section adds its own: training's K,
j_k, w_i; async's (i, t), C, F, S, g, rho; pruning's beta). Each letter means one thing in this
file; B, K, C, F, lambda and tau are the paper's, the others this file's notation.
    B           block_size: MASK tokens drafted in one pass
    j           a position in the text: x_j is the token at position j
    x_0 .. x_n  out.tokens: the prompt, then the tokens committed so far; x_n is the last
    i           a block position, i = 1 .. B: a block's i-th token
    d_1 .. d_B  draft: one block's drafted tokens, d_i at position n + i (read: draft_rows)
    R           num_real: a draft's real tokens, B (B - 1 and a pad after a full-acceptance hit)
    a           num_accepted: the accepted prefix d_1 .. d_a
    t           next_token: the target's own token after d_1 .. d_a (its correction of d_{a+1},
                or the bonus token if a = R)
    tau         tau: tokens committed per round (a + 1), mean over rounds
    p, q        p_target, q_draft: the target's and the drafter's token probabilities
    u           a U(0, 1) draw of lossless sampling (accept_draft)
    m           a MASK token, in the mask diagrams (where # marks "may attend")

Shapes: b batch, N causal (clean) tokens, V vocabulary, H hidden size, W the tokens of a pass,
past: tokens already in a KV cache.
Three coordinates: a token's *row* is its place in one pass's input (and so of its hidden
state and logits in that pass's output); its *position* is its place in the text (x_j is at
position j; the position id RoPE sees); its *block position* i says which token of its block
it is. For d_i: the drafter's logits are draft_logits[i - 1], the target's p_logits[i - 1].
All three, row by row, in one table: build_branch_pass.
Words, each in one sense: "mask", an attention mask (bool, True = may attend); "MASK", the
drafter's mask token; loss_mask, True on the response tokens (they carry loss); "segment", a
stretch of a packed pass that hangs off one row of its causal stream, its "root" (a training
block's root is its anchor j_k); "layer", a decoder layer, counted from 0. "Our reading"
marks a choice of this implementation where the paper is silent; "the paper" is always arXiv
2611.06425. Helpers from runtime.py are named where they are used.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn
from tqdm.auto import tqdm

from runtime import (
    Caches,
    Clock,
    KVCache,
    Output,
    Range,
    additive_mask,
    async_lanes,
    attention_pass,
    cache_len,
    causal_pass,
    check_request,
    check_settings,
    finite_step,
    host_copy,
    in_logit_chunks,
    keep_layers,
    load_causal_lm,
    pass_phases,
    prefill,
    read_round,
    setting,
    tokenizer_fingerprint,
    with_settings,
)
from systems.rounds import Watch

MASK_TOKEN = "<|MASK|>"
CONFIG_NAME = "d3d_config.json"


# --------------------------------------------------------------------------------------------------
# Config
#
# From runtime.py: setting(default, help, Range) declares a field with its help and its range;
# check_settings checks every field; with_settings(config, Class, keywords) replaces fields by
# keyword settings (a TypeError names an unknown one). load_causal_lm loads an HF causal LM;
# tokenizer_fingerprint hashes a tokenizer, so a drafter refuses a target with another one.


@dataclass
class D3DConfig:
    """The method's settings, saved as d3d_config.json next to every drafter: the one source of
    B, K, lambda, gamma and d1_from for training, validation and decoding. A variant replaces a
    field: Drafter(drafter.model, replace(drafter.d3d_config, ar_weight=0.0)) measures L_block
    alone (validation_tau). A drafter trained at lambda = 0 reads d_1 at MASK 1, d1_from="mask":
    nothing trains the causal row's guess (draft_rows)."""

    block_size: int = setting(
        16,
        "B: MASK tokens drafted in one pass (paper default 16; Table 4 compares 8/16/32)",
        Range(int, low=1),
    )
    mask_token_id: int = setting(-1, "id of MASK in the drafter's embedding table (make_drafter)")
    num_anchors: int = setting(
        64,
        "K: blocks per training sequence. Table 5 (D3D-1.7B, Qwen3-8B, B = 16, MATH-500): tau "
        "7.89 / 8.14 / 8.15 / 8.17 at K = 16 / 64 / 128 / 256, near saturation at 64",
        Range(int, low=1),
    )
    ar_weight: float = setting(
        1.0,
        "lambda: weight of the auxiliary autoregressive loss L_AR (Table 3: 1.0 is best)",
        Range(float, low=0),
    )
    decay_gamma: float | None = setting(
        None,
        "gamma: block position weights exp(-(i-1)/gamma), gamma > 0; None: uniform weights",
        Range(float, low=0, low_open=True),
    )
    target_vocab_size: int = setting(
        0, "the target's vocabulary size (its output layer); drafter logits are cut to it"
    )
    tokenizer_hash: str = setting(
        "", "fingerprint of the tokenizer the drafter was made for (drivers check the target's)"
    )
    layer_ids: list[int] | None = setting(
        None, "which layers of the initial checkpoint the drafter kept (None: all)"
    )
    d1_from: str = setting(
        "causal",
        'where a block\'s d_1 is read (draft_rows): "causal", the LM head at the token just '
        "before the block's MASKs, x_n when decoding (our reading: the paper is silent); "
        '"mask", at MASK 1',
        Range(str, choices=("causal", "mask")),
    )

    def __post_init__(self):
        check_settings(self)

    @classmethod
    def load(cls, path: str) -> "D3DConfig":
        with open(os.path.join(path, CONFIG_NAME)) as f:
            fields = json.load(f)
        return cls(**fields)


MODES = ("target", "sync", "async")


@dataclass
class DecodeConfig:
    """How generate decodes, in the manner of transformers' GenerationConfig: generate(target,
    drafter, input_ids, config, **settings), each keyword replacing a field. DecodeConfig()
    decodes a fixed 128 new tokens (no EOS stops it), greedily, in sync mode, with the
    drafter's B. None means "not given" in every field: its help says what is used then."""

    max_new_tokens: int = setting(
        128, "tokens decoded after the prompt (fewer if EOS comes first)", Range(int, low=0)
    )
    mode: str = setting(
        "sync",
        '"target": the target alone (the drafter may be None); "sync": D3D drafts a block, the '
        'target verifies it; "async": the drafter drafts the next block during verification',
        Range(str, choices=MODES),
    )
    temperature: float = setting(
        0.0,
        "0: greedy, the target's own output token for token; > 0: sampling, lossless",
        Range(float, low=0),
    )
    eos_token_id: int | list[int] | None = setting(
        None,
        "a token (or a list) that ends the output, kept; None: only max_new_tokens ends it",
        Range(int, low=0, each=True),
    )
    block_size: int | None = setting(
        None, "B: MASK tokens drafted in one pass; None: the drafter's", Range(int, low=1)
    )
    coverage: int | None = setting(
        None,
        "C (async): how many block positions i get rejection branches; None: default_budget(B)",
        Range(int, low=0),
    )
    fanout: int | None = setting(
        None,
        "F (async): candidate tokens t per covered position; None: default_budget(B)",
        Range(int, low=0),
    )
    cover: str = setting(
        "first",
        'which positions C covers (async, plan_branches): "first", i = 1 .. C; "likely", '
        "the C likeliest first rejections",
        Range(str, choices=("first", "likely")),
    )
    lanes: int | None = setting(
        None,
        "async: 2 runs the packed pass beside verification (CUDA: a stream; CPU: a thread), 1 "
        "after it; None: runtime.async_lanes picks (1 on CUDA: _decode_async)",
        Range(int, choices=(1, 2)),
    )
    keep_ratio: float | None = setting(
        None,
        "selective prefill (lossy): the share of prompt chunks the target prefills "
        "(select_chunks); None: the whole prompt",
        Range(float, low=0, high=1, low_open=True),
    )
    chunk_size: int = setting(64, "tokens per prompt chunk of selective prefill", Range(int, low=1))
    trace: bool = setting(False, "add a Chrome trace of the phases (stats['trace'])", Range(bool))

    def __post_init__(self):
        check_settings(self)


# --------------------------------------------------------------------------------------------------
# The standalone drafter


class Drafter(nn.Module):
    """An HF causal LM plus its D3DConfig: `hidden_states` of a packed pass, `logits` over the
    target's vocabulary. One LM head: at a causal token's row it predicts the next token (as
    L_AR trains it), at a MASK's row that MASK's token (which rows a draft reads: draft_rows)."""

    def __init__(self, model: nn.Module, config: D3DConfig):
        super().__init__()
        self.model = model
        self.d3d_config = config

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def hidden_states(self, ids, positions, mask, cache=None) -> torch.Tensor:
        """Last hidden states (b, W, H) of ids (b, W) at positions (b, W); mask: bool (b, 1, W,
        past + W), True = may attend; cache: an HF cache holding the past (KVCache.hf; `cache=`
        is transformers 5's name for past_key_values)."""
        # runtime.additive_mask: the bool mask as the float mask HF's attention adds
        out = self.model.get_decoder()(
            input_ids=ids,
            position_ids=positions,
            attention_mask=additive_mask(mask, self.model),
            cache=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits over the target's vocabulary, MASK excluded."""
        all_logits = self.model.get_output_embeddings()(hidden)
        logits = all_logits[..., : self.d3d_config.target_vocab_size].float()
        if self.d3d_config.mask_token_id < logits.shape[-1]:
            # MASK can never be drafted
            logits[..., self.d3d_config.mask_token_id] = float("-inf")
        return logits

    def forward(self, ids, positions, mask, cache=None) -> torch.Tensor:
        return self.logits(self.hidden_states(ids, positions, mask, cache))

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
    model, mask_token_id=None, *, tokenizer, layers=None, target_vocab_size=None, **config
):
    """Turn any HF causal LM with the target's tokenizer into a D3D drafter. MASK:
    `mask_token_id` (not a text token), else `<|MASK|>` if the tokenizer has it, else the first
    id past the text tokens, len(tokenizer) (embeddings grow only if the table lacks that id).
    `layers`: decoder layers to keep; `target_vocab_size`: default this model's; other
    keywords go to D3DConfig."""
    drafter_vocab = model.get_output_embeddings().weight.shape[0]
    text_vocab = len(tokenizer)
    if drafter_vocab < text_vocab:
        raise ValueError(
            f"the drafter's vocabulary ({drafter_vocab} ids) does not cover the tokenizer's "
            f"{text_vocab} "
            "tokens: initialise the drafter from a checkpoint of the target's family "
            "(same tokenizer)"
        )
    if not target_vocab_size:
        target_vocab_size = drafter_vocab
    if target_vocab_size > drafter_vocab:
        raise ValueError(
            f"the drafter's vocabulary ({drafter_vocab} ids) does not cover the target's "
            f"({target_vocab_size}): initialise the drafter from a checkpoint with the target's "
            "tokenizer and vocabulary"
        )
    named_mask = None
    if MASK_TOKEN in tokenizer.get_vocab():
        named_mask = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if mask_token_id is None:
        mask_token_id = text_vocab
        if named_mask is not None:
            mask_token_id = named_mask
    elif mask_token_id < text_vocab and mask_token_id != named_mask:
        raise ValueError(
            f"mask_token_id {mask_token_id} is the text token "
            f"{tokenizer.convert_ids_to_tokens(mask_token_id)!r}: the target can produce it. Leave "
            f"mask_token_id=None to use a free id (>= {text_vocab})"
        )
    if mask_token_id >= drafter_vocab:
        # no free id: grow the embedding table (and a tied or separate output layer)
        model.resize_token_embeddings(mask_token_id + 1, mean_resizing=False)
    if layers is not None and not layers:
        raise ValueError("a drafter keeps at least one decoder layer, got layers=[]")
    layer_ids = None
    if layers is not None:
        layer_ids = list(layers)
        # runtime.keep_layers: those decoder layers, in place, renumbered from 0
        keep_layers(model, list(layers))
    d3d_config = D3DConfig(
        mask_token_id=mask_token_id,
        target_vocab_size=target_vocab_size,
        tokenizer_hash=tokenizer_fingerprint(tokenizer),
        layer_ids=layer_ids,
        **config,
    )
    return Drafter(model, d3d_config)


# --------------------------------------------------------------------------------------------------
# Packed attention: one causal stream, blocks hanging off points of it (Fig. 1a)
#
# Training's symbols (this section and the next):
#     K        num_anchors: blocks per training sequence (a measurement's own count, in
#              validation and pruning, is val_anchors)
#     k        a training block, k = 1 .. K
#     j_k      anchors: the position block k hangs off; its labels are x_{j_k+1} .. x_{j_k+B}
#     w_i      block position i's weight in L_block, exp(-(i-1)/gamma)
#     lambda   ar_weight: the weight of L_AR in L = L_block + lambda * L_AR
#     gamma    decay_gamma: the decay of w_i (None, the default: every w_i = 1; an option of
#              this implementation)
#     M        the tokens of a pass's segments (W = N + M)


def packed_attention_mask(num_causal: int, roots, block_size: int, *, prefix_len=0, past_len=0):
    """Mask and position ids of a packed sequence [causal stream | segment 1 | segment 2 | ...].

    Rows and positions ("Three coordinates", module docstring): the `num_causal` causal tokens
    are rows 0, 1, ... at positions past_len, past_len + 1, ..., after `past_len` cached tokens
    that every token sees.
    A segment is `prefix_len` prefix tokens (0 in training and draft_block; 1 in the async
    pass) and then a block of `block_size` MASKs. Each segment *hangs off* one causal token,
    its root: roots[..., s] is the row of segment s's root (in training, block k's anchor
    j_k), at position j = past_len + that row, and the segment's tokens sit at positions
    j + 1, j + 2, ....

    Who sees whom: a causal token sees the causal tokens of lower or equal row. A segment token
    sees the causal tokens up to its root (so, by position, nothing after j: two segments
    whose position spans overlap still cannot read each other's future) and no other segment.
    Inside its segment, a prefix token sees the prefix up to itself; a MASK sees it all.

    Example: x_0 .. x_4 (past_len = 0, so row = position), blocks of B = 2 off x_1 and x_3
    (# = may attend, m = a MASK token):

                     x_0 x_1 x_2 x_3 x_4 | m m | m m
        x_0 (pos 0)  #                   |     |
        x_1 (pos 1)  #   #               |     |
        x_2 (pos 2)  #   #   #           |     |
        x_3 (pos 3)  #   #   #   #       |     |
        x_4 (pos 4)  #   #   #   #   #   |     |
        m   (pos 2)  #   #               | # # |          block off x_1: the tokens at 2, 3
        m   (pos 3)  #   #               | # # |
        m   (pos 4)  #   #   #   #       |     | # #      block off x_3: the tokens at 4, 5
        m   (pos 5)  #   #   #   #       |     | # #

    With a prefix (prefix_len = 1, the async pass): one segment [t, m, m] off x_1 of x_0 .. x_2
    (t is the token the segment assumes at position 2; all rows: build_branch_pass's table):

                     x_0 x_1 x_2 | t m m
        x_0 (pos 0)  #           |
        x_1 (pos 1)  #   #       |
        x_2 (pos 2)  #   #   #   |
        t   (pos 2)  #   #       | #              a prefix token: the prefix up to itself
        m   (pos 3)  #   #       | # # #          a MASK: its whole segment
        m   (pos 4)  #   #       | # # #

    test_d3d.py checks both pictures against this function's output, mark by mark.
    In training each MASK row predicts its own token (L_block); where decoding reads a block's
    tokens: draft_rows. Positions may repeat (a block's tokens sit at the positions of causal
    tokens after its root): the mask, not the positions, keeps them apart.

    roots: (S,) or (b, S) long, rows of the causal stream. Returns mask (b, 1, W, past_len +
    W) bool and position_ids (b, W) long, W = num_causal + S * (prefix_len + block_size)."""
    if roots.dim() == 1:
        roots = roots[None]
    device = roots.device
    b, num_segments = roots.shape
    # every segment has the same shape: sizes are host ints
    seg_len = prefix_len + block_size
    token = torch.arange(num_segments * seg_len, device=device)
    seg_of = token // seg_len  # (M,) the segment of each segment token
    place_in_seg = token % seg_len  # (M,) its place inside the segment
    is_prefix = place_in_seg < prefix_len  # (M,)
    causal_row = torch.arange(num_causal, device=device)
    # (b, M) the row of the root each segment token hangs off
    seg_root = roots[:, seg_of]
    # mask[query row, key row]: may the query's token see the key's (below, [:, None] indexes
    # queries and [None, :] keys). Four blocks: [[causal sees causal, causal sees segments],
    #                                            [segment sees causal, segment sees segments]]
    # causal tokens see the causal stream up to themselves (b, N, N), and no segment (b, N, M)
    causal_sees_causal = (causal_row[None, :] <= causal_row[:, None]).expand(b, -1, -1)
    causal_sees_segments = torch.zeros(b, num_causal, len(seg_of), dtype=torch.bool, device=device)
    # segment tokens see the causal stream up to the root (b, M, N)
    segment_sees_causal = causal_row[None, None, :] <= seg_root[:, :, None]
    # and their own segment (M, M): prefix tokens causally, MASKs the whole segment
    same = seg_of[:, None] == seg_of[None, :]
    in_order = place_in_seg[None, :] <= place_in_seg[:, None]
    segment_sees_segments = same & (in_order | ~is_prefix[:, None])
    causal_part = torch.cat([causal_sees_causal, causal_sees_segments], 2)
    segment_part = torch.cat([segment_sees_causal, segment_sees_segments.expand(b, -1, -1)], 2)
    mask = torch.cat([causal_part, segment_part], 1)  # (b, W, W)
    past = torch.ones(b, mask.shape[1], past_len, dtype=torch.bool, device=device)
    mask = torch.cat([past, mask], 2)
    causal_positions = causal_row.expand(b, -1)
    segment_positions = seg_root + 1 + place_in_seg
    positions = torch.cat([causal_positions, segment_positions], 1) + past_len  # (b, W)
    return mask[:, None], positions


# --------------------------------------------------------------------------------------------------
# Training: blockwise denoising + auxiliary autoregressive supervision (Fig. 1a)


def sample_anchors(loss_mask, num_anchors: int, generator=None):
    """`num_anchors` anchors j_k per sequence (K in training), uniformly without replacement
    among the positions j whose next token x_{j+1} is a response token, drawn with `generator`
    (Sampler.uniform). Returns anchors (b, K) sorted, and valid (b, K) (False where a sequence
    has fewer than K such positions: its extra anchors count nowhere)."""
    b, seq_len = loss_mask.shape
    eligible = torch.zeros_like(loss_mask, dtype=torch.bool)
    eligible[:, :-1] = loss_mask[:, 1:].bool()
    scores = Sampler(generator=generator).uniform((b, seq_len), loss_mask.device)
    scores = scores.masked_fill(~eligible, -1.0)
    top = scores.topk(min(num_anchors, seq_len), dim=1)
    anchors, order = top.indices.sort(dim=1)
    return anchors, top.values.gather(1, order) >= 0


def _packed_inputs(drafter, input_ids, anchors, block_size):
    """(ids, positions, mask) of the packed sequence: the causal stream, then a block of B MASKs
    per anchor."""
    b, num_causal = input_ids.shape
    mask, positions = packed_attention_mask(num_causal, anchors, block_size)
    mask_token_id = drafter.d3d_config.mask_token_id
    mask_tokens = input_ids.new_full((b, anchors.shape[1] * block_size), mask_token_id)
    return torch.cat([input_ids, mask_tokens], 1), positions, mask


def _packed_hidden(drafter, input_ids, anchors, block_size):
    """Training-shape pass: hidden states of the causal stream (b, N, H) and of each block's B
    MASKs (b, K, B, H)."""
    num_causal = input_ids.shape[1]
    num_anchors = anchors.shape[1]
    inputs = _packed_inputs(drafter, input_ids, anchors, block_size)
    hidden = drafter.hidden_states(*inputs)  # (b, N + K*B, H)
    block_hidden = hidden[:, num_causal:].unflatten(1, (num_anchors, block_size))
    return hidden[:, :num_causal], block_hidden


def draft_rows(
    prefix_row: torch.Tensor, first_mask_row: torch.Tensor, block_size: int, d1_from: str
) -> torch.Tensor:
    """Where the tokens d_1 .. d_B a block drafts are read: rows (..., B) of a packed pass. The
    one home of the d1_from rule, for every block of every pass (d3d_loss's block_acc reads the
    same rows from its own split of the training pass):
        d_2 .. d_B  at MASK 2 .. B, rows first_mask_row + 1 .. first_mask_row + B - 1
        d_1         d1_from="causal" (our reading: the paper is silent): at `prefix_row`, the
                    token just before the block's MASKs, whose LM head predicts the next token
                    as L_AR trains it. MASK 1 still trains (L_block reads every MASK); no pass
                    reads it. d1_from="mask": at MASK 1, row first_mask_row (the choice when
                    lambda = 0, where nothing trains the causal row's guess).
    Every pass that reads blocks, at B = 4 under "causal" (N causal tokens; s = 0 .. S - 1):

        pass                            prefix_row (its token)   first_mask_row  rows read
        training block k                j_k (x_{j_k})            N + 4 (k - 1)   j_k, then
          (offline_tau)                                                          MASK 2 .. 4
        sync draft (draft_block)        num_new - 1 (x_n)        5               prefix_row, 6, 7, 8
        async fallback draft            0 (x_n)                  1               0, 2, 3, 4
          (draft_block)
        async packed pass, segment s    5 + 5 s (t, or d_R)      6 + 5 s         (5, 7, 8, 9)
          (build_branch_pass)                                                    + 5 s

    The fallback draft's five rows:

        row  token  position  read as
          0  x_n    n         d_1      the LM head at x_n predicts position n + 1
          1  m      n + 1     unread   (d_1 under d1_from="mask")
          2  m      n + 2     d_2
          3  m      n + 3     d_3
          4  m      n + 4     d_4      rows = [0, 2, 3, 4]

    (A full-acceptance segment's prefix row reads g, the bonus guess: that draft's d_1 comes
    from MASK 2, prepared_draft.) prefix_row, first_mask_row: rows (...), broadcast together."""
    prefix_row, first_mask_row = torch.broadcast_tensors(prefix_row, first_mask_row)
    rows = first_mask_row[..., None] + torch.arange(block_size, device=first_mask_row.device)
    if d1_from == "causal":
        rows[..., 0] = prefix_row
    return rows


def cross_entropy(
    drafter: Drafter, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of the drafter's logits at `hidden` (rows, H) against `labels`
    (rows,), and its argmax (rows,)."""

    def chunk(h, y):
        log_p = torch.log_softmax(drafter.logits(h), -1)  # (rows, V), float32
        return -log_p.gather(-1, y[:, None])[:, 0], log_p.argmax(-1)

    # runtime.in_logit_chunks: chunk() on a few rows at a time, its results joined
    return in_logit_chunks(drafter.d3d_config.target_vocab_size, chunk, hidden, labels)


def _greedy_tokens(drafter: Drafter, hidden: torch.Tensor) -> torch.Tensor:
    """The drafter's argmax token at each row of `hidden` (rows, H), a few rows of logits at a
    time."""

    def chunk(h):
        return (drafter.logits(h).argmax(-1),)

    (tokens,) = in_logit_chunks(drafter.d3d_config.target_vocab_size, chunk, hidden)
    return tokens


def _block_labels(input_ids, loss_mask, anchors, valid, block_size):
    """Labels x_{j_k+i} (i = 1..B) of every block k (b, K, B), and where they count (they
    exist, are response tokens, and the anchor is valid)."""
    num_causal = input_ids.shape[1]
    steps = torch.arange(1, block_size + 1, device=anchors.device)
    label_pos = anchors[:, :, None] + steps  # (b, K, B) the position j_k + i of each label
    inside = label_pos < num_causal
    label_pos = label_pos.clamp(max=num_causal - 1)
    labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
    is_response = loss_mask.bool().gather(1, label_pos.flatten(1)).view_as(label_pos)
    counts = inside & is_response & valid[:, :, None]
    return labels, counts


def _position_weights(block_size: int, decay_gamma: float | None, device) -> torch.Tensor:
    """w_i = exp(-(i-1)/gamma) for block positions i = 1 .. B; all ones when gamma is None."""
    if decay_gamma is None:
        return torch.ones(block_size, device=device)
    steps = torch.arange(block_size, device=device)
    return torch.exp(-steps / decay_gamma)


def d3d_loss(drafter: Drafter, input_ids, loss_mask, *, generator=None, at=None):
    """L = L_block + lambda * L_AR on right-padded input_ids (b, N), loss_mask (b, N) True on
    response tokens, with the drafter's config: K blocks of B MASKs, lambda = ar_weight, block
    position weights w_i = exp(-(i-1)/gamma) (gamma = decay_gamma; None: uniform). L_block:
    cross-entropy of block k's MASK i against x_{j_k+i}, weighted by w_i; L_AR: the causal
    stream's next-token loss. A block is all MASKs (our reading: no noise level, no token of it
    revealed): the drafter learns to fill a whole block in one pass, as decoding asks of it. `at`:
    (anchors, valid) as sample_anchors returns them (default: K drawn here with `generator`).

    Returns (loss, {loss_block, loss_ar, block_acc}). block_acc (B,): per block position i, the
    share of counted blocks whose d_i, read where decoding reads it (draft_rows), is x_{j_k+i}."""
    cfg = drafter.d3d_config
    block_size = cfg.block_size
    if at is None:
        at = sample_anchors(loss_mask, cfg.num_anchors, generator)
    anchors, valid = at
    # (b, N, H), (b, K, B, H)
    causal_hidden, block_hidden = _packed_hidden(drafter, input_ids, anchors, block_size)
    labels, counts = _block_labels(input_ids, loss_mask, anchors, valid, block_size)  # (b, K, B)
    weights = _position_weights(block_size, cfg.decay_gamma, input_ids.device)
    # the labelled block rows
    token_loss, predicted = cross_entropy(drafter, block_hidden[counts], labels[counts])
    w = (counts * weights)[counts]
    loss_block = (token_loss * w).sum() / w.sum().clamp(min=1e-8)
    loss_ar = torch.zeros((), device=input_ids.device)
    if cfg.ar_weight > 0:
        # the causal token at position j predicts x_{j+1}: response tokens only
        has_label = loss_mask[:, 1:].bool()
        ar_hidden = causal_hidden[:, :-1][has_label]
        ar_tok, _ = cross_entropy(drafter, ar_hidden, input_ids[:, 1:][has_label])
        loss_ar = ar_tok.sum() / has_label.sum().clamp(min=1)
    with torch.no_grad():
        correct = torch.zeros_like(counts)
        correct[counts] = predicted == labels[counts]
        if cfg.d1_from == "causal":
            # d_1 as decoding reads it (draft_rows): the anchor's causal row
            first = counts[:, :, 0]  # (b, K)
            hidden_size = causal_hidden.shape[-1]
            index = anchors[:, :, None].expand(-1, -1, hidden_size)
            anchor_hidden = causal_hidden.gather(1, index)  # (b, K, H)
            d1 = _greedy_tokens(drafter, anchor_hidden[first])
            correct[:, :, 0][first] = d1 == labels[:, :, 0][first]
        block_acc = correct.sum((0, 1)) / counts.sum((0, 1)).clamp(min=1)
    metrics = {
        "loss_block": loss_block.detach(),
        "loss_ar": loss_ar.detach(),
        "block_acc": block_acc,
    }
    return loss_block + cfg.ar_weight * loss_ar, metrics


@torch.no_grad()
def offline_tau(drafter: Drafter, input_ids, loss_mask, *, val_anchors=32, generator=None, at=None):
    """Validation tau without the target (the responses are its greedy output): a block of the
    config's B drafted at anchor j_k, read as draft_rows says, is accepted as far as it
    matches x_{j_k+1}, x_{j_k+2}, .... `at`: (anchors, valid) as sample_anchors returns them
    (default: `val_anchors` per sequence, drawn here). Returns tau (a + 1) per valid anchor."""
    block_size = drafter.d3d_config.block_size
    if at is None:
        at = sample_anchors(loss_mask, val_anchors, generator)
    anchors, valid = at
    num_causal = input_ids.shape[1]
    num_anchors = anchors.shape[1]
    inputs = _packed_inputs(drafter, input_ids, anchors, block_size)
    hidden = drafter.hidden_states(*inputs)  # (b, N + K*B, H)
    block_starts = block_size * torch.arange(num_anchors, device=anchors.device)
    first_mask_rows = num_causal + block_starts
    d1_from = drafter.d3d_config.d1_from
    rows = draft_rows(anchors, first_mask_rows, block_size, d1_from)  # (b, K, B)
    index = rows.flatten(1)[..., None].expand(-1, -1, hidden.shape[-1])
    draft_hidden = hidden.gather(1, index).unflatten(1, rows.shape[1:])  # (b, K, B, H)
    labels, counts = _block_labels(input_ids, loss_mask, anchors, valid, block_size)
    draft = _greedy_tokens(drafter, draft_hidden[valid].flatten(0, 1))
    # (num_valid, B); past the end of the sequence: no match
    matches = (draft.view_as(labels[valid]) == labels[valid]) & counts[valid]
    return (matches.long().cumprod(-1).sum(-1) + 1).float()


# --------------------------------------------------------------------------------------------------
# Drafting, verification and acceptance
#
# Two habits keep the host ahead of the device, so that a GPU is never idle mid-round:
# - A round reads the device once: read_round brings back its outcome (a, t, the draft, and in
#   async the plan) in one transfer. Everything before it is queued without waiting, and what
#   comes after it decides on host values. (Sampling with a generator on another device than the
#   model copies the probabilities to it: reproducible, at the cost of a wait.)
# - Every pass has one of a few fixed shapes, so a compiled pass (a CUDA graph on a GPU,
#   systems/fast.py) replays each round. W tokens a pass:
#     target    1                  a target-only step
#     target    B + 1              verify [x_n, d_1 .. d_B]
#     drafter   B + 1 + B          sync draft: the unread committed tokens padded to B + 1, B MASKs
#     drafter   1 + B              async fallback draft: x_n and B MASKs
#     drafter   1 + B + S (1 + B)  async packed pass: x_n, d_1 .. d_B, S = C x F + 1 segments
#   A draft is B tokens even after a full-acceptance hit (prepared_draft).


@dataclass
class Sampler:
    """How tokens are picked: greedy at temperature 0, else drawn from softmax(logits /
    temperature) with `generator` (None: torch's default generator). Every random number of
    decoding, and training's anchors, comes from `uniform` or `draw`, drawn on the generator's
    device: a seeded run draws the same numbers wherever the model runs."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    def _device(self, device) -> torch.device:
        """Where a draw runs: the generator's device (the one place that decides it)."""
        if self.generator is None:
            return device
        return self.generator.device

    def uniform(self, shape: tuple, device) -> torch.Tensor:
        """U(0, 1) numbers of `shape`, returned on `device`."""
        numbers = torch.rand(shape, generator=self.generator, device=self._device(device))
        return numbers.to(device)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per distribution of probs (..., V)."""
        flat = probs.reshape(-1, probs.shape[-1]).to(self._device(probs.device))
        tokens = torch.multinomial(flat, 1, generator=self.generator)
        return tokens.view(probs.shape[:-1]).to(probs.device)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """softmax(logits / temperature), in float32."""
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def pick(self, logits: torch.Tensor):
        """Greedy or sampled tokens from logits (..., V). Returns (tokens, probs or None)."""
        if self.temperature == 0:
            return logits.argmax(-1), None
        probs = self.probs(logits)
        return self.draw(probs), probs


@torch.no_grad()
def draft_block(
    drafter: Drafter, cache: KVCache, new_tokens, block_size: int, width=None, keep_read=True
):
    """One drafter pass over the committed tokens it has not read, new_tokens (1, num_new)
    ending with x_n, then a MASK block off x_n. `width`: the causal part padded to this many
    tokens (one shape for every num_new; the pads come after x_n and no block sees them).
    The cache then keeps the new tokens' KV (sync: the next draft reads after them), or with
    keep_read=False holds what it held before (async: its packed pass reads x_n again).
    Returns the draft logits (B, V): draft_logits[i - 1] drafts d_i (rows: draft_rows)."""
    num_new = new_tokens.shape[1]
    device = new_tokens.device
    start = cache.length
    if width is None:
        width = num_new
    width = max(width, num_new)
    # the block hangs off x_n, the last of the new tokens; a fill, not a copy from the host
    x_n_row = torch.full((1,), num_new - 1, device=device)
    mask, positions = packed_attention_mask(width, x_n_row, block_size, past_len=start)
    mask_token_id = drafter.d3d_config.mask_token_id
    mask_tokens = torch.full((1, block_size), mask_token_id, device=device)
    padded = nn.functional.pad(new_tokens, (0, width - num_new))
    ids = torch.cat([padded, mask_tokens], 1)
    hidden = cache.run(ids, positions, mask)  # (width + B, H)
    # the pads' and the MASKs' KV go; the committed tokens' stay if keep_read
    kept = start
    if keep_read:
        kept = start + num_new
    cache.rewind(kept)
    first_mask_row = x_n_row.new_full((1,), width)
    rows = draft_rows(x_n_row, first_mask_row, block_size, drafter.d3d_config.d1_from)[0]
    return drafter.logits(hidden[rows])


@torch.no_grad()
def verify_block(cache: KVCache, last_token: torch.Tensor, draft: torch.Tensor):
    """One target pass on [x_n, d_1 .. d_B] (the cache holds x_0 .. x_{n-1}). Returns p_logits
    (B+1, V): row i - 1 predicts position n + i, where d_i sits (row 0: after x_n alone); row B
    predicts the bonus position n + B + 1."""
    return causal_pass(cache, torch.cat([last_token.view(1), draft])[None])


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] for a 0-d device index, without reading it (plain indexing with a 0-d tensor
    reads it back)."""
    return x.index_select(0, index.view(1))[0]


def accept_draft(p_logits, draft, q_draft, sampler: Sampler, num_real: int | None = None):
    """(a, t) = (num_accepted, next_token): the textbook acceptance rule, written without a
    branch on a device value. p_logits (B+1, V): row i - 1 is the target's prediction for d_i's
    position; draft (B,); q_draft (B, V) or None (greedy); R = num_real (default B: the draft's
    real tokens; a pad (prepared_draft) is never accepted, even if it equals the target's
    token). With p_i, q_i the target's and the drafter's distributions at d_i's
    position, the rule as a host loop:

        for i in 1 .. R:
            greedy:   ok = d_i == argmax p_i
            sampling: ok = u_i * q_i(d_i) <= p_i(d_i)    (probability min(1, p_i / q_i))
            if not ok:
                t = argmax p_i, or drawn from max(p_i - q_i, 0) normalised (p_i where that
                    is all zero: p_i == q_i up to rounding)
                return (i - 1, t)
        return (R, argmax p_{R+1}, or drawn from p_{R+1})    # the bonus token

    The code does every i at once (u is B draws made together) and returns 0-d tensors left on
    the device, for the round's one host read ("Two habits", above Sampler)."""
    block_size = draft.shape[0]
    if num_real is None:
        num_real = block_size
    # "for i in 1 .. R": positions past R (the pad) never pass
    real = torch.arange(block_size, device=draft.device) < num_real  # (B,)
    if sampler.temperature == 0:
        target_tokens = p_logits.argmax(-1)  # (B+1,) argmax p_1 .. p_{B+1}
        # ok_i = d_i == argmax p_i
        agrees = (draft == target_tokens[:block_size]) & real
        # a: the ok's before the first not-ok ("break")
        num_accepted = agrees.long().cumprod(0).sum()
        # t = argmax p_{a+1}: the correction, or the bonus if a = R (_at: no host read)
        return num_accepted, _at(target_tokens, num_accepted)
    p_target = sampler.probs(p_logits)  # (B+1, V) p_1 .. p_{B+1}
    block_index = torch.arange(block_size, device=draft.device)
    p_d = p_target[block_index, draft]  # (B,) p_i(d_i)
    q_d = q_draft[block_index, draft]  # (B,) q_i(d_i)
    u = sampler.uniform((block_size,), p_d.device)
    # ok_i = u_i * q_i(d_i) <= p_i(d_i): u <= p/q without dividing by a tiny q
    accepts = (u * q_d <= p_d) & real
    # a: the ok's before the first not-ok ("break")
    num_accepted = accepts.long().cumprod(0).sum()
    # p_{a+1} (V,), read without a host read (_at)
    p_next = _at(p_target, num_accepted)
    # q_{a+1}; the zero row keeps the index a = B in range (there the bonus is drawn from p)
    q_next = _at(nn.functional.pad(q_draft, (0, 0, 0, 1)), num_accepted)
    # the rejection's t: from max(p - q, 0) normalised ...
    residual = (p_next - q_next).clamp(min=0)
    # ... or from p where that is all zero (p == q up to rounding: rejection had chance ~0)
    residual = torch.where(residual.sum() > 0, residual, p_next)
    # a = R: the loop ran out, the bonus token from p_{R+1}; else the rejection's residual
    all_accepted = num_accepted == num_real  # a 0-d bool tensor: nothing is read
    next_dist = torch.where(all_accepted, p_next, residual)
    return num_accepted, sampler.draw(next_dist / next_dist.sum())


# --------------------------------------------------------------------------------------------------
# Decoding loops: target-only (the reference) and synchronous speculative decoding
#
# Each loop is the method alone. Around it, generate times every pass (each KVCache times its
# own fixed-shape passes: runtime.Clock) and hands each round's values to one `watch` call
# (systems/rounds.py), which feeds on_round (a RoundInfo, above generate), a streamer and
# async's hit/miss tally.
#
# What the loops (and draft_block, verify_block, draft_branches) take from runtime.py:
#   KVCache(model, max_len)  fixed-size KV cache, its length a host int (.length). .run(ids
#       (1, W), positions, mask (1, 1, W, length + W)) writes W tokens after what it holds and
#       returns drafter hidden states (W, H) or target float logits (W, V); it pads the mask
#       with False to all max_len slots, so a pass of W tokens has one shape every round and
#       no query sees a slot past its own pass (stale KV there is never read).
#       .rewind(length) keeps the first `length` tokens (the next pass writes over the rest);
#       .reset(skipped): empty, for a request whose first `skipped` prompt tokens stay out of
#       the cache (selective prefill; lengths given to rewind and positions still count them)
#   Caches  .target, .drafter: the two KVCaches (Caches.make(target, drafter, max_len)),
#       reusable across requests; .compiled: whether their passes are torch.compile'd;
#       .timed(clock): each fixed-shape pass inside is timed under its phase
#   causal_pass(cache, ids)  a causal pass over ids (1, W) after what the cache holds;
#       prefill(cache, ids, positions): the same, eagerly, for a prompt of any length;
#       attention_pass: the same, returning each layer's attention (heads, W, cache length)
#   read_round(values, *caches)  the round's one host read ("Two habits" above), after the
#       round's passes: each tensor back as tolist() gives it (an int, a list, a list of
#       lists), in one transfer that also checks each layer's count of tokens written against
#       .length (a model that ignored its cache fails here)
#   Output(prompt, budget, eos)  .tokens: prompt + committed, ints; .commit(tokens) appends
#       them cut after the first EOS (kept) or at the budget, and raises if nothing is
#       committed; .commit_round(accepted, next) commits both and records tau (the tokens
#       committed after any cut); .done: the budget is reached or an EOS committed
#   Clock(device, phases)  `with clock.span(key):` adds the time inside to stats' time_<key>
#       (CUDA events, read after the decode: no mid-round wait); pass_phases names each
#       fixed-shape pass by its width
#   check_request, cache_len, async_lanes  generate's input checks (-> B); the KV slots a
#       request needs (prompt + max_new_tokens + its widest pass: 2B + 1 sync, (1 + B)(S + 1)
#       async); the lanes when none are given (the rule: _decode_async's docstring)
# From systems/rounds.py, Watch: after each round's commit and rewinds, watch(out, draft, R,
# (a, t)) (async adds the plan (covered, candidates, g) and the selected segment); from the
# lengths of the round before it knows n, x_n, what was committed and which pass drafted.


def _prefill(caches: Caches, input_ids, selection, out: Output, clock: Clock, sampler) -> None:
    """The target prefills the prompt (or the chunks selective prefill kept) and produces the
    first token itself; the drafter reads the prompt (selective prefill: it already has), so
    that its first draft pass reads x_n alone."""
    ids = input_ids
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    if selection is not None:
        ids = selection["kept_ids"]
        positions = selection["kept_positions"]
    caches.target.reset(skipped=input_ids.shape[1] - ids.shape[1])
    if caches.drafter is not None and selection is None:
        caches.drafter.reset()
    if out.done:
        return
    with clock.span("prefill"):
        logits = prefill(caches.target, ids, positions)[-1]
        token = sampler.pick(logits)[0]
        out.commit(read_round([token], caches.target))
        if caches.drafter is not None and selection is None:
            prefill(caches.drafter, input_ids)


def _decode_target(out: Output, caches: Caches, sampler: Sampler, watch) -> None:
    """Plain autoregressive decoding with the target alone: the reference output and the speedup
    baseline. watch: the round's watchers."""
    x_n = torch.tensor([out.tokens[-1:]], device=caches.target.device)  # (1, 1)
    while not out.done:
        logits = causal_pass(caches.target, x_n)[-1]
        next_token = sampler.pick(logits)[0]
        x_n = next_token.view(1, 1)
        (next_token,) = read_round([next_token], caches.target)
        out.commit([next_token])
        watch(out, [], 0, (0, next_token))


def _decode_sync(drafter, out: Output, caches: Caches, config, *, sampler, watch) -> None:
    """Draft a block, verify it, accept, commit; repeat until out.done (Sec. 3). At a round's
    start, with x_0 .. x_n committed, the target's cache holds x_0 .. x_{n-1} (x_n goes first
    into the verification) and the drafter's the committed tokens it has read. config: the
    DecodeConfig, its B resolved; watch: the round's watchers."""
    tc = caches.target
    dc = caches.drafter
    block_size = config.block_size
    while not out.done:
        # draft: the drafter reads the committed tokens it has not read (x_{n-a} .. x_n after a
        # round that accepted a) and drafts B after x_n; its cache keeps what it read
        new_tokens = torch.tensor([out.tokens[dc.length :]], device=dc.device)
        draft_logits = draft_block(drafter, dc, new_tokens, block_size, width=block_size + 1)
        draft, q_draft = sampler.pick(draft_logits)
        p_logits = verify_block(tc, new_tokens[0, -1], draft)
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler)
        # the round's one host read
        num_accepted, next_token, draft = read_round([num_accepted, next_token, draft], tc, dc)
        # d_1 .. d_a, t join the output (cut at EOS or the budget, which end the decode)
        out.commit_round(draft[:num_accepted], next_token)
        # the target keeps x_0 .. x_n, d_1 .. d_a: t, the new x_n, goes into the next verify
        tc.rewind(len(out.tokens) - 1)
        watch(out, draft, block_size, (num_accepted, next_token))


# --------------------------------------------------------------------------------------------------
# Asynchronous speculative decoding (Fig. 1c, Fig. 3)
#
# Async's symbols:
#     (i, t)   an outcome of verification: d_1 .. d_{i-1} accepted, then the target says t
#              (i <= R: d_i rejected, t its correction; i = R + 1: full acceptance, t the bonus
#              token). The round's own outcome is (a + 1, t). A *branch* is the segment
#              prepared for a covered i and a candidate t; full acceptance's is for (R + 1, g)
#     C, F     coverage, fanout: how many block positions i get branches (the covered
#              positions); candidate tokens t per covered position
#     S        segments of the packed pass: C x F branches and full acceptance
#     g        the full-acceptance segment's guess of the bonus token (bonus_guess)
#     rho_i    the chance that d_i is the first rejection (first_rejection_chance)
#
# One async round, plainly. x_0 .. x_n are committed and d_1 .. d_B is the draft to verify, of
# R real tokens: R = B, except in the round after a full-acceptance hit (B - 1 and a pad:
# prepared_draft; the paper's picture has R = B always).
#
#   while not done:
#     if no block was prepared for this round (round 0, or a miss):
#       d_1 .. d_B = the drafter's block after x_n (its cache keeps   draft_block
#         no KV of it: the packed pass reads x_n again)
#     plan the outcomes (i, t) to prepare: C positions i x F tokens t  plan_branches
#     build one packed pass: [x_n, d_1 .. d_B], then per outcome a    build_branch_pass
#       segment [t, B MASKs] off d_{i-1}, then [d_R, B MASKs] off
#       d_{R-1} for full acceptance
#     at once (_Overlap.both; one after the other at lanes = 1, the CUDA default: _decode_async):
#       the target verifies [x_n, d_1 .. d_B]                         verify_block
#       the drafter runs the packed pass                              draft_branches
#     a, t = the accepted count and the target's own next token       accept_draft
#     g = full acceptance's guess of the bonus token                  bonus_guess
#     read a, t, the draft, the plan and g from the device, at once   read_round
#     commit d_1 .. d_a, t; both caches keep x_0 .. x_n, d_1 .. d_a   commit_round, rewind
#     if (a + 1, t) was planned, a branch:                            select_segment
#       the next d_1 .. d_B = that branch's block                     prepared_draft
#     elif a = R (all accepted) and g = t, full acceptance:           select_segment
#       the next d_1 .. d_B = full acceptance's block after g         prepared_draft
#
# _decode_async, just below the table, is this loop, line for line (select_segment makes the
# last if/elif choice; a decode that is over prepares nothing). The functions it calls follow
# it, in the order it calls them, after the worked trace.
#
# What each KV cache holds across one round (committed x_0 .. x_n at the start; R = num_real,
# a = num_accepted, t = next_token; "+" = written after what the cache held):
#
#   step                         target's cache               drafter's cache
#   round's start                x_0 .. x_{n-1}               x_0 .. x_{n-1}
#   fallback draft (a miss, or   x_0 .. x_{n-1}               + x_n, B MASKs; rewound to n
#     the first round)                                          tokens: x_0 .. x_{n-1}
#   verify, packed pass (side    + x_n, d_1 .. d_B            + x_n, d_1 .. d_B, S segments
#     by side)
#   commit d_1 .. d_a, t         out.tokens: x_0 .. x_n, d_1 .. d_a, t (n + a + 2 tokens)
#   rewind (why: at the lines)   to len(out.tokens) - 1       to n + 1 + a
#                                = n + 1 + a                  (x_0 .. x_n, d_1 .. d_a)
#   next round's start           x_0 .. x_{n'-1}, n' = n + a + 1: t = x_{n'} is in neither cache,
#                                it goes first into the next verify and packed pass


def _decode_async(drafter, out: Output, caches: Caches, config, *, sampler, watch, overlap):
    """The async round of this section's box, in a loop until out.done: while the target
    verifies the draft, one packed drafter pass prepares the next draft for the likely outcomes
    of that verification (the caches through one round: the table under the box; four rounds:
    the worked trace below it). config: the DecodeConfig, its B, C, F resolved; watch: the round's
    watchers; overlap: an _Overlap, the lanes the two passes run in.

    Lanes, when generate is given none (runtime.async_lanes): on a CPU, 2 (a worker thread) for
    a target of 20M parameters or more, else 1; on CUDA, 1 (eager passes are launched from one
    Python thread, so a second stream has little to overlap; compiled passes on two streams are
    refused, their graphs share one memory pool). At lanes = 1 the packed pass runs after the
    verification: a hit still takes no draft pass, but the packed pass is on the critical path.
    lanes = 2 on CUDA (decode.py --lanes 2) is Fig. 1c's two streams."""
    tc = caches.target
    dc = caches.drafter
    block_size = config.block_size
    # x_n (1,) on the device: the prefill's token, then each round's t
    x_n = torch.tensor(out.tokens[-1:], device=dc.device)
    # the draft's logits, when the round before prepared them, and R, its real tokens
    draft_logits = None
    num_real = block_size
    while not out.done:
        n = len(out.tokens) - 1
        if draft_logits is None:
            # round 0, or a miss: the fallback draft. Its KV of x_n goes too: every packed
            # pass starts with x_n, so it has one shape
            draft_logits = draft_block(drafter, dc, x_n[None], block_size, keep_read=False)
            num_real = block_size
        draft, q_draft = sampler.pick(draft_logits)
        covered, candidates = plan_branches(draft_logits, draft, num_real, config)
        packed = build_branch_pass(
            drafter, x_n, draft, covered, candidates, num_real, past_len=dc.length
        )
        p_logits, draft_hidden = overlap.both(
            functools.partial(verify_block, tc, x_n, draft),
            functools.partial(draft_branches, dc, packed),
        )
        num_accepted, next_token = accept_draft(p_logits, draft, q_draft, sampler, num_real)
        guess = bonus_guess(drafter, draft_hidden, sampler)
        # the next round's x_n, kept on the device: no copy from the host
        x_n = next_token.view(1)
        plan = [covered, candidates, guess]
        # device tensors in, the same names as host ints and lists out
        num_accepted, next_token, draft, *plan = read_round(
            [num_accepted, next_token, draft, *plan], tc, dc
        )
        # d_1 .. d_a, t join the output (cut at EOS or the budget, which end the decode)
        out.commit_round(draft[:num_accepted], next_token)
        # both caches keep x_0 .. x_n, d_1 .. d_a, n + 1 + a tokens (the table under the box);
        # t, the new x_n, goes first into the next passes. After a cut at EOS or the budget the
        # target keeps only the committed tokens but t, fewer, and the decode is over
        tc.rewind(len(out.tokens) - 1)
        dc.rewind(n + 1 + num_accepted)
        segment = select_segment(num_accepted, next_token, num_real, *plan)
        watch(out, draft, num_real, (num_accepted, next_token), plan, segment)
        draft_logits = None
        if segment >= 0 and not out.done:
            draft_logits, num_real = prepared_draft(drafter, draft_hidden, segment)


# >>> worked async trace (python tests/worked_trace.py --write regenerates it)
# Asynchronous decoding at B = 4, C = 2, F = 1 (cover="first": i = 1, 2), greedy,
# made by tests/worked_trace.py (a tiny target, a drafter whose logits follow a script).
# Prompt x_0 .. x_4 = 18 87 71 54 8; the target's prefill says x_5 = 37.
# The target's greedy x_5 .. x_19 = 37 53 17 48 18 40 49 33 74 3 4 24 53 71 87.
# The drafter is right at every position except x_7 (runner-up right) and x_10 (both choices wrong).
#
# hit: the round's outcome (a + 1, t) was prepared, and that block is the next draft;
# miss: it was not, and the next round drafts anew. A cache of length 7 holds x_0 .. x_6.
#
# First, a rejection branch used: d_2 is rejected and the branch prepared for (i, t) = (2, t)
# becomes the next draft, with no drafting on the critical path.
# round 0: n = 5, x_0 .. x_5 committed
#   draft       d_1 .. d_4 = 53 18 48 18
#               drafted by a draft pass (x_n and 4 MASKs, its KV dropped again); d_1 from the LM
#               head at x_n, d_2 .. d_4 from MASK 2 .. 4
#   target      a = 1 (d_1); t = 17, its correction of d_2
#   committed   53 17 (= x_6 .. x_7)
#   passes      verify x_n, d_1 .. d_4: target cache -> 10; packed pass x_n, d_1 .. d_4,
#               2 x [t, 4 MASKs], [d_4, 4 MASKs]: drafter cache -> 25; then both rewind
#   prepared    (i, t) = (1, 54)  (2, 17)*  (5, 41)
#   hit         (2, 17) was prepared; that branch's block is the next draft
#   target cache  5 -> 7: x_0 .. x_4 -> x_0 .. x_5, d_1
#   drafter cache 5 -> 7: x_0 .. x_4 -> x_0 .. x_5, d_1
#
# Second, a miss: d_3 is rejected, but C = 2 covers only i = 1, 2, so nothing was prepared for (3,
# t): the next round's draft is a fallback draft pass.
# round 1: n = 7, x_0 .. x_7 committed
#   draft       d_1 .. d_4 = 48 18 41 49
#               drafted by a rejection branch of the previous round's packed pass (its t is x_n);
#               d_1 from the LM head at x_n, d_2 .. d_4 from MASK 2 .. 4
#   target      a = 2 (d_1 .. d_2); t = 40, its correction of d_3
#   committed   48 18 40 (= x_8 .. x_10)
#   passes      verify x_n, d_1 .. d_4: target cache -> 12; packed pass x_n, d_1 .. d_4,
#               2 x [t, 4 MASKs], [d_4, 4 MASKs]: drafter cache -> 27; then both rewind
#   prepared    (i, t) = (1, 49)  (2, 19)  (5, 33)
#   miss        nothing prepared for (3, 40): the next round drafts anew
#   target cache  7 -> 10: x_0 .. x_6 -> x_0 .. x_7, d_1 .. d_2
#   drafter cache 7 -> 10: x_0 .. x_6 -> x_0 .. x_7, d_1 .. d_2
#
# Third, a full-acceptance hit: all four tokens are accepted and the full-acceptance block guessed
# the bonus token t; its other B - 1 rows and a pad are the next draft.
# round 2: n = 10, x_0 .. x_10 committed
#   draft       d_1 .. d_4 = 49 33 74 3
#               drafted by a draft pass (x_n and 4 MASKs, its KV dropped again); d_1 from the LM
#               head at x_n, d_2 .. d_4 from MASK 2 .. 4
#   target      a = 4 (d_1 .. d_4, all real tokens); t = 4, its bonus token
#   committed   49 33 74 3 4 (= x_11 .. x_15)
#   passes      verify x_n, d_1 .. d_4: target cache -> 15; packed pass x_n, d_1 .. d_4,
#               2 x [t, 4 MASKs], [d_4, 4 MASKs]: drafter cache -> 30; then both rewind
#   prepared    (i, t) = (1, 50)  (2, 34)  (5, 4)*
#   hit         (5, 4) was prepared; the full-acceptance block: its other B - 1 rows and a pad are
#               the next draft
#   target cache  10 -> 15: x_0 .. x_9 -> x_0 .. x_10, d_1 .. d_4
#   drafter cache 10 -> 15: x_0 .. x_9 -> x_0 .. x_10, d_1 .. d_4
#
# The padded draft of the full-acceptance hit: three real tokens and a pad that is never accepted;
# the target's token for the pad's position (predicted at d_3's row) is the bonus. The budget is
# reached: decoding stops.
# round 3: n = 15, x_0 .. x_15 committed
#   draft       d_1 .. d_4 = 24 53 71 pad (d_4 is a pad: never accepted)
#               drafted by the previous round's full-acceptance block: d_1 .. d_3 from its
#               MASK 2 .. 4 (its first row guessed x_n, the bonus token)
#   target      a = 3 (d_1 .. d_3, all real tokens); t = 87, its bonus token
#   committed   24 53 71 87 (= x_16 .. x_19)
#   passes      verify x_n, d_1 .. d_4: target cache -> 20; packed pass x_n, d_1 .. d_4,
#               2 x [t, 4 MASKs], [d_3, 4 MASKs]: drafter cache -> 35; then both rewind
#   prepared    (i, t) = (1, 25)  (2, 54)  (4, 87)*
#   hit         (4, 87) was prepared; the decode is over: never used
#   target cache  15 -> 19: x_0 .. x_14 -> x_0 .. x_15, d_1 .. d_3
#   drafter cache 15 -> 19: x_0 .. x_14 -> x_0 .. x_15, d_1 .. d_3
# <<< worked async trace


# The steps of the async round, in the order _decode_async calls them: the branch budget (C, F)
# and plan_branches; build_branch_pass and draft_branches; bonus_guess; select_segment and
# prepared_draft (the pad after a full-acceptance hit); then _Overlap, the two lanes.


def default_budget(block_size: int) -> tuple[int, int]:
    """Branch budget (coverage C, fanout F): the paper's C = 12, F = 2 at B = 16; C scales with
    B as C = 0.75 B within 1 .. B, rounded half to even (Python's round: B = 6 gives 4; our
    reading, the paper gives C only at B = 16)."""
    coverage = max(1, min(block_size, round(0.75 * block_size)))
    fanout = 2
    return coverage, fanout


def branch_budget(config, block_size: int) -> tuple[int, int]:
    """(C, F) of a DecodeConfig at block size B: its coverage and fanout, default_budget(B) for
    either that is None."""
    coverage, fanout = default_budget(block_size)
    if config.coverage is not None:
        coverage = config.coverage
    if config.fanout is not None:
        fanout = config.fanout
    return coverage, fanout


def first_rejection_chance(draft_logits, draft, num_real: int, temperature: float):
    """rho_i = q(d_1) ... q(d_{i-1}) * (1 - q(d_i)) for i = 1 .. B (B,): the chance that d_i is
    the first rejection, with q the drafter's probabilities at the scoring temperature (our
    reading: 1 when decoding greedily, where no temperature is given, else the sampling
    temperature). A pad (i > R = num_real) is never rejected: rho_i = -inf."""
    scoring_temperature = temperature
    if temperature == 0:
        scoring_temperature = 1.0
    probs = torch.softmax(draft_logits.float() / scoring_temperature, -1)
    # (B,) q(d_i), the drafter's probability of its own d_i
    q_d = probs.gather(1, draft[:, None])[:, 0]
    # q(d_1) ... q(d_{i-1}): the chance that d_i is reached
    reach = torch.cat([torch.ones_like(q_d[:1]), torch.cumprod(q_d, 0)[:-1]])
    rho = reach * (1 - q_d)
    rho[num_real:] = float("-inf")
    return rho


def plan_branches(draft_logits, draft, num_real: int, config):
    """The outcomes (i, t) that get a branch: C covered block positions i x F candidate tokens t
    (the drafter's F likeliest tokens at i, except d_i itself), for a draft (B,) of R =
    num_real real tokens. config: a DecodeConfig (its coverage C, fanout F, cover and
    temperature; branch_budget). cover="first": i = 1 .. C; "likely": the C largest rho_i
    (first_rejection_chance); a pad's position i > R only where C > R (prepared_draft).
    Returns covered (C,), the i ascending (d_i's logits are draft_logits[i - 1]), and
    candidates (C, F), left on the device."""
    block_size, vocab = draft_logits.shape
    coverage, fanout = branch_budget(config, block_size)
    coverage = min(coverage, block_size)
    fanout = min(fanout, vocab - 1)
    if config.cover == "first":
        covered = torch.arange(1, coverage + 1, device=draft.device)
    else:  # "likely"
        rho = first_rejection_chance(draft_logits, draft, num_real, config.temperature)
        # draft_logits[i - 1] -> block position i
        covered = torch.topk(rho, coverage).indices.sort().values + 1
    # d_i is never its own alternative
    others = draft_logits.scatter(-1, draft[:, None], float("-inf"))
    # block position i -> draft_logits[i - 1]
    candidates = others.topk(fanout, dim=-1).indices[covered - 1]
    return covered, candidates  # (C,), (C, F)


def build_branch_pass(
    drafter: Drafter, last_token, draft, covered, candidates, num_real=None, *, past_len: int
):
    """Input of the packed pass that drafts the next block (B MASKs) for each planned outcome of
    verifying `draft` (B,); covered (C,), candidates (C, F): plan_branches.

    The key fact: the segment for outcome (i, t) is the fallback draft that the next round would
    run if the outcome is (i, t), [t, B MASKs] with t as that round's x_n, hanging off d_{i-1}:
    its rows see what that round's cache and x_n would hold. One pass drafts them all.

    After the cache's x_0 .. x_{n-1} (past_len = n), the causal stream: x_n (`last_token`,
    (1,)), then d_1 .. d_B (the accepted drafts get their KV here): row i holds d_i. Then
    S = C x F + 1 segments, each [token, B MASKs] hanging off one causal row, its root (the
    mask's `roots`): the branch (i, t) is [t, B MASKs] off d_{i-1} (row i - 1), t at position
    n + i; full acceptance is [d_R, B MASKs] off d_{R-1} (R = `num_real`, default B; why d_R
    is repeated: prepared_draft).
    Segment s's first token is row (B + 1) + (B + 1) s; its B MASKs follow it. A segment's first
    token sits at position n + root + 1, each of its MASKs one position further. W = (B + 1)(S + 1)
    tokens: 20 at B = 4, C = 2, F = 1; 40 at the default C = 3, F = 2.
    Every row at B = 4, C = 2, F = 1 (covered i = 1, 2), d1_from="causal". A segment's row sees
    the cache, the causal rows 0 .. its root, and in its segment: its first token itself, a
    MASK all of it (packed_attention_mask draws the mask). A first token's row drafts the
    position after its own, a MASK's row its own; d' is the next draft a segment prepares:

        row  token  position  root  read as (draft_rows)
          0  x_n    n         -     -            causal stream
          1  d_1    n + 1     -     -
          2  d_2    n + 2     -     -
          3  d_3    n + 3     -     -
          4  d_4    n + 4     -     -
          5  t1     n + 1     0     d'_1         branch (1, t1): d_1 rejected, the
          6  m      n + 2     0     unread       target said t1
          7  m      n + 3     0     d'_2
          8  m      n + 4     0     d'_3
          9  m      n + 5     0     d'_4
         10  t2     n + 2     1     d'_1         branch (2, t2): d_1 accepted, d_2
         11  m      n + 3     1     unread       rejected, the target said t2
         12  m      n + 4     1     d'_2
         13  m      n + 5     1     d'_3
         14  m      n + 6     1     d'_4
         15  d_4    n + 4     3     g (bonus)    full acceptance: g guesses x_{n+5},
         16  m      n + 5     3     unread       d'_1 .. d'_3 the tokens after it,
         17  m      n + 6     3     d'_1         then a pad
         18  m      n + 7     3     d'_2
         19  m      n + 8     3     d'_3

    rows (S, B) = [[5, 7, 8, 9], [10, 12, 13, 14], [15, 17, 18, 19]] (d1_from="mask": 6, 11, 16
    first). test_d3d.py checks this table against the function, row by row.
    Built from host sizes only: its shape depends on B, C and F. Returns input ids (1, W),
    position ids (1, W), mask (1, 1, W, past+W) and those rows (S, B), in the order of
    candidates.flatten(), then full acceptance."""
    block_size = draft.shape[0]
    fanout = candidates.shape[1]
    if num_real is None:
        num_real = block_size
    # each segment's root, the causal row it hangs off (the table's "root" column):
    # branch (i, t) off d_{i-1}, row i - 1, once per candidate t (C x F,) ...
    branch_roots = covered[:, None].expand(-1, fanout).flatten() - 1
    # ... and full acceptance off d_{R-1}, row R - 1 (1,)
    full_root = covered.new_full((1,), num_real - 1)
    roots = torch.cat([branch_roots, full_root])  # (S,): S = C x F + 1 whatever the draft
    num_segments = len(roots)
    # each segment's tokens: its first token (t, or d_R for full acceptance), then B MASKs
    mask_token_id = drafter.d3d_config.mask_token_id
    segment_len = 1 + block_size
    segments = torch.full((num_segments, segment_len), mask_token_id, device=draft.device)
    segments[:, 0] = torch.cat([candidates.flatten(), draft[num_real - 1 : num_real]])
    num_causal = 1 + block_size  # x_n, d_1 .. d_B
    ids = torch.cat([last_token, draft, segments.flatten()])[None]
    mask, position_ids = packed_attention_mask(
        num_causal, roots, block_size, prefix_len=1, past_len=past_len
    )
    # segment s starts at row N + (1 + B) s with its first token; its MASKs follow
    segment_index = torch.arange(num_segments, device=draft.device)
    first_token_rows = num_causal + segment_len * segment_index
    first_mask_rows = first_token_rows + 1
    d1_from = drafter.d3d_config.d1_from
    rows = draft_rows(first_token_rows, first_mask_rows, block_size, d1_from)
    return ids, position_ids, mask, rows


def draft_branches(cache: KVCache, packed) -> torch.Tensor:
    """The packed pass: the drafter runs build_branch_pass's input after what its cache holds
    (x_0 .. x_{n-1}). Returns the hidden states at each segment's draft rows (S, B, H)."""
    ids, position_ids, mask, rows = packed
    return cache.run(ids, position_ids, mask)[rows]


def bonus_guess(drafter: Drafter, draft_hidden, sampler: Sampler):
    """g: the full-acceptance segment's guess of the bonus token (a 0-d device tensor), at its
    first draft row (draft_hidden[-1, 0]: the last segment, column 0 of its draft_rows), picked
    as every draft token is: greedily, or drawn at the sampling temperature (then a hit needs
    the target's bonus token to equal this draw). draft_hidden: (S, B, H), draft_branches's.
    At B = 1 the guess is -1, never a token: no row after it could be the next draft."""
    guess = sampler.pick(drafter.logits(draft_hidden[-1, 0]))[0]
    if draft_hidden.shape[1] == 1:
        return torch.full_like(guess, -1)
    return guess


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess) -> int:
    """The prepared segment that the round's outcome (a + 1, t) selects: its index among the
    packed pass's segments, or -1 on a miss (nothing was prepared for it). Host values, read
    with the outcome: a = num_accepted, t = next_token, R = num_real; covered, the C positions
    i, and candidates, C lists of F tokens t (plan_branches); guess, g (bonus_guess).
    The segments: branch (i, t) for each covered i and each of its candidates t, in that
    order, then full acceptance. The branch prepared for (a + 1, t) if there is one; else full
    acceptance if a = R and g = t. Both can match only where C covers a pad; then the branch
    wins (prepared_draft)."""
    fanout = 0
    if candidates:
        fanout = len(candidates[0])
    for place, position in enumerate(covered):
        if position == num_accepted + 1 and next_token in candidates[place]:
            return place * fanout + candidates[place].index(next_token)
    if num_accepted == num_real and guess == next_token:
        return len(covered) * fanout
    return -1


def prepared_draft(drafter: Drafter, draft_hidden, segment: int):
    """A hit's next draft, from the selected segment's block: (logits (B, V), R), R = num_real,
    the draft's real tokens; draft_hidden (S, B, H): draft_branches's. A branch (i, t) gives its
    whole block, R = B. Full acceptance (the last segment) gives its rows after the first (the
    bonus guess g) and a pad, R = B - 1. The pad is explained here; every other mention of it
    points here.

    In short: the full-acceptance segment spends its first row on g, its guess of the bonus
    token, so its block leaves B - 1 tokens for the next draft; a pad makes that draft B tokens
    long again, so every pass keeps its shape and a compiled pass replays. The cost: each round
    after such a hit commits at most B tokens, not B + 1 (a run of full-acceptance hits commits B
    a round).

    The segment prepares the next draft for the outcome (R + 1, g): all R real tokens accepted,
    then the bonus token g. It is [d_R, B MASKs] off d_{R-1}: repeating d_R, rather than hanging
    B MASKs off d_R, gives it the shape of every segment, [token, B MASKs]. Its first row, d_R
    again at d_R's position, sees what d_R's causal row sees: g is the drafter's next-token guess
    at d_R, as x_n's row guesses d_1. Its MASKs see the cache, x_n .. d_R and one another, never
    g: the block is the drafter's guess of what follows d_R, made before anyone knows the bonus
    token. So a hit asks g = t: the block is used only where the target said the token it
    continues. Exactness does not need the test (verification keeps the output the target's);
    acceptance does. At B = 4 (rows 15 .. 19 of build_branch_pass's table, at C = 2, F = 1; the
    last five rows of any packed pass), d_1 .. d_4 all accepted:

      position         n+1  n+2  n+3  n+4  n+5  n+6  n+7  n+8  n+9
      draft            d_1  d_2  d_3  d_4
      segment                         d_4  m    m    m    m      off d_3
      its row read as                 g    -    d'_1 d'_2 d'_3   (g: x_{n+5}; MASK 1 unread)
      the target says                      t = g                 a hit: n' = n + 5, x_{n'} = t
      next draft                                d'_1 d'_2 d'_3 pad

    The pad is a row of zero logits: token 0 when greedy, a uniform draw when sampling. In the
    round after the hit:
    - accept_draft never accepts the pad (num_real = R); if the target accepts d'_1 .. d'_R, its
      bonus token is p_logits[R], predicted at d'_R's row for the pad's position;
    - the full-acceptance segment is [d'_R, B MASKs] off d'_{R-1}: none hangs off the pad;
    - a branch covers the pad's position only where C > R (C = B; its rho is -inf), with arbitrary
      candidates (the pad's logits say nothing); if that branch (R + 1, t) and full acceptance
      both match, the branch wins (select_segment): its block has B real tokens, full's B - 1."""
    num_segments, block_size = draft_hidden.shape[:2]
    if segment < num_segments - 1:
        return drafter.logits(draft_hidden[segment]), block_size
    logits = drafter.logits(draft_hidden[segment, 1:])
    return nn.functional.pad(logits, (0, 0, 0, 1)), block_size - 1


class _Overlap:
    """Runs verification and the packed pass side by side (lanes = 2): on CUDA in two streams
    (verify's has the higher priority), on a CPU the packed pass in a worker thread (the two
    share the cores: each gets half of torch's threads); lanes = 1: one after the other. The
    clock times the two together ("both"; each pass is timed by its cache). A context manager:
    the worker thread ends, and the threads come back, on leaving it."""

    def __init__(self, device: torch.device, lanes: int, clock: Clock):
        self.clock = clock
        self.streams = device.type == "cuda" and lanes > 1
        self.pool = None
        if self.streams:
            self.main = torch.cuda.current_stream(device)
            # the critical path goes first
            self.verify_stream = torch.cuda.Stream(device, priority=-1)
            self.draft_stream = torch.cuda.Stream(device)
        elif lanes > 1:
            self.pool = ThreadPoolExecutor(1, "packed-pass")
            self.threads = torch.get_num_threads()
            torch.set_num_threads(max(1, self.threads // 2))

    def __enter__(self) -> "_Overlap":
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            torch.set_num_threads(self.threads)

    def both(self, verify, packed):
        """verify() and packed() side by side; returns both results."""
        with self.clock.span("both"):
            if not self.streams:
                return self._without_streams(verify, packed)
            # both read what the main stream made: the draft, the packed pass's input
            self.verify_stream.wait_stream(self.main)
            self.draft_stream.wait_stream(self.main)
            with torch.cuda.stream(self.verify_stream):
                p_logits = verify()
            with torch.cuda.stream(self.draft_stream):
                draft_hidden = packed()
            for stream, result in (
                (self.verify_stream, p_logits),
                (self.draft_stream, draft_hidden),
            ):
                # join: both results are read on the main stream
                self.main.wait_stream(stream)
                # made on a side stream: the allocator must not reuse its memory early
                result.record_stream(self.main)
            return p_logits, draft_hidden

    def _without_streams(self, verify, packed):
        """A worker thread (kernels release the GIL), or one pass after the other."""
        if self.pool is None:
            return verify(), packed()
        # the caller's no_grad does not reach into the worker thread
        future = self.pool.submit(torch.no_grad()(packed))
        p_logits = verify()
        return p_logits, future.result()


# --------------------------------------------------------------------------------------------------
# Progressive layer pruning with recovery distillation (Fig. 1b)
#
# A decoder layer has two indices here. Its current index, 0 .. layers - 1 of the drafter as it
# is now, is what scoring, least_costly_layer and remove_layer use. Its original index, its
# place in the checkpoint the drafter was made from, is what D3DConfig.layer_ids keeps and what
# prune_drafter's records report (_original_ids maps one to the other).
# Pruning's one symbol: beta, recovery's pull toward the label (our reading; adjusted_teacher).


@dataclass
class PruneConfig:
    """How prune_drafter prunes, recovers and measures (prune_drafter, recover and distill_loss
    read it). A stopping rule, min_layers or tau_floor, is prune_drafter's to require."""

    min_layers: int | None = setting(
        None, "stop at this many decoder layers; None: only tau_floor stops", Range(int, low=1)
    )
    tau_floor: float | None = setting(
        None,
        "stop after the first removal whose recovered tau falls below tau_floor x the unpruned "
        "tau (that removal is undone); None: only min_layers stops",
        Range(float, low=0, low_open=True),
    )
    recovery_steps: int = setting(
        100, "AdamW steps of recovery distillation after each removal (0: none)", Range(int, low=0)
    )
    lr: float = setting(5e-5, "recovery's learning rate", Range(float, low=0, low_open=True))
    beta: float = setting(
        0.5,
        "recovery's pull toward the label (our reading; adjusted_teacher)",
        Range(float, low=0, high=1),
    )
    val_anchors: int = setting(
        32,
        "anchors a measurement samples per sequence: validation tau, scoring, recovery (not K)",
        Range(int, low=1),
    )
    seed: int = setting(
        0,
        "seeds the measurement's anchors (the same on every call) and recovery's",
        Range(int, low=0),
    )
    checkpointing: bool = setting(
        False, "recompute each layer's activations in recovery's backward", Range(bool)
    )

    def __post_init__(self):
        check_settings(self)


def adjusted_teacher(
    teacher_logits: torch.Tensor, labels: torch.Tensor, beta: float
) -> torch.Tensor:
    """The distribution recovery distils to (our reading of "adjusted toward the supervised
    token": the paper gives no formula): (1 - beta) * softmax(teacher) + beta * onehot(label).
    Sums to one."""
    soft_label = (1 - beta) * torch.softmax(teacher_logits.float(), -1)
    # + beta at the label, without building the one-hot
    beta_column = torch.full_like(soft_label[..., :1], beta)
    return soft_label.scatter_add(-1, labels[..., None], beta_column)


def distill_loss(student: Drafter, teacher: Drafter, input_ids, loss_mask, config, generator=None):
    """Cross-entropy of the student against adjusted_teacher(teacher, label, config.beta), with
    no gradient through the teacher, on one packed batch of the student's B: the blocks (labels
    x_{j_k+i}, config.val_anchors per sequence) and the causal stream (labels x_{j+1}), response
    tokens only. The two means are added. config: a PruneConfig.

    It ignores gamma and lambda (our reading: the paper gives recovery no weights). Those two
    shape what the drafter learns from the labels in training; recovery only asks the pruned
    drafter to match the unpruned one, whose distribution already carries that training, so
    every block position counts alike and the two terms are weighted alike."""
    block_size = student.d3d_config.block_size
    beta = config.beta
    anchors, valid = sample_anchors(loss_mask, config.val_anchors, generator)
    labels, counts = _block_labels(input_ids, loss_mask, anchors, valid, block_size)
    with torch.no_grad():
        teacher_causal, teacher_block = _packed_hidden(teacher, input_ids, anchors, block_size)
    student_causal, student_block = _packed_hidden(student, input_ids, anchors, block_size)
    has_label = loss_mask[:, 1:].bool()

    def chunk(student_h, label, teacher_h):
        with torch.no_grad():
            soft_label = adjusted_teacher(teacher.logits(teacher_h), label, beta)
        # MASK: soft_label = 0 and log_p = -inf; the clamp keeps 0 * -inf out
        log_p = torch.log_softmax(student.logits(student_h), -1).clamp(min=-1e4)
        return (-(soft_label * log_p).sum(-1),)

    loss = torch.zeros((), device=input_ids.device)
    # the blocks, then the causal stream (row j, label x_{j+1})
    for student_hidden, teacher_hidden, label_ids, counted in (
        (student_block, teacher_block, labels, counts),
        (student_causal[:, :-1], teacher_causal[:, :-1], input_ids[:, 1:], has_label),
    ):
        rows = (student_hidden[counted], label_ids[counted], teacher_hidden[counted])
        (token_loss,) = in_logit_chunks(student.d3d_config.target_vocab_size, chunk, *rows)
        loss = loss + token_loss.sum() / counted.sum().clamp(min=1)
    return loss


@torch.no_grad()
def validation_tau(drafter: Drafter, batches, *, val_anchors: int = 32, seed: int = 0):
    """(mean offline tau, mean block cross-entropy) over (input_ids, loss_mask) batches. Both
    are measured on the same blocks: one generator, seeded with `seed`, draws each batch's
    `val_anchors` anchors per sequence, and offline_tau and the block loss both take them. The
    same seed gives the same anchors on every call, so drafters with different layers are
    compared on identical blocks."""
    generator = torch.Generator().manual_seed(seed)
    # the block loss alone: lambda = 0 skips L_AR's rows
    block_only = Drafter(drafter.model, replace(drafter.d3d_config, ar_weight=0.0))
    taus = []
    losses = []
    for input_ids, loss_mask in batches:
        at = sample_anchors(loss_mask, val_anchors, generator)
        taus.append(offline_tau(drafter, input_ids, loss_mask, at=at))
        _, metrics = d3d_loss(block_only, input_ids, loss_mask, at=at)
        losses.append(metrics["loss_block"].item())
    return torch.cat(taus).mean().item(), sum(losses) / len(losses)


@contextlib.contextmanager
def _only_layers(drafter: Drafter, layer_ids: list[int]):
    """Keep only decoder layers `layer_ids` for the duration; yields the decoder."""
    decoder = drafter.model.get_decoder()
    config = drafter.model.config
    layers = decoder.layers
    layer_types = getattr(config, "layer_types", None)
    keep_layers(drafter.model, layer_ids)
    try:
        yield decoder
    finally:  # every layer back, numbered from 0 again
        decoder.layers = layers
        config.layer_types = layer_types
        keep_layers(drafter.model, list(range(len(layers))))


@torch.no_grad()
def tau_without_each_layer(drafter: Drafter, batches, *, val_anchors: int = 32, seed: int = 0):
    """{layer: offline tau of the drafter without that decoder layer}, each from validation_tau
    on the same anchors. systems/fast.py's tau_without_each_layer gives the same numbers from one
    recorded pass per batch, at a fraction of the cost."""
    scores = {}
    num_layers = len(drafter.model.get_decoder().layers)
    for layer in tqdm(range(num_layers), desc="score layers", leave=False):
        with _only_layers(drafter, _all_but(num_layers, layer)):
            scores[layer] = validation_tau(drafter, batches, val_anchors=val_anchors, seed=seed)[0]
    return scores


def _all_but(num_layers: int, layer: int) -> list[int]:
    """Every decoder layer of `num_layers` but `layer`."""
    return [other for other in range(num_layers) if other != layer]


def _original_ids(drafter: Drafter) -> list[int]:
    """The drafter's decoder layers, by their index in the checkpoint it was made from."""
    return drafter.d3d_config.layer_ids or list(range(len(drafter.model.get_decoder().layers)))


def remove_layer(drafter: Drafter, index: int) -> None:
    """Remove decoder layer `index` (its index among the current layers) for good, in place;
    d3d_config.layer_ids keeps the original indices."""
    original = _original_ids(drafter)
    keep_layers(drafter.model, _all_but(len(original), index))
    drafter.d3d_config.layer_ids = [original[kept] for kept in _all_but(len(original), index)]


def least_costly_layer(drafter: Drafter, scores: dict, val_batches, *, val_anchors=32, seed=0):
    """The layer whose removal costs least tau, as its index among the current layers (what
    remove_layer takes; _original_ids maps it to the checkpoint's index, which prune_drafter's
    records report). `scores`: tau without each layer, by the same current index. Ties, common
    for weak drafters, go to the smallest change in block loss (our reading: the paper is
    silent)."""
    tied = [layer for layer in scores if scores[layer] == max(scores.values())]
    if len(tied) == 1:
        return tied[0]
    num_layers = len(drafter.model.get_decoder().layers)
    measure = dict(val_anchors=val_anchors, seed=seed)
    _, base_loss = validation_tau(drafter, val_batches, **measure)

    def loss_change(layer):
        with _only_layers(drafter, _all_but(num_layers, layer)):
            return abs(validation_tau(drafter, val_batches, **measure)[1] - base_loss)

    return min(tied, key=loss_change)


def recover(drafter: Drafter, teacher: Drafter, train_batches, config, generator=None) -> int:
    """Recovery (Fig. 1b): config.recovery_steps AdamW steps (config: a PruneConfig) distilling
    the pruned drafter toward the fixed unpruned one, its distribution adjusted toward the label
    (distill_loss, beta). A step whose gradient norm is not finite is skipped; returns how many
    were."""
    if config.recovery_steps <= 0:
        return 0
    drafter.train()
    if config.checkpointing:
        # transformers 5's gradient checkpointing
        drafter.model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    skipped = 0
    for step in tqdm(range(config.recovery_steps), desc="recover", leave=False):
        input_ids, loss_mask = train_batches[step % len(train_batches)]
        loss = distill_loss(drafter, teacher, input_ids, loss_mask, config, generator)
        loss.backward()
        # runtime.finite_step: clip to norm 1, step unless the norm is not finite, zero grads
        skipped += not finite_step(optimizer, params, 1.0)
        # under a caller's autocast, later passes must not read stale bf16 copies
        torch.clear_autocast_cache()
    if config.checkpointing:
        drafter.model.activation_checkpointing_disable()
    drafter.eval()
    return skipped


def _undo_removal(drafter: Drafter, snapshot: Drafter, device) -> None:
    """Back to the drafter as it was before the last removal (its host copy)."""
    drafter.model = snapshot.model.to(device)
    drafter.d3d_config = snapshot.d3d_config


def prune_drafter(
    drafter: Drafter, val_batches, train_batches, config=None, *, score=None, **settings
):
    """Greedy progressive pruning, in place (Fig. 1b), as config (a PruneConfig; keyword
    `settings` replace its fields) says. Each iteration: score every layer by the offline tau
    without it (`score`: tau_without_each_layer, or systems/fast.py's, quicker), remove the one
    that costs least, recover for recovery_steps steps distilled from the fixed unpruned
    drafter, re-measure tau. Stops at min_layers, or after the first removal whose recovered
    tau falls below tau_floor x the unpruned tau (undone: "kept" False; its "layers" is still
    the depth it measured). The copy kept to undo a removal waits in host memory.

    Returns an iterator of records (dicts) for the caller to print: the unpruned drafter's,
    then one per iteration. It is lazy: the call checks the settings and does nothing else;
    the teacher's copy and the first measurement happen when the first record is taken, and
    each iteration runs as its record is taken (list(prune_drafter(...)) runs them all)."""
    config = with_settings(config, PruneConfig, settings)
    if config.min_layers is None and config.tau_floor is None:
        raise ValueError(
            "give a stopping rule: min_layers (a target depth) or tau_floor "
            "(fraction of unpruned tau)"
        )
    min_layers = config.min_layers
    tau_floor = config.tau_floor
    if score is None:
        score = tau_without_each_layer

    def records():
        # the fixed, unpruned drafter (made when the first record is taken)
        teacher = copy.deepcopy(drafter).eval().requires_grad_(False)
        measure = dict(val_anchors=config.val_anchors, seed=config.seed)
        generator = torch.Generator().manual_seed(config.seed)
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
            iteration += 1
            start = time.perf_counter()
            original = _original_ids(drafter)
            scores = score(drafter.eval(), val_batches, **measure)  # 1. score
            best = least_costly_layer(drafter, scores, val_batches, **measure)
            score_seconds = time.perf_counter() - start
            snapshot = None
            if tau_floor is not None:
                snapshot = host_copy(drafter)  # runtime.host_copy: a copy in host memory
            remove_layer(drafter, best)  # 2. remove
            # 3. recover
            skipped = recover(drafter, teacher, train_batches, config, generator)
            # 4. re-measure (without recovery, the score is already the pruned drafter's tau)
            tau_after = scores[best]
            if config.recovery_steps > 0:
                tau_after = validation_tau(drafter, val_batches, **measure)[0]
            kept = tau_floor is None or tau_after >= tau_floor * tau0  # of the unpruned tau
            if not kept:  # below the floor: undo this removal and stop
                _undo_removal(drafter, snapshot, teacher.device)
            # tau without each layer, by the layer's original index
            layer_taus = {original[layer]: round(tau, 4) for layer, tau in scores.items()}
            yield {
                "iteration": iteration,
                "removed_layer": original[best],
                # the depth whose tau this record measured; if undone, the drafter went back
                # to one layer more
                "layers": len(original) - 1,
                "tau_before_recovery": scores[best],
                "tau_after_recovery": tau_after,
                "seconds": time.perf_counter() - start,
                "score_seconds": score_seconds,
                "kept": kept,
                "recovery_skipped": skipped,
                "tau_without_layer": layer_taus,
            }
            if not kept:
                break

    return records()


# --------------------------------------------------------------------------------------------------
# Selective prefilling (paper appendix, Fig. 5, Tables 6-7)


@torch.no_grad()
def select_chunks(
    drafter: Drafter, input_ids, *, keep_ratio, chunk_size=64, query_window=32, cache=None
):
    """The drafter reads the whole prompt into its cache (`cache`, else a new one) and picks the
    chunks the target prefills: the first, the last, then the best by score, ceil(keep_ratio *
    num_chunks) in all but at least 2, in their order. A token's score is the attention it gets
    from the last `query_window` prompt tokens, mean over layers, heads and queries; a chunk's
    score is the sum of its tokens' scores (our reading: the paper is silent).
    Returns kept_ids and kept_positions (1, kept tokens), drafter_cache (full prompt),
    chunk_scores, kept_chunks, num_chunks, chunks_kept."""
    if not 0 < keep_ratio <= 1 or chunk_size < 1:
        raise ValueError(
            f"need keep_ratio in (0, 1] and chunk_size >= 1, got {keep_ratio}, {chunk_size}"
        )
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    window = min(query_window, prompt_len)
    if cache is None:
        cache = KVCache(drafter, prompt_len)
    cache.rewind(0)
    if prompt_len > window:  # the bulk of the prompt with the fast attention path
        prefill(cache, input_ids[:, : prompt_len - window])
    # per layer: (heads, window, prompt_len)
    attentions = attention_pass(cache, input_ids[:, prompt_len - window :])
    # (prompt_len,): the attention each prompt token receives
    attention = torch.stack(attentions).mean((0, 1, 2))[:prompt_len]
    num_chunks = math.ceil(prompt_len / chunk_size)
    scores = torch.zeros(num_chunks, device=device).index_add_(
        0, torch.arange(prompt_len, device=device) // chunk_size, attention
    )
    num_keep = min(num_chunks, max(2, math.ceil(keep_ratio * num_chunks)))
    ranked = scores.clone()
    # the first and the last chunk are always kept
    ranked[0] = float("inf")
    ranked[-1] = float("inf")
    kept = sorted(torch.topk(ranked, num_keep).indices.tolist())
    spans = []
    for chunk in kept:
        end = min((chunk + 1) * chunk_size, prompt_len)
        spans.append(torch.arange(chunk * chunk_size, end, device=device))
    positions = torch.cat(spans)
    return {
        "kept_ids": input_ids[:, positions],
        "kept_positions": positions[None],
        "drafter_cache": cache,
        "chunk_scores": scores.tolist(),
        "kept_chunks": kept,
        "num_chunks": num_chunks,
        "chunks_kept": len(kept),
    }


# --------------------------------------------------------------------------------------------------
# generate: the entry point (target-only, sync, async; selective prefill)


@dataclass
class RoundInfo:
    """What one decoding round did, as plain Python values (ints and lists of ints), for
    generate(on_round=...): made after the round's one host read, its commit and its caches'
    rewinds, and only when on_round is given."""

    # "target", "sync" or "async"
    mode: str
    # 0, 1, 2, ... (the prefill's first token is not a round)
    index: int
    # the round starts with x_0 .. x_n committed (x_n = out.tokens[n]; the prompt counts)
    n: int
    # the token x_n itself: the last committed, just before d_1 (round 0: the prefill's token)
    x_n: int
    # d_1 .. d_B as verified ([] in target mode; a full-acceptance hit's last is a pad)
    draft: list[int]
    # R: the draft's real tokens (B, or B - 1 after a full-acceptance hit; 0 in target mode)
    num_real: int
    # "draft pass" (sync; async's fallback draft, also its first round), "branch" or "full
    # acceptance" (that segment of the previous round's packed pass), "" in target mode
    drafted_by: str
    # where a block's d_1 is read (draft_rows): "causal" or "mask"
    d1_from: str
    # a: the accepted prefix d_1 .. d_a
    num_accepted: int
    # t: the target's own token after d_1 .. d_a (correction, or the bonus token if a = R)
    next_token: int
    # what this round added to the output (d_1 .. d_a, t; cut at EOS or the budget)
    committed: list[int]
    # tokens the target's KV cache held at the round's start, and at its end
    target_cache: tuple[int, int]
    # the same for the drafter's KV cache ((0, 0) in target mode)
    drafter_cache: tuple[int, int]
    # async only (None in the other modes): the outcomes (i, t) that the packed pass's segments
    # were prepared for, in order: the branches, then full acceptance (R + 1, g)
    outcomes: list[tuple[int, int]] | None = None
    # async only: the index in outcomes that this round's outcome selected (a hit: that
    # segment's block is the next round's draft); -1 on a miss (the next round drafts anew)
    segment: int | None = None


@torch.no_grad()
def generate(
    target,
    drafter,
    input_ids,
    config=None,
    *,
    generator=None,
    caches=None,
    on_round=None,
    streamer=None,
    **settings,
):
    """Decode input_ids (1, prompt_len) as config (a DecodeConfig; default DecodeConfig())
    says, each keyword in `settings` replacing one of its fields (generate(target, drafter, ids,
    max_new_tokens=64, mode="async")), until EOS (kept) or max_new_tokens. Returns (output_ids
    (1, prompt + new), stats: tau, accept_lengths, num_rounds, time per phase, ...; the
    docstring of runtime.Output.stats lists every key).

    Greedy output is the target's, token for token; sampling is lossless (its draws use
    `generator`). caches: fixed-size KV caches to reuse (default: per request). on_round:
    called with a RoundInfo after each round (its values ride on the round's one host read).
    streamer: a transformers streamer (TextStreamer, ...), given the prompt, then the prefill's
    token, then each round's committed tokens ((1, n) on the CPU), then end(). Batches:
    systems.batched."""
    config = with_settings(config, DecodeConfig, settings)
    # a clear error for each bad input (runtime.py); B, None without a drafter
    block_size = check_request(target, drafter, input_ids, config)
    # B, or 1 in target mode (no drafter): it sizes the branch budget and the caches
    sizing_block = block_size or 1
    coverage, fanout = branch_budget(config, sizing_block)
    use_drafter = None
    if config.mode != "target" or config.keep_ratio is not None:
        use_drafter = drafter
    prompt_len = input_ids.shape[1]
    # only the async packed pass holds branches in the drafter's cache
    cached_coverage = 0
    if config.mode == "async":
        cached_coverage = coverage
    need = cache_len(prompt_len, config.max_new_tokens, sizing_block, cached_coverage, fanout)
    if caches is None:
        caches = Caches.make(target, use_drafter, need)
    else:
        caches = caches.check(target, use_drafter, need)
    # async's lanes (the rule: _decode_async's docstring); the target's size matters only to
    # the default
    num_params = 0
    if config.mode == "async" and config.lanes is None:
        num_params = sum(p.numel() for p in target.parameters())
    # caches.compiled: whether a model's passes are torch.compile'd (systems/fast.py)
    compiled = caches.compiled and config.mode == "async"
    lanes = async_lanes(input_ids.device.type, compiled, config.lanes, num_params)
    # every setting resolved: the loops read B, C, F and the lanes from here
    config = replace(config, block_size=block_size, coverage=coverage, fanout=fanout, lanes=lanes)
    out = Output(input_ids[0].tolist(), config.max_new_tokens, config.eos_token_id)
    # each fixed-shape pass is timed under its phase, by the cache that runs it (runtime.py)
    clock = Clock(input_ids.device, pass_phases(config.mode, sizing_block, coverage, fanout))
    sampler = Sampler(config.temperature, generator)
    # selective prefill: what the target prefills; the drafter's cache holds the full prompt
    selection = None
    if config.keep_ratio is not None:
        keep = dict(keep_ratio=config.keep_ratio, chunk_size=config.chunk_size)
        with clock.span("scoring"):
            selection = select_chunks(drafter, input_ids, cache=caches.drafter, **keep)
    _prefill(caches, input_ids, selection, out, clock, sampler)
    # on_round, the streamer and async's tally, fed once a round (systems/rounds.py)
    watch = Watch(config, caches, RoundInfo, drafter, on_round, streamer)
    watch.start(out)
    with caches.timed(clock):
        if config.mode == "target":
            _decode_target(out, caches, sampler, watch)
        elif config.mode == "sync":
            _decode_sync(drafter, out, caches, config, sampler=sampler, watch=watch)
        else:
            with _Overlap(caches.drafter.device, config.lanes, clock) as overlap:
                loop = dict(sampler=sampler, watch=watch, overlap=overlap)
                _decode_async(drafter, out, caches, config, **loop)
    watch.end()
    stats = watch.stats()
    stats.update(out.stats(clock.totals(), config.mode, selection))
    if config.trace:
        stats["trace"] = clock.trace()
    return torch.tensor([out.tokens], device=input_ids.device), stats
