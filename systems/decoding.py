"""The modes of a run, and one prompt decoded in each.

parse_mode reads a mode as --mode and --modes name it, mode_config makes it a DecodeConfig;
prepare makes the run's KV caches (and compiled passes) once and returns them; request gives
d3d.generate's config and keywords for one mode; decode_prompt decodes a prompt in every mode of
a run and returns the records that the drivers and the benches time (record); encode makes a
prompt's ids.

`models` everywhere: the run's Models (decode.load); `run`: its Run, the DecodeConfig every mode
starts from and the run's own settings, only read; `plan`: its Plan, what it decodes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

import torch
from torch import nn

import d3d
import runtime
from systems import cli, fast, peers


@dataclass
class Models:
    """What a run decodes with, loaded once (decode.load)."""

    target: nn.Module
    # None when only target-only decoding runs
    drafter: d3d.Drafter | None
    tokenizer: object
    # the token ids that end an answer (the tokenizer's and the target's generation config's)
    eos: list[int]
    # the run's description for its JSON: device, dtype, attn, target, drafter and its config
    info: dict

    def block_size(self, config: d3d.DecodeConfig) -> int | None:
        """B of a run: the config's, else the drafter's (None without a drafter)."""
        if config.block_size is not None:
            return config.block_size
        if self.drafter is None:
            return None
        return self.drafter.d3d_config.block_size


@dataclass
class Run:
    """A run's decoding settings: the DecodeConfig every mode starts from (decode.py's flags of
    its fields; a mode spec replaces its mode and budget: mode_config), and what is not
    d3d.generate's."""

    config: d3d.DecodeConfig
    # seeds each request's generator (the same draws in every mode)
    seed: int = 0
    # --compile: None, "whole" or "regional" (fast.compile_passes)
    compile: str | None = None
    # KV cache slots per model (None: what the prompts need)
    max_len: int | None = None
    # the greedy check's tolerance in logits (None: forensics.tie_tolerance's)
    tie_tolerance: float | None = None


@dataclass
class Plan:
    """What a run decodes, read from decode.py's flags before anything loads (decode.plan_run):
    the demo and each bench take it whole."""

    # the demo's mode (--mode, else runtime.default_mode's), or the one --sampling-check and
    # --prefill-bench use
    mode: str
    # the demo without --mode: the other speculative modes, shown beside it
    compare: list[str]
    # the benchmark's speculative modes (target-only always runs: it is the baseline)
    modes: list[str]
    # --bench's files (None with --prefill-bench)
    bench_files: list[str] | None
    # async's lanes (None: runtime.async_lanes decides)
    lanes: int | None
    # no benchmark named: the demo (or --explain)
    demo: bool = True
    # Qwen3's chat template with thinking on (encode)
    thinking: bool = False
    # --sampling-check's N (None: no sampling check)
    samples: int | None = None
    # --concurrency's sizes (None: Table 1)
    levels: list[int] | None = None
    # --trace's path
    trace: str | None = None
    # --prefill-bench: its keep ratios (None: no prefill bench), problems per long prompt, and
    # how many long prompts
    keep_ratios: list[float] | None = None
    num_docs: int | None = None
    num_long_prompts: int = 10
    # the demo's prompts (--sampling-check: its first), read before the models load
    prompts: list[str] | None = None
    # (path, field, prompts) of each --bench file, or of --prefill-bench's (all its problems)
    files: list[tuple] | None = None
    # the demo without --mode: why runtime.default_mode chose its mode (said under the table)
    why: str | None = None


def parse_mode(spec: str) -> tuple[str, dict]:
    """(mode, overrides) of 'sync', 'async', 'async:C,F[,cover]' (a branch budget to sweep, the
    paper's Fig. 3) or a transformers baseline (peers.BASELINES). A D3D mode or 'target' may end
    in '+compiled' (its passes compiled, beside the eager ones in the same run) and '+2lanes'
    (async: the packed pass in a second lane)."""
    spec, *setting = spec.split("+")
    mode, _, budget = spec.partition(":")
    unknown = any(s not in ("compiled", "2lanes") for s in setting)
    if unknown or (setting and mode in peers.BASELINES):
        raise runtime.UserError(
            f"unknown setting in {'+'.join([spec, *setting])!r}: a D3D mode or target may end "
            "in +compiled and +2lanes (async), e.g. sync+compiled async+compiled+2lanes"
        )
    flags = {}
    if "compiled" in setting:
        flags["compiled"] = True
    if "2lanes" in setting:
        flags["lanes"] = 2
    known = d3d.MODES + peers.BASELINES
    if mode not in known or (budget and mode != "async"):
        names = ", ".join(known)
        raise runtime.UserError(f"unknown mode {spec!r}: use one of {names} or async:C,F[,cover]")
    if not budget:
        return mode, flags
    parts = budget.split(",")
    try:
        overrides = {"coverage": int(parts[0]), "fanout": int(parts[1])}
    except (ValueError, IndexError):
        raise runtime.UserError(
            f"bad async budget {spec!r}: write async:C,F or async:C,F,likely (e.g. async:12,2)"
        )
    if len(parts) > 2:
        overrides["cover"] = parts[2]
    return mode, {**overrides, **flags}


