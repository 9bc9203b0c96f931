"""The modes of a run, and one prompt decoded in each.

parse_mode reads a mode as --mode and --modes name it; prepare makes the run's KV caches (and
compiled passes) once and returns them; request_kwargs gives d3d.generate's arguments for one
mode; decode_prompt decodes a prompt in every mode of a run and returns the records that the
drivers and the benches time (record); encode makes a prompt's ids.

`opts` everywhere: the run's decoding settings (decode.py's flags by name), only read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import d3d
import runtime
from systems import fast, peers


def available_modes() -> tuple[str, ...]:
    return d3d.MODES


def parse_mode(spec: str) -> tuple[str, dict]:
    """(mode, overrides) of 'sync', 'async', 'async:C,F[,cover]' (a branch budget to sweep, the
    paper's Fig. 3) or a transformers baseline (peers.BASELINES). A D3D mode or 'target' may end
    in '+compiled' (its passes compiled, beside the eager ones in the same run) and '+2lanes'
    (async: the packed pass in a second lane)."""
    spec, *setting = spec.split("+")
    unknown = any(s not in ("compiled", "2lanes") for s in setting)
    on_a_baseline = bool(setting) and spec.split(":")[0] in peers.BASELINES
    if unknown or on_a_baseline:
        raise runtime.UserError(
            f"unknown setting in {'+'.join([spec, *setting])!r}: a D3D mode or target may end "
            "in +compiled and +2lanes (async), e.g. sync+compiled async+compiled+2lanes"
        )
    flags = {}
    if "compiled" in setting:
        flags["compiled"] = True
    if "2lanes" in setting:
        flags["lanes"] = 2
    mode, overrides = _parse_budget(spec)
    return mode, {**overrides, **flags}


def _parse_budget(spec: str) -> tuple[str, dict]:
    mode, _, budget = spec.partition(":")
    if mode in peers.BASELINES and not budget:
        return mode, {}
    if mode not in available_modes() or (budget and mode != "async"):
        names = ", ".join(available_modes() + peers.BASELINES)
        raise runtime.UserError(f"unknown mode {spec!r}: use one of {names} or async:C,F[,cover]")
    if not budget:
        return mode, {}
    parts = budget.split(",")
    try:
        overrides = {"coverage": int(parts[0]), "fanout": int(parts[1])}
    except (ValueError, IndexError):
        raise runtime.UserError(
            f"bad async budget {spec!r}: write async:C,F or async:C,F,likely (e.g. async:12,2)"
        )
    if len(parts) > 2:
        overrides["cover"] = parts[2]
    return mode, overrides


def encode(tok, text: str, thinking: bool, device) -> torch.Tensor:
    """Prompt ids (1, n): the chat template if the tokenizer has one (Qwen3: thinking off unless
    asked)."""
    if not text.strip():
        raise runtime.UserError("empty prompt: give some text to answer")
    if not tok.chat_template:
        return torch.tensor([tok(text).input_ids], device=device)
    text = tok.apply_chat_template(
        [{"role": "user", "content": text}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    ids = tok(text, add_special_tokens=False).input_ids
    return torch.tensor([ids], device=device)


def encode_files(tok, files, thinking: bool, device) -> dict[str, tuple]:
    """{dataset name: (path, field, prompt ids)} of (path, field, prompts) per prompt file; the
    name is the file's, made unique with its index where two files share it."""
    datasets = {}
    for path, field, prompts in files:
        name = os.path.splitext(os.path.basename(path))[0]
        if name in datasets:
            name = f"{name}-{len(datasets)}"
        ids = [encode(tok, p, thinking, device) for p in prompts]
        datasets[name] = (path, field, ids)
    return datasets


# ---------------------------------------------------------------------------------------------
# The run's KV caches


@dataclass
class RunCaches:
    """The KV caches of fixed size that every request of a run reuses (prepare makes them)."""

    eager: runtime.Caches
    # a second pair whose passes are compiled (--compile or a '+compiled' mode), else None
    compiled: runtime.Caches | None = None
    # compiling and warming up those passes: not decode time, printed apart
    compile_seconds: float = 0.0


def _budget(spec: str, opts: dict, block_size: int) -> tuple[int, int]:
    """(C, F) of one mode: its own async:C,F, else --coverage / --fanout, else d3d's."""
    overrides = parse_mode(spec)[1]
    coverage, fanout = d3d.default_budget(block_size)
    if opts["coverage"] is not None:
        coverage = opts["coverage"]
    if opts["fanout"] is not None:
        fanout = opts["fanout"]
    coverage = overrides.get("coverage", coverage)
    fanout = overrides.get("fanout", fanout)
    return coverage, fanout


def prepare(models, opts: dict, all_ids: list[torch.Tensor], modes: list[str]) -> RunCaches:
    """Once per run, before the warm-up: the KV caches of fixed size every request reuses
    (--max-len, else the longest prompt + --max-new-tokens + the widest pass of `modes`), and
    with --compile or a '+compiled' mode a second pair whose fixed-shape passes are compiled,
    every shape warmed up (the time is printed: compile time is not decode time)."""
    target = models[0]
    drafter = models[1]
    block_size = opts["block_size"]
    if block_size is None and drafter is not None:
        block_size = drafter.d3d_config.block_size
    if block_size is None:
        block_size = 1
    widest = 0
    for spec in modes:
        coverage, fanout = _budget(spec, opts, block_size)
        if parse_mode(spec)[0] != "async":
            coverage = 0
        widest = max(widest, runtime.cache_len(0, 0, block_size, coverage, fanout))
    # the warm-ups decode up to this many tokens
    new_tokens = max(opts["max_new_tokens"], 16, 2 * block_size + 3)
    need = max(x.shape[1] for x in all_ids) + new_tokens + widest
    max_len = opts.get("max_len")
    if max_len and max_len < need:
        raise runtime.UserError(
            f"--max-len {max_len} is too small for these prompts: they need {need} KV slots "
            "(the longest prompt + --max-new-tokens + the widest pass)"
        )
    if not max_len:
        max_len = need
    d3d_modes = [m for m in modes if parse_mode(m)[0] not in ("target", *peers.BASELINES)]
    use_drafter = None
    if d3d_modes:
        use_drafter = drafter
    caches = RunCaches(eager=runtime.Caches.make(target, use_drafter, max_len))
    compiled = [m for m in modes if opts.get("compile") or parse_mode(m)[1].get("compiled")]
    if not compiled:
        return caches
    caches.compiled = runtime.Caches.make(target, use_drafter, max_len)
    fast.compile_passes(caches.compiled, regional=opts.get("compile") == "regional")
    plain = [m.replace("+compiled", "") for m in compiled]
    for spec in dict.fromkeys(m for m in plain if parse_mode(m)[0] not in peers.BASELINES):
        # each shape it uses (an async budget sets the packed pass's)
        mode, overrides = parse_mode(spec)
        settings = {k: opts[k] for k in ("coverage", "fanout", "cover") if opts[k] is not None}
        settings |= overrides
        if mode == "async":
            # a CPU's two lanes run with half the threads each, which dynamo's guards see
            settings.setdefault("lanes", opts.get("lanes"))
        caches.compile_seconds += fast.warm_up(
            target,
            use_drafter,
            caches.compiled,
            all_ids[0][:, :8],
            [mode],
            block_size=opts["block_size"],
            **settings,
        )
    print(
        f"compiled the fixed-shape passes of {', '.join(compiled)} in "
        f"{caches.compile_seconds:.1f} s (not counted in any time below)"
    )
    return caches


# ---------------------------------------------------------------------------------------------
# One prompt in every mode


def generate_kwargs(mode: str, opts: dict, eos, max_new_tokens, device) -> dict:
    """The keyword arguments of d3d.generate (and batched.generate) that every mode shares, with
    a fresh seeded generator each (the same draws in every mode)."""
    if max_new_tokens is None:
        max_new_tokens = opts["max_new_tokens"]
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "mode": mode,
        "eos_token_id": eos,
        "temperature": opts["temperature"],
        "generator": torch.Generator(device).manual_seed(opts["seed"]),
    }
    if mode != "target":
        kwargs["block_size"] = opts["block_size"]
    return kwargs


