"""Answer prompts with a D3D drafter, or benchmark it against target-only decoding (the paper's Table 1 protocol).

    python decode.py                                     # the shipped toy target, the drafter `python train.py` wrote
    python decode.py --target Qwen/Qwen3-8B --drafter runs/qwen3-8b/drafter --prompt "What is 17 * 23?"
    python decode.py --bench toy-target/prompts-test.jsonl --max-samples 20 --out runs/bench.json
    python decode.py --bench toy-target/prompts-test.jsonl --max-samples 32 --modes sync --concurrency 1 4 8 16

Answers are coloured by origin: green = draft tokens the target accepted, yellow = the target's own token that
closes every round (the first token comes from the target's prefill). Then a table of target-only decoding and each
mode on the same prompts (speed, speedup, tau, hit rate, same tokens) and the acceptance histogram. Without --mode:
sync, shown beside async. On one GPU at batch 1 async is estimated to lose to sync with a drafter as deep as the
target: both passes are bound by memory bandwidth, so running them at once saves little and each miss adds a draft;
it can pay with a shallow drafter, or with the drafter on a device of its own (README, "Async on one GPU": measure it
with --bench FILE --modes sync async). --trace PATH draws one decode's passes on a timeline, a track per lane.
--sampling-check N (with --temperature): N sampled answers by target-only and by --mode, compared per position.
Benchmark (the paper's protocol): batch 1, greedy unless --temperature, a warm-up, then per prompt target-only
decoding and each speculative mode, in the same run. speedup = target-only time per output token / speculative
time per output token, prefill excluded (TTFT reported apart), times and tokens summed over a dataset; tau = mean
over rounds, averaged per prompt. Every greedy output (speculative modes and baselines) is checked token for token
against the target-only output; where one differs, a teacher-forced target pass gives the target's logit margin at
the first differing token: within rounding (tie_tolerance) it is a near-tie, beyond it an error.
Baselines (--modes hf hf-assisted hf-lookup, off by default): transformers' own generate, assisted generation with
the drafter's model drafting one token per pass, and prompt lookup, timed by the same rule (hf_decode).
--concurrency (the paper's Table 2): prompts in consecutive groups of c decoded as one batch; throughput = new tokens
of all requests / wall time of the batches (prefill included), speedup over batched target-only at the same c.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import itertools
import json
import math
import os
import platform
import shlex
import sys
import weakref

import torch
import transformers
from tqdm.auto import tqdm

import d3d
import fast
import runtime
import toy
import train

TOY_DRAFTER, TOY_TARGET = "runs/toy/drafter", toy.SHIPPED  # the toy's default drafter, and its shipped target
TOY_PROMPTS = os.path.join(toy.SHIPPED, toy.DATA_FILES["test"])
PROMPT_FIELDS = ("question", "prompt", "turns")  # GSM8K-, HumanEval-, MT-Bench-style files (first turn only)
COLOURS, RESET = {"draft": "\033[32m", "target": "\033[33m"}, "\033[0m"
TIME_KEYS = ("time_draft", "time_verify", "time_packed_draft", "time_fallback_draft", "time_overlap_saved",
             "time_verify_launch", "time_packed_draft_launch")
# transformers' own greedy decoding, benchmarked next to D3D (off unless named in --modes): plain generate, assisted
# generation with the drafter's model as a token-by-token assistant, prompt lookup
BASELINES = ("hf", "hf-assisted", "hf-lookup")
TIE_EPS_MULTIPLE, TIE_EPS_FLOOR = 8, 2.0 ** -16  # the greedy check's rounding allowance: see tie_tolerance


def available_modes() -> tuple[str, ...]:
    return tuple(getattr(d3d, "MODES", ("target", "sync")))


def parse_mode(spec: str) -> tuple[str, dict]:
    """'sync', 'async', 'async:C,F[,cover]' (a branch budget to sweep, the paper's Fig. 3), or a transformers
    baseline (BASELINES): (mode, overrides). A D3D mode or 'target' may end in '+compiled' (its passes compiled,
    beside the eager ones in the same run) and '+2lanes' (async: the packed pass in a second lane)."""
    spec, *setting = spec.split("+")
    if any(s not in ("compiled", "2lanes") for s in setting) or (setting and spec.split(":")[0] in BASELINES):
        raise ValueError(f"unknown setting in {'+'.join([spec, *setting])!r}: a D3D mode or target may end in "
                         "+compiled and +2lanes (async), e.g. sync+compiled async+compiled+2lanes")
    flags = {"compiled": True} if "compiled" in setting else {}
    flags.update({"lanes": 2} if "2lanes" in setting else {})
    mode, overrides = _parse_budget(spec)
    return mode, {**overrides, **flags}


def _parse_budget(spec: str) -> tuple[str, dict]:
    mode, _, budget = spec.partition(":")
    if mode in BASELINES and not budget:
        return mode, {}
    if mode not in available_modes() or (budget and mode != "async"):
        raise ValueError(f"unknown mode {spec!r}: use one of {', '.join(available_modes() + BASELINES)} "
                         "or async:C,F[,cover]")
    if not budget:
        return mode, {}
    parts = budget.split(",")
    try:
        overrides = {"coverage": int(parts[0]), "fanout": int(parts[1])}
    except (ValueError, IndexError):
        raise ValueError(f"bad async budget {spec!r}: write async:C,F or async:C,F,likely (e.g. async:12,2)")
    if len(parts) > 2:
        overrides["cover"] = parts[2]
    return mode, overrides


# ----------------------------------------------------------------------------------------------------------------------
# Models and prompts


def load(target, drafter, modes, device, dtype, attn, threads=None):
    """(target, drafter or None if only target-only decoding runs, the target's tokenizer, EOS ids, description)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args_file = os.path.join(drafter, "train_args.json")
    recipe = json.load(open(args_file)) if os.path.isfile(args_file) else {}
    if dtype in (None, "auto") and recipe.get("compute_dtype") == "float32":
        dtype = "float32"  # trained in fp32 (the toy always is): decode in it too
    dtype = train.resolve_dtype(dtype, device)
    need_drafter = any(m != "target" for m in modes)
    if (need_drafter or target is None) and drafter == TOY_DRAFTER and not os.path.isdir(drafter):
        raise FileNotFoundError(f"no drafter at {TOY_DRAFTER}: train the toy's drafter with `python train.py` "
                                "(about 1½ min on 2 CPU cores), or pass --target and --drafter")
    draft_model = d3d.Drafter.from_pretrained(drafter, dtype, device, attn).eval() if need_drafter else None
    if target is None:  # the target the drafter was trained for
        target = recipe.get("target", TOY_TARGET)
    tok = transformers.AutoTokenizer.from_pretrained(target)
    if draft_model is not None:
        d3d.check_tokenizer(draft_model, tok)  # before loading a large target for nothing
    model = runtime.load_causal_lm(target, dtype, device, attn_implementation=attn).eval()
    if device.type == "cpu" and not threads and sum(p.numel() for p in model.parameters()) < 20_000_000:
        torch.set_num_threads(1)  # a tiny model's passes are too short to split between threads (the toy: ~2x faster)
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = sorted({tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    num_threads = torch.get_num_threads()
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"cpu ({platform.machine()}, {num_threads} thread{'s' * (num_threads > 1)})",
            "dtype": str(dtype), "attn": attn,
            "target": target, "drafter": drafter if need_drafter else None, "eos_token_id": eos,
            "drafter_config": dataclasses.asdict(draft_model.d3d_config) if draft_model else None}
    return model, draft_model, tok, eos, info


def encode(tok, text: str, thinking: bool, device) -> torch.Tensor:
    """Prompt ids (1, n): the chat template if the tokenizer has one (Qwen3: thinking off unless asked)."""
    if not text.strip():
        raise ValueError("empty prompt: give some text to answer")
    if not tok.chat_template:
        return torch.tensor([tok(text).input_ids], device=device)
    text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=thinking)
    return torch.tensor([tok(text, add_special_tokens=False).input_ids], device=device)


def read_prompts(path: str, field: str | None = None, max_samples: int | None = None) -> tuple[str, list[str]]:
    """(field, prompts) of a JSON Lines file; the field is auto-detected among PROMPT_FIELDS unless given."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no prompts (empty file)")
    field = field or next((k for k in PROMPT_FIELDS if k in rows[0]), None)
    if field is None or field not in rows[0]:
        raise ValueError(f"{path}: no prompt field {field or PROMPT_FIELDS} (keys: {sorted(rows[0])}); "
                         "name it with --prompt-field")
    return field, [r[field][0] if isinstance(r[field], list) else r[field] for r in rows[:max_samples]]


# ----------------------------------------------------------------------------------------------------------------------
# One prompt in every mode, and how to show a round


def generate_kwargs(mode: str, opts: dict, eos, max_new_tokens, device) -> dict:
    """d3d.generate's keyword arguments for one mode, a fresh seeded generator each (the same draws in every mode)."""
    kwargs = {"max_new_tokens": max_new_tokens or opts["max_new_tokens"], "mode": mode, "eos_token_id": eos,
              "temperature": opts["temperature"], "generator": torch.Generator(device).manual_seed(opts["seed"])}
    if mode != "target":
        kwargs["block_size"] = opts["block_size"]
    return kwargs


def decode_prompt(models, ids, modes, opts, max_new_tokens=None) -> dict[str, dict]:
    """{mode: d3d.generate's stats (hf_decode's for a baseline) + new_tokens, decode_time, decode_tokens} for each
    mode, in order."""
    target, drafter, _, eos, _ = models
    records = {}
    for spec in modes:
        mode, overrides = parse_mode(spec)
        if mode in BASELINES:
            records[spec] = hf_decode(models, ids, mode, opts, max_new_tokens or opts["max_new_tokens"])
            continue
        kwargs = generate_kwargs(mode, opts, eos, max_new_tokens, ids.device)
        compiled = overrides.pop("compiled", False) or opts.get("compile")
        kwargs["caches"] = opts.get("compiled_caches" if compiled else "caches")  # the run's KV caches (prepare)
        lanes = overrides.pop("lanes", opts.get("lanes"))  # None: generate's rule (runtime.async_lanes)
        if mode == "async":  # branch budget C x F and which positions (plan_branches); unset = d3d's defaults
            kwargs.update({k: opts[k] for k in ("coverage", "fanout", "cover") if opts[k] is not None}, **overrides)
            kwargs["lanes"] = lanes
        if opts.get("keep_ratio") is not None:  # selective prefilling (lossy, off by default)
            kwargs.update(keep_ratio=opts["keep_ratio"], chunk_size=opts["chunk_size"])
        if opts.get("trace"):  # the phases as a Chrome trace (write_trace)
            kwargs["trace"] = True
        use_drafter = mode != "target" or opts.get("keep_ratio") is not None
        out, stats = d3d.generate(target, drafter if use_drafter else None, ids, **kwargs)
        records[spec] = {**stats, "new_tokens": out[0, ids.shape[1]:].tolist(),
                         "decode_time": stats["time_total"] - stats["time_prefill"],  # the first token is prefill's
                         "decode_tokens": max(stats["num_new_tokens"] - 1, 0)}
        if "time_both" in stats:  # what running verification and the packed pass side by side saved (< 0: cost)
            records[spec]["time_overlap_saved"] = stats["time_verify"] + stats["time_packed_draft"] - stats["time_both"]
    return records


def prepare(models, opts: dict, all_ids: list[torch.Tensor], modes: list[str]) -> None:
    """Once per run, before the warm-up: the KV caches of fixed size every request reuses (opts["caches"]; --max-len,
    else the longest prompt + --max-new-tokens + the widest pass of `modes`), and with --compile or a '+compiled'
    mode a second pair (opts["compiled_caches"]) whose fixed-shape passes are compiled, every shape warmed up
    (opts["compile_seconds"], printed: compile time is not decode time)."""
    target, drafter = models[0], models[1]
    block_size = opts["block_size"] or (drafter.d3d_config.block_size if drafter is not None else 1)
    widest = 0
    for spec in modes:
        mode, overrides = parse_mode(spec)
        budget = d3d.default_budget(block_size)
        coverage = overrides.get("coverage", opts["coverage"] if opts["coverage"] is not None else budget[0])
        fanout = overrides.get("fanout", opts["fanout"] if opts["fanout"] is not None else budget[1])
        widest = max(widest, runtime.cache_len(0, 0, block_size, coverage * (mode == "async"), fanout))
    new_tokens = max(opts["max_new_tokens"], 16, 2 * block_size + 3)  # the warm-ups decode up to this many
    need = max(x.shape[1] for x in all_ids) + new_tokens + widest
    if opts.get("max_len") and opts["max_len"] < need:
        raise ValueError(f"--max-len {opts['max_len']} is too small for these prompts: they need {need} KV slots "
                         "(the longest prompt + --max-new-tokens + the widest pass)")
    use_drafter = drafter if any(parse_mode(m)[0] not in ("target", *BASELINES) for m in modes) else None
    opts["caches"] = runtime.Caches.make(target, use_drafter, opts.get("max_len") or need)
    compiled = [m for m in modes if opts.get("compile") or parse_mode(m)[1].get("compiled")]
    if compiled:
        opts["compiled_caches"] = runtime.Caches.make(target, use_drafter, opts.get("max_len") or need)
        fast.compile_passes(opts["compiled_caches"], regional=opts.get("compile") == "regional")
        opts["compile_seconds"] = 0.0
        for spec in dict.fromkeys(m.replace("+compiled", "") for m in compiled if parse_mode(m)[0] not in BASELINES):
            mode, overrides = parse_mode(spec)  # each shape it uses (an async budget sets the packed pass's)
            settings = {k: opts[k] for k in ("coverage", "fanout", "cover") if opts[k] is not None} | overrides
            if mode == "async":  # a CPU's two lanes run with half the threads each, which dynamo's guards see
                settings.setdefault("lanes", opts.get("lanes"))
            opts["compile_seconds"] += fast.warm_up(target, use_drafter, opts["compiled_caches"], all_ids[0][:, :8],
                                                    [mode], block_size=opts["block_size"], **settings)
        print(f"compiled the fixed-shape passes of {', '.join(compiled)} in {opts['compile_seconds']:.1f} s "
              "(not counted in any time below)")


def write_trace(models, ids: torch.Tensor, mode: str, opts: dict, path: str) -> dict:
    """One prompt decoded once more in `mode` (after the run: its passes are warm), its phases written to `path` as a
    Chrome trace: draft, verify, packed_draft, fallback_draft, both and prefill spans, a track for each CUDA stream
    or host thread they ran on. Returns the trace."""
    record = decode_prompt(models, ids, [mode], {**opts, "trace": True})[mode]
    trace = record["trace"]
    trace["otherData"] = {"mode": mode, **{k: record[k] for k in ("lanes", "tau", "num_rounds") if k in record}}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    tracks = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    print(f"wrote {path}: {mode}, {record['num_rounds']} rounds, {len(trace['traceEvents']) - len(tracks) - 1} spans "
          f"on {len(tracks)} track(s) ({', '.join(tracks)}); open it in ui.perfetto.dev or chrome://tracing")
    return trace


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """Index of the first differing token (None if equal; the shorter length if one output is a prefix)."""
    if reference == other:
        return None
    return next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))