def mode_config(spec: str, run: Run) -> tuple[d3d.DecodeConfig, bool]:
    """(the run's DecodeConfig with the mode, budget and lanes of `spec` in it, whether its
    passes are compiled): 'async:2,1,likely' is replace(config, mode="async", coverage=2,
    fanout=1, cover="likely")."""
    mode, overrides = parse_mode(spec)
    compiled = overrides.pop("compiled", False) or run.compile is not None
    if mode in peers.BASELINES:
        # transformers' generate reads only B and max_new_tokens of it (peers.hf_decode)
        return run.config, False
    return replace(run.config, mode=mode, **overrides), compiled


# GSM8K-, HumanEval-, MT-Bench-style files (first turn only)
PROMPT_FIELDS = ("question", "prompt", "turns")


def read_prompts(path: str, field=None, max_samples=None) -> tuple[str, list[str]]:
    """(field, prompts) of a JSON Lines file, the first `max_samples` (None: all); the field is
    the first of PROMPT_FIELDS a row has, unless given."""
    named = PROMPT_FIELDS
    if field is not None:
        named = (field,)
    expected = f"a JSON object with a prompt field ({', '.join(named)})"
    rows = cli.read_jsonl("prompts file", path, expected)
    found = [k for k in named if k in rows[0]]
    if not found:
        raise runtime.UserError(
            f"{path}: no prompt field {' or '.join(named)} (keys: {sorted(rows[0])}); "
            "name it with --prompt-field"
        )
    field = found[0]
    prompts = []
    for row in rows[:max_samples]:
        value = row[field]
        if isinstance(value, list):
            # a conversation's turns: the first one
            value = value[0]
        prompts.append(value)
    return field, prompts


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


def encode_files(models: Models, plan: Plan) -> dict[str, tuple]:
    """{dataset name: (path, field, prompt ids)} of the plan's (path, field, prompts) per
    prompt file; the name is the file's, made unique with its index where two files share it."""
    datasets = {}
    for path, field, prompts in plan.files:
        name = os.path.splitext(os.path.basename(path))[0]
        if name in datasets:
            name = f"{name}-{len(datasets)}"
        ids = [encode(models.tokenizer, p, plan.thinking, models.target.device) for p in prompts]
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


