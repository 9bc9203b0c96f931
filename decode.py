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
import dataclasses
import json
import math
import os
import platform
import shlex
import sys

import torch
import transformers
from tqdm.auto import tqdm

import d3d
import runtime
import toy
from systems import benches, cli, decoding, figures, forensics, peers, pictures

TOY_DRAFTER, TOY_TARGET = (
    "runs/toy/drafter",
    toy.SHIPPED,
)  # the toy's default drafter, and its shipped target
TOY_PROMPTS = os.path.join(toy.SHIPPED, toy.DATA_FILES["test"])
PROMPT_FIELDS = (
    "question",
    "prompt",
    "turns",
)  # GSM8K-, HumanEval-, MT-Bench-style files (first turn only)
COLOURS, RESET = {"draft": "\033[32m", "target": "\033[33m"}, "\033[0m"


# ----------------------------------------------------------------------------------------------------------------------
# Models and prompts


def load(target, drafter, modes, device, dtype, attn, threads=None):
    """(target, drafter or None if only target-only decoding runs, the target's tokenizer, EOS ids, description)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    need_drafter = any(m != "target" for m in modes)
    if (need_drafter or target is None) and drafter == TOY_DRAFTER and not os.path.isdir(drafter):
        raise runtime.UserError(
            f"no drafter at {TOY_DRAFTER} — train the toy's drafter with "
            "`python train.py` (about 1½ min on 2 CPU cores), or pass --target "
            "and --drafter"
        )
    if need_drafter or target is None:
        cli.check_drafter_folder("--drafter", drafter)
    args_file = os.path.join(drafter, "train_args.json")
    recipe = {}
    if os.path.isfile(args_file):
        recipe = cli.read_json("--drafter", args_file)
    if dtype in (None, "auto") and recipe.get("compute_dtype") == "float32":
        dtype = "float32"  # trained in fp32 (the toy always is): decode in it too
    dtype = runtime.resolve_dtype(dtype, device)
    draft_model = (
        d3d.Drafter.from_pretrained(drafter, dtype, device, attn).eval() if need_drafter else None
    )
    if target is None:  # the target the drafter was trained for
        recorded = recipe.get("target", TOY_TARGET)
        on_hub = cli.looks_like_hub_name(recorded)
        target = runtime.find_recorded(recorded, f"{args_file}: target", must_exist=not on_hub)
    cli.check_model_folder("--target", target)
    tok = transformers.AutoTokenizer.from_pretrained(target)
    if draft_model is not None:
        runtime.check_tokenizer(draft_model, tok)  # before loading a large target for nothing
    model = runtime.load_causal_lm(target, dtype, device, attn_implementation=attn).eval()
    if (
        device.type == "cpu"
        and not threads
        and sum(p.numel() for p in model.parameters()) < 20_000_000
    ):
        torch.set_num_threads(
            1
        )  # a tiny model's passes are too short to split between threads (the toy: ~2x faster)
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = sorted({tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    num_threads = torch.get_num_threads()
    info = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.machine()}, {num_threads} thread{'s' * (num_threads > 1)})",
        "dtype": str(dtype),
        "attn": attn,
        "target": target,
        "drafter": drafter if need_drafter else None,
        "eos_token_id": eos,
        "drafter_config": dataclasses.asdict(draft_model.d3d_config) if draft_model else None,
    }
    return model, draft_model, tok, eos, info


def read_prompts(
    path: str, field: str | None = None, max_samples: int | None = None
) -> tuple[str, list[str]]:
    """(field, prompts) of a JSON Lines file; the field is auto-detected among PROMPT_FIELDS unless given."""
    rows = cli.read_jsonl(
        "prompts file",
        path,
        f"a JSON object with a prompt field ({field or ', '.join(PROMPT_FIELDS)})",
    )
    field = field or next((k for k in PROMPT_FIELDS if k in rows[0]), None)
    if field is None or field not in rows[0]:
        raise runtime.UserError(
            f"{path}: no prompt field {field or PROMPT_FIELDS} (keys: {sorted(rows[0])}); "
            "name it with --prompt-field"
        )
    return field, [
        r[field][0] if isinstance(r[field], list) else r[field] for r in rows[:max_samples]
    ]


# ----------------------------------------------------------------------------------------------------------------------
# How to show a round


def write_trace(models, ids: torch.Tensor, mode: str, opts: dict, path: str) -> dict:
    """One prompt decoded once more in `mode` (after the run: its passes are warm), its phases written to `path` as a
    Chrome trace: draft, verify, packed_draft, fallback_draft, both and prefill spans, a track for each CUDA stream
    or host thread they ran on. Returns the trace."""
    record = decoding.decode_prompt(models, ids, [mode], {**opts, "trace": True})[mode]
    trace = record["trace"]
    trace["otherData"] = {
        "mode": mode,
        **{k: record[k] for k in ("lanes", "tau", "num_rounds") if k in record},
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    tracks = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    print(
        f"wrote {path}: {mode}, {record['num_rounds']} rounds, {len(trace['traceEvents']) - len(tracks) - 1} spans "
        f"on {len(tracks)} track(s) ({', '.join(tracks)}); open it in ui.perfetto.dev or chrome://tracing"
    )
    return trace


def colour_answer(tok, new_tokens: list[int], accept_lengths: list[int], colour: bool) -> str:
    """The answer, accepted drafts green, the target's own tokens yellow. Round r commits accept_lengths[r] tokens:
    drafts, then the target's (a final round cut by EOS or the budget may end on a draft: shown as the target's)."""
    if not colour:
        return tok.decode(new_tokens, skip_special_tokens=True)
    origin = ["target"] + [o for n in accept_lengths for o in ["draft"] * (n - 1) + ["target"]]
    origin += ["target"] * (len(new_tokens) - len(origin))  # target-only decoding has no rounds
    pieces, shown, start = [], "", 0
    for end in range(1, len(new_tokens) + 1):
        if (
            end == len(new_tokens) or origin[end] != origin[start]
        ):  # a run of one origin ends: decode up to it
            text = tok.decode(
                new_tokens[:end], skip_special_tokens=True
            )  # whole prefix: multi-byte text stays whole
            piece = (
                text[len(shown) :] if text.startswith(shown) else tok.decode(new_tokens[start:end])
            )
            pieces.append(COLOURS[origin[start]] + piece + RESET)
            shown, start = text, end
    return "".join(pieces)


def histogram(accept_lengths: list[int], width: int = 40) -> str:
    """One bar per round length that occurred (lengths with no round are left out)."""
    counts = collections.Counter(accept_lengths)
    top, total = max(counts.values(), default=1), max(len(accept_lengths), 1)
    return "\n".join(
        f"  {n:>3} | {'#' * math.ceil(width * counts[n] / top):<{width}} {counts[n]:>5} "
        f"({counts[n] / total:.0%})"
        for n in sorted(counts)
    )


def _finite(x):  # NaN is not JSON: write null
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


# ----------------------------------------------------------------------------------------------------------------------
# The two drivers: interactive answers and the benchmark


def interactive(
    models,
    prompts: list[str],
    mode: str,
    opts: dict,
    thinking: bool,
    colour: bool,
    compare: list[str] = (),
) -> dict:
    """Answer each prompt with `mode` (coloured by origin), then compare it with target-only decoding, and with the
    `compare` modes, on the same prompts."""
    target, _, tok, _, info = models
    modes = list(dict.fromkeys(["target", mode, *compare]))
    # a bad prompt fails before any decoding
    all_ids = [decoding.encode(tok, p, thinking, target.device) for p in prompts]
    decoding.prepare(models, opts, all_ids, modes)
    decoding.decode_prompt(models, all_ids[0], modes, opts, max_new_tokens=8)  # warm-up
    if colour:
        print(
            f"{COLOURS['draft']}accepted draft tokens{RESET}, {COLOURS['target']}the target's own tokens{RESET}"
        )
    records = collections.defaultdict(list)
    for i, (text, ids) in enumerate(zip(prompts, all_ids)):
        for m, r in decoding.decode_prompt(models, ids, modes, opts).items():
            records[m].append(r)
        r = records[mode][-1]
        print(
            f"\n── prompt {i + 1}/{len(prompts)}: {text}\n"
            f"{colour_answer(tok, r['new_tokens'], r['accept_lengths'], colour)}"
        )
    block_size = opts["block_size"] or (info["drafter_config"] or {}).get("block_size")
    print(
        f"\n{len(prompts)} prompt(s), {info['device']}, {info['dtype']}, block size {block_size}; tok/s with "
        "prefill excluded, speedup = target-only time per output token / the mode's"
    )
    print(
        f"{'mode':<8}{'tok/s':>8}{'speedup':>9}{'τ':>6}{'hit rate':>10}   same tokens as target-only"
    )
    summaries = {}
    for m in modes:
        s = summaries[m] = figures.summarise(records[m], records["target"])
        same = sum(
            r["new_tokens"] == b["new_tokens"] for r, b in zip(records[m], records["target"])
        )
        same = "sampled" if opts["temperature"] and m != "target" else f"{same}/{len(prompts)}"
        tau = "-" if m == "target" else f"{s['tau']:.2f}"
        hit_rate = format(s["hit_rate"], ".0%") if "hit_rate" in s else "-"
        print(
            f"{m:<8}{s['tokens_per_s']:8.0f}{s['speedup']:8.2f}×{tau:>6}{hit_rate:>10}   "
            f"{same if m != 'target' else '-'}"
        )
    if "async" in modes:
        lanes = records["async"][0]["lanes"]
        print(
            f"async: the packed pass ran {'beside' if lanes == 2 else 'after'} the verification ({lanes} "
            f"lane{'s' * (lanes == 2)}); its hit rate is how often the next draft was ready when the verification "
            "ended"
        )
    if mode != "target":
        print(
            f"{mode}: acceptance histogram (tokens committed per round, 1 .. {block_size + 1}):\n"
            + histogram([n for r in records[mode] for n in r["accept_lengths"]])
        )
    return {
        "summary": summaries[mode],
        "summaries": summaries,
        "block_size": block_size,
        "stats": merged_stats(records[mode]) if mode != "target" else None,
        "answers": [tok.decode(r["new_tokens"], skip_special_tokens=True) for r in records[mode]],
    }


def merged_stats(records: list[dict]) -> dict:
    """One mode's stats over several prompts: accept lengths joined, hits and misses added."""
    merged = {"accept_lengths": [n for r in records for n in r["accept_lengths"]]}
    for key in ("hits_per_position", "misses_per_position"):
        if key in records[0]:
            merged[key] = [sum(counts) for counts in zip(*(r[key] for r in records))]
    return merged