def colour_answer(tok, new_tokens: list[int], accept_lengths: list[int], colour: bool) -> str:
    """The answer, accepted drafts green, the target's own tokens yellow. Round r commits accept_lengths[r] tokens:
    drafts, then the target's (a final round cut by EOS or the budget may end on a draft: shown as the target's)."""
    if not colour:
        return tok.decode(new_tokens, skip_special_tokens=True)
    origin = ["target"] + [o for n in accept_lengths for o in ["draft"] * (n - 1) + ["target"]]
    origin += ["target"] * (len(new_tokens) - len(origin))  # target-only decoding has no rounds
    pieces, shown, start = [], "", 0
    for end in range(1, len(new_tokens) + 1):
        if end == len(new_tokens) or origin[end] != origin[start]:  # a run of one origin ends: decode up to it
            text = tok.decode(new_tokens[:end], skip_special_tokens=True)  # whole prefix: multi-byte text stays whole
            piece = text[len(shown):] if text.startswith(shown) else tok.decode(new_tokens[start:end])
            pieces.append(COLOURS[origin[start]] + piece + RESET)
            shown, start = text, end
    return "".join(pieces)


def histogram(accept_lengths: list[int], width: int = 40) -> str:
    """One bar per round length that occurred (lengths with no round are left out)."""
    counts = collections.Counter(accept_lengths)
    top, total = max(counts.values(), default=1), max(len(accept_lengths), 1)
    return "\n".join(f"  {n:>3} | {'#' * math.ceil(width * counts[n] / top):<{width}} {counts[n]:>5} "
                     f"({counts[n] / total:.0%})" for n in sorted(counts))


