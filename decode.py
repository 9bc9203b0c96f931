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
from systems import benches, cli, decode_flags, decoding, explain, peers, pictures
from systems.decoding import Models, Plan, Run


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
    print(answer, f"(tau {stats['tau']:.2f}, the mean over its rounds)")
    return out, stats


# the toy's test prompts
TOY_PROMPTS = os.path.join(toy.SHIPPED, toy.DATA_FILES["test"])


# ---------------------------------------------------------------------------------------------
# Models and prompts


def load(flags: decode_flags.ModelFlags, modes: list[str]) -> Models:
    """The run's Models for `modes`: target, drafter, the target's tokenizer, EOS ids, its
    description.

    The drafter is None when only target-only decoding runs; flags.target None: the one the
    drafter was trained for (its train_args.json)."""
    target = flags.target
    drafter = flags.drafter
    need_drafter = any(m != "target" for m in modes)
    recipe = drafter_recipe(drafter, check=need_drafter or target is None)
    # a device this machine lacks: one line, before anything loads
    device = runtime.resolve_device(flags.device)
    dtype = flags.dtype
    if dtype in (None, "auto") and recipe.get("compute_dtype") == "float32":
        # trained in fp32 (the toy always is): decode in it too
        dtype = "float32"
    dtype = runtime.resolve_dtype(dtype, device)
    if target is None:
        # the target the drafter was trained for
        recorded = recipe.get("target", toy.SHIPPED)
        where = f"{os.path.join(drafter, 'train_args.json')}: target"
        on_hub = cli.looks_like_hub_name(recorded)
        target = runtime.find_recorded(recorded, where, must_exist=not on_hub)
        # the recorded target's folder, a toy's against its toy.json (a --target given,
        # check_args checked), before either model loads
        cli.check_model_folder("--target", target)
    draft_model = None
    if need_drafter:
        draft_model = d3d.Drafter.from_pretrained(drafter, dtype, device, flags.attn).eval()
    tok = runtime.load_tokenizer(target)
    if draft_model is not None:
        # before loading a large target for nothing
        runtime.check_tokenizer(draft_model, tok)
    model = runtime.load_causal_lm(target, dtype, device, attn_implementation=flags.attn).eval()
    num_params = sum(p.numel() for p in model.parameters())
    if device.type == "cpu" and not flags.threads and num_params < 20_000_000:
        # a tiny model's passes are too short to split between threads (the toy: ~2x faster)
        torch.set_num_threads(1)
    eos = getattr(model.generation_config, "eos_token_id", None)
    if not isinstance(eos, list):
        eos = [eos]
    eos = sorted({tok.eos_token_id, *eos} - {None})
    # the GPU's name, or the CPU's architecture and torch's threads
    threads = torch.get_num_threads()
    described = f"cpu ({platform.machine()}, {threads} thread{'s' * (threads > 1)})"
    if device.type == "cuda":
        described = torch.cuda.get_device_name(device)
    info = dict(device=described, dtype=str(dtype), attn=flags.attn, target=target)
    info.update(drafter=None, eos_token_id=eos, drafter_config=None)
    if draft_model is not None:
        info.update(drafter=drafter, drafter_config=dataclasses.asdict(draft_model.d3d_config))
    return Models(model, draft_model, tok, eos, info)


def drafter_recipe(drafter: str, check: bool) -> dict:
    """The drafter folder's train_args.json ({} without one); with `check` the folder must be
    a drafter's (the toy's: a hint to train it)."""
    if check and drafter == decode_flags.TOY_DRAFTER and not os.path.isdir(drafter):
        raise runtime.UserError(
            f"no drafter at {decode_flags.TOY_DRAFTER} — train the toy's drafter with "
            "`python train.py` (about 1½ min on 2 CPU cores), or pass --target "
            "and --drafter"
        )
    if check:
        cli.check_drafter_folder("--drafter", drafter)
    path = os.path.join(drafter, "train_args.json")
    if not os.path.isfile(path):
        return {}
    return cli.read_json("--drafter", path)


# ---------------------------------------------------------------------------------------------
# One prompt, decoded in front of the reader