def request_kwargs(
    spec: str, opts: dict, caches: RunCaches | None, eos, device, max_new_tokens=None
) -> dict:
    """d3d.generate's keyword arguments for one mode as --mode or --modes names it.
    caches: the run's (prepare); None makes them per request."""
    mode, overrides = parse_mode(spec)
    kwargs = generate_kwargs(mode, opts, eos, max_new_tokens, device)
    compiled = overrides.pop("compiled", False) or opts.get("compile")
    if caches is not None and compiled:
        kwargs["caches"] = caches.compiled
    elif caches is not None:
        kwargs["caches"] = caches.eager
    # None: generate's rule (runtime.async_lanes)
    lanes = overrides.pop("lanes", opts.get("lanes"))
    if mode == "async":
        # branch budget C x F and which positions (plan_branches); unset: d3d's defaults
        for key in ("coverage", "fanout", "cover"):
            if opts[key] is not None:
                kwargs[key] = opts[key]
        kwargs.update(overrides)
        kwargs["lanes"] = lanes
    if opts.get("keep_ratio") is not None:
        # selective prefilling (lossy, off by default)
        kwargs["keep_ratio"] = opts["keep_ratio"]
        kwargs["chunk_size"] = opts["chunk_size"]
    if opts.get("trace"):
        # the phases as a Chrome trace (decode.py's write_trace)
        kwargs["trace"] = True
    return kwargs