def bench(
    models, files: list[tuple[str, str, list[str]]], modes: list[str], opts: dict, thinking: bool
) -> dict:
    """files: (path, field, prompts) of each prompt file. Greedy outputs that differ from target-only are classified
    by forensics.classify_divergence (opts["tie_tolerance"]: a fixed tolerance in logits instead of tie_tolerance's)."""
    target, _, tok, _, info = models
    datasets = {}
    for path, field, prompts in files:
        name = os.path.splitext(os.path.basename(path))[0]
        ids = [decoding.encode(tok, p, thinking, target.device) for p in prompts]
        datasets[name if name not in datasets else f"{name}-{len(datasets)}"] = (path, field, ids)
    decoding.prepare(
        models, opts, [x for _, _, ids in datasets.values() for x in ids], ["target"] + modes
    )
    first = next(iter(datasets.values()))[2][0]
    decoding.decode_prompt(models, first, ["target"] + modes, opts, max_new_tokens=16)  # warm-up
    results, mismatches, everything = {}, [], collections.defaultdict(list)
    for name, (path, field, prompts) in datasets.items():
        records = collections.defaultdict(list)
        for i, ids in enumerate(tqdm(prompts, desc=name, unit="prompt", dynamic_ncols=True)):
            for mode, r in decoding.decode_prompt(models, ids, ["target"] + modes, opts).items():
                records[mode].append(r)
                found = forensics.divergence(
                    target,
                    tok,
                    ids,
                    records["target"][-1]["new_tokens"],
                    r["new_tokens"],
                    opts,
                    dataset=name,
                    prompt_index=i,
                    mode=mode,
                )
                mismatches += [found] if found else []
        results[name] = {
            "path": path,
            "field": field,
            "num_prompts": len(prompts),
            "modes": {},
            "per_prompt": {},
        }
        for m in records:
            results[name]["modes"][m] = figures.summarise(records[m], records["target"])
            results[name]["modes"][m]["mismatches"] = sum(
                x["dataset"] == name and x["mode"] == m for x in mismatches
            )
            results[name]["modes"][m]["errors"] = sum(
                x["dataset"] == name and x["mode"] == m and x["class"] == "error"
                for x in mismatches
            )
            results[name]["per_prompt"][m] = [
                {k: v for k, v in r.items() if k != "new_tokens"} for r in records[m]
            ]
            everything[m] += records[m]
    block_size = opts["block_size"] or info["drafter_config"]["block_size"]
    overall = {m: figures.summarise(everything[m], everything["target"]) for m in everything}
    text = figures.table(results, overall, modes, block_size)
    checked = sum(len(everything[m]) for m in modes)
    if opts["temperature"]:
        check = "greedy check skipped: at temperature > 0 the outputs are samples"
    else:
        check = forensics.greedy_check(mismatches, checked)
    print(f"\n{text}\n\n{check}")
    mean = {
        m: {
            k: figures._mean(results[n]["modes"][m][k] for n in results) for k in ("speedup", "tau")
        }
        for m in modes
    }
    counts = collections.Counter(x["class"] for x in mismatches)
    result = {
        "datasets": results,
        "mean": mean,
        "overall": overall,
        "block_size": block_size,
        "table": text,
        "mismatches": {
            "count": len(mismatches),
            "checked": checked,
            "identical": checked - len(mismatches),
            "near_ties": counts["near-tie"],
            "errors": counts["error"],
            "list": mismatches,
        },
    }
    if "hf" in overall:  # > 1: this repo's target-only loop is faster than transformers' generate
        result["target_vs_hf"] = overall["target"]["tokens_per_s"] / overall["hf"]["tokens_per_s"]
    return result


