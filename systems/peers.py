"""The transformers peers of D3D, benchmarked beside it on the same prompts and timed by the
same rule (hf_decode): plain generate (hf), assisted generation with the drafter's causal LM as
the assistant (hf-assisted, assistant_model) and prompt lookup (hf-lookup)."""

from __future__ import annotations

import copy
import itertools
import math
import weakref

import torch
import transformers

import d3d
import runtime

# transformers' own greedy decoding, benchmarked next to D3D (off unless named in --modes):
# plain generate, assisted generation with the drafter's model as a token-by-token assistant,
# prompt lookup
BASELINES = ("hf", "hf-assisted", "hf-lookup")


# ---------------------------------------------------------------------------------------------
# Peers: transformers' own greedy decoding, in the same run and on the same prompts as D3D


class _Rounds(transformers.generation.BaseStreamer):
    """Tokens committed per target pass: assisted generation and prompt lookup hand each pass's
    accepted tokens to the streamer in one put (the first put is the prompt)."""

    def __init__(self):
        self.sizes = []

    def put(self, value):
        self.sizes.append(value.numel())

    def end(self):
        pass


# drafter model -> its assistant view, built once per run
_ASSISTANTS = weakref.WeakKeyDictionary()


def assistant_model(drafter: d3d.Drafter, vocab_size: int) -> torch.nn.Module:
    """The drafter's own causal LM as a transformers assistant: the same weight tensors (shared,
    not copied) in a copied module tree whose embedding and output rows are cut to the target's
    `vocab_size` (assisted generation needs equal vocabularies; the cut drops the MASK row
    make_drafter adds when the vocabulary has no free row)."""
    model = drafter.model
    if model in _ASSISTANTS:
        return _ASSISTANTS[model]
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    # new modules and configs around the same tensors
    assistant = copy.deepcopy(model, memo=shared)
    emb = assistant.get_input_embeddings()
    head = assistant.get_output_embeddings()
    if head.weight.shape[0] > vocab_size:
        tied = head.weight is emb.weight
        # a view: no copy
        emb.weight = torch.nn.Parameter(emb.weight[:vocab_size], requires_grad=False)
        if tied:
            head.weight = emb.weight
        else:
            head.weight = torch.nn.Parameter(head.weight[:vocab_size], requires_grad=False)
        if head.bias is not None:
            head.bias = torch.nn.Parameter(head.bias[:vocab_size], requires_grad=False)
        emb.num_embeddings = vocab_size
        head.out_features = vocab_size
        assistant.config.get_text_config().vocab_size = vocab_size
    _ASSISTANTS[model] = assistant
    return assistant


@torch.no_grad()
def hf_decode(models, ids: torch.Tensor, mode: str, config) -> dict:
    """One prompt with transformers' generate, greedy, batch 1: the record decode_prompt keeps
    for a mode.

    hf: plain generate. hf-assisted: the drafter's causal LM drafts B tokens one pass each
    (num_assistant_tokens=B, schedule "constant", confidence threshold off: every round drafts
    B tokens, as a D3D block does). hf-lookup: prompt lookup with B candidate tokens (n-grams
    up to transformers' default of 2). B: --block-size, else the drafter's.

    Prefill is excluded as in d3d.generate's stats: decode_time = time of a max_new_tokens=N
    call minus time of a max_new_tokens=1 call on the same prompt (the target's prefill, which
    also yields the first token, plus generate's fixed per-call cost); time_prefill = the
    1-token call. The assistant's reading of the prompt stays in decode time, like the D3D
    drafter's. τ: tokens committed per target pass, the first pass (prompt + first drafts)
    left out as D3D leaves out its prefill."""
    target = models.target
    eos = models.eos
    # config: the mode's DecodeConfig (its block_size and max_new_tokens)
    block_size = models.block_size(config)
    max_new_tokens = config.max_new_tokens
    pad = models.tokenizer.pad_token_id
    if pad is None:
        pad = eos[0]
    kwargs = {
        "attention_mask": torch.ones_like(ids),
        "do_sample": False,
        "num_beams": 1,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    if mode == "hf-assisted":
        vocab_size = target.get_output_embeddings().weight.shape[0]
        assistant = assistant_model(models.drafter, vocab_size)
        assistant.generation_config.update(
            num_assistant_tokens=block_size,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
        kwargs["assistant_model"] = assistant
    elif mode == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = block_size
    rounds = _Rounds()
    times = []
    for n in sorted({1, max(max_new_tokens, 1)}):
        # plain generate: one token per pass, no streamer in its loop
        streamer = None
        if n > 1 and mode != "hf":
            streamer = rounds
        clock = runtime.Clock(ids.device)
        out = target.generate(ids, max_new_tokens=n, streamer=streamer, **kwargs)
        times.append(clock.now() - clock.start)
    new = out[0, ids.shape[1] :].tolist()[:max_new_tokens]
    # the streamer's puts: the prompt, the first pass, then the rounds after
    accept = rounds.sizes[2:]
    decode_time = times[-1] - times[0]
    decode_tokens = max(len(new) - 1, 0)
    tokens_per_s = math.nan
    if decode_tokens > 0 and decode_time > 0:
        tokens_per_s = decode_tokens / decode_time
    return {
        "new_tokens": new,
        "num_new_tokens": len(new),
        "accept_lengths": accept,
        "num_rounds": len(accept),
        "tau": runtime.mean(accept),
        "time_prefill": times[0],
        "time_total": times[-1],
        "decode_time": decode_time,
        "decode_tokens": decode_tokens,
        "tokens_per_s": tokens_per_s,
    }