def drafter_for(spec: str, opts: dict, drafter):
    """The drafter a mode decodes with: None for target-only decoding (unless selective
    prefilling scores the prompt with it)."""
    if parse_mode(spec)[0] != "target":
        return drafter
    if opts.get("keep_ratio") is not None:
        return drafter
    return None


def record(ids: torch.Tensor, out: torch.Tensor, stats: dict) -> dict:
    """What a run keeps of one decode: d3d.generate's stats, the new tokens, and the decode time
    and tokens that speeds are measured on (prefill excluded: the first token is prefill's)."""
    kept = dict(stats)
    kept["new_tokens"] = out[0, ids.shape[1] :].tolist()
    kept["decode_time"] = stats["time_total"] - stats["time_prefill"]
    kept["decode_tokens"] = max(stats["num_new_tokens"] - 1, 0)
    if "time_both" in stats:
        # what running verification and the packed pass side by side saved (< 0: cost)
        apart = stats["time_verify"] + stats["time_packed_draft"]
        kept["time_overlap_saved"] = apart - stats["time_both"]
    return kept


def decode_prompt(
    models, ids, modes, opts, caches: RunCaches | None = None, max_new_tokens=None
) -> dict[str, dict]:
    """{mode: record} for each mode, in order: d3d.generate's stats (peers.hf_decode's for a
    baseline), the new tokens, decode_time and decode_tokens."""
    target, drafter, _, eos, _ = models
    records = {}
    for spec in modes:
        if parse_mode(spec)[0] in peers.BASELINES:
            if max_new_tokens is None:
                budget = opts["max_new_tokens"]
            else:
                budget = max_new_tokens
            records[spec] = peers.hf_decode(models, ids, spec, opts, budget)
            continue
        kwargs = request_kwargs(spec, opts, caches, eos, ids.device, max_new_tokens)
        use = drafter_for(spec, opts, drafter)
        out, stats = d3d.generate(target, use, ids, **kwargs)
        records[spec] = record(ids, out, stats)
    return records