# Every number a flag takes, and the values it accepts (None: not given, the default applies).
# Zero is legal where it means something: --temperature 0 (greedy), --coverage 0 (async with only
# the full-acceptance branch, as in async:0,2), --seed 0, --tie-tolerance 0.
RANGES = {
    "threads": cli.Range(int, low=1),
    "max_samples": cli.Range(int, low=1),
    "block_size": cli.Range(int, low=1),
    "temperature": cli.Range(float, low=0),
    "max_new_tokens": cli.Range(int, low=1),
    "coverage": cli.Range(int, low=0),
    "fanout": cli.Range(int, low=1),
    "max_len": cli.Range(int, low=1),
    "seed": cli.Range(int, low=0),
    "sampling_check_samples": cli.Range(int, low=2),
    "tie_tolerance": cli.Range(float, low=0),
    "concurrency": cli.Range(int, low=1, each=True),
    "keep_ratio": cli.Range(float, low=0, high=1, low_open=True),
    "chunk_size": cli.Range(int, low=1),
    "keep_ratios": cli.Range(float, low=0, high=1, low_open=True, each=True),
    "num_docs": cli.Range(int, low=1),
}
FLAGS = {
    "sampling_check_samples": "--sampling-check",
    "bench_files": "--bench",
    "prefill_bench_file": "--prefill-bench",
}


