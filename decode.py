"""Answer prompts with a D3D drafter, or benchmark it against target-only decoding.

    python decode.py               # the shipped toy target, the drafter train.py wrote
    python decode.py --explain     # the first prompt's decode, round by round
    python decode.py --target Qwen/Qwen3-8B --drafter runs/qwen3-8b/drafter \\
        --prompt "What is 17 * 23?"
    python decode.py --bench toy-target/prompts-test.jsonl --max-samples 20
    python decode.py --bench toy-target/prompts-test.jsonl --max-samples 32 \\
        --modes sync --concurrency 1 4 8 16

The demo loads the models, calls d3d.generate on each prompt, each round's tokens handed to
an on_round callback that colours them, and prints the answer: green = draft tokens the
target accepted, yellow = the target's own token that closes every round (the first token
comes from the target's prefill). Then a table of target-only decoding and each mode on
the same prompts (speed, speedup, tau, hit rate, same tokens) and the acceptance histogram.
Without --mode: sync, shown beside async. On one GPU at batch 1 async is estimated to lose
to sync with a drafter as deep as the target: both passes are bound by memory bandwidth, so
running them at once saves little and each miss adds a draft; it can pay with a shallow
drafter, or with the drafter on a device of its own (README, "Async on one GPU": measure it
with --bench FILE --modes sync async).

--explain: the first prompt decoded once, each round told as it ends: the draft and where
it came from, what the target accepted and said, what was committed, in async the prepared
outcomes and the one used, and what each KV cache held before and after.
--trace PATH draws one decode's passes on a timeline, a track per lane.
--sampling-check N (with --temperature): N sampled answers by target-only and by --mode,
compared per position.

Benchmark (the paper's Table 1 protocol): batch 1, greedy unless --temperature, a warm-up,
then per prompt target-only decoding and each speculative mode, in the same run.
speedup = target-only time per output token / speculative time per output token, prefill
excluded (TTFT reported apart), times and tokens summed over a dataset; tau = mean over
rounds, averaged per prompt. Every greedy output (speculative modes and baselines) is
checked token for token against the target-only output; where one differs, a
teacher-forced target pass gives the target's logit margin at the first differing token:
within rounding (tie_tolerance) it is a near-tie, beyond it an error.
Baselines (--modes hf hf-assisted hf-lookup, off by default): transformers' own generate,
assisted generation with the drafter's model drafting one token per pass, and prompt
lookup, timed by the same rule (hf_decode).
--concurrency (the paper's Table 2): prompts in consecutive groups of c decoded as one
batch; throughput = new tokens of all requests / wall time of the batches (prefill
included), speedup over batched target-only at the same c.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import math
import os
import platform
import shlex
import sys

import torch
import transformers

import d3d
import runtime
import toy
from runtime import Range
from systems import benches, cli, decoding, explain, figures, forensics, peers, pictures
from systems.decoding import Models, Run


def sample(target_path="toy-target", drafter_path="runs/toy/drafter", prompt="7 * 6 + 8 - 5"):
    """The program to copy (README, "Watch a round"): load the target and the drafter, make a
    DecodeConfig, call d3d.generate, print each round and the answer. From the repository's
    folder, after `python train.py`: python -c "import decode; decode.sample()"."""
    tok = transformers.AutoTokenizer.from_pretrained(target_path)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_path).eval()
    drafter = d3d.Drafter.from_pretrained(drafter_path).eval()
    chat = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"]
    config = d3d.DecodeConfig(max_new_tokens=64, eos_token_id=tok.eos_token_id)
    # prints each round: the draft, what was accepted, what the caches hold
    printer = explain.RoundPrinter(tok.decode)
    out, stats = d3d.generate(target, drafter, ids, config, on_round=printer)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    print(answer, f"(tau {stats['tau']:.2f})")
    return out, stats


# the toy's default drafter, and its shipped target
TOY_DRAFTER = "runs/toy/drafter"
TOY_TARGET = toy.SHIPPED
TOY_PROMPTS = os.path.join(toy.SHIPPED, toy.DATA_FILES["test"])
# GSM8K-, HumanEval-, MT-Bench-style files (first turn only)
PROMPT_FIELDS = ("question", "prompt", "turns")


# ---------------------------------------------------------------------------------------------
# Models and prompts


def load(target, drafter, modes, device, dtype, attn, threads=None) -> Models:
    """The run's Models: target, drafter, the target's tokenizer, EOS ids, its description.

    The drafter is None when only target-only decoding runs; target None: the one the
    drafter was trained for (its train_args.json)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    need_drafter = any(m != "target" for m in modes)
    check_drafter = need_drafter or target is None
    missing_toy = drafter == TOY_DRAFTER and not os.path.isdir(drafter)
    if check_drafter and missing_toy:
        raise runtime.UserError(
            f"no drafter at {TOY_DRAFTER} — train the toy's drafter with "
            "`python train.py` (about 1½ min on 2 CPU cores), or pass --target "
            "and --drafter"
        )
    if check_drafter:
        cli.check_drafter_folder("--drafter", drafter)
    # a device this machine lacks: one line, before anything loads
    device = runtime.resolve_device(str(device))
    args_file = os.path.join(drafter, "train_args.json")
    recipe = {}
    if os.path.isfile(args_file):
        recipe = cli.read_json("--drafter", args_file)
    if dtype in (None, "auto") and recipe.get("compute_dtype") == "float32":
        # trained in fp32 (the toy always is): decode in it too
        dtype = "float32"
    dtype = runtime.resolve_dtype(dtype, device)
    draft_model = None
    if need_drafter:
        draft_model = d3d.Drafter.from_pretrained(drafter, dtype, device, attn).eval()
    if target is None:
        # the target the drafter was trained for
        recorded = recipe.get("target", TOY_TARGET)
        on_hub = cli.looks_like_hub_name(recorded)
        where = f"{args_file}: target"
        target = runtime.find_recorded(recorded, where, must_exist=not on_hub)
    cli.check_model_folder("--target", target)
    tok = runtime.load_tokenizer(target)
    if draft_model is not None:
        # before loading a large target for nothing
        runtime.check_tokenizer(draft_model, tok)
    model = runtime.load_causal_lm(target, dtype, device, attn_implementation=attn)
    model = model.eval()
    num_params = sum(p.numel() for p in model.parameters())
    if device.type == "cpu" and not threads and num_params < 20_000_000:
        # a tiny model's passes are too short to split between threads (the toy: ~2x faster)
        torch.set_num_threads(1)
    eos = getattr(model.generation_config, "eos_token_id", None)
    if not isinstance(eos, list):
        eos = [eos]
    eos = sorted({tok.eos_token_id, *eos} - {None})
    info = {
        "device": describe_device(device),
        "dtype": str(dtype),
        "attn": attn,
        "target": target,
        "drafter": None,
        "eos_token_id": eos,
        "drafter_config": None,
    }
    if draft_model is not None:
        info["drafter"] = drafter
        info["drafter_config"] = dataclasses.asdict(draft_model.d3d_config)
    return Models(model, draft_model, tok, eos, info)