def answer(models: Models, ids, mode: str, run: Run, caches, colour: bool) -> dict:
    """One prompt in the demo's mode: d3d.generate, its rounds streamed into the answer
    (explain.ColoredStream: accepted drafts green, the target's own tokens yellow), the
    answer printed. Returns the run's record of it (decoding.record)."""
    config, kwargs = decoding.request(mode, models, run, caches)
    # the answer streams as the rounds commit it, special tokens (EOS) left out
    text = functools.partial(models.tokenizer.decode, skip_special_tokens=True)
    stream = explain.ColoredStream(decode=text, colour=colour)
    drafter = decoding.drafter_for(config, models.drafter)
    out, stats = d3d.generate(models.target, drafter, ids, config, on_round=stream, **kwargs)
    print()
    return decoding.record(ids, out, stats)


def explain_prompt(models: Models, plan: Plan, run: Run) -> dict:
    """--explain: the first prompt decoded once in the plan's mode, every round described as it
    ends (explain.RoundPrinter): the draft and where it came from, what the target accepted and
    said, what was committed, in async the prepared outcomes and the one used, and what each
    KV cache held before and after. Then the answer."""
    tok = models.tokenizer
    prompt = plan.prompts[0]
    mode = plan.mode
    ids = decoding.encode(tok, prompt, plan.thinking, models.target.device)
    config, kwargs = decoding.request(mode, models, run)
    printer = explain.RoundPrinter(decode=tok.decode, block_size=models.block_size(config))
    # x_0 .. x_{p-1}: the prompt; x_p: the first token, the target's prefill's
    p = ids.shape[1]
    print(f"── prompt (x_0 .. x_{p - 1}): {prompt}")
    print(f"   prefilled into the KV caches; the target's prefill also gives x_{p}\n")
    drafter = decoding.drafter_for(config, models.drafter)
    out, stats = d3d.generate(models.target, drafter, ids, config, on_round=printer, **kwargs)
    new_tokens = out[0, p:].tolist()
    text = tok.decode(new_tokens, skip_special_tokens=True)
    print(
        f"\nx_{p} = {tok.decode(new_tokens[:1])!r} came from the target's prefill; "
        f"{printer.rounds} rounds committed the other {len(new_tokens) - 1} tokens"
    )
    if mode != "target":
        print(f"τ = {stats['tau']:.2f} tokens committed per round, the mean over all rounds")
    print(f"answer: {text}")
    return {"mode": mode, "answer": text, "new_tokens": new_tokens, "stats": stats}


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


def demo(args, models: Models, plan: Plan, run: Run) -> dict:
    """Answer each prompt with the plan's mode (answer: coloured by origin), then compare it
    with target-only decoding, and with the plan's `compare` modes, on the same prompts; with
    --trace, write_trace of the first prompt; with --plot, the acceptance histogram drawn."""
    colour = not args.no_color and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    mode = plan.mode
    modes = list(dict.fromkeys(["target", mode, *plan.compare]))
    tok = models.tokenizer
    # a bad prompt fails before any decoding
    all_ids = [decoding.encode(tok, p, plan.thinking, models.target.device) for p in plan.prompts]
    caches = decoding.prepare(models, run, all_ids, modes)
    # warm-up
    decoding.decode_prompt(models, all_ids[0], modes, run, caches, max_new_tokens=8)
    if colour:
        draft = explain.COLOURS["draft"]
        own = explain.COLOURS["target"]
        reset = explain.RESET
        print(f"{draft}accepted draft tokens{reset}, {own}the target's own tokens{reset}")
    records = collections.defaultdict(list)
    for i, (text, ids) in enumerate(zip(plan.prompts, all_ids)):
        print(f"\n── prompt {i + 1}/{len(plan.prompts)}: {text}")
        for m in modes:
            if m == mode:
                records[m].append(answer(models, ids, m, run, caches, colour))
            else:
                records[m].append(decoding.decode_prompt(models, ids, [m], run, caches)[m])
    block_size = models.block_size(run.config)
    summaries = benches.print_summary(models, records, plan, run)
    stats = None
    if mode != "target":
        # its rounds over every prompt, as pictures.draw_acceptance reads them
        stats = dict(summaries[mode])
        stats["accept_lengths"] = [n for r in records[mode] for n in r["accept_lengths"]]
        rounds = f"tokens committed per round, 1 .. {block_size + 1}"
        print(f"{mode}: acceptance histogram ({rounds}):")
        print(benches.histogram(stats["histogram"]))
    if plan.trace:
        decoding.write_trace(models, all_ids[0], mode, run, caches, plan.trace)
    if args.plot and stats is not None:
        title = f"{mode}, {len(all_ids)} prompt(s)"
        path = pictures.draw_acceptance(args.plot, stats, block_size, title=title)
        drawn = "the acceptance histogram"
        if mode == "async":
            drawn += " and hits / misses per verification outcome"
        print(f"wrote {path}: {drawn}")
    return {
        "summary": summaries[mode],
        "summaries": summaries,
        "block_size": block_size,
        "stats": stats,
        "answers": [tok.decode(r["new_tokens"], skip_special_tokens=True) for r in records[mode]],
    }


