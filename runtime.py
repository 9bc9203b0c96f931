"""What d3d.py runs on, none of it the method:

- fixed-size KV caches, their length kept on the host;
- the round's one host read, which also checks that every pass wrote its cache;
- chunked prefill, and a pass that returns attention weights (selective prefill's score);
- the clock that times the phases without waiting for the device;
- the committed tokens with their stop rules, and a decode's stats;
- generate's input checks;
- loss logits made a few rows at a time;
- the tokenizer's fingerprint;
- which mode and how many lanes run when none are named (one rule for d3d.generate and
  decode.py);
- loading, a guarded optimizer step and a host copy of a model, which training and pruning
  share;
- sizes checked before memory is spent: positions against max_position_embeddings, and the
  bytes a request (check_request) or a training step (check_training_size) certainly needs
  against the memory there is: free memory on CUDA, /proc/meminfo's MemAvailable on a Linux
  CPU, else the position check alone. D3D_MEMORY_LIMIT=BYTES (digits: D3D_MEMORY_LIMIT=2000000)
  lowers that limit;
- the device a flag names, and loading with no network: a local folder, the local Hugging Face
  cache, the hub only if it can be reached."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import math
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn


class UserError(ValueError):
    """Bad input from the person running a driver: a flag out of its range, a file that is
    missing, empty or cut short. Its message is one line, "<what is wrong> — <how to fix it>";
    the drivers print it as `error: ...` and exit with status 2 (systems/cli.py)."""


# --------------------------------------------------------------------------------------------------
# Settings: one range each, checked by one validator


@dataclass(frozen=True)
class Range:
    """The values a setting accepts: a type, and bounds that may be open or closed, or a list
    of `choices`. `each`: the setting takes a list (or one value), and every item must lie in
    the range. kind=bool takes True or False."""

    kind: type = int
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    each: bool = False
    choices: tuple | None = None

    def describe(self) -> str:
        """The range in words: '>= 1', '> 0', 'in (0, 1]', "one of 'first', 'likely'"."""
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind is bool:
            return "True or False"
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            right = ")" if self.high_open else "]"
            return f"in {left}{self.low}, {self.high}{right}"
        if self.low is not None:
            sign = ">" if self.low_open else ">="
            return f"{sign} {self.low}"
        if self.high is not None:
            sign = "<" if self.high_open else "<="
            return f"{sign} {self.high}"
        return "any finite number"

    def holds(self, value) -> bool:
        """Whether one value lies in the range (a float must also be finite)."""
        if self.choices is not None:
            return type(value) is self.kind and value in self.choices
        if self.kind is bool or isinstance(value, bool):
            return self.kind is bool and isinstance(value, bool)
        if not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None:
            if value < self.low:
                return False
            if self.low_open and value == self.low:
                return False
        if self.high is not None:
            if value > self.high:
                return False
            if self.high_open and value == self.high:
                return False
        return True


def flag_name(name: str) -> str:
    """A keyword of main(**kw) as its command-line flag: num_anchors -> --num-anchors."""
    return "--" + name.replace("_", "-")


def check_ranges(
    values: dict, ranges: dict[str, Range], flags: dict[str, str] | None = None, owner=None
):
    """Raise UserError for the first value outside its range. None means "not given" and is
    always allowed (the caller then uses its documented default). The message names a flag
    (`flags` renames a keyword whose flag is spelt otherwise: sampling_check_samples ->
    --sampling-check), or with `owner` a config's field (DecodeConfig.max_new_tokens)."""
    if flags is None:
        flags = {}
    for name, allowed in ranges.items():
        value = values.get(name)
        if value is None:
            continue
        where = flags.get(name, flag_name(name))
        if owner is not None:
            where = f"{owner}.{name}"
        items = [value]
        if allowed.each and isinstance(value, (list, tuple)):
            items = value
        for item in items:
            if not allowed.holds(item):
                raise UserError(
                    f"{where} must be {allowed.kind.__name__} {allowed.describe()}, "
                    f"got {item!r} — give a value {allowed.describe()}"
                )


def setting(default, help: str, range: Range | None = None):
    """A config field with its explanation and range written once, where the drivers' flags
    can read them (dataclasses.fields(config)[i].metadata)."""
    return field(default=default, metadata={"help": help, "range": range})


def check_settings(config) -> None:
    """A config's __post_init__: every field against the range in its metadata."""
    ranges = {f.name: f.metadata["range"] for f in fields(config) if f.metadata.get("range")}
    check_ranges(vars(config), ranges, owner=type(config).__name__)


def with_settings(config, kind: type, settings: dict):
    """`config` (None: the defaults of `kind`) with the keyword `settings` replacing its fields,
    as model.generate(**kwargs) updates its GenerationConfig; an unknown name is a TypeError."""
    names = {f.name for f in fields(kind)}
    unknown = sorted(set(settings) - names)
    if unknown:
        known = ", ".join(sorted(names))
        raise TypeError(f"{kind.__name__} has no setting {unknown[0]!r}; its settings: {known}")
    if config is None:
        return kind(**settings)
    if not isinstance(config, kind):
        raise TypeError(f"config must be a {kind.__name__}, got {type(config).__name__}")
    if not settings:
        return config
    return replace(config, **settings)


# --------------------------------------------------------------------------------------------------
# Fixed-size KV caches