def check_args(args: dict) -> None:
    """Every flag in its range and every file it reads there, before anything loads."""
    cli.check_ranges(args, RANGES, FLAGS)
    if args["target"] is not None:
        cli.check_model_folder("--target", args["target"])
    if args["prompts_file"] is not None:
        cli.check_file("--prompts-file", args["prompts_file"])
    for path in args["bench_files"] or []:
        cli.check_file("--bench", path)
    if args["prefill_bench_file"] is not None:
        cli.check_file("--prefill-bench", args["prefill_bench_file"])
    if args["plot"] is not None and (args["bench_files"] or args["prefill_bench_file"]):
        raise runtime.UserError("--plot draws the demo's rounds — drop --bench / --prefill-bench")
    for flag, path in (
        ("--out", args["out"]),
        ("--trace", args["trace"]),
        ("--plot", args["plot"]),
    ):
        if path is not None and os.path.isdir(path):
            raise runtime.UserError(f"{flag} {path} is a folder — give a file name")


def main(
    *,
    target,
    drafter,
    device,
    dtype,
    attn,
    prompt,
    prompts_file,
    prompt_field,
    max_samples,
    thinking,
    mode,
    block_size,
    temperature,
    max_new_tokens,
    coverage,
    fanout,
    cover,
    seed,
    bench_files,
    modes,
    out,
    no_color,
    keep_ratio=None,
    chunk_size=64,
    prefill_bench_file=None,
    keep_ratios=(1.0, 0.3, 0.2, 0.1),
    num_docs=12,
    concurrency=None,
    tie_tolerance=None,
    threads=None,
    sampling_check_samples=None,
    compile=False,
    max_len=None,
    lanes=None,
    trace=None,
    plot=None,
):
    args = dict(locals())  # recorded in the benchmark JSON
    check_args(args)
    if threads:
        torch.set_num_threads(threads)
    speculative = [m for m in decoding.available_modes() if m != "target"]
    if (
        prefill_bench_file
    ):  # the paper pairs selective prefilling with sequential (sync) speculative decoding
        mode, modes, bench_files = mode or "sync", [mode or "sync"], None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compare = []  # the demo without --mode: the rule's mode on this device, beside the other one and the target
    if mode is None and not bench_files and not prefill_bench_file and not sampling_check_samples:
        mode, why = runtime.default_mode(torch.device(device).type)
        compare = [m for m in speculative if m != mode]
        print(f"mode {mode}: {why}")
    mode = mode or speculative[-1]
    modes = [
        m for m in modes or speculative if m != "target"
    ]  # target-only always runs: it is the baseline
    lanes = lanes or (
        1 if bench_files else None
    )  # a benchmark names +2lanes itself; else the rule (runtime.py)
    for m in dict.fromkeys([mode, *compare] + modes):
        spec, flags = decoding.parse_mode(m)  # raises on an unknown mode or a bad async:C,F
        if spec == "async":  # two compiled lanes on CUDA are refused: before anything loads
            runtime.async_lanes(
                torch.device(device).type,
                compile or flags.get("compiled", False),
                flags.get("lanes", lanes),
            )
    baselines = [m for m in modes if m in peers.BASELINES]
    if mode in peers.BASELINES and not bench_files:
        raise runtime.UserError(
            f"{mode} is a benchmark baseline: run it with --bench FILE.jsonl --modes {mode}"
        )
    if baselines and bench_files and (temperature or keep_ratio is not None):
        raise runtime.UserError(
            f"{', '.join(baselines)} decode greedy with the full prompt: drop --temperature and "
            "--keep-ratio, or these modes"
        )
    if bench_files and not modes:
        raise runtime.UserError(
            f"--modes: name speculative modes ({', '.join(speculative)}); target-only always runs"
        )
    if concurrency is not None and (not bench_files or min(concurrency) < 1):
        raise runtime.UserError(
            f"--concurrency takes sizes >= 1 and goes with --bench, got {concurrency}"
        )
    if sampling_check_samples is not None and (
        not temperature or sampling_check_samples < 2 or bench_files
    ):
        raise runtime.UserError(
            "--sampling-check N (N >= 2) samples answers: give it --temperature > 0, without --bench"
        )
    if trace and (prefill_bench_file or sampling_check_samples or concurrency):
        raise runtime.UserError(
            "--trace goes with the demo or with --bench (Table 1), not with --prefill-bench, "
            "--sampling-check or --concurrency"
        )
    if max_samples is not None and max_samples < 1:
        raise runtime.UserError(f"--max-samples must be >= 1, got {max_samples}")
    if prompt is not None and "-" in prompt:  # `--prompt -`: one prompt per non-empty line of stdin
        prompt = [p for p in prompt if p != "-"] + [
            line.rstrip("\n") for line in sys.stdin if line.strip()
        ]
        if not prompt:
            raise runtime.UserError("no prompts on stdin")
    if not bench_files and not prefill_bench_file and prompt is None:
        prompts_file = prompts_file or TOY_PROMPTS
        if prompts_file == TOY_PROMPTS and not os.path.isfile(prompts_file):
            raise runtime.UserError(
                f"no prompts at {TOY_PROMPTS}: `git checkout -- toy-target` restores the toy's "
                "files, or pass --prompt"
            )
        prompt = read_prompts(prompts_file, prompt_field, max_samples or 3)[1]
    files = [
        (path, *read_prompts(path, prompt_field, max_samples)) for path in bench_files or []
    ]  # before loading
    if prefill_bench_file:
        docs = read_prompts(prefill_bench_file, prompt_field)[1]
    torch.manual_seed(seed)
    models = load(
        target,
        drafter,
        modes if bench_files else [mode, *compare] + (["sync"] if keep_ratio else []),
        device,
        dtype,
        attn,
        threads,
    )
    opts = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "seed": seed,
        "block_size": block_size,
        "coverage": coverage,
        "fanout": fanout,
        "cover": cover,
        "keep_ratio": keep_ratio,
        "chunk_size": chunk_size,
        "tie_tolerance": tie_tolerance,
        "compile": compile,
        "max_len": max_len,
        "lanes": lanes,
    }
    if prefill_bench_file:
        result = benches.prefill_bench(
            models,
            prefill_bench_file,
            docs,
            mode,
            list(keep_ratios),
            num_docs,
            max_samples or 10,
            {**opts, "keep_ratio": None},
            thinking,
        )
    elif sampling_check_samples:
        result = benches.sampling_check(
            models, prompt[0], mode, opts, thinking, sampling_check_samples
        )
    elif not bench_files:
        colour = not no_color and sys.stdout.isatty() and "NO_COLOR" not in os.environ
        summary = interactive(models, prompt, mode, opts, thinking, colour, compare)
        if plot and summary["stats"] is not None:
            title = f"{mode}, {len(prompt)} prompt(s)"
            path = pictures.draw_acceptance(
                plot, summary["stats"], summary["block_size"], title=title
            )
            print(
                f"wrote {path}: the acceptance histogram"
                + (" and hits / misses per verification outcome" if mode == "async" else "")
            )
        if trace:
            write_trace(
                models,
                decoding.encode(models[2], prompt[0], thinking, models[0].device),
                mode,
                opts,
                trace,
            )
        return summary
    elif concurrency:
        result = benches.concurrency_bench(models, files, modes, list(concurrency), opts, thinking)
    else:
        result = bench(models, files, modes, opts, thinking)
        if trace:  # the first prompt of the first file, in the first mode named
            write_trace(
                models,
                decoding.encode(models[2], files[0][2][0], thinking, models[0].device),
                modes[0],
                opts,
                trace,
            )
    command = (
        "python " + shlex.join(sys.argv) if sys.argv[0].endswith("decode.py") else None
    )  # None: called in-process
    result["env"] = {
        **models[4],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "command": command,
        "args": args,
    }
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(_finite(result), f, indent=1, ensure_ascii=False)
        print(f"wrote {out}")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("models")
    g.add_argument(
        "--target",
        help="target: HF hub name or folder (default: 'target' in the drafter's "
        f"train_args.json, else {TOY_TARGET})",
    )
    g.add_argument(
        "--drafter", default=TOY_DRAFTER, help=f"D3D drafter folder (default: {TOY_DRAFTER})"
    )
    g.add_argument("--device", help="cuda, cuda:1, cpu, ... (default: cuda if available, else cpu)")
    g.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="weights of both models (default: auto = bfloat16 where the device computes it natively: "
        "CUDA, or a CPU with AVX512-BF16/AMX; float32 elsewhere and for drafters trained in float32)",
    )
    g.add_argument(
        "--attn", default="sdpa", choices=["sdpa", "eager"], help="attention kernel (default: sdpa)"
    )
    g.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: 1 for a target under 20M parameters, "
        "like the toy; else torch's choice; use 1 on a CPU shared with other jobs)",
    )
    g = p.add_argument_group("prompts")
    g.add_argument(
        "--prompt",
        action="append",
        help="a prompt to answer (repeatable); '-' reads one per line of stdin",
    )
    g.add_argument(
        "--prompts-file",
        help=f"JSON Lines prompts to answer without --prompt (default: {TOY_PROMPTS})",
    )
    g.add_argument(
        "--prompt-field",
        help=f"JSON field of the prompt (default: first of {', '.join(PROMPT_FIELDS)})",
    )
    g.add_argument(
        "--max-samples",
        type=int,
        help="prompts per file (default: 3 interactive, all with --bench)",
    )
    g.add_argument(
        "--thinking",
        action="store_true",
        help="Qwen3 chat template with thinking on (default: off)",
    )
    g = p.add_argument_group("decoding")
    g.add_argument(
        "--mode",
        help=f"one of {', '.join(decoding.available_modes())} (default: sync on every device, "
        "shown beside async and the target; runtime.default_mode says why)",
    )
    g.add_argument(
        "--block-size", type=int, help="B, draft tokens per round (default: the drafter's)"
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    g.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens per answer at most (default: 128)"
    )
    g.add_argument(
        "--coverage",
        type=int,
        help="async: C, draft positions with rejection branches (default: d3d's)",
    )
    g.add_argument(
        "--fanout",
        type=int,
        help="async: F, candidate tokens per covered position (default: d3d's)",
    )
    g.add_argument(
        "--lanes",
        type=int,
        choices=[1, 2],
        help="async: 2 runs the packed pass beside verification (CUDA: "
        "a second stream; CPU: a second thread, each lane with half of --threads), 1 one after the other "
        "(default: 1 with --bench, where a mode ending in +2lanes names the other; else "
        "runtime.async_lanes: 1 on CUDA, 2 on a CPU for a target of 20M parameters or more). With --compile "
        "on CUDA, 2 is "
        "refused: the compiled passes' CUDA graphs share one memory pool",
    )
    g.add_argument(
        "--compile",
        nargs="?",
        const="whole",
        choices=["whole", "regional"],
        help="compile the "
        "fixed-shape passes (torch.compile, fullgraph): 'whole' (the flag alone) one graph per pass shape, "
        "CUDA graphs on a GPU; 'regional' one decoder layer compiled once and reused by every layer "
        "(compiles in a fraction of the time, runs slower: fast.compile_passes). Warmed up first, compile "
        "time reported apart; '+compiled' modes use it too (default: off; '+compiled': whole)",
    )
    g.add_argument(
        "--trace",
        metavar="PATH",
        help="after the run, decode the first prompt once more in --mode (with "
        "--bench: the first of --modes) and write its phases (draft, verify, packed_draft, ...) as a "
        "Chrome trace, a track for each CUDA stream or host thread: open it in ui.perfetto.dev",
    )
    g.add_argument(
        "--max-len",
        type=int,
        help="KV cache slots per model, kept for the whole run (default: the longest "
        "prompt + --max-new-tokens + the widest pass)",
    )
    g.add_argument(
        "--cover",
        choices=["first", "likely"],
        help="async: branch the first C positions or the C likeliest first rejections (default: d3d's)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of sampling (default: 0)")
    g.add_argument(
        "--sampling-check",
        dest="sampling_check_samples",
        type=int,
        metavar="N",
        help="lossless sampling, measured: N answers to the first prompt by target-only and by --mode, "
        "per-position distance between the two token distributions (needs --temperature)",
    )
    g = p.add_argument_group("benchmark (prints Table 1, writes --out)")
    g.add_argument(
        "--bench",
        dest="bench_files",
        nargs="+",
        metavar="FILE.jsonl",
        help="prompt files to benchmark",
    )
    g.add_argument(
        "--modes",
        nargs="+",
        help="speculative modes to compare with target-only (default: all); "
        "async:C,F[,likely] sets a branch budget, e.g. --modes sync async:0,2 async:12,2 async:12,1; "
        f"transformers baselines, greedy, off unless named: {', '.join(peers.BASELINES)} (plain generate, "
        "the drafter's model as a token-by-token assistant, prompt lookup; B draft tokens per round)",
    )
    g.add_argument(
        "--tie-tolerance",
        type=float,
        help="greedy check: a divergence whose target logit margin is "
        f"within this many logits is a near-tie, else an error (default: {forensics.TIE_EPS_MULTIPLE} x "
        "max(the dtype's machine epsilon, 2^-16) x the largest |logit| at that position)",
    )
    g.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        metavar="C",
        help="concurrent requests, e.g. 1 4 8 16: Table 2 (throughput per concurrency) instead of Table 1",
    )
    g.add_argument(
        "--out",
        default="runs/bench.json",
        help="benchmark figures, JSON (default: runs/bench.json)",
    )
    g = p.add_argument_group(
        "selective prefilling (lossy: the target reads only the kept prompt chunks)"
    )
    g.add_argument(
        "--keep-ratio", type=float, help="share of prompt chunks the target prefills (default: off)"
    )
    g.add_argument(
        "--chunk-size", type=int, default=64, help="prompt tokens per chunk (default: 64)"
    )
    g.add_argument(
        "--prefill-bench",
        dest="prefill_bench_file",
        metavar="FILE.jsonl",
        help="benchmark selective prefilling on long prompts built from this file's problems",
    )
    g.add_argument(
        "--keep-ratios",
        type=float,
        nargs="+",
        default=[1.0, 0.3, 0.2, 0.1],
        help="keep ratios for --prefill-bench (default: 1.0 0.3 0.2 0.1)",
    )
    g.add_argument(
        "--num-docs", type=int, default=12, help="problems per long prompt (default: 12)"
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--plot",
        metavar="PATH.png",
        help="the demo: draw the mode's acceptance-length "
        "histogram (async: and hits / misses per verification outcome) as a PNG; needs "
        "matplotlib (pip install -r requirements-plots.txt)",
    )
    g.add_argument(
        "--no-color",
        action="store_true",
        help="plain answers (default: ANSI colours on a terminal)",
    )
    return p


def cli_main(argv: list[str]) -> dict:
    """`python decode.py ...`: parse the flags, then main."""
    return main(**vars(build_parser().parse_args(argv)))


if __name__ == "__main__":
    cli.run(cli_main, sys.argv[1:])