# ---------------------------------------------------------------------------------------------
# The flags, checked before anything loads


def check_args(args: dict) -> None:
    """Every flag in its range, every file it reads there and every file it writes free to
    write (cli.check_output), before anything loads."""
    cli.check_flags(args, decode_flags.GROUPS, decode_flags.NARROWER)
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
    # what --explain cannot go with: it describes one decode
    alone = ("bench_files", "prefill_bench_file", "sampling_check_samples", "concurrency")
    alone += ("trace", "plot")
    given = [decode_flags.FLAGS.get(n, cli.flag_name(n)) for n in alone if args[n] is not None]
    if args["explain"] and given:
        raise runtime.UserError(
            f"--explain describes one decode of the first prompt — drop {', '.join(given)}"
        )
    # what the run writes: a benchmark's figures (--out), a trace, a picture
    force = args["force"]
    if args["bench_files"] or args["prefill_bench_file"] or args["sampling_check_samples"]:
        cli.check_output("--out", args["out"], cli.BENCHMARK, force)
    cli.check_output("--trace", args["trace"], cli.TRACE, force)
    cli.check_output("--plot", args["plot"], cli.PICTURE, force)


def check_plan(args, plan: Plan, device_type: str) -> None:
    """What the modes of a run cannot do (an unknown mode, a bad async:C,F, two compiled lanes
    on CUDA), then the first combination of flags it cannot make (refusals: each with its
    one-line error, in the order tried), said before the models load."""
    for m in dict.fromkeys([plan.mode, *plan.compare, *plan.modes]):
        spec, flags = decoding.parse_mode(m)
        if spec == "async":
            compiled = args.compile or flags.get("compiled", False)
            runtime.async_lanes(device_type, compiled, flags.get("lanes", plan.lanes))
    mode = plan.mode
    bench = plan.bench_files
    baselines = ", ".join(m for m in plan.modes if m in peers.BASELINES)
    speculative = ", ".join(m for m in d3d.MODES if m != "target")
    lossy = args.temperature or args.keep_ratio is not None
    apart = args.prefill_bench_file or plan.samples or plan.levels
    refusals = [
        (
            mode in peers.BASELINES and not bench,
            f"{mode} is a benchmark baseline: run it with --bench FILE.jsonl --modes {mode}",
        ),
        (
            baselines and bench and lossy,
            f"{baselines} decode greedy with the full prompt: drop --temperature and "
            "--keep-ratio, or these modes",
        ),
        (
            bench and not plan.modes,
            f"--modes: name speculative modes ({speculative}); target-only always runs",
        ),
        (
            plan.levels is not None and not bench,
            f"--concurrency takes sizes >= 1 and goes with --bench, got {args.concurrency}",
        ),
        (
            plan.samples is not None and (not args.temperature or bench),
            "--sampling-check N (N >= 2) samples answers: give it --temperature > 0, without "
            "--bench",
        ),
        (
            args.trace and apart,
            "--trace goes with the demo or with --bench (Table 1), not with --prefill-bench, "
            "--sampling-check or --concurrency",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise runtime.UserError(message)


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
    return decoding.read_prompts(path, args.prompt_field, count)[1]


def plan_run(args) -> Plan:
    """What a run decodes: its modes, lanes and device, every combination the flags cannot make
    refused (check_plan), then the prompts and prompt files it reads, read before anything
    loads."""
    speculative = [m for m in d3d.MODES if m != "target"]
    mode = args.mode
    modes = args.modes
    bench_files = args.bench_files
    prefill = args.prefill_bench_file
    if prefill:
        # the paper pairs selective prefilling with sequential (sync) speculative decoding
        mode = mode or "sync"
        modes = [mode]
        bench_files = None
    # a word that is no device: one line here; a device this machine lacks: load's check
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device is not None:
        device_type = runtime.parse_device(args.device).type
    # the demo without --mode: the rule's mode on this device, beside the other one and the
    # target (--explain: that mode alone)
    compare = []
    why = None
    demo = not bench_files and not prefill and not args.sampling_check_samples
    if mode is None and demo:
        mode, why = runtime.default_mode(device_type)
        if not args.explain:
            compare = [m for m in speculative if m != mode]
    if mode is None:
        mode = speculative[-1]
    if modes is None:
        modes = speculative
    modes = [m for m in modes if m != "target"]
    lanes = args.lanes
    if lanes is None and bench_files:
        # a benchmark names +2lanes itself; else the rule (runtime.py)
        lanes = 1
    plan = Plan(mode, compare, modes, bench_files, lanes, demo, args.thinking, why=why)
    plan.samples = args.sampling_check_samples
    plan.levels = args.concurrency
    plan.trace = args.trace
    check_plan(args, plan, device_type)
    if not bench_files and not prefill:
        plan.prompts = demo_prompts(args)
    plan.files = []
    for path in bench_files or []:
        plan.files.append((path, *decoding.read_prompts(path, args.prompt_field, args.max_samples)))
    if prefill:
        # every problem of the file: the long prompts are made of them
        plan.files.append((prefill, *decoding.read_prompts(prefill, args.prompt_field)))
        plan.keep_ratios = list(args.keep_ratios)
        plan.num_docs = args.num_docs
        if args.max_samples is not None:
            plan.num_long_prompts = args.max_samples
    return plan


def main(args: argparse.Namespace) -> dict:
    """decode.py with parsed flags (build_parser().parse_args(argv)): the demo, --explain,
    or a benchmark. Every flag is checked before anything loads. Returns what the run printed,
    as numbers; a benchmark also writes it to --out."""
    check_args(vars(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = plan_run(args)
    torch.manual_seed(args.seed)
    loaded_modes = [plan.mode, *plan.compare]
    if plan.bench_files:
        loaded_modes = plan.modes
    elif args.keep_ratio:
        # selective prefilling scores the prompt with the drafter, target-only decoding's too
        loaded_modes.append("sync")
    models = load(cli.settings_of(decode_flags.ModelFlags, vars(args)), loaded_modes)
    # the DecodeConfig every mode starts from: its flags, the lanes the plan chose
    config = cli.settings_of(d3d.DecodeConfig, vars(args), decode_flags.NOT_FLAGS, lanes=plan.lanes)
    run = Run(config, args.seed, args.compile, args.max_len, args.tie_tolerance)
    if args.explain:
        return explain_prompt(models, plan, run)
    if plan.demo:
        return demo(args, models, plan, run)
    # the benchmark the plan names
    if plan.keep_ratios is not None:
        result = benches.prefill_bench(models, plan, run)
    elif plan.samples:
        result = benches.sampling_check(models, plan, run)
    elif plan.levels:
        # the paper's Table 2
        result = benches.concurrency_bench(models, plan, run)
    else:
        result = benches.table1(models, plan, run)
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


def build_parser() -> argparse.ArgumentParser:
    """decode.py's flags, a group per settings dataclass."""
    p = cli.Parser(
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_groups(p, decode_flags.GROUPS, later=decode_flags.LATER)
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