def prepare(models: Models, run: Run, all_ids: list[torch.Tensor], modes: list[str]) -> RunCaches:
    """Once per run, before the warm-up: the KV caches of fixed size every request reuses
    (--max-len, else the longest prompt + --max-new-tokens + the widest pass of `modes`), and
    with --compile or a '+compiled' mode a second pair whose fixed-shape passes are compiled,
    every shape warmed up (the time is printed: compile time is not decode time)."""
    block_size = models.block_size(run.config)
    if block_size is None:
        block_size = 1
    widest = 0
    for spec in modes:
        # its own async:C,F, else --coverage / --fanout, else d3d's
        coverage, fanout = d3d.branch_budget(mode_config(spec, run)[0], block_size)
        if parse_mode(spec)[0] != "async":
            coverage = 0
        else:
            runtime.check_fanout(fanout, models.drafter.d3d_config.target_vocab_size)
        widest = max(widest, runtime.cache_len(0, 0, block_size, coverage, fanout))
    # the warm-ups decode up to this many tokens
    new_tokens = max(run.config.max_new_tokens, 16, 2 * block_size + 3)
    need = max(x.shape[1] for x in all_ids) + new_tokens + widest
    max_len = run.max_len
    if max_len and max_len < need:
        raise runtime.UserError(
            f"--max-len {max_len} is too small for these prompts: they need {need} KV slots "
            "(the longest prompt + --max-new-tokens + the widest pass)"
        )
    if not max_len:
        max_len = need
    # the drafter's cache too where a mode drafts, or where selective prefilling scores the
    # prompt with the drafter (drafter_for: target-only decoding with --keep-ratio as well)
    use_drafter = None
    drafts = any(parse_mode(m)[0] not in ("target", *peers.BASELINES) for m in modes)
    if drafts or run.config.keep_ratio is not None:
        use_drafter = models.drafter
    caches = RunCaches(eager=runtime.Caches.make(models.target, use_drafter, max_len))
    compiled = [m for m in modes if run.compile or parse_mode(m)[1].get("compiled")]
    if not compiled:
        return caches
    caches.compiled = runtime.Caches.make(models.target, use_drafter, max_len)
    fast.compile_passes(caches.compiled, regional=run.compile == "regional")
    plain = [m.replace("+compiled", "") for m in compiled]
    for spec in dict.fromkeys(m for m in plain if parse_mode(m)[0] not in peers.BASELINES):
        # each shape it uses (an async budget sets the packed pass's; a CPU's two lanes run
        # with half the threads each, which dynamo's guards see)
        config = mode_config(spec, run)[0]
        shape = ("block_size", "coverage", "fanout", "cover", "lanes")
        settings = {name: getattr(config, name) for name in shape}
        prompt = all_ids[0][:, :8]
        caches.compile_seconds += fast.warm_up(
            models.target, use_drafter, caches.compiled, prompt, [config.mode], **settings
        )
    print(
        f"compiled the fixed-shape passes of {', '.join(compiled)} in "
        f"{caches.compile_seconds:.1f} s (not counted in any time below)"
    )
    return caches


# ---------------------------------------------------------------------------------------------
# One prompt in every mode


def request(spec: str, models: Models, run: Run, caches=None, max_new_tokens=None):
    """(d3d.generate's config, its keywords: a fresh seeded generator on the target's device
    (the same draws in every mode) and the run's caches) for one mode as --mode or --modes names
    it. caches: the run's RunCaches (prepare); None makes them per request. batched.generate
    takes the same."""
    config, compiled = mode_config(spec, run)
    config = replace(config, eos_token_id=models.eos)
    if max_new_tokens is not None:
        config = replace(config, max_new_tokens=max_new_tokens)
    kwargs = {"generator": torch.Generator(models.target.device).manual_seed(run.seed)}
    if caches is not None and compiled:
        kwargs["caches"] = caches.compiled
    elif caches is not None:
        kwargs["caches"] = caches.eager
    return config, kwargs


def drafter_for(config: d3d.DecodeConfig, drafter):
    """The drafter a mode decodes with: None for target-only decoding (unless selective
    prefilling scores the prompt with it)."""
    if config.mode != "target" or config.keep_ratio is not None:
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
    models: Models, ids, modes, run: Run, caches: RunCaches | None = None, max_new_tokens=None
) -> dict[str, dict]:
    """{mode: record} for each mode, in order: d3d.generate's stats (peers.hf_decode's for a
    baseline), the new tokens, decode_time and decode_tokens."""
    records = {}
    for spec in modes:
        config, kwargs = request(spec, models, run, caches, max_new_tokens)
        if parse_mode(spec)[0] in peers.BASELINES:
            records[spec] = peers.hf_decode(models, ids, spec, config)
            continue
        use = drafter_for(config, models.drafter)
        out, stats = d3d.generate(models.target, use, ids, config, **kwargs)
        records[spec] = record(ids, out, stats)
    return records


def write_trace(models: Models, ids, mode: str, run: Run, caches, path: str) -> dict:
    """One prompt decoded once more in `mode` (after the run: its passes are warm), its phases
    written to `path` as a Chrome trace: draft, verify, packed_draft, fallback_draft, both and
    prefill spans, a track for each CUDA stream or host thread they ran on. Returns it."""
    traced = replace(run, config=replace(run.config, trace=True))
    record = decode_prompt(models, ids, [mode], traced, caches)[mode]
    trace = record["trace"]
    trace["otherData"] = {"mode": mode}
    for key in ("lanes", "tau", "num_rounds"):
        if key in record:
            trace["otherData"][key] = record[key]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    events = trace["traceEvents"]
    tracks = [e["args"]["name"] for e in events if e["name"] == "thread_name"]
    spans = len(events) - len(tracks) - 1
    print(
        f"wrote {path}: {mode}, {record['num_rounds']} rounds, {spans} spans on "
        f"{len(tracks)} track(s) ({', '.join(tracks)}); open it in ui.perfetto.dev or "
        "chrome://tracing"
    )
    return trace