# ----------------------------------------------------------------------------------------------------------------------
# Peers: transformers' own greedy decoding, in the same run and on the same prompts as D3D


class _Rounds(transformers.generation.BaseStreamer):
    """Tokens committed per target pass: assisted generation and prompt lookup hand each pass's accepted tokens to
    the streamer in one put (the first put is the prompt)."""

    def __init__(self):
        self.sizes = []

    def put(self, value):
        self.sizes.append(value.numel())

    def end(self):
        pass


_ASSISTANTS = weakref.WeakKeyDictionary()  # drafter model -> its assistant view, built once per run


def assistant_model(drafter: d3d.Drafter, vocab_size: int) -> torch.nn.Module:
    """The drafter's own causal LM as a transformers assistant: the same weight tensors (shared, not copied) in a
    copied module tree whose embedding and output rows are cut to the target's `vocab_size` (assisted generation
    needs equal vocabularies; the cut drops the MASK row make_drafter adds when the vocabulary has no free row)."""
    model = drafter.model
    if model not in _ASSISTANTS:
        shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
        assistant = copy.deepcopy(model, memo=shared)  # new modules and configs around the same tensors
        emb, head = assistant.get_input_embeddings(), assistant.get_output_embeddings()
        if head.weight.shape[0] > vocab_size:
            tied = head.weight is emb.weight
            emb.weight = torch.nn.Parameter(emb.weight[:vocab_size], requires_grad=False)  # a view: no copy
            head.weight = emb.weight if tied else torch.nn.Parameter(head.weight[:vocab_size], requires_grad=False)
            if head.bias is not None:
                head.bias = torch.nn.Parameter(head.bias[:vocab_size], requires_grad=False)
            emb.num_embeddings = head.out_features = vocab_size
            assistant.config.get_text_config().vocab_size = vocab_size
        _ASSISTANTS[model] = assistant
    return _ASSISTANTS[model]


@torch.no_grad()
def hf_decode(models, ids: torch.Tensor, mode: str, opts: dict, max_new_tokens: int) -> dict:
    """One prompt with transformers' generate, greedy, batch 1, the record decode_prompt keeps for a mode.

    hf: plain generate. hf-assisted: the drafter's causal LM drafts B tokens one pass each (num_assistant_tokens=B,
    schedule "constant", confidence threshold off: every round drafts B tokens, as a D3D block does). hf-lookup:
    prompt lookup with B candidate tokens (n-grams up to transformers' default of 2). B: --block-size, else the
    drafter's. Prefill is excluded as in d3d.generate's stats: decode_time = time of a max_new_tokens=N call minus
    time of a max_new_tokens=1 call on the same prompt (the target's prefill, which also yields the first token, plus
    generate's fixed per-call cost); time_prefill = the 1-token call. The assistant's reading of the prompt stays in
    decode time, like the D3D drafter's. τ: tokens committed per target pass, the first pass (prompt + first drafts)
    left out as D3D leaves out its prefill."""
    target, drafter, tok, eos, _ = models
    block_size = opts["block_size"] or drafter.d3d_config.block_size
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": False, "num_beams": 1, "eos_token_id": eos,
              "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else eos[0]}
    if mode == "hf-assisted":
        assistant = assistant_model(drafter, target.get_output_embeddings().weight.shape[0])
        assistant.generation_config.update(num_assistant_tokens=block_size, num_assistant_tokens_schedule="constant",
                                           assistant_confidence_threshold=0.0)
        kwargs["assistant_model"] = assistant
    elif mode == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = block_size
    rounds = _Rounds() if mode != "hf" else None  # plain generate: one token per pass, no streamer in its loop
    times = []
    for n in sorted({1, max(max_new_tokens, 1)}):
        clock = runtime.Clock(ids.device)
        out = target.generate(ids, max_new_tokens=n, streamer=rounds if n > 1 else None, **kwargs)
        times.append(clock.now() - clock.start)
    new = out[0, ids.shape[1]:].tolist()[:max_new_tokens]
    accept = rounds.sizes[2:] if rounds is not None else []  # [prompt, first pass, the rounds after]
    decode_time = times[-1] - times[0]
    return {"new_tokens": new, "num_new_tokens": len(new), "accept_lengths": accept, "num_rounds": len(accept),
            "tau": sum(accept) / len(accept) if accept else math.nan, "time_prefill": times[0],
            "time_total": times[-1], "decode_time": decode_time, "decode_tokens": max(len(new) - 1, 0),
            "tokens_per_s": (len(new) - 1) / decode_time if len(new) > 1 and decode_time > 0 else math.nan}


# ----------------------------------------------------------------------------------------------------------------------
# Greedy check: rounding at near-ties or an error


