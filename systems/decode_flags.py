"""decode.py's flags: a dataclass per group of `python decode.py --help`, each field one flag
(cli.add_settings), beside d3d.DecodeConfig's own fields; GROUPS names them in the order --help
shows them, NARROWER and LATER where the driver takes less than a field or decides its default
when it runs."""

from __future__ import annotations

import dataclasses

import d3d
from runtime import Range
from systems import cli, decoding, forensics, peers

# the toy's default drafter
TOY_DRAFTER = "runs/toy/drafter"


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
        cli.DTYPE_RANGE,
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
        None, f"JSON field of the prompt (default: first of {', '.join(decoding.PROMPT_FIELDS)})"
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
        f"one of {', '.join(d3d.MODES)}, or a spec as --modes takes (default: "
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
    """What the demo shows besides its answers, and whether a run writes over files it did not
    write."""

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
    force: bool = cli.flag(
        False,
        "write --out, --trace and --plot over files decode.py did not write (default: refuse, "
        "before anything loads); never into the repository's toy-target/",
        Range(bool),
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
# {field: Range} and {field: its flag} where it is not --field-name, as check_ranges takes them
RANGES, FLAGS = cli.flag_ranges(GROUPS, NARROWER)