def describe_device(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture and torch's threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    plural = "s" * (threads > 1)
    return f"cpu ({platform.machine()}, {threads} thread{plural})"


def read_prompts(
    path: str, field: str | None = None, max_samples: int | None = None
) -> tuple[str, list[str]]:
    """(field, prompts) of a JSON Lines file; the field is found among PROMPT_FIELDS unless
    given."""
    fields = field
    if fields is None:
        fields = ", ".join(PROMPT_FIELDS)
    rows = cli.read_jsonl("prompts file", path, f"a JSON object with a prompt field ({fields})")
    if field is None:
        field = next((k for k in PROMPT_FIELDS if k in rows[0]), None)
    if field is None or field not in rows[0]:
        named = field
        if named is None:
            named = PROMPT_FIELDS
        raise runtime.UserError(
            f"{path}: no prompt field {named} (keys: {sorted(rows[0])}); "
            "name it with --prompt-field"
        )
    prompts = []
    for row in rows[:max_samples]:
        value = row[field]
        if isinstance(value, list):
            value = value[0]
        prompts.append(value)
    return field, prompts


def plain_text(tok):
    """token ids -> text, special tokens (EOS) left out."""

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    return decode


# ---------------------------------------------------------------------------------------------
# One prompt, decoded in front of the reader


def answer(models: Models, ids, mode: str, run: Run, caches, colour: bool) -> dict:
    """One prompt in the demo's mode: d3d.generate, its rounds streamed into the answer
    (explain.ColoredStream: accepted drafts green, the target's own tokens yellow), the
    answer printed. Returns the run's record of it (decoding.record)."""
    config, kwargs = decoding.request(mode, models, run, caches, ids.device)
    # the answer streams as the rounds commit it
    stream = explain.ColoredStream(decode=plain_text(models.tokenizer), colour=colour)
    drafter = decoding.drafter_for(config, models.drafter)
    out, stats = d3d.generate(models.target, drafter, ids, config, on_round=stream, **kwargs)
    print()
    return decoding.record(ids, out, stats)


def explain_prompt(models: Models, prompt: str, mode: str, run: Run, thinking: bool) -> dict:
    """--explain: one prompt decoded once in `mode`, every round described as it ends
    (explain.RoundPrinter): the draft and where it came from, what the target accepted and
    said, what was committed, in async the prepared outcomes and the one used, and what each
    KV cache held before and after. Then the answer."""
    tok = models.tokenizer
    ids = decoding.encode(tok, prompt, thinking, models.target.device)
    config, kwargs = decoding.request(mode, models, run, None, ids.device)
    printer = explain.RoundPrinter(decode=tok.decode, block_size=models.block_size(config))
    # x_0 .. x_{p-1}: the prompt; x_p: the first token, the target's prefill's
    p = ids.shape[1]
    print(f"── prompt (x_0 .. x_{p - 1}): {prompt}")
    print(f"   prefilled into the KV caches; the target's prefill also gives x_{p}\n")
    drafter = decoding.drafter_for(config, models.drafter)
    out, stats = d3d.generate(models.target, drafter, ids, config, on_round=printer, **kwargs)
    new_tokens = out[0, ids.shape[1] :].tolist()
    text = plain_text(tok)(new_tokens)
    print(
        f"\nx_{p} = {tok.decode(new_tokens[:1])!r} came from the target's prefill; "
        f"{printer.rounds} rounds committed the other {len(new_tokens) - 1} tokens"
    )
    if mode != "target":
        print(f"τ = {stats['tau']:.2f} tokens committed per round")
    print(f"answer: {text}")
    return {"mode": mode, "answer": text, "new_tokens": new_tokens, "stats": stats}


def write_trace(models: Models, ids, mode: str, run: Run, caches, path: str) -> dict:
    """One prompt decoded once more in `mode` (after the run: its passes are warm), its phases
    written to `path` as a Chrome trace: draft, verify, packed_draft, fallback_draft, both and
    prefill spans, a track for each CUDA stream or host thread they ran on. Returns it."""
    traced = dataclasses.replace(run, config=dataclasses.replace(run.config, trace=True))
    record = decoding.decode_prompt(models, ids, [mode], traced, caches)[mode]
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


def histogram(accept_lengths: list[int], width: int = 40) -> str:
    """One bar per round length that occurred (lengths with no round are left out)."""
    counts = collections.Counter(accept_lengths)
    top = max(counts.values(), default=1)
    total = max(len(accept_lengths), 1)
    lines = []
    for n in sorted(counts):
        bar = "#" * math.ceil(width * counts[n] / top)
        lines.append(f"  {n:>3} | {bar:<{width}} {counts[n]:>5} ({counts[n] / total:.0%})")
    return "\n".join(lines)


def _finite(x):
    """NaN is not JSON: written as null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


# ---------------------------------------------------------------------------------------------
# The two drivers: the demo and the benchmark


def demo(
    models: Models,
    prompts: list[str],
    mode: str,
    run: Run,
    thinking: bool,
    colour: bool,
    compare: list[str] = (),
    trace: str | None = None,
) -> dict:
    """Answer each prompt with `mode` (answer: coloured by origin), then compare it with
    target-only decoding, and with the `compare` modes, on the same prompts. trace: a path
    for write_trace (the first prompt)."""
    modes = list(dict.fromkeys(["target", mode, *compare]))
    # a bad prompt fails before any decoding
    all_ids = [
        decoding.encode(models.tokenizer, p, thinking, models.target.device) for p in prompts
    ]
    caches = decoding.prepare(models, run, all_ids, modes)
    # warm-up
    decoding.decode_prompt(models, all_ids[0], modes, run, caches, max_new_tokens=8)
    if colour:
        draft = explain.COLOURS["draft"]
        own = explain.COLOURS["target"]
        reset = explain.RESET
        print(f"{draft}accepted draft tokens{reset}, {own}the target's own tokens{reset}")
    records = collections.defaultdict(list)
    for i, (text, ids) in enumerate(zip(prompts, all_ids)):
        print(f"\n── prompt {i + 1}/{len(prompts)}: {text}")
        for m in modes:
            if m == mode:
                records[m].append(answer(models, ids, m, run, caches, colour))
            else:
                records[m].append(decoding.decode_prompt(models, ids, [m], run, caches)[m])
    block_size = models.block_size(run.config)
    summaries = print_summary(models, records, modes, run, len(prompts), block_size)
    if mode != "target":
        lengths = [n for r in records[mode] for n in r["accept_lengths"]]
        print(
            f"{mode}: acceptance histogram (tokens committed per round, 1 .. "
            f"{block_size + 1}):\n" + histogram(lengths)
        )
    if trace:
        write_trace(models, all_ids[0], mode, run, caches, trace)
    stats = None
    if mode != "target":
        stats = merged_stats(records[mode])
    return {
        "summary": summaries[mode],
        "summaries": summaries,
        "block_size": block_size,
        "stats": stats,
        "answers": [plain_text(models.tokenizer)(r["new_tokens"]) for r in records[mode]],
    }


def print_summary(models, records, modes, run: Run, num_prompts: int, block_size) -> dict:
    """The demo's table: each mode's speed, speedup, tau, hit rate and whether its tokens are
    target-only's. Returns {mode: figures.summarise}."""
    info = models.info
    print(
        f"\n{num_prompts} prompt(s), {info['device']}, {info['dtype']}, block size "
        f"{block_size}; tok/s with prefill excluded, speedup = target-only time per output "
        "token / the mode's"
    )
    header = f"{'mode':<8}{'tok/s':>8}{'speedup':>9}{'τ':>6}{'hit rate':>10}"
    print(header + "   same tokens as target-only")
    summaries = {}
    for m in modes:
        s = figures.summarise(records[m], records["target"])
        summaries[m] = s
        pairs = zip(records[m], records["target"])
        same = sum(r["new_tokens"] == b["new_tokens"] for r, b in pairs)
        same = f"{same}/{num_prompts}"
        if run.config.temperature and m != "target":
            same = "sampled"
        if m == "target":
            same = "-"
        tau = "-"
        if m != "target":
            tau = f"{s['tau']:.2f}"
        hit_rate = "-"
        if "hit_rate" in s:
            hit_rate = format(s["hit_rate"], ".0%")
        print(f"{m:<8}{s['tokens_per_s']:8.0f}{s['speedup']:8.2f}×{tau:>6}{hit_rate:>10}   {same}")
    if "async" in modes:
        lanes = records["async"][0]["lanes"]
        where = "after"
        if lanes == 2:
            where = "beside"
        print(
            f"async: the packed pass ran {where} the verification ({lanes} "
            f"lane{'s' * (lanes == 2)}); its hit rate is how often the next draft was ready "
            "when the verification ended"
        )
    return summaries


def merged_stats(records: list[dict]) -> dict:
    """One mode's stats over several prompts: accept lengths joined, hits and misses added."""
    merged = {"accept_lengths": [n for r in records for n in r["accept_lengths"]]}
    for key in ("hits_per_position", "misses_per_position"):
        if key in records[0]:
            merged[key] = [sum(counts) for counts in zip(*(r[key] for r in records))]
    return merged


# ---------------------------------------------------------------------------------------------
# The flags, checked before anything loads


def check_args(args: dict) -> None:
    """Every flag in its range and every file it reads there, before anything loads."""
    cli.check_flags(args, GROUPS, NARROWER)
    if args["target"] is not None:
        cli.check_model_folder("--target", args["target"])
    if args["prompts_file"] is not None:
        cli.check_file("--prompts-file", args["prompts_file"])
    for path in args["bench_files"] or []:
        cli.check_file("--bench", path)
    if args["prefill_bench_file"] is not None:
        cli.check_file("--prefill-bench", args["prefill_bench_file"])
    benchmark = args["bench_files"] or args["prefill_bench_file"]
    if args["plot"] is not None and benchmark:
        raise runtime.UserError("--plot draws the demo's rounds — drop --bench / --prefill-bench")
    if args["explain"]:
        others = {
            "--bench": args["bench_files"],
            "--prefill-bench": args["prefill_bench_file"],
            "--sampling-check": args["sampling_check_samples"],
            "--concurrency": args["concurrency"],
            "--trace": args["trace"],
            "--plot": args["plot"],
        }
        given = [flag for flag, value in others.items() if value is not None]
        if given:
            raise runtime.UserError(
                f"--explain describes one decode of the first prompt — drop {', '.join(given)}"
            )
    for flag in ("--out", "--trace", "--plot"):
        path = args[flag[2:]]
        if path is not None and os.path.isdir(path):
            raise runtime.UserError(f"{flag} {path} is a folder — give a file name")


def check_modes(args, mode, compare, modes, bench_files, lanes, device) -> None:
    """What the modes of a run cannot do, said before the models load."""
    for m in dict.fromkeys([mode, *compare] + modes):
        # raises on an unknown mode or a bad async:C,F
        spec, flags = decoding.parse_mode(m)
        if spec == "async":
            # two compiled lanes on CUDA are refused: before anything loads
            compiled = args.compile or flags.get("compiled", False)
            device_type = torch.device(device).type
            runtime.async_lanes(device_type, compiled, flags.get("lanes", lanes))
    baselines = [m for m in modes if m in peers.BASELINES]
    if mode in peers.BASELINES and not bench_files:
        raise runtime.UserError(
            f"{mode} is a benchmark baseline: run it with --bench FILE.jsonl --modes {mode}"
        )
    lossy = args.temperature or args.keep_ratio is not None
    if baselines and bench_files and lossy:
        raise runtime.UserError(
            f"{', '.join(baselines)} decode greedy with the full prompt: drop --temperature "
            "and --keep-ratio, or these modes"
        )


def check_combinations(args, modes, bench_files) -> None:
    """Flags that do not go together, said before the models load."""
    if bench_files and not modes:
        speculative = [m for m in decoding.available_modes() if m != "target"]
        raise runtime.UserError(
            f"--modes: name speculative modes ({', '.join(speculative)}); target-only always runs"
        )
    if args.concurrency is not None and not bench_files:
        raise runtime.UserError(
            f"--concurrency takes sizes >= 1 and goes with --bench, got {args.concurrency}"
        )
    samples = args.sampling_check_samples
    if samples is not None and (not args.temperature or bench_files):
        raise runtime.UserError(
            "--sampling-check N (N >= 2) samples answers: give it --temperature > 0, "
            "without --bench"
        )
    apart = args.prefill_bench_file or samples or args.concurrency
    if args.trace and apart:
        raise runtime.UserError(
            "--trace goes with the demo or with --bench (Table 1), not with --prefill-bench, "
            "--sampling-check or --concurrency"
        )


def demo_prompts(args) -> list[str]:
    """The prompts the demo answers: --prompt (with '-': one per line of stdin), else the
    first --max-samples of --prompts-file (default: 3 of the toy's test prompts)."""
    prompts = args.prompt
    if prompts is not None and "-" in prompts:
        # `--prompt -`: one prompt per non-empty line of stdin
        prompts = [p for p in prompts if p != "-"]
        prompts += [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if not prompts:
            raise runtime.UserError("no prompts on stdin")
    if prompts is not None:
        return prompts
    path = args.prompts_file
    if path is None:
        path = TOY_PROMPTS
    if path == TOY_PROMPTS and not os.path.isfile(path):
        raise runtime.UserError(
            f"no prompts at {TOY_PROMPTS}: `git checkout -- toy-target` restores the toy's "
            "files, or pass --prompt"
        )
    count = args.max_samples
    if count is None:
        count = 3
    return read_prompts(path, args.prompt_field, count)[1]


@dataclasses.dataclass
class Plan:
    """What a run decodes, read from its flags before anything loads."""

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
    device: str
    # --sampling-check's N (None: no sampling check)
    samples: int | None = None


def plan_run(args) -> Plan:
    """The modes, lanes and device of a run, every combination the flags cannot make refused."""
    speculative = [m for m in decoding.available_modes() if m != "target"]
    mode = args.mode
    modes = args.modes
    bench_files = args.bench_files
    if args.prefill_bench_file:
        # the paper pairs selective prefilling with sequential (sync) speculative decoding
        if mode is None:
            mode = "sync"
        modes = [mode]
        bench_files = None
    device = args.device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # the demo without --mode: the rule's mode on this device, beside the other one and the
    # target (--explain: that mode alone)
    compare = []
    is_demo = not bench_files and not args.prefill_bench_file
    is_demo = is_demo and not args.sampling_check_samples
    if mode is None and is_demo:
        mode, why = runtime.default_mode(torch.device(device).type)
        if not args.explain:
            compare = [m for m in speculative if m != mode]
        print(f"mode {mode}: {why}")
    if mode is None:
        mode = speculative[-1]
    if modes is None:
        modes = speculative
    modes = [m for m in modes if m != "target"]
    lanes = args.lanes
    if lanes is None and bench_files:
        # a benchmark names +2lanes itself; else the rule (runtime.py)
        lanes = 1
    check_modes(args, mode, compare, modes, bench_files, lanes, device)
    check_combinations(args, modes, bench_files)
    samples = args.sampling_check_samples
    return Plan(mode, compare, modes, bench_files, lanes, device, samples)


def main(args: argparse.Namespace) -> dict:
    """decode.py with parsed flags (build_parser().parse_args(argv)): the demo, --explain,
    or a benchmark. Every flag is checked before anything loads. Returns what the run printed,
    as numbers; a benchmark also writes it to --out."""
    check_args(vars(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = plan_run(args)
    prompts = None
    if not plan.bench_files and not args.prefill_bench_file:
        prompts = demo_prompts(args)
    # read before loading
    files = []
    for path in plan.bench_files or []:
        files.append((path, *read_prompts(path, args.prompt_field, args.max_samples)))
    torch.manual_seed(args.seed)
    loaded_modes = plan.modes
    if not plan.bench_files:
        loaded_modes = [plan.mode, *plan.compare]
    if not plan.bench_files and args.keep_ratio:
        loaded_modes.append("sync")
    models = load(
        args.target, args.drafter, loaded_modes, plan.device, args.dtype, args.attn, args.threads
    )
    # the DecodeConfig every mode starts from: its flags, the lanes the plan chose
    config = cli.settings_of(d3d.DecodeConfig, vars(args), NOT_FLAGS, lanes=plan.lanes)
    run = Run(config, args.seed, args.compile, args.max_len, args.tie_tolerance)
    if args.explain:
        return explain_prompt(models, prompts[0], plan.mode, run, args.thinking)
    if not plan.bench_files and not args.prefill_bench_file and not plan.samples:
        return show_demo(args, models, prompts, plan, run)
    result = benchmark(args, models, prompts, files, plan, run)
    # None: called in-process
    command = None
    if sys.argv[0].endswith("decode.py"):
        command = "python " + shlex.join(sys.argv)
    result["env"] = {
        **models.info,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "command": command,
        "args": dict(vars(args)),
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(_finite(result), f, indent=1, ensure_ascii=False)
        print(f"wrote {args.out}")
    return result


def show_demo(args, models: Models, prompts: list[str], plan: Plan, run: Run) -> dict:
    """The demo, and with --plot its acceptance histogram drawn."""
    colour = not args.no_color and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    mode = plan.mode
    summary = demo(models, prompts, mode, run, args.thinking, colour, plan.compare, args.trace)
    if args.plot and summary["stats"] is not None:
        title = f"{mode}, {len(prompts)} prompt(s)"
        stats = summary["stats"]
        path = pictures.draw_acceptance(args.plot, stats, summary["block_size"], title=title)
        drawn = "the acceptance histogram"
        if mode == "async":
            drawn += " and hits / misses per verification outcome"
        print(f"wrote {path}: {drawn}")
    return summary


def benchmark(args, models: Models, prompts, files, plan: Plan, run: Run) -> dict:
    """The benchmark the flags name: --prefill-bench, --sampling-check, --concurrency
    (Table 2), else Table 1 (--bench)."""
    thinking = args.thinking
    if args.prefill_bench_file:
        docs = read_prompts(args.prefill_bench_file, args.prompt_field)[1]
        count = args.max_samples
        if count is None:
            count = 10
        full = dataclasses.replace(run, config=dataclasses.replace(run.config, keep_ratio=None))
        path = args.prefill_bench_file
        ratios = list(args.keep_ratios)
        return benches.prefill_bench(
            models, path, docs, plan.mode, ratios, args.num_docs, count, full, thinking
        )
    if plan.samples:
        return benches.sampling_check(models, prompts[0], plan.mode, run, thinking, plan.samples)
    if args.concurrency:
        levels = list(args.concurrency)
        return benches.concurrency_bench(models, files, plan.modes, levels, run, thinking)
    trace = None
    if args.trace:
        trace = functools.partial(write_trace, models, run=run, path=args.trace)
    return benches.table1(models, files, plan.modes, run, thinking, trace)


@dataclasses.dataclass
class ModelFlags:
    """The models and where they run (load)."""

    target: str | None = cli.flag(
        None,
        "target: HF hub name or folder (default: 'target' in the drafter's train_args.json, "
        "else the toy's, toy-target/)",
    )
    drafter: str = cli.flag(TOY_DRAFTER, "D3D drafter folder")
    device: str | None = cli.flag(
        None, "cuda, cuda:1, cpu, ... (default: cuda if available, else cpu)"
    )
    dtype: str = cli.flag(
        "auto",
        "weights of both models (auto = bfloat16 where the device computes it natively: "
        "CUDA, or a CPU with AVX512-BF16/AMX; float32 elsewhere and for drafters trained in "
        "float32)",
        Range(str, choices=("auto", "float32", "bfloat16")),
    )
    attn: str = cli.flag("sdpa", "attention kernel", Range(str, choices=("sdpa", "eager")))
    threads: int | None = cli.flag(
        None,
        "torch CPU threads (default: 1 for a target under 20M parameters, like the toy; else "
        "torch's choice; use 1 on a CPU shared with other jobs)",
        Range(int, low=1),
    )


@dataclasses.dataclass
class PromptFlags:
    """What the demo answers (demo_prompts, read_prompts)."""

    prompt: list[str] | None = cli.flag(
        None,
        "a prompt to answer (repeatable); '-' reads one per line of stdin",
        action="append",
    )
    prompts_file: str | None = cli.flag(
        None, "JSON Lines prompts to answer without --prompt (default: the toy's test prompts)"
    )
    prompt_field: str | None = cli.flag(
        None, f"JSON field of the prompt (default: first of {', '.join(PROMPT_FIELDS)})"
    )
    max_samples: int | None = cli.flag(
        None, "prompts per file (default: 3 for the demo, all with --bench)", Range(int, low=1)
    )
    thinking: bool = cli.flag(
        False, "Qwen3 chat template with thinking on (default: off)", Range(bool)
    )


@dataclasses.dataclass
class RunFlags:
    """How the run decodes beyond d3d.DecodeConfig: the mode spec, compiling, tracing."""

    mode: str | None = cli.flag(
        None,
        f"one of {', '.join(decoding.available_modes())}, or a spec as --modes takes (default: "
        "sync on every device, shown beside async and the target; runtime.default_mode says "
        "why)",
    )
    compile: str | None = cli.flag(
        None,
        "compile the fixed-shape passes (torch.compile, fullgraph): 'whole' (the flag alone) "
        "one graph per pass shape, CUDA graphs on a GPU; 'regional' one decoder layer compiled "
        "once and reused by every layer (compiles in a fraction of the time, runs slower: "
        "fast.compile_passes). Warmed up first, compile time reported apart; '+compiled' "
        "modes use it too (default: off; '+compiled': whole)",
        Range(str, choices=("whole", "regional")),
        nargs="?",
        const="whole",
    )
    trace: str | None = cli.flag(
        None,
        "after the run, decode the first prompt once more in --mode (with --bench: the first "
        "of --modes) and write its phases (draft, verify, packed_draft, ...) as a Chrome "
        "trace, a track for each CUDA stream or host thread: open it in ui.perfetto.dev",
        metavar="PATH",
    )
    max_len: int | None = cli.flag(
        None,
        "KV cache slots per model, kept for the whole run (default: the longest prompt + "
        "--max-new-tokens + the widest pass)",
        Range(int, low=1),
    )
    seed: int = cli.flag(0, "seed of sampling", Range(int, low=0))
    sampling_check_samples: int | None = cli.flag(
        None,
        "lossless sampling, measured: N answers to the first prompt by target-only and by "
        "--mode, per-position distance between the two token distributions (needs "
        "--temperature)",
        Range(int, low=2),
        flag="--sampling-check",
        metavar="N",
    )


@dataclasses.dataclass
class BenchFlags:
    """Table 1 (benches.table1) and Table 2 (--concurrency)."""

    bench_files: list[str] | None = cli.flag(
        None, "prompt files to benchmark", flag="--bench", nargs="+", metavar="FILE.jsonl"
    )
    modes: list[str] | None = cli.flag(
        None,
        "speculative modes to compare with target-only (default: all); async:C,F[,likely] "
        "sets a branch budget, e.g. --modes sync async:0,2 async:12,2 async:12,1; "
        f"transformers baselines, greedy, off unless named: {', '.join(peers.BASELINES)} "
        "(plain generate, the drafter's model as a token-by-token assistant, prompt lookup; "
        "B draft tokens per round)",
        nargs="+",
    )
    tie_tolerance: float | None = cli.flag(
        None,
        "greedy check: a divergence whose target logit margin is within this many logits is "
        f"a near-tie, else an error (default: {forensics.TIE_EPS_MULTIPLE} x max(the dtype's "
        "machine epsilon, 2^-16) x the largest |logit| at that position)",
        Range(float, low=0),
    )
    concurrency: list[int] | None = cli.flag(
        None,
        "concurrent requests, e.g. 1 4 8 16: Table 2 (throughput per concurrency) instead of "
        "Table 1",
        Range(int, low=1, each=True),
        metavar="C",
    )
    out: str = cli.flag("runs/bench.json", "benchmark figures, JSON")


@dataclasses.dataclass
class PrefillFlags:
    """The selective prefilling benchmark (benches.prefill_bench; lossy: the target reads only
    the kept prompt chunks)."""

    prefill_bench_file: str | None = cli.flag(
        None,
        "benchmark selective prefilling on long prompts built from this file's problems",
        flag="--prefill-bench",
        metavar="FILE.jsonl",
    )
    keep_ratios: list[float] = cli.flag(
        (1.0, 0.3, 0.2, 0.1),
        "keep ratios for --prefill-bench",
        Range(float, low=0, high=1, low_open=True, each=True),
    )
    num_docs: int = cli.flag(12, "problems per long prompt", Range(int, low=1))


@dataclasses.dataclass
class OutputFlags:
    """What the demo shows besides its answers."""

    explain: bool = cli.flag(
        False,
        "decode the first prompt once in --mode (default: the demo's, sync: "
        "runtime.default_mode) and print each round as it ends: the draft and where it came "
        "from, what the target accepted and said, what was committed, in async the prepared "
        "outcomes and the one used, both KV caches before and after; then the answer",
        Range(bool),
    )
    plot: str | None = cli.flag(
        None,
        "the demo: draw the mode's acceptance-length histogram (async: and hits / misses per "
        "verification outcome) as a PNG; needs matplotlib (pip install -r "
        "requirements-plots.txt)",
        metavar="PATH.png",
    )
    no_color: bool = cli.flag(
        False, "plain answers (default: ANSI colours on a terminal)", Range(bool)
    )


# d3d.DecodeConfig's fields that no flag sets: --mode takes a spec (RunFlags), EOS is the
# target's, --trace names a file
NOT_FLAGS = ("mode", "eos_token_id", "trace")
GROUPS = {
    "models": ModelFlags,
    "prompts": PromptFlags,
    "decoding (d3d.DecodeConfig)": (d3d.DecodeConfig, NOT_FLAGS),
    "the run": RunFlags,
    "benchmark (prints Table 1, writes --out)": BenchFlags,
    "selective prefilling benchmark": PrefillFlags,
    "output": OutputFlags,
}
# where the driver takes less than DecodeConfig: an answer of no tokens has no speed, and
# F = 0 branches nothing (async:C,0 is async:0,F)
NARROWER = {"max_new_tokens": Range(int, low=1), "fanout": Range(int, low=1)}
# a benchmark names +2lanes itself; else the rule (runtime.py)
LATER = {
    "lanes": "1 with --bench, where a mode ending in +2lanes names the other; else "
    "runtime.async_lanes: 1 on CUDA, 2 on a CPU for a target of 20M parameters or more. With "
    "--compile on CUDA, 2 is refused: the compiled passes' CUDA graphs share one memory pool"
}
RANGES, FLAGS = cli.flag_ranges(GROUPS, NARROWER)


def build_parser() -> argparse.ArgumentParser:
    """decode.py's flags, a group per settings dataclass."""
    p = cli.Parser(
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_groups(p, GROUPS, later=LATER, narrower=NARROWER)
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """decode.py's flags as main takes them; from Python: main(parse_args(["--mode", ...]))."""
    return build_parser().parse_args([str(a) for a in argv])


def cli_main(argv: list[str]) -> dict:
    """`python decode.py ...`: parse the flags, then main."""
    return main(parse_args(argv))


if __name__ == "__main__":
    try:
        cli.run(cli_main, sys.argv[1:])
    except KeyboardInterrupt:
        # Ctrl-C: one line, no traceback (a benchmark's --out is written when it ends)
        print(
            "decode.py: interrupted (Ctrl-C); --out and --trace are written when a run ends",
            file=sys.stderr,
        )
        sys.exit(130)