def additive_mask(mask: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Bool mask (True = may attend) as HF's additive float mask, in attention's
    dtype (autocast's or the model's)."""
    kind = mask.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
    else:
        dtype = next(model.parameters()).dtype
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill_(~mask, torch.finfo(dtype).min)


class KVCache:
    """A model's KV cache of fixed size (an HF StaticCache), made once and reused for every
    request, so that shapes and addresses never change (what compiled passes and CUDA graphs
    need). A pass writes its q tokens at the cache's own slot; `rewind` moves back (a rejected
    draft, a packed pass's branches) without touching the tensors.

    The length is kept on the host: the StaticCache's own is a device tensor, and reading it
    would wait for the device. `skipped`: prompt tokens selective prefill left out of the
    target's cache, so positions run that far ahead of the slots. `step` runs the fixed-shape
    passes: the fast path (fast.py) swaps in a compiled one and sets `compiled`. `clock`: a
    Clock that times each fixed-shape pass under its phase (Caches.timed), or None."""

    def __init__(self, model: nn.Module, max_len: int):
        from transformers import StaticCache

        # a d3d.Drafter: its passes return hidden states, not logits
        self.drafter = hasattr(model, "d3d_config")
        if self.drafter:
            config = model.model.config
        else:
            config = model.config
        self.model = model
        self.max_len = max_len
        self.length = 0
        self.skipped = 0
        self.device = next(model.parameters()).device
        self.hf = StaticCache(config=config, max_cache_len=max_len)
        self.step = self.forward
        self.compiled = False
        self.clock = None

    def forward(self, ids, positions, mask) -> torch.Tensor:
        """ids, positions (1, q); mask (1, 1, q, max_len) bool over the cache's slots.
        A drafter: its last hidden states (q, H); a target: float logits (q, V)."""
        if self.drafter:
            return self.model.hidden_states(ids, positions, mask, self.hf)[0]
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=additive_mask(mask, self.model),
            cache=self.hf,
            use_cache=True,
        )
        return out.logits[0].float()

    def run(self, ids, positions, mask, *, fixed: bool = True) -> torch.Tensor:
        """A pass over ids (1, q) written at slots length .. length+q-1; mask
        (1, 1, q, length+q) is widened to all slots (no query sees past its pass).
        fixed=False (a prefill: any length) always runs eagerly."""
        q = ids.shape[1]
        # refused before the write: an overflowing write moves the position first
        if self.length + q > self.max_len:
            raise ValueError(
                f"KV cache full: {self.length} + {q} tokens > max_len {self.max_len}; "
                "make the cache larger (generate's caches=, decode.py --max-len)"
            )
        step = self.forward
        span = contextlib.nullcontext()
        if fixed:
            step = self.step
        if fixed and self.clock is not None:
            span = self.clock.pass_span(self.drafter, q)
        try:
            with span:
                mask = F.pad(mask, (0, self.max_len - self.length - q))
                self.length += q
                return step(ids, positions, mask)
        except RuntimeError as error:
            if out_of_memory(error):
                raise self.too_large(q, error) from None
            # a forward that drops its cache (in any layer) meets a mask wider than its own keys
            if not all(layer.is_initialized for layer in self.hf.layers):
                self.check(self.written(self.device).tolist())
            raise error

    def too_large(self, q: int, error: RuntimeError) -> UserError:
        """The error for a pass that ran out of memory: what it was, what torch said."""
        said = str(error).strip().splitlines()[0]
        return UserError(
            f"a pass of {q} tokens over {type(self.model).__name__}'s KV cache of "
            f"{self.max_len} slots ran out of memory ({said}) — lower max_new_tokens, "
            "block_size or fanout (decode.py --max-new-tokens, --block-size, --fanout)"
        )

    def positions(self, q: int, device) -> torch.Tensor:
        """(1, q) positions of the next q tokens: after what the cache holds and the
        prompt tokens it skipped."""
        return torch.arange(q, device=device)[None] + self.length + self.skipped

    def written(self, device) -> torch.Tensor:
        """The cache's own length in each of its layers (num_layers,), left on the device for
        the round's one read (-1: a layer never written)."""
        lengths = []
        for layer in self.hf.layers:
            if layer.is_initialized:
                lengths.append(layer.cumulative_length.to(device))
            else:
                lengths.append(torch.tensor(-1, device=device))
        return torch.stack(lengths)

    def check(self, written: list[int]) -> None:
        """A pass that ignored its cache (a model whose forward drops cache=, in one layer or
        all) would decode wrong tokens without an error; that layer's own length then differs
        from the host's. `written`: each layer's, as `written` gives them."""
        for index, held in enumerate(written):
            if held == self.length:
                continue
            holds = f"{held} tokens in layer {index}"
            if held < 0:
                holds = f"nothing in layer {index}"
            raise ignored_cache(f"{type(self.model).__name__}'s KV cache", holds, self.length)

    def rewind(self, length: int) -> None:
        """Keep the sequence's first `length` tokens (slots: length - skipped); the next pass
        overwrites the rest. Only drops tokens: a length past what the cache holds is an error,
        since those slots were never written."""
        if length - self.skipped > self.length:
            held = self.length + self.skipped
            raise ValueError(
                f"cannot rewind the KV cache to {length} tokens: it holds {held}; "
                f"rewind drops tokens, so give a length of at most {held}"
            )
        if length - self.skipped < self.length:
            self.hf.crop(length - self.skipped - self.length)
            self.length = length - self.skipped

    def reset(self, skipped: int = 0) -> None:
        """Empty, for a new request whose first `skipped` prompt tokens the cache will not hold."""
        self.rewind(self.skipped)
        self.skipped = skipped


@dataclass
class Caches:
    """The target's and the drafter's KVCache, kept across requests (decode.py makes one
    pair per run)."""

    target: KVCache
    drafter: KVCache | None

    @classmethod
    def make(cls, target: nn.Module, drafter: nn.Module | None, max_len: int) -> "Caches":
        """The pair, refused in one line if the memory there is cannot hold both caches (a
        StaticCache takes its memory at the first pass)."""
        need = kv_bytes_per_slot(target) * max_len
        if drafter is not None:
            need += kv_bytes_per_slot(drafter) * max_len
        device = next(target.parameters()).device
        lower = "max_new_tokens, block_size or fanout, or the slots (Caches.make's max_len; "
        lower += "decode.py --max-new-tokens, --block-size, --fanout, --max-len)"
        check_memory(f"a pair of KV caches of {max_len:,} slots", need, device, lower)
        target_cache = KVCache(target, max_len)
        drafter_cache = None
        if drafter is not None:
            drafter_cache = KVCache(drafter, max_len)
        return cls(target_cache, drafter_cache)

    @contextlib.contextmanager
    def timed(self, clock: "Clock"):
        """Inside, each cache's fixed-shape passes are timed by `clock` (KVCache.clock)."""
        for cache in (self.target, self.drafter):
            if cache is not None:
                cache.clock = clock
        try:
            yield
        finally:
            for cache in (self.target, self.drafter):
                if cache is not None:
                    cache.clock = None

    @property
    def compiled(self) -> bool:
        """Whether either model's fixed-shape passes are compiled (fast.compile_passes)."""
        if self.target.compiled:
            return True
        return self.drafter is not None and self.drafter.compiled

    def check(self, target: nn.Module, drafter: nn.Module | None, need: int) -> "Caches":
        """These caches, if they belong to these models and hold `need` slots; else a
        clear error."""
        same_models = self.target.model is target
        if same_models and drafter is not None:
            same_models = self.drafter.model is drafter
        if not same_models:
            raise ValueError(
                "caches were made for other models: Caches.make(target, drafter, max_len)"
            )
        too_short = need > self.target.max_len
        if drafter is not None and need > self.drafter.max_len:
            too_short = True
        if too_short:
            raise ValueError(
                f"this request needs KV caches of {need} slots (prompt + max_new_tokens + "
                f"the widest pass), the caches have {self.target.max_len}: make them larger "
                "(Caches.make(..., max_len), decode.py --max-len)"
            )
        return self


def sync_draft_width(block_size: int) -> int:
    """Tokens of sync's draft pass: the unread committed tokens padded to B + 1, then B MASKs."""
    return 2 * block_size + 1


def packed_width(block_size: int, coverage: int, fanout: int) -> int:
    """Tokens of async's packed pass: x_n, d_1 .. d_B, then S = C F + 1 segments [token, B
    MASKs] (C at most B)."""
    segments = min(coverage, block_size) * fanout + 1
    return 1 + block_size + segments * (1 + block_size)


def cache_len(
    prompt_len: int, max_new_tokens: int, block_size: int = 1, coverage: int = 0, fanout: int = 0
) -> int:
    """Slots a request needs: its tokens plus the widest pass written past them (async:
    the packed pass)."""
    widest = max(sync_draft_width(block_size), packed_width(block_size, coverage, fanout))
    return prompt_len + max_new_tokens + widest


def pass_phases(mode: str, block_size: int, coverage: int, fanout: int) -> dict:
    """{(the drafter's cache?, tokens of the pass): phase} of a decode's fixed-shape passes:
    what the Clock names each pass that a KVCache runs. Each kind of pass has its own width,
    so its width names it; the target-only loop's one-token passes and the prefills are not
    timed one by one."""
    phases = {}
    if mode == "sync":
        phases[(False, block_size + 1)] = "verify"
        phases[(True, sync_draft_width(block_size))] = "draft"
    if mode == "async":
        phases[(False, block_size + 1)] = "verify"
        phases[(True, 1 + block_size)] = "fallback_draft"
        phases[(True, packed_width(block_size, coverage, fanout))] = "packed_draft"
    return phases


# what torch says when an allocation fails: CUDA's OutOfMemoryError, the CPU allocator's
# words, and a size too large to count
MEMORY_WORDS = (
    "out of memory",
    "can't allocate memory",
    "not enough memory",
    "size calculation overflowed",
    "multiplication overflow",
)


def out_of_memory(error: RuntimeError) -> bool:
    """Whether a RuntimeError is an allocation that failed (never an ignored cache)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    said = str(error).lower()
    return any(words in said for words in MEMORY_WORDS)


def ignored_cache(cache: str, holds: str, written: int) -> RuntimeError:
    """The error for a cache that holds other than what was written into it: the model's
    forward ignored it."""
    return RuntimeError(
        f"{cache} holds {holds} where {written} were written: the model's forward ignored "
        "the cache it was given (transformers outside the versions in requirements.txt?)"
    )


def read_round(values: list[torch.Tensor], *caches: KVCache) -> list:
    """The round's one host read: every tensor of `values` (integers, on one device) comes
    back as tolist() gives it (a 0-d tensor as an int, a 1-d one as a list, ...), in one
    transfer that also reads each cache's own length in every layer and checks it against
    the host's (KVCache.check)."""
    device = values[0].device
    flat = [v.reshape(-1) for v in values]
    lengths = [c.written(device) for c in caches]
    read = torch.cat(flat + lengths).tolist()
    start = 0
    shaped = []
    for value, numbers in zip(values, flat):
        piece = read[start : start + len(numbers)]
        start += len(numbers)
        shaped.append(_unflatten(piece, list(value.shape)))
    for cache, written in zip(caches, lengths):
        cache.check(read[start : start + len(written)])
        start += len(written)
    return shaped


def _unflatten(numbers: list, shape: list[int]):
    """A flat list back in `shape`, as tolist() nests it (shape [] gives the number)."""
    if not shape:
        return numbers[0]
    if len(shape) == 1:
        return numbers
    if shape[0] == 0:
        return []
    size = len(numbers) // shape[0]
    return [_unflatten(numbers[r * size : (r + 1) * size], shape[1:]) for r in range(shape[0])]


def causal_mask(q: int, past_len: int, device) -> torch.Tensor:
    """(1, 1, q, past_len + q) bool: q new tokens see the past and each other causally."""
    ones = torch.ones(q, past_len + q, dtype=torch.bool, device=device)
    return ones.tril(past_len)[None, None]


def causal_pass(cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
    """A plain causal pass over ids (1, q) after what the cache holds."""
    q = ids.shape[1]
    positions = cache.positions(q, ids.device)
    return cache.run(ids, positions, causal_mask(q, cache.length, ids.device))


# tokens a prefill pass reads: its mask is chunk x cache length, never prompt x prompt
# (a 32k prompt's would take 1 GiB)
PREFILL_CHUNK = 512


def prefill(
    cache: KVCache, ids: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Causal passes over a prompt, ids (1, n) at positions (1, n) (default: after what
    the cache holds), that write it into the cache PREFILL_CHUNK tokens at a time,
    eagerly (any length). Returns the last pass's output: its last row is the last
    token's."""
    if positions is None:
        positions = cache.positions(ids.shape[1], ids.device)
    for start in range(0, ids.shape[1], PREFILL_CHUNK):
        chunk = ids[:, start : start + PREFILL_CHUNK]
        mask = causal_mask(chunk.shape[1], cache.length, ids.device)
        chunk_positions = positions[:, start : start + PREFILL_CHUNK]
        out = cache.run(chunk, chunk_positions, mask, fixed=False)
    return out


def attention_pass(cache: KVCache, ids: torch.Tensor) -> list[torch.Tensor]:
    """A causal pass over ids (1, q) after what the cache holds, with eager attention
    (the only kind that returns its weights): each layer's attention weights
    (heads, q, cache length + q), float."""
    model = cache.model.model  # a d3d.Drafter's HF model
    q = ids.shape[1]
    positions = cache.positions(q, ids.device)
    mask = causal_mask(q, cache.length, ids.device)
    mask = F.pad(mask, (0, cache.max_len - cache.length - q))
    attn_implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        out = model.get_decoder()(
            input_ids=ids,
            position_ids=positions,
            attention_mask=additive_mask(mask, model),
            cache=cache.hf,
            use_cache=True,
            output_attentions=True,
        )
        cache.length += q
    finally:
        model.set_attn_implementation(attn_implementation)
    return [a[0, :, :, : cache.length].float() for a in out.attentions]


# --------------------------------------------------------------------------------------------------
# Decoding bookkeeping: the clock and the committed tokens


class Clock:
    """Where a decode's time goes, kept out of the loops' way: `with clock.span(key):` adds
    the time inside to `key`, and a KVCache it times (Caches.timed) adds each fixed-shape pass
    to its phase (`phases`: pass_phases), so the loops hold no timing lines. On CUDA a span is
    two events on the current stream (a pass's own stream), read once the decode is over
    (timing never makes the host wait mid-round), and the host time spent queuing the work is
    kept too (key + "_launch"); elsewhere, the host clock. Each span remembers its lane (the
    CUDA stream, or the host thread, it ran on): `trace` draws the lanes as tracks."""

    def __init__(self, device: torch.device, phases: dict | None = None):
        self.device = device
        # {(a drafter's cache?, tokens of the pass): phase}
        self.phases = phases or {}
        self.cuda = device.type == "cuda"
        self.spans = []  # (key, start, end, lane)
        self.host = {}  # CUDA: seconds the host spent queuing each key's work
        self.start = self.now()
        self.zero = self._mark()  # where a trace's time starts

    def now(self) -> float:
        """The host clock once the device is done with what was queued."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _lane(self) -> str:
        if self.cuda:
            return f"CUDA stream {torch.cuda.current_stream(self.device).stream_id}"
        return f"thread {threading.current_thread().name}"

    @contextlib.contextmanager
    def span(self, key: str):
        """`with clock.span(key):` adds the time inside to `key`."""
        start = self._mark()
        host_start = time.perf_counter()
        lane = self._lane()
        yield
        # a list append: safe from a worker thread too
        self.spans.append((key, start, self._mark(), lane))
        if self.cuda:
            queued = time.perf_counter() - host_start
            launch = key + "_launch"
            self.host[launch] = self.host.get(launch, 0.0) + queued

    def pass_span(self, drafter: bool, width: int):
        """The span of one fixed-shape pass of `width` tokens, named by its phase; a pass of
        no phase is not timed."""
        phase = self.phases.get((drafter, width))
        if phase is None:
            return contextlib.nullcontext()
        return self.span(phase)

    def _seconds(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def totals(self) -> dict:
        """Seconds per key, and "total" since the clock started."""
        seconds = {**self.host, "total": self.now() - self.start}
        for key, start, end, _ in self.spans:
            seconds[key] = seconds.get(key, 0.0) + self._seconds(start, end)
        return seconds

    def trace(self) -> dict:
        """The spans as a Chrome trace (open in ui.perfetto.dev or chrome://tracing): one
        track per lane, each span named by its key, times in microseconds from the clock's
        start. Read after the decode (totals waits)."""
        self.now()
        lanes = list(dict.fromkeys(lane for *_, lane in self.spans))
        process = {"name": f"d3d decode on {self.device}"}
        events = [{"name": "process_name", "ph": "M", "pid": 0, "args": process}]
        for i, lane in enumerate(lanes):
            track = {"name": lane}
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": track})
        for key, start, end, lane in self.spans:
            events.append(
                {
                    "name": key,
                    "ph": "X",
                    "pid": 0,
                    "tid": lanes.index(lane),
                    "ts": 1e6 * self._seconds(self.zero, start),
                    "dur": 1e6 * self._seconds(start, end),
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def mean(values) -> float:
    """The mean of `values`; nan for none."""
    if not values:
        return float("nan")
    return sum(values) / len(values)


class Output:
    """Committed tokens of one sequence, with the stop rules (EOS kept, max_new_tokens) and
    the tokens committed per round."""

    def __init__(self, prompt: list[int], max_new_tokens: int, eos_token_id):
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        if isinstance(eos_token_id, (list, tuple, set)):
            eos = eos_token_id
        else:
            eos = [eos_token_id]
        self.eos = {int(e) for e in eos if e is not None}
        self.done = max_new_tokens <= 0
        # per speculative round: tokens committed (accepted + 1)
        self.accept_lengths: list[int] = []

    def commit(self, new: list[int]) -> list[int]:
        """Append tokens, cut at the first EOS (kept) or at max_new_tokens. Returns what was
        committed."""
        # a finished sequence takes no more tokens
        if self.done:
            raise RuntimeError(
                "tokens committed to a finished sequence: a decoding loop lost track of its "
                "rows or of the stop rule"
            )
        room = self.prompt_len + self.max_new_tokens - len(self.tokens)
        new = new[:room]
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[: i + 1]
                break
        self.tokens.extend(new)
        num_new = len(self.tokens) - self.prompt_len
        ends_in_eos = bool(new) and new[-1] in self.eos
        self.done = num_new >= self.max_new_tokens or ends_in_eos
        # the sequence would stand still and the next round repeat this one forever
        if not new and not self.done:
            raise RuntimeError(
                "a round committed no token and the sequence is not done: a decoding loop "
                "lost its tokens"
            )
        return new

    def commit_round(self, accepted: list[int], next_token: int) -> None:
        """Commit a speculative round: the accepted draft tokens and the target's token."""
        committed = self.commit(accepted + [next_token])
        self.accept_lengths.append(len(committed))

    def summary(self) -> dict:
        """tau (mean tokens committed per round), accept_lengths, num_rounds,
        num_new_tokens."""
        return {
            "tau": mean(self.accept_lengths),
            "accept_lengths": self.accept_lengths,
            "num_rounds": len(self.accept_lengths),
            "num_new_tokens": len(self.tokens) - self.prompt_len,
        }

    def stats(self, seconds: dict, mode: str, selection) -> dict:
        """A single-sequence decode's stats, from its clock's seconds per phase
        (Clock.totals). Every key of d3d.generate's stats, times in seconds:

        Every mode (here):
            tau                      mean tokens committed per speculative round (accepted
                                     + 1); nan in mode "target", which has no rounds
            accept_lengths           tokens committed in each round
            num_rounds               speculative rounds (the prefill's token is not one)
            num_new_tokens           tokens committed after the prompt
            time_total               the whole decode, from the clock's start
            time_prefill             time to the first token: the target's prefill, the
                                     drafter's, and selective prefill's scoring
            time_<phase>_launch      CUDA only: the host time spent queuing each phase
        Mode "sync" (here):
            time_draft               the drafter's passes
            time_verify              the target's verification passes
        Mode "async" (here):
            time_verify              the target's verification passes
            time_packed_draft        the packed passes that prepare the next draft
            time_fallback_draft      the drafts made after a miss
            time_draft               packed + fallback
            time_both                the verification and the packed pass together
        Mode "async" (d3d._decode_async):
            hits_per_position        rounds whose next draft was prepared, by the first
                                     rejection: index i - 1, the verification rejected
                                     d_i; index B, full acceptance
            misses_per_position      rounds whose next draft was not prepared, same index
            pad_full_acceptances     rounds that accepted a padded draft (B - 1 tokens and
                                     a pad) whole
            coverage                 C: the rejection positions the packed pass prepares
            fanout                   F: the candidates for the target's token at each (the
                                     drafter's likeliest other than d_i)
            cover                    which positions: "first" (1 .. C) or "likely"
            lanes                    1: the packed pass after the verification; 2: beside it
        keep_ratio (selective prefill, here):
            num_chunks               the prompt's chunks
            chunks_kept              the chunks the target prefilled
            prompt_tokens_prefilled  the prompt tokens the target prefilled
            time_scoring             the drafter's scoring of the chunks
            time_target_prefill      the target's prefill of the kept chunks
        trace=True (d3d.generate):
            trace                    the round's phases as a Chrome trace (Clock.trace)
        A batch's stats (systems.batched.generate) are listed in its docstring."""
        phases = {
            "target": (),
            "sync": ("draft", "verify"),
            "async": ("fallback_draft", "packed_draft", "verify", "both"),
        }
        stats = self.summary()
        stats["time_total"] = seconds["total"]
        # time to first token: the target's prefill, the drafter's, and selective
        # prefill's scoring
        prefill = seconds.get("prefill", 0.0)
        stats["time_prefill"] = prefill + seconds.get("scoring", 0.0)
        for key in phases[mode]:
            stats[f"time_{key}"] = seconds.get(key, 0.0)
        for key, value in seconds.items():
            if key.endswith("_launch"):
                stats[f"time_{key}"] = value
        if mode == "async":
            stats["time_draft"] = stats["time_fallback_draft"] + stats["time_packed_draft"]
        if selection is not None:
            stats["num_chunks"] = selection["num_chunks"]
            stats["chunks_kept"] = selection["chunks_kept"]
            stats["prompt_tokens_prefilled"] = selection["kept_ids"].shape[1]
            stats["time_scoring"] = seconds["scoring"]
            stats["time_target_prefill"] = prefill
        return stats


# --------------------------------------------------------------------------------------------------
# Number formats


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device: torch.device) -> bool:
    """Does the device compute bf16 natively (CUDA: the GPU says; CPU: AVX512-BF16 or AMX
    in /proc/cpuinfo)? Elsewhere bf16 matmuls fall back to slow kernels (measured:
    ~20-200x slower)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu" or not os.path.exists("/proc/cpuinfo"):
        return False
    with open("/proc/cpuinfo") as f:
        flag_lines = (line.split() for line in f if line.startswith("flags"))
        flags = next(flag_lines, [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """--dtype of both drivers: "auto" (or None) is bf16 where the device does it natively,
    else fp32; an explicit bf16 on a CPU without it is honoured with a warning."""
    if name in (None, "auto"):
        if native_bf16(device):
            return torch.bfloat16
        return torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
    if DTYPES[name] == torch.bfloat16 and device.type == "cpu" and not native_bf16(device):
        warnings.warn(
            "bf16 on a CPU without AVX512-BF16/AMX runs on slow fallback kernels (measured "
            "on AVX2: a drafter training step 130 s instead of 5.9 s in fp32); --dtype auto "
            "picks fp32 here"
        )
    return DTYPES[name]


# --------------------------------------------------------------------------------------------------
# generate's input checks


def check_request(target, drafter, input_ids, config) -> int | None:
    """d3d.generate's input checks beyond each setting's range (DecodeConfig checks those): a
    clear error for each bad input. Returns the block size (config.block_size, default the
    drafter's; None without a drafter)."""
    if isinstance(input_ids, (list, tuple)):
        raise ValueError(
            "d3d.generate decodes one prompt (1, prompt_len); a list of prompts decodes as "
            "one batch with systems.batched.generate"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise ValueError(
            "input_ids must have shape (1, prompt_len) (batch 1, not empty: at least one "
            f"token), got {tuple(input_ids.shape)}"
        )
    target_device = next(target.parameters()).device
    if input_ids.device != target_device:
        raise ValueError(
            f"input_ids are on {input_ids.device}, the target on {target_device}: put them on "
            "one device (input_ids.to(target.device))"
        )
    needs_drafter = config.mode != "target" or config.keep_ratio is not None
    if drafter is not None and needs_drafter and drafter.device != target_device:
        raise ValueError(
            f"the target is on {target_device}, the drafter on {drafter.device}: put both on "
            "one device (drafter.to(target.device))"
        )
    if drafter is None and needs_drafter:
        why = ""
        if config.keep_ratio:
            why = " (it scores the prompt chunks)"
        raise ValueError(f"mode {config.mode!r} needs a drafter{why}")
    if drafter is None:
        check_sizes(target, None, input_ids.shape[1], 1, config)
        return None
    target_rows = target.get_output_embeddings().weight.shape[0]
    drafter_rows = drafter.d3d_config.target_vocab_size
    if drafter_rows != target_rows:
        raise ValueError(
            f"the drafter was made for a target vocabulary of {drafter_rows} tokens, "
            f"this target has {target_rows}: use a drafter made with the target's "
            "tokenizer"
        )
    trained = drafter.d3d_config.block_size
    block_size = config.block_size
    if block_size is None:
        block_size = trained
    if block_size != trained and config.mode != "target":
        # legal (an experiment); warnings shows the same words from one line once a run
        warnings.warn(
            f"the drafter was trained at B = {trained} and decodes at B = {block_size} "
            f"(block_size, decode.py --block-size): legal, but expect another tau than at "
            f"B = {trained}"
        )
    # target-only decoding writes one token a pass
    sizing_block = block_size
    if config.mode == "target":
        sizing_block = 1
    check_sizes(target, drafter, input_ids.shape[1], sizing_block, config)
    return block_size


# --------------------------------------------------------------------------------------------------
# Sizes checked before memory is spent: positions, and the bytes certainly needed against the
# memory there is


MEMORY_LIMIT = "D3D_MEMORY_LIMIT"


def in_bytes(n: int) -> str:
    """A byte count as people read it: '300,011,000,580 bytes (279.4 GiB)'."""
    return f"{n:,} bytes ({n / 2**30:.1f} GiB)"


def memory_limit(device) -> tuple[int | None, str]:
    """The bytes an allocation on `device` may still take, and where that number comes from:
    free CUDA memory (with what torch holds unused), /proc/meminfo's MemAvailable on a Linux
    CPU, else None; D3D_MEMORY_LIMIT=BYTES (digits) lowers it."""
    device = torch.device(device)
    limit = None
    source = ""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        limit = free + unused
        source = f"{device} has free"
    elif device.type == "cpu" and os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            rows = dict(line.split(":", 1) for line in f if ":" in line)
        if "MemAvailable" in rows:
            limit = int(rows["MemAvailable"].split()[0]) * 1024
            source = "/proc/meminfo has MemAvailable"
    written = os.environ.get(MEMORY_LIMIT, "").strip()
    if not written:
        return limit, source
    if not written.isdigit():
        raise UserError(
            f"{MEMORY_LIMIT}={written!r} is not a number of bytes — write digits only, "
            f"e.g. {MEMORY_LIMIT}=8000000000 for 8 GB"
        )
    if limit is None or int(written) < limit:
        limit = int(written)
        source = f"{MEMORY_LIMIT} allows"
    return limit, source


def check_memory(asked: str, need: int, device, lower: str) -> None:
    """UserError if `need` bytes pass the memory limit of `device`: one line, what was asked,
    what it needs, what there is, what to lower."""
    limit, source = memory_limit(device)
    if limit is None or need <= limit:
        return
    raise UserError(
        f"{asked} needs at least {in_bytes(need)}, {source} {in_bytes(limit)} — lower {lower} "
        f"({MEMORY_LIMIT}=BYTES, in digits, sets a lower limit)"
    )


def max_positions(model) -> int | None:
    """A model's max_position_embeddings (a d3d.Drafter: its HF model's); None if it has none."""
    if hasattr(model, "d3d_config"):
        model = model.model
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def check_positions(asked: str, need: int, name: str, model, lower: str) -> None:
    """UserError if `need` positions pass the model's max_position_embeddings (None: no model,
    or none given)."""
    if model is None:
        return
    limit = max_positions(model)
    if limit is not None and need > limit:
        raise UserError(
            f"{asked} needs {need} positions, {name} has max_position_embeddings {limit} — "
            f"lower {lower}"
        )


def kv_bytes_per_slot(model) -> int:
    """Bytes one cache slot takes in every layer of a model (keys and values)."""
    if hasattr(model, "d3d_config"):
        model = model.model
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * heads * head_dim * itemsize


def check_fanout(fanout: int, vocab_size: int) -> None:
    """F counts the drafter's likeliest tokens other than d_i (plan_branches), so at most
    V - 1: a larger one is a UserError, before caches are sized by it (cache_len)."""
    if fanout > vocab_size - 1:
        raise UserError(
            f"fanout {fanout} asks for more candidates than the {vocab_size - 1} tokens other "
            f"than d_i in a vocabulary of {vocab_size} — give fanout (decode.py --fanout) at "
            f"most {vocab_size - 1}"
        )


def check_sizes(target, drafter, prompt_len: int, block_size: int, config) -> None:
    """generate's sizes before anything is allocated (check_request calls it; a batch passes
    its longest prompt): the positions the request reaches, and the bytes it certainly needs
    (both KV caches of cache_len slots, and the widest pass's mask, which KVCache.run widens
    to every slot: a bool and an additive float per query and slot)."""
    uses_drafter = config.mode != "target" or config.keep_ratio is not None
    if not uses_drafter:
        drafter = None
    vocab = target.get_output_embeddings().weight.shape[0]
    if drafter is not None:
        vocab = drafter.d3d_config.target_vocab_size
    if config.mode == "async" and config.fanout is not None:
        check_fanout(config.fanout, vocab)
    new = config.max_new_tokens
    asked = f"a prompt of {prompt_len} tokens, max_new_tokens {new} and B = {block_size}"
    lower = "max_new_tokens or block_size (decode.py --max-new-tokens, --block-size)"
    # the verification's last token x_{n+B}, and one past it
    positions = prompt_len + new + block_size + 1
    check_positions(asked, positions, "the target", target, lower)
    coverage = 0
    fanout = 0
    if config.mode == "async":
        # the full-acceptance block hangs off d_B: the drafter reaches B further
        positions += block_size
        coverage = config.coverage
        shown = f"coverage {coverage}"
        if coverage is None:
            # d3d's default C is at least 1: what is certainly needed
            coverage = 1
            shown = "the default coverage (at least 1)"
        fanout = config.fanout
        if fanout is None:
            fanout = 2
        asked += f", {shown}, fanout {fanout}"
        lower = "max_new_tokens, block_size, coverage or fanout (decode.py --max-new-tokens, "
        lower += "--block-size, --coverage, --fanout)"
    check_positions(asked, positions, "the drafter", drafter, lower)
    slots = cache_len(prompt_len, new, block_size, coverage, fanout)
    # every pass's mask spans all slots: the prefill's chunk, or the widest pass past it
    widest = min(prompt_len, PREFILL_CHUNK)
    need = kv_bytes_per_slot(target) * slots
    if drafter is not None:
        widest = max(widest, cache_len(0, 0, block_size, coverage, fanout))
        need += kv_bytes_per_slot(drafter) * slots
    float_size = next(target.parameters()).element_size()
    need += widest * slots * (1 + float_size)
    device = next(target.parameters()).device
    asked += f" ({slots} KV slots, a pass of {widest} tokens)"
    check_memory(asked, need, device, lower)


def check_training_size(
    drafter,
    examples,
    *,
    batch_size: int,
    max_len: int,
    device,
    bf16: bool = False,
    val_anchors: int = 0,
) -> None:
    """train.py's sizes before training, for `examples` ((prompt ids, response ids) pairs,
    training and held-out) cut to max_len tokens: the packed sequence's positions (the longest
    L, + B) against max_position_embeddings, and the bytes a step certainly needs against the
    memory there is: the packed mask of b x (L + K B)^2 (a bool and an additive float), the
    hidden states every layer keeps for backward, and AdamW's state (gradient and two moments,
    fp32) of every trained weight. val_anchors: the held-out passes' K, when it is wider."""
    config = drafter.d3d_config
    block_size = config.block_size
    num_anchors = max(config.num_anchors, val_anchors)
    longest = max(len(prompt) + len(response) for prompt, response in examples)
    seq_len = min(longest, max_len)
    asked = (
        f"training on sequences of {seq_len} tokens (--max-len {max_len}) with --batch-size "
        f"{batch_size}, --num-anchors {num_anchors} and --block-size {block_size}"
    )
    lower = "--block-size, --num-anchors, --max-len or --batch-size"
    check_positions(asked, seq_len + block_size, "the drafter", drafter, lower)
    tokens = seq_len + num_anchors * block_size
    float_size = 4
    if bf16:
        float_size = 2
    mask = batch_size * tokens**2 * (1 + float_size)
    hf = drafter.model.config.get_text_config()
    hidden = batch_size * tokens * hf.hidden_size * float_size * hf.num_hidden_layers
    trained = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    optimizer = 3 * 4 * trained
    asked += f" ({tokens} packed tokens a sequence)"
    check_memory(asked, mask + hidden + optimizer, device, lower)


# --------------------------------------------------------------------------------------------------
# Which mode, and how many lanes, where the caller names none: one rule for d3d.generate and
# decode.py


# a CPU's second thread pays from this target size on (a tiny model's passes hold the GIL:
# two threads were measured slower, RESULTS.md, "Speed on the toy")
TWO_LANES_MIN_PARAMS = 20_000_000


def default_mode(device_type: str) -> tuple[str, str]:
    """The speculative mode a run uses where none is named, and why: sync on every device
    until a measured run shows async faster there (d3d.generate's default is sync too)."""
    if device_type == "cuda":
        why = (
            "at batch 1 both the verification and the drafter's passes are bound by memory "
            "bandwidth: an async round streams both models' weights through the same memory "
            "at once, so overlap saves little and every miss adds a whole draft (an estimate "
            "until a GPU measures it: README, 'Async on one GPU'; compare with --bench FILE "
            "--modes sync async)"
        )
        return "sync", why
    why = (
        "on a CPU a pass costs in proportion to its tokens, so async's packed pass costs more "
        "than the draft a hit saves (RESULTS.md, Speed on the toy)"
    )
    return "sync", why


_compiled_lanes_on_cuda = False  # lifted only by unproven_compiled_lanes()


def async_lanes(
    device_type: str, compiled: bool, lanes: int | None = None, num_params: int = 0
) -> int:
    """How many lanes async decoding runs in: 1, the packed pass after the verification; 2,
    beside it (CUDA: a second stream; CPU: a second thread). lanes=None picks: 2 on a CPU
    for a target of TWO_LANES_MIN_PARAMS or more, else 1 (on CUDA, eager passes are bound
    by kernel launches from one Python thread, so a second stream has nothing to overlap).

    Refused with a clear error: two lanes with compiled passes on CUDA. torch.compile's CUDA
    graphs keep one memory pool per device, and a graph reuses the blocks an earlier one
    freed; replayed at once on two streams, the verification and the packed pass may
    overwrite each other's activations, and nothing would raise."""
    if lanes is None:
        big_target = num_params >= TWO_LANES_MIN_PARAMS
        if device_type == "cpu" and big_target:
            lanes = 2
        else:
            lanes = 1
    if lanes not in (1, 2):
        raise ValueError(
            "lanes must be 1 (one pass after the other) or 2 (a second stream or thread), "
            f"got {lanes}"
        )
    compiled_on_cuda = compiled and device_type == "cuda"
    if lanes == 2 and compiled_on_cuda and not _compiled_lanes_on_cuda:
        raise ValueError(
            "two lanes with compiled passes on CUDA are refused: their CUDA graphs share one "
            "memory pool, so verification and the packed pass replayed at once on two "
            "streams may overwrite each other's activations without an error. Use one lane "
            "(lanes=1; decode.py --lanes 1, or a mode without +2lanes) or eager passes (no "
            "--compile, no +compiled)"
        )
    return lanes


@contextlib.contextmanager
def unproven_compiled_lanes():
    """Inside, async_lanes allows two lanes with compiled passes on CUDA: for
    tests/gpu_check.py alone, which compares their tokens with one lane's."""
    global _compiled_lanes_on_cuda
    _compiled_lanes_on_cuda = True
    try:
        yield
    finally:
        _compiled_lanes_on_cuda = False


# --------------------------------------------------------------------------------------------------
# Loss logits in chunks


# fp32 logits alive at once in the loss: 128 MiB on a CPU, 1 GiB on a GPU (Qwen3's 151,936
# tokens: 220 or 1,766 rows; every chunk recasts the tied head and sums its gradient)
LOGITS_PER_CHUNK = {
    "cpu": 2**25,
    "cuda": 2**28,
}


def loss_chunk_rows(vocab_size: int, device: torch.device | str) -> int:
    """Rows of logits the loss makes at once on this kind of device."""
    kind = torch.device(device).type
    logits = LOGITS_PER_CHUNK.get(kind, LOGITS_PER_CHUNK["cpu"])
    return max(1, logits // vocab_size)


def in_logit_chunks(vocab_size: int, fn, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fn(*chunk) over `rows` ((N, ...) each) a few rows at a time, outputs concatenated:
    fn makes logits over `vocab_size` tokens, and a batch's would take tens of GB at once.
    Under autograd each chunk's logits are recomputed in backward, not kept."""
    size = loss_chunk_rows(vocab_size, rows[0].device)
    # an empty batch still runs once: its loss stays in the graph
    num_rows = max(len(rows[0]), 1)
    outputs = []
    for start in range(0, num_rows, size):
        chunk = [r[start : start + size] for r in rows]
        if torch.is_grad_enabled() and rows[0].requires_grad:
            checkpoint = torch.utils.checkpoint.checkpoint
            outputs.append(checkpoint(fn, *chunk, use_reentrant=False))
        else:
            outputs.append(fn(*chunk))
    return tuple(torch.cat(parts) for parts in zip(*outputs))


# --------------------------------------------------------------------------------------------------
# The tokenizer a drafter was made for


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the token -> id table: two tokenizers with the same fingerprint
    split text identically."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    table = json.dumps(vocab, ensure_ascii=False).encode()
    return hashlib.sha256(table).hexdigest()[:16]


def check_tokenizer(drafter, tokenizer) -> None:
    """Raise if a d3d.Drafter was made for another tokenizer than `tokenizer` (the
    target's)."""
    expected = drafter.d3d_config.tokenizer_hash
    if expected and expected != tokenizer_fingerprint(tokenizer):
        raise ValueError(
            "the drafter was made for a different tokenizer than the target's: its drafts "
            "would be other tokens. Train a drafter for this target "
            "(python train.py --target ...)"
        )


# --------------------------------------------------------------------------------------------------
# Loading, layer surgery, a guarded training step, a host copy (train.py and pruning)


def keep_layers(model: nn.Module, layer_ids: list[int]) -> nn.Module:
    """Keep only decoder layers `layer_ids`, in that order and in place, renumbered 0..n-1
    (cache slots, config). No layer at all (pruning's score of a one-layer drafter) goes
    straight from the embeddings to the final norm."""
    decoder = model.get_decoder()
    config = model.config
    layers = decoder.layers
    in_range = all(0 <= i < len(layers) for i in layer_ids)
    if not in_range or len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"layer ids must be distinct and in [0, {len(layers)}), got {layer_ids}")
    decoder.layers = nn.ModuleList([layers[i] for i in layer_ids])
    for new_idx, layer in enumerate(decoder.layers):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):
                module.layer_idx = new_idx  # the cache slot this attention writes to
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in layer_ids]
    config.num_hidden_layers = len(layer_ids)
    return model


def parse_device(name: str, flag: str = "--device") -> torch.device:
    """The device a name spells, whether or not this machine has it; a word torch does not
    read as a device is a UserError."""
    try:
        return torch.device(name)
    except RuntimeError:
        message = f"{flag} {name} is not a device — give cpu, cuda, cuda:N or mps"
        raise UserError(message) from None


def resolve_device(name: str | None, flag: str = "--device") -> torch.device:
    """The device a flag names, checked before anything loads: None is CUDA if there is one,
    else the CPU; a CUDA or MPS device this machine lacks is a UserError."""
    if name is None:
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    device = parse_device(name, flag)
    if device.type == "cuda":
        count = 0
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
        if count == 0:
            built = "built with CUDA" if torch.version.cuda else "built without CUDA"
            raise UserError(
                f"{flag} {name}: this machine has no CUDA device (torch {torch.__version__}, "
                f"{built}) — use {flag} cpu, or leave {flag} out"
            )
        if device.index is not None and device.index >= count:
            raise UserError(
                f"{flag} {name}: this machine has {count} CUDA device(s), cuda:0 .. "
                f"cuda:{count - 1} — give one of those"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{flag} {name}: MPS is not available here — use {flag} cpu")
    return device


# seconds to wait for the hub to answer before a name counts as unreachable
HUB_TIMEOUT = 3.0


def hub_reachable() -> bool:
    """Whether the Hugging Face hub can be asked: not offline (HF_HUB_OFFLINE), and its host
    takes a connection within HUB_TIMEOUT (behind a proxy, the client is left to try)."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY")
    if any(os.environ.get(name) for name in proxies):
        return True
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port
    if port is None:
        port = 80 if endpoint.scheme == "http" else 443
    try:
        socket.create_connection((endpoint.hostname, port), timeout=HUB_TIMEOUT).close()
    except OSError:
        return False
    return True


def cached_snapshot(name: str) -> str | None:
    """The folder of the local Hugging Face cache that holds hub model `name` (its main
    revision), found by reading the cache alone; None if the cache holds no config.json of it.
    (from_pretrained(name, local_files_only=True) would still open a connection: the hub
    client fetches, once a day, a list it names in its user-agent.)"""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    if isinstance(found, str):
        return os.path.dirname(found)
    return None


def from_local_or_hub(load, path: str, flag: str, **kwargs):
    """load(path, **kwargs) (a from_pretrained) without waiting on a network that is not
    there: a local folder as it is; a hub name from its folder in the local Hugging Face cache
    first (no connection opened), then from the hub if it answers; else one line naming local
    folders."""
    if os.path.isdir(path):
        return load(path, **kwargs)
    snapshot = cached_snapshot(path)
    if snapshot is not None:
        try:
            return load(snapshot, **kwargs)
        except OSError:
            pass
    why = "no local folder, not in the Hugging Face cache, and the hub cannot be reached"
    if hub_reachable():
        try:
            return load(path, **kwargs)
        except OSError as error:
            why = str(error).strip().splitlines()[0]
    raise UserError(
        f"{flag} {path}: {why} — give a local folder: toy-target (the toy's target), or "
        "one that save_pretrained wrote"
    )


def load_tokenizer(path: str, flag: str = "--target"):
    """AutoTokenizer.from_pretrained, from a local folder or as from_local_or_hub says."""
    from transformers import AutoTokenizer

    return from_local_or_hub(AutoTokenizer.from_pretrained, path, flag)


def load_causal_lm(
    path: str, dtype=None, device=None, flag: str = "--target", **kwargs
) -> nn.Module:
    """AutoModelForCausalLM.from_pretrained in `dtype` on `device`, from a local folder or as
    from_local_or_hub says (`flag` names it in the error). On a GPU with `accelerate`
    installed the weights go straight there (device_map); without it they pass through host
    memory first (an 8B model in bf16: 16 GB)."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained
    if device is None:
        device = "cpu"
    device = torch.device(device)
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    if device.type != "cpu" and has_accelerate:
        return from_local_or_hub(load, path, flag, dtype=dtype, device_map=device, **kwargs)
    if device.type != "cpu":
        warnings.warn(
            f"loading {path} through host memory first (pip install accelerate loads it "
            f"straight to {device})"
        )
    return from_local_or_hub(load, path, flag, dtype=dtype, **kwargs).to(device)


REPOSITORY = os.path.dirname(os.path.abspath(__file__))


def record_path(path: str | None) -> str | None:
    """A path as a run's record keeps it: a file of this repository (the shipped toy's) relative
    to the repository, so the record still holds after the clone moves; any other path as the
    user gave it."""
    if path is None:
        return None
    full = os.path.abspath(path)
    if os.path.commonpath([full, REPOSITORY]) == REPOSITORY and os.path.exists(full):
        return os.path.relpath(full, REPOSITORY)
    return path


def find_recorded(path: str | None, what: str, must_exist: bool = True) -> str | None:
    """A path from a run's record: as written if it is there (from the current folder), else
    relative to the repository (record_path); gone from both, a UserError naming it."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        if path is not None and must_exist and not os.path.exists(path):
            raise UserError(f"{what} {path} is gone — restore it, or train again")
        return path
    inside = os.path.join(REPOSITORY, path)
    if os.path.exists(inside):
        return inside
    if must_exist:
        raise UserError(
            f"{what} {path} is gone (looked in the current folder and in "
            f"{REPOSITORY}) — restore it, or train again"
        )
    return path


def finite_step(optimizer: torch.optim.Optimizer, params, max_norm: float) -> bool:
    """Clip the gradients to max_norm and step, unless their norm is not finite: then drop
    them and skip the step (one NaN or Inf would reach the weights and both AdamW moments).
    Returns whether it stepped. The norm is the same on every rank (gradients are reduced
    before it), so every rank decides alike. One host read."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    stepped = bool(torch.isfinite(norm))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stepped


def host_copy(module: nn.Module) -> nn.Module:
    """A deep copy in host memory, made tensor by tensor (never a second whole copy on the
    device)."""
    memo = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("cpu", copy=True), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.to("cpu", copy=True)
    return copy.deepcopy(module, memo)