def tie_tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest logit margin that rounding can flip at one position: 8 x eps x the largest |logit| there, with
    eps = max(the dtype's machine epsilon, 2^-16).

    Why: passes that share a prefix but not a shape (1 row in target-only decoding, B+1 in verification, the whole
    sequence in the check's pass) round differently, and each logit carries an error relative to the logits' scale.
    In bf16/fp16 the final rounding of the logits dominates; in fp32 the error accumulated over the layers does,
    about 1e-6 relative, far above fp32's epsilon (hence the 2^-16 floor). Measured on SmolLM2-135M-Instruct
    (3 prompts x 96 tokens, 1-row vs 9-row vs whole-sequence passes), the top-two margin moved by at most 2.4
    (bf16) and 1.7 (fp16) times the dtype's epsilon x max|logit|, and by 1.1e-6 x max|logit| (9.4 fp32 epsilons)
    in fp32: the tolerance leaves 3x headroom in bf16 and 100x in fp32. A margin beyond it is a difference in what
    was computed (a wrong cache, position or token), not rounding. At max|logit| 20: bf16 1.25 logits, fp32 2.4e-3."""
    eps = max(torch.finfo(dtype).eps, TIE_EPS_FLOOR)
    return TIE_EPS_MULTIPLE * eps * logits.abs().max().item()


@torch.no_grad()
def classify_divergence(target, ids: torch.Tensor, reference: list[int], other: list[int], position: int,
                        tolerance: float | None = None) -> dict:
    """Class of a greedy output that leaves target-only's at new token `position`: one teacher-forced target pass
    over prompt + the shared tokens gives the target's margin there, logit(target-only token) - logit(other
    token). "near-tie" if |margin| <= tolerance (tie_tolerance unless given), else "error"; an output that is a
    strict prefix of the other (no token to compare) is an error."""
    if position >= min(len(reference), len(other)):
        return {"class": "error", "margin": None, "tolerance": tolerance, "reason": "outputs differ in length only"}
    prefix = torch.tensor([reference[:position]], dtype=ids.dtype, device=ids.device)
    logits = target(input_ids=torch.cat([ids, prefix], 1), logits_to_keep=1).logits[0, -1]
    tolerance = tie_tolerance(logits, target.dtype) if tolerance is None else tolerance  # the weights' precision
    logits = logits.float()
    margin = (logits[reference[position]] - logits[other[position]]).item()
    return {"class": "near-tie" if abs(margin) <= tolerance else "error", "margin": margin, "tolerance": tolerance,
            "max_abs_logit": logits.abs().max().item()}


def divergence(target, tok, ids: torch.Tensor, reference: list[int], other: list[int], opts: dict, **where):
    """None if a greedy output equals target-only's, else where it leaves it (tokens shown) and its class."""
    pos = first_difference(reference, other)
    if opts["temperature"] or pos is None:
        return None
    show = [{"id": t[pos], "text": tok.decode(t[pos:pos + 1])} if pos < len(t) else "end of output"
            for t in (reference, other)]
    return {**where, "position": pos, "target_token": show[0], "mode_token": show[1],
            **classify_divergence(target, ids, reference, other, pos, opts.get("tie_tolerance"))}


def greedy_check(divergences: list[dict], checked: int, against: str = "target-only") -> str:
    """The summary line of the greedy check, then the first error if any."""
    ties = [d for d in divergences if d["class"] == "near-tie"]
    errors = [d for d in divergences if d["class"] == "error"]
    largest = f" (largest margin {max(abs(d['margin']) for d in ties):.3g})" if ties else ""
    text = (f"greedy check: identical {checked - len(divergences)}, near-tie divergences {len(ties)}{largest}, "
            f"errors {len(errors)} (of {checked} outputs against {against})")
    if errors:
        x = errors[0]
        margin = (f"margin {x['margin']:.3g} > tolerance {x['tolerance']:.3g}" if x["margin"] is not None
                  else x["reason"])
        text += (f"\n  first error: {x['dataset']} prompt {x['prompt_index']}, {x['mode']}, new token {x['position']}: "
                 f"target {x['target_token']} vs {x['mode']} {x['mode_token']}, {margin}")
    return text


# ----------------------------------------------------------------------------------------------------------------------
# Aggregation and the Table 1 layout


def _mean(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def summarise(records: list[dict], baseline: list[dict]) -> dict:
    """One mode over some prompts, against target-only decoding of the same prompts."""
    def s_per_token(recs):
        tokens = sum(r["decode_tokens"] for r in recs)
        return sum(r["decode_time"] for r in recs) / tokens if tokens else math.nan
    rounds = sum(r["num_rounds"] for r in records)
    out = {"speedup": s_per_token(baseline) / s_per_token(records), "tau": _mean(r["tau"] for r in records),
           "tokens_per_s": 1 / s_per_token(records), "ttft_s": _mean(r["time_prefill"] for r in records),
           "num_rounds": rounds, "num_new_tokens": sum(r["num_new_tokens"] for r in records),
           "histogram": dict(sorted(collections.Counter(n for r in records for n in r["accept_lengths"]).items())),
           "ms_per_round": {k[5:]: 1000 * sum(r[k] for r in records) / max(rounds, 1) for k in TIME_KEYS
                            if k in records[0]}}
    if rounds:  # the whole round, to compare with its phases
        out["ms_per_round"]["round"] = 1000 * sum(r["decode_time"] for r in records) / rounds
    if "hits_per_position" in records[0]:  # async: pooled over rounds (index k-1: rejection at k; last: all accepted)
        for k in ("hits_per_position", "misses_per_position"):
            out[k] = [sum(col) for col in zip(*(r[k] for r in records))]
        hits, misses = sum(out["hits_per_position"]), sum(out["misses_per_position"])
        out["hit_rate"] = hits / max(1, hits + misses)
    return out


def table(results: dict, overall: dict, modes: list[str], block_size: int) -> str:
    """Rows: modes; columns: per dataset speedup and tau, then their mean (the paper's Table 1). Below, over all
    datasets: decode speed, time to first token, hit rate and where the time of a round goes (round = decode time
    / rounds; the phases may sum to less: acceptance, bookkeeping; on GPU async verify and packed draft overlap).
    "overlap": for async, what running verify and the packed pass side by side saved, measured, in ms per round
    (below zero where it cost time)."""
    names = list(results) + ["Avg."]
    lines = [" " * 26 + "".join(f"{n[:17]:<18}" for n in names), f"{'Method':<26}" + "Speedup  τ       " * len(names)]
    for mode in modes:
        cells = [results[n]["modes"][mode] for n in results]
        cells.append({k: _mean(c[k] for c in cells) for k in ("speedup", "tau")})
        drafts = mode != "hf" and not mode.startswith("target")  # plain generate and target-only draft nothing
        label = f"{mode} ({block_size})" if drafts else mode
        lines.append(f"{label:<26}" + "".join(f"{c['speedup']:6.2f}× " + (f"{c['tau']:5.2f}    " if not
                                                                              math.isnan(c["tau"]) else "    -    ")
                                              for c in cells))
    if "hf" in overall:
        ratio = overall["target"]["tokens_per_s"] / overall["hf"]["tokens_per_s"]
        lines.append(f"target-only (this repo) vs transformers generate: {ratio:.2f}× (output tokens per s, "
                     "all datasets; speedups above are against this repo's target-only decoding)")
        if ratio < 1:  # a slower baseline would inflate every speedup: say what they are against the faster one
            lines.append("against transformers generate (the faster baseline here): " + ", ".join(
                f"{m} {overall[m]['tokens_per_s'] / overall['hf']['tokens_per_s']:.2f}×" for m in modes if m != "hf"))
    targets = [m for m in ["target"] + modes if m.split("+")[0] == "target"]
    if len(targets) > 1:  # target-only in more than one setting: the speedups against the fastest of them too
        fastest = max(targets, key=lambda m: overall[m]["tokens_per_s"])
        lines.append(f"against the fastest target-only ({fastest}, {overall[fastest]['tokens_per_s']:.1f} tok/s): "
                     + ", ".join(f"{m} {overall[m]['tokens_per_s'] / overall[fastest]['tokens_per_s']:.2f}×"
                                 for m in modes if m not in targets))
    phases = ["round"] + [k[5:] for k in TIME_KEYS if k != "time_overlap_saved" and  # that is the overlap column
                          any(overall[m]["ms_per_round"].get(k[5:], 0) for m in modes)]  # (launch: CUDA only)
    lines.append(f"\n{'all datasets':<22}{'tok/s':>8}{'TTFT ms':>9}{'hit rate':>9}{'overlap ms':>11}   ms per round: "
                 + " / ".join(phases) + ("  (draft = packed + fallback)" if "packed_draft" in phases else ""))
    for mode in ["target"] + modes:
        o = overall[mode]
        per_round = [f"{o['ms_per_round'][p]:.2f}" if p in o["ms_per_round"] else "-" for p in phases]
        overlap = f"{o['ms_per_round']['overlap_saved']:.2f}" if "overlap_saved" in o["ms_per_round"] else "-"
        lines.append(f"{mode:<22}{o['tokens_per_s']:8.1f}{1000 * o['ttft_s']:9.1f}"
                     f"{format(o['hit_rate'], '.0%') if 'hit_rate' in o else '-':>9}{overlap:>11}   "
                     + (" / ".join(per_round) if mode.split("+")[0] != "target" else "-"))
    return "\n".join(lines)


def sampling_check(models, prompt: str, mode: str, opts: dict, thinking: bool, num_samples: int) -> dict:
    """Lossless speculative sampling, measured: `num_samples` answers to one prompt by target-only sampling and by
    `mode`, each answer from its own seed, then per position the total variation distance between the two empirical
    distributions of the token there (an answer that ended counts as one more outcome). A second target-only set
    shows the distance that sampling noise alone gives: a lossless mode stays near it, a biased one rises above."""
    ids = encode(models[2], prompt, thinking, models[0].device)
    prepare(models, opts, [ids], ["target", mode])
    sets = {"target": "target", mode: mode, "target, again": "target"}
    answers = {}
    bar = tqdm(total=len(sets) * num_samples, desc="sampling check", unit="answer", dynamic_ncols=True)
    for k, (name, m) in enumerate(sets.items()):
        answers[name] = []
        for i in range(num_samples):  # seeds never shared between sets
            seed = (opts["seed"] * len(sets) + k) * num_samples + i
            answers[name].append(decode_prompt(models, ids, [m], {**opts, "seed": seed})[m]["new_tokens"])
            bar.update(1)
    bar.close()

    def distance(a, b, position):  # total variation between the token laws at `position` (-1: the answer ended)
        ca, cb = (collections.Counter(r[position] if position < len(r) else -1 for r in rows) for rows in (a, b))
        return 0.5 * sum(abs(ca[t] - cb[t]) for t in ca.keys() | cb.keys()) / num_samples

    length = max(len(r) for rows in answers.values() for r in rows)
    rows = [(p, distance(answers[mode], answers["target"], p), distance(answers["target, again"], answers["target"], p))
            for p in range(length)]
    print(f"\nsampling check at temperature {opts['temperature']}: {num_samples} answers per set, prompt {prompt!r}\n"
          f"{'position':>8}  TV({mode}, target)  TV(target, target again)")
    for p, spec, noise in rows:
        print(f"{p + 1:>8}  {spec:>16.3f}  {noise:>24.3f}" + ("   (the target's prefill token)" if p == 0 else ""))
    mean = {k: sum(r[i] for r in rows) / len(rows) for i, k in ((1, mode), (2, "target, again"))}
    print(f"{'mean':>8}  {mean[mode]:>16.3f}  {mean['target, again']:>24.3f}")
    return {"positions": [{"tv_mode": a, "tv_noise": b} for _, a, b in rows], "mean_tv_mode": mean[mode],
            "mean_tv_noise": mean["target, again"], "num_samples": num_samples, "mode": mode}


def _finite(x):  # NaN is not JSON: write null
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


# ----------------------------------------------------------------------------------------------------------------------
# The two drivers: interactive answers and the benchmark


def interactive(models, prompts: list[str], mode: str, opts: dict, thinking: bool, colour: bool,
                compare: list[str] = ()) -> dict:
    """Answer each prompt with `mode` (coloured by origin), then compare it with target-only decoding, and with the
    `compare` modes, on the same prompts."""
    target, _, tok, _, info = models
    modes = list(dict.fromkeys(["target", mode, *compare]))
    all_ids = [encode(tok, p, thinking, target.device) for p in prompts]  # a bad prompt fails before any decoding
    prepare(models, opts, all_ids, modes)
    decode_prompt(models, all_ids[0], modes, opts, max_new_tokens=8)  # warm-up
    if colour:
        print(f"{COLOURS['draft']}accepted draft tokens{RESET}, {COLOURS['target']}the target's own tokens{RESET}")
    records = collections.defaultdict(list)
    for i, (text, ids) in enumerate(zip(prompts, all_ids)):
        for m, r in decode_prompt(models, ids, modes, opts).items():
            records[m].append(r)
        r = records[mode][-1]
        print(f"\n── prompt {i + 1}/{len(prompts)}: {text}\n"
              f"{colour_answer(tok, r['new_tokens'], r['accept_lengths'], colour)}")
    block_size = opts["block_size"] or (info["drafter_config"] or {}).get("block_size")
    print(f"\n{len(prompts)} prompt(s), {info['device']}, {info['dtype']}, block size {block_size}; tok/s with "
          "prefill excluded, speedup = target-only time per output token / the mode's")
    print(f"{'mode':<8}{'tok/s':>8}{'speedup':>9}{'τ':>6}{'hit rate':>10}   same tokens as target-only")
    summaries = {}
    for m in modes:
        s = summaries[m] = summarise(records[m], records["target"])
        same = sum(r["new_tokens"] == b["new_tokens"] for r, b in zip(records[m], records["target"]))
        same = "sampled" if opts["temperature"] and m != "target" else f"{same}/{len(prompts)}"
        tau = "-" if m == "target" else f"{s['tau']:.2f}"
        hit_rate = format(s["hit_rate"], ".0%") if "hit_rate" in s else "-"
        print(f"{m:<8}{s['tokens_per_s']:8.0f}{s['speedup']:8.2f}×{tau:>6}{hit_rate:>10}   "
              f"{same if m != 'target' else '-'}")
    if "async" in modes:
        lanes = records["async"][0]["lanes"]
        print(f"async: the packed pass ran {'beside' if lanes == 2 else 'after'} the verification ({lanes} "
              f"lane{'s' * (lanes == 2)}); its hit rate is how often the next draft was ready when the verification "
              "ended")
    if mode != "target":
        print(f"{mode}: acceptance histogram (tokens committed per round, 1 .. {block_size + 1}):\n" +
              histogram([n for r in records[mode] for n in r["accept_lengths"]]))
    return {"summary": summaries[mode], "summaries": summaries,
            "answers": [tok.decode(r["new_tokens"], skip_special_tokens=True) for r in records[mode]]}


def bench(models, files: list[tuple[str, str, list[str]]], modes: list[str], opts: dict, thinking: bool) -> dict:
    """files: (path, field, prompts) of each prompt file. Greedy outputs that differ from target-only are classified
    by classify_divergence (opts["tie_tolerance"]: a fixed tolerance in logits instead of tie_tolerance's)."""
    target, _, tok, _, info = models
    datasets = {}
    for path, field, prompts in files:
        name = os.path.splitext(os.path.basename(path))[0]
        ids = [encode(tok, p, thinking, target.device) for p in prompts]
        datasets[name if name not in datasets else f"{name}-{len(datasets)}"] = (path, field, ids)
    prepare(models, opts, [x for _, _, ids in datasets.values() for x in ids], ["target"] + modes)
    decode_prompt(models, next(iter(datasets.values()))[2][0], ["target"] + modes, opts, max_new_tokens=16)  # warm-up
    results, mismatches, everything = {}, [], collections.defaultdict(list)
    for name, (path, field, prompts) in datasets.items():
        records = collections.defaultdict(list)
        for i, ids in enumerate(tqdm(prompts, desc=name, unit="prompt", dynamic_ncols=True)):
            for mode, r in decode_prompt(models, ids, ["target"] + modes, opts).items():
                records[mode].append(r)
                found = divergence(target, tok, ids, records["target"][-1]["new_tokens"], r["new_tokens"], opts,
                                   dataset=name, prompt_index=i, mode=mode)
                mismatches += [found] if found else []
        results[name] = {"path": path, "field": field, "num_prompts": len(prompts), "modes": {}, "per_prompt": {}}
        for m in records:
            results[name]["modes"][m] = summarise(records[m], records["target"])
            results[name]["modes"][m]["mismatches"] = sum(x["dataset"] == name and x["mode"] == m for x in mismatches)
            results[name]["modes"][m]["errors"] = sum(x["dataset"] == name and x["mode"] == m and
                                                      x["class"] == "error" for x in mismatches)
            results[name]["per_prompt"][m] = [{k: v for k, v in r.items() if k != "new_tokens"} for r in records[m]]
            everything[m] += records[m]
    block_size = opts["block_size"] or info["drafter_config"]["block_size"]
    overall = {m: summarise(everything[m], everything["target"]) for m in everything}
    text = table(results, overall, modes, block_size)
    checked = sum(len(everything[m]) for m in modes)
    if opts["temperature"]:
        check = "greedy check skipped: at temperature > 0 the outputs are samples"
    else:
        check = greedy_check(mismatches, checked)
    print(f"\n{text}\n\n{check}")
    mean = {m: {k: _mean(results[n]["modes"][m][k] for n in results) for k in ("speedup", "tau")} for m in modes}
    counts = collections.Counter(x["class"] for x in mismatches)
    result = {"datasets": results, "mean": mean, "overall": overall, "block_size": block_size, "table": text,
              "mismatches": {"count": len(mismatches), "checked": checked, "identical": checked - len(mismatches),
                             "near_ties": counts["near-tie"], "errors": counts["error"], "list": mismatches}}
    if "hf" in overall:  # > 1: this repo's target-only loop is faster than transformers' generate
        result["target_vs_hf"] = overall["target"]["tokens_per_s"] / overall["hf"]["tokens_per_s"]
    return result


def decode_group(models, group: list[torch.Tensor], modes: list[str], opts: dict, max_new_tokens=None) -> dict:
    """One group of concurrent requests (prompt ids (1, n) each) in every mode: {mode: batch stats + new_tokens per
    row}. Target and sync decode the group as one batch (d3d.generate with a list); async only a group of 1."""
    target, drafter, _, eos, _ = models
    records = {}
    for spec in modes:
        mode, overrides = parse_mode(spec)
        if mode == "async":  # the batch-1 loop; decode_prompt's record carries the same totals
            r = decode_prompt(models, group[0], [spec], opts, max_new_tokens)[spec]
            records[spec] = {**r, "new_tokens": [r["new_tokens"]]}
            continue
        kwargs = generate_kwargs(mode, opts, eos, max_new_tokens, target.device)
        batch = [ids[0] for ids in group]  # 1-D prompts of different lengths
        outs, stats = d3d.generate(target, drafter if mode != "target" else None, batch, **kwargs)
        records[spec] = {**{k: v for k, v in stats.items() if k != "rows"},
                         "accept_lengths": [n for row in stats["rows"] for n in row["accept_lengths"]],
                         "new_tokens": [out[ids.shape[1]:].tolist() for out, ids in zip(outs, group)]}
    return records


def summarise_concurrent(records: list[dict], baseline: list[dict]) -> dict:
    """One mode at one concurrency over consecutive groups: throughput = new tokens of all requests / wall time of
    the batches (prefill included), speedup over target-only of the same groups, where a round's time goes."""
    def throughput(recs):
        return sum(r["num_new_tokens"] for r in recs) / sum(r["time_total"] for r in recs)
    rounds = max(1, sum(r["num_rounds"] for r in records))
    ms = {k: 1000 * sum(r[f"time_{k}"] for r in records) / rounds for k in ("draft", "verify")}
    ms["round"] = 1000 * sum(r["time_total"] - r["time_prefill"] for r in records) / rounds
    ms["other"] = ms["round"] - ms["draft"] - ms["verify"]  # acceptance, commits, cache bookkeeping
    return {"tokens_per_s": throughput(records), "speedup": throughput(records) / throughput(baseline),
            "num_new_tokens": sum(r["num_new_tokens"] for r in records), "num_batches": len(records),
            "wall_s": sum(r["time_total"] for r in records), "num_rounds": sum(r["num_rounds"] for r in records),
            "tau": _mean(n for r in records for n in r["accept_lengths"]), "ms_per_round": ms,  # over all rows' rounds
            "prefill_ms_per_batch": 1000 * _mean(r["time_prefill"] for r in records)}


def concurrency_table(results: dict, overall: dict, levels: list[int], modes: list[str], block_size: int) -> str:
    """The paper's Table 2: per dataset, rows = modes, columns = concurrency, cells = throughput (tokens/s over wall
    time) and speedup over target-only at the same concurrency. Below, over all datasets, where a round goes."""
    lines = ["throughput in tokens/s over wall time (speedup over target-only at the same concurrency)"]
    for name, result in results.items():
        title = f"{name} ({result['num_prompts']} prompts)"
        lines.append(f"\n{title:<27}" + "".join(f"{'c=' + str(c):<18}" for c in levels))
        for mode in ["target"] + modes:
            cells = [result["levels"][c].get(mode) for c in levels]
            cells = [f"{x['tokens_per_s']:.1f} ({x['speedup']:.2f}×)" if x else "-" for x in cells]
            lines.append(f"{mode if mode == 'target' else f'{mode} ({block_size})':<27}"
                         + "".join(f"{x:<18}" for x in cells))
    if any(parse_mode(m)[0] == "async" for m in modes) and max(levels) > 1:
        lines.append("async runs at concurrency 1 only: batched async is not built (see d3d.generate)")
    lines.append(f"\nall datasets, ms per round: round = draft + verify + other (acceptance, bookkeeping); "
                 f"prefill ms per batch apart\n{'mode':<24}{'c':>4}{'rounds':>8}{'tau':>7}{'round':>9}{'draft':>9}"
                 f"{'verify':>9}{'other':>9}{'prefill':>9}")
    for c in levels:
        for mode, o in overall[c].items():
            ms = o["ms_per_round"]
            phases = "".join(f"{ms[k]:>9.2f}" for k in ("round", "draft", "verify", "other"))
            prefill = o["prefill_ms_per_batch"]
            tau = "-" if math.isnan(o["tau"]) else f"{o['tau']:.2f}"
            lines.append(f"{mode:<24}{c:>4}{o['num_rounds']:>8}{tau:>7}{phases}{prefill:>9.1f}")
    return "\n".join(lines)


def concurrency_bench(models, files, modes: list[str], levels: list[int], opts: dict, thinking: bool) -> dict:
    """Table 2: at each concurrency c, the prompts of each file in consecutive groups of c decoded as one batch,
    target-only and each speculative mode (async at c = 1 only); greedy outputs are checked row by row against
    target-only decoding of the same group."""
    target, _, tok, _, info = models
    datasets = {}
    for path, field, prompts in files:
        name = os.path.splitext(os.path.basename(path))[0]
        datasets[name if name not in datasets else f"{name}-{len(datasets)}"] = (
            path, field, [encode(tok, p, thinking, target.device) for p in prompts])
    results, mismatches, everything = {}, [], collections.defaultdict(lambda: collections.defaultdict(list))
    for name, (path, field, prompts) in datasets.items():
        results[name] = {"path": path, "field": field, "num_prompts": len(prompts), "levels": {}}
        for c in levels:
            run = ["target"] + [m for m in modes if c == 1 or parse_mode(m)[0] != "async"]
            decode_group(models, prompts[:c], run, opts, max_new_tokens=16)  # warm-up at this batch size
            records = collections.defaultdict(list)
            groups = [prompts[i:i + c] for i in range(0, len(prompts), c)]
            for g, group in enumerate(tqdm(groups, desc=f"{name} c={c}", unit="batch", dynamic_ncols=True)):
                for mode, r in decode_group(models, group, run, opts).items():
                    records[mode].append(r)
                    for row, (ref, new) in enumerate(zip(records["target"][-1]["new_tokens"], r["new_tokens"])):
                        found = divergence(target, tok, group[row], ref, new, opts, dataset=name, concurrency=c,
                                           mode=mode, prompt_index=g * c + row)
                        mismatches += [found] if found else []
            results[name]["levels"][c] = {m: summarise_concurrent(records[m], records["target"]) for m in run}
            for m in run:
                everything[c][m] += records[m]
                results[name]["levels"][c][m]["mismatches"] = sum(
                    (x["dataset"], x["concurrency"], x["mode"]) == (name, c, m) for x in mismatches)
    overall = {c: {m: summarise_concurrent(everything[c][m], everything[c]["target"]) for m in everything[c]}
               for c in levels}
    block_size = opts["block_size"] or info["drafter_config"]["block_size"]
    text = concurrency_table(results, overall, levels, modes, block_size)
    checked = sum(len(r["new_tokens"]) for c in levels for m in everything[c] if m != "target"
                  for r in everything[c][m])
    check = ("greedy check skipped: at temperature > 0 the outputs are samples" if opts["temperature"] else
             greedy_check(mismatches, checked, against="target-only at the same concurrency"))
    print(f"\n{text}\n\n{check}")
    counts = collections.Counter(x["class"] for x in mismatches)
    return {"concurrency": levels, "datasets": results, "overall": overall, "block_size": block_size, "table": text,
            "mismatches": {"count": len(mismatches), "checked": checked, "identical": checked - len(mismatches),
                           "near_ties": counts["near-tie"], "errors": counts["error"], "list": mismatches}}


def long_prompts(docs: list[str], num_docs: int, count: int, seed: int) -> list[tuple[str, int]]:
    """Long prompts from real text: `num_docs` problems one after another, then a request to solve one of them
    (the paper's LongBench single-document QA in miniature). Returns (prompt, index of the asked problem)."""
    rng = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        chosen = [docs[(i * num_docs + k) % len(docs)] for k in range(num_docs)]
        asked = int(torch.randint(1, num_docs + 1, (1,), generator=rng))
        body = "\n\n".join(f"Problem {k + 1}: {doc}" for k, doc in enumerate(chosen))
        prompts.append((f"Here are {num_docs} math problems.\n\n{body}\n\nSolve problem {asked} step by step and "
                        f"give its final answer. Ignore the other problems.", asked))
    return prompts


def prefill_bench(models, path: str, docs: list[str], mode: str, keep_ratios: list[float], num_docs: int,
                  count: int, opts: dict, thinking: bool) -> dict:
    """Selective prefilling (paper Tables 6-7 in miniature): per long prompt, target-only decoding with full prefill
    (the baseline), then `mode` with the drafter choosing the kept chunks at each keep ratio (1.0 = full prefill,
    the drafter's scoring pass included in TTFT). TTFT, decode and end-to-end speedups are ratios to the baseline
    in the same run; "same answer" compares the whole output, "same number" its last number, with the baseline's."""
    import re

    target, _, tok, _, _ = models
    prompts = long_prompts(docs, num_docs, count, opts["seed"])
    ids = [encode(tok, p, thinking, target.device) for p, _ in prompts]
    rows = {"target, full prefill": None} | {f"{r:.0%} + D3D ({mode})": r for r in keep_ratios}
    last_number = lambda toks: (re.findall(r"-?\d[\d,]*\.?\d*", tok.decode(toks)) or [None])[-1]  # noqa: E731
    records = collections.defaultdict(list)
    prepare(models, opts, ids, ["target", mode])
    decode_prompt(models, ids[0], ["target"], opts, max_new_tokens=4)  # warm-up
    for x in tqdm(ids, desc="long prompts", unit="prompt", dynamic_ncols=True):
        for name, ratio in rows.items():
            row_opts = {**opts, "keep_ratio": ratio}
            records[name].append(decode_prompt(models, x, ["target" if ratio is None else mode], row_opts)
                                 .popitem()[1])
    base = records["target, full prefill"]

    def per_token(recs, key, tokens):
        return sum(r[key] for r in recs) / max(1, sum(r[tokens] for r in recs))
    table_rows, result = [], {}
    for name, recs in records.items():
        result[name] = {
            "same_answer": _mean(float(r["new_tokens"] == b["new_tokens"]) for r, b in zip(recs, base)),
            "same_number": _mean(float(last_number(r["new_tokens"]) == last_number(b["new_tokens"]))
                                 for r, b in zip(recs, base)),
            "ttft_s": _mean(r["time_prefill"] for r in recs),
            "ttft_speedup": _mean(b["time_prefill"] for b in base) / _mean(r["time_prefill"] for r in recs),
            "decode_speedup": per_token(base, "decode_time", "decode_tokens") /
            per_token(recs, "decode_time", "decode_tokens"),
            "e2e_speedup": per_token(base, "time_total", "num_new_tokens") /
            per_token(recs, "time_total", "num_new_tokens"),
            "prompt_tokens": _mean(x.shape[1] for x in ids),
            "prompt_tokens_prefilled": _mean(r.get("prompt_tokens_prefilled", x.shape[1]) for r, x in zip(recs, ids)),
            "tau": _mean(r["tau"] for r in recs),
        }
        o = result[name]
        table_rows.append(f"{name:<24}{o['same_answer']:>7.0%}{o['same_number']:>8.0%}"
                          f"{o['prompt_tokens_prefilled']:>9.0f}"
                          f"{1000 * o['ttft_s']:>9.0f}{o['ttft_speedup']:>7.2f}×{o['decode_speedup']:>7.2f}×"
                          f"{o['e2e_speedup']:>7.2f}×{o['tau']:>7.2f}")
    prompt_tokens = result[next(iter(result))]["prompt_tokens"]
    header = (f"{os.path.basename(path)}: {count} prompts of {num_docs} problems (~{prompt_tokens:.0f}"
              f" tokens), chunks of {opts['chunk_size']} tokens\n{'setting':<24}{'same':>7}{'number':>8}{'prefill':>9}"
              f"{'TTFT ms':>9}{'TTFT':>8}{'decode':>8}{'E2E':>8}{'τ':>7}")
    text = header + "\n" + "\n".join(table_rows)
    print("\n" + text)
    return {"prefill_bench": result, "table": text, "num_prompts": count, "num_docs": num_docs,
            "chunk_size": opts["chunk_size"], "mode": mode, "source": path}


def main(*, target, drafter, device, dtype, attn, prompt, prompts_file, prompt_field, max_samples, thinking, mode,
         block_size, temperature, max_new_tokens, coverage, fanout, cover, seed, bench_files, modes, out, no_color,
         keep_ratio=None, chunk_size=64, prefill_bench_file=None, keep_ratios=(1.0, 0.3, 0.2, 0.1), num_docs=12,
         concurrency=None, tie_tolerance=None, threads=None, sampling_check_samples=None, compile=False, max_len=None,
         lanes=None, trace=None):
    args = dict(locals())  # recorded in the benchmark JSON
    if threads:
        torch.set_num_threads(threads)
    speculative = [m for m in available_modes() if m != "target"]
    if prefill_bench_file:  # the paper pairs selective prefilling with sequential (sync) speculative decoding
        mode, modes, bench_files = mode or "sync", [mode or "sync"], None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compare = []  # the demo without --mode: the rule's mode on this device, beside the other one and the target
    if mode is None and not bench_files and not prefill_bench_file and not sampling_check_samples:
        mode, why = runtime.default_mode(torch.device(device).type)
        compare = [m for m in speculative if m != mode]
        print(f"mode {mode}: {why}")
    mode = mode or speculative[-1]
    modes = [m for m in modes or speculative if m != "target"]  # target-only always runs: it is the baseline
    lanes = lanes or (1 if bench_files else None)  # a benchmark names +2lanes itself; else the rule (runtime.py)
    for m in dict.fromkeys([mode, *compare] + modes):
        spec, flags = parse_mode(m)  # raises on an unknown mode or a bad async:C,F
        if spec == "async":  # two compiled lanes on CUDA are refused: before anything loads
            runtime.async_lanes(torch.device(device).type, compile or flags.get("compiled", False),
                                flags.get("lanes", lanes))
    baselines = [m for m in modes if m in BASELINES]
    if mode in BASELINES and not bench_files:
        raise ValueError(f"{mode} is a benchmark baseline: run it with --bench FILE.jsonl --modes {mode}")
    if baselines and bench_files and (temperature or keep_ratio is not None):
        raise ValueError(f"{', '.join(baselines)} decode greedy with the full prompt: drop --temperature and "
                         "--keep-ratio, or these modes")
    if bench_files and not modes:
        raise ValueError(f"--modes: name speculative modes ({', '.join(speculative)}); target-only always runs")
    if concurrency is not None and (not bench_files or min(concurrency) < 1):
        raise ValueError(f"--concurrency takes sizes >= 1 and goes with --bench, got {concurrency}")
    if sampling_check_samples is not None and (not temperature or sampling_check_samples < 2 or bench_files):
        raise ValueError("--sampling-check N (N >= 2) samples answers: give it --temperature > 0, without --bench")
    if trace and (prefill_bench_file or sampling_check_samples or concurrency):
        raise ValueError("--trace goes with the demo or with --bench (Table 1), not with --prefill-bench, "
                         "--sampling-check or --concurrency")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {max_samples}")
    if prompt is not None and "-" in prompt:  # `--prompt -`: one prompt per non-empty line of stdin
        prompt = [p for p in prompt if p != "-"] + [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if not prompt:
            raise ValueError("no prompts on stdin")
    if not bench_files and not prefill_bench_file and prompt is None:
        prompts_file = prompts_file or TOY_PROMPTS
        if prompts_file == TOY_PROMPTS and not os.path.isfile(prompts_file):
            raise FileNotFoundError(f"no prompts at {TOY_PROMPTS}: `git checkout -- toy-target` restores the toy's "
                                    "files, or pass --prompt")
        prompt = read_prompts(prompts_file, prompt_field, max_samples or 3)[1]
    files = [(path, *read_prompts(path, prompt_field, max_samples)) for path in bench_files or []]  # before loading
    if prefill_bench_file:
        docs = read_prompts(prefill_bench_file, prompt_field)[1]
    torch.manual_seed(seed)
    models = load(target, drafter, modes if bench_files else [mode, *compare] + (["sync"] if keep_ratio else []),
                  device, dtype, attn, threads)
    opts = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "block_size": block_size,
            "coverage": coverage, "fanout": fanout, "cover": cover, "keep_ratio": keep_ratio, "chunk_size": chunk_size,
            "tie_tolerance": tie_tolerance, "compile": compile, "max_len": max_len, "lanes": lanes}
    if prefill_bench_file:
        result = prefill_bench(models, prefill_bench_file, docs, mode, list(keep_ratios), num_docs, max_samples or 10,
                               {**opts, "keep_ratio": None}, thinking)
    elif sampling_check_samples:
        result = sampling_check(models, prompt[0], mode, opts, thinking, sampling_check_samples)
    elif not bench_files:
        colour = not no_color and sys.stdout.isatty() and "NO_COLOR" not in os.environ
        summary = interactive(models, prompt, mode, opts, thinking, colour, compare)
        if trace:
            write_trace(models, encode(models[2], prompt[0], thinking, models[0].device), mode, opts, trace)
        return summary
    elif concurrency:
        result = concurrency_bench(models, files, modes, list(concurrency), opts, thinking)
    else:
        result = bench(models, files, modes, opts, thinking)
        if trace:  # the first prompt of the first file, in the first mode named
            write_trace(models, encode(models[2], files[0][2][0], thinking, models[0].device), modes[0], opts, trace)
    command = "python " + shlex.join(sys.argv) if sys.argv[0].endswith("decode.py") else None  # None: called in-process
    result["env"] = {**models[4], "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version(), "command": command, "args": args}
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(_finite(result), f, indent=1, ensure_ascii=False)
        print(f"wrote {out}")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target: HF hub name or folder (default: 'target' in the drafter's "
                                    f"train_args.json, else {TOY_TARGET})")
    g.add_argument("--drafter", default=TOY_DRAFTER, help=f"D3D drafter folder (default: {TOY_DRAFTER})")
    g.add_argument("--device", help="cuda, cuda:1, cpu, ... (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="weights of both models (default: auto = bfloat16 where the device computes it natively: "
                        "CUDA, or a CPU with AVX512-BF16/AMX; float32 elsewhere and for drafters trained in float32)")
    g.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention kernel (default: sdpa)")
    g.add_argument("--threads", type=int, help="torch CPU threads (default: 1 for a target under 20M parameters, "
                   "like the toy; else torch's choice; use 1 on a CPU shared with other jobs)")
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", help="a prompt to answer (repeatable); '-' reads one per line of stdin")
    g.add_argument("--prompts-file", help=f"JSON Lines prompts to answer without --prompt (default: {TOY_PROMPTS})")
    g.add_argument("--prompt-field", help=f"JSON field of the prompt (default: first of {', '.join(PROMPT_FIELDS)})")
    g.add_argument("--max-samples", type=int, help="prompts per file (default: 3 interactive, all with --bench)")
    g.add_argument("--thinking", action="store_true", help="Qwen3 chat template with thinking on (default: off)")
    g = p.add_argument_group("decoding")
    g.add_argument("--mode", help=f"one of {', '.join(available_modes())} (default: sync on every device, shown beside "
                                  "async and the target; runtime.default_mode says why)")
    g.add_argument("--block-size", type=int, help="B, draft tokens per round (default: the drafter's)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer at most (default: 128)")
    g.add_argument("--coverage", type=int, help="async: C, draft positions with rejection branches (default: d3d's)")
    g.add_argument("--fanout", type=int, help="async: F, candidate tokens per covered position (default: d3d's)")
    g.add_argument("--lanes", type=int, choices=[1, 2], help="async: 2 runs the packed pass beside verification (CUDA: "
                   "a second stream; CPU: a second thread, each lane with half of --threads), 1 one after the other "
                   "(default: 1 with --bench, where a mode ending in +2lanes names the other; else "
                   "runtime.async_lanes: 1 on CUDA, 2 on a CPU for a target of 20M parameters or more). With --compile "
                   "on CUDA, 2 is "
                   "refused: the compiled passes' CUDA graphs share one memory pool")
    g.add_argument("--compile", nargs="?", const="whole", choices=["whole", "regional"], help="compile the "
                   "fixed-shape passes (torch.compile, fullgraph): 'whole' (the flag alone) one graph per pass shape, "
                   "CUDA graphs on a GPU; 'regional' one decoder layer compiled once and reused by every layer "
                   "(compiles in a fraction of the time, runs slower: fast.compile_passes). Warmed up first, compile "
                   "time reported apart; '+compiled' modes use it too (default: off; '+compiled': whole)")
    g.add_argument("--trace", metavar="PATH", help="after the run, decode the first prompt once more in --mode (with "
                   "--bench: the first of --modes) and write its phases (draft, verify, packed_draft, ...) as a "
                   "Chrome trace, a track for each CUDA stream or host thread: open it in ui.perfetto.dev")
    g.add_argument("--max-len", type=int, help="KV cache slots per model, kept for the whole run (default: the longest "
                   "prompt + --max-new-tokens + the widest pass)")
    g.add_argument("--cover", choices=["first", "likely"],
                   help="async: branch the first C positions or the C likeliest first rejections (default: d3d's)")
    g.add_argument("--seed", type=int, default=0, help="seed of sampling (default: 0)")
    g.add_argument("--sampling-check", dest="sampling_check_samples", type=int, metavar="N",
                   help="lossless sampling, measured: N answers to the first prompt by target-only and by --mode, "
                        "per-position distance between the two token distributions (needs --temperature)")
    g = p.add_argument_group("benchmark (prints Table 1, writes --out)")
    g.add_argument("--bench", dest="bench_files", nargs="+", metavar="FILE.jsonl", help="prompt files to benchmark")
    g.add_argument("--modes", nargs="+", help="speculative modes to compare with target-only (default: all); "
                   "async:C,F[,likely] sets a branch budget, e.g. --modes sync async:0,2 async:12,2 async:12,1; "
                   f"transformers baselines, greedy, off unless named: {', '.join(BASELINES)} (plain generate, the "
                   "drafter's model as a token-by-token assistant, prompt lookup; B draft tokens per round)")
    g.add_argument("--tie-tolerance", type=float, help="greedy check: a divergence whose target logit margin is "
                   f"within this many logits is a near-tie, else an error (default: {TIE_EPS_MULTIPLE} x max(the "
                   "dtype's machine epsilon, 2^-16) x the largest |logit| at that position)")
    g.add_argument("--concurrency", type=int, nargs="+", metavar="C",
                   help="concurrent requests, e.g. 1 4 8 16: Table 2 (throughput per concurrency) instead of Table 1")
    g.add_argument("--out", default="runs/bench.json", help="benchmark figures, JSON (default: runs/bench.json)")
    g = p.add_argument_group("selective prefilling (lossy: the target reads only the kept prompt chunks)")
    g.add_argument("--keep-ratio", type=float, help="share of prompt chunks the target prefills (default: off)")
    g.add_argument("--chunk-size", type=int, default=64, help="prompt tokens per chunk (default: 64)")
    g.add_argument("--prefill-bench", dest="prefill_bench_file", metavar="FILE.jsonl",
                   help="benchmark selective prefilling on long prompts built from this file's problems")
    g.add_argument("--keep-ratios", type=float, nargs="+", default=[1.0, 0.3, 0.2, 0.1],
                   help="keep ratios for --prefill-bench (default: 1.0 0.3 0.2 0.1)")
    g.add_argument("--num-docs", type=int, default=12, help="problems per long prompt (default: 12)")
    g = p.add_argument_group("output")
    g.add_argument("--no-color", action="store_true", help="plain answers (default: ANSI colours on a terminal)")
    return p


if __name__ == "__main__":
    try:
        main(**vars(build_parser().parse_args()))
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
