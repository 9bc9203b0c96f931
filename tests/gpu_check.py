"""The GPU check: the one script to run first on a GPU machine. About 5 minutes on one H100/H200,
nothing downloaded.

    python tests/gpu_check.py OUT_DIR           # CUDA: the paper's shapes (Qwen3-8B, two drafters)
    python tests/gpu_check.py --tiny OUT_DIR    # anywhere: toy sizes on the CPU in about a minute

Each step runs in its own process under its own time limit and writes OUT_DIR/<n>-<name>.txt as it
finishes (first line: PASSED, FAILED or SKIPPED); the script prints every step's file and
OUT_DIR/summary.txt, and exits non-zero if any check failed or a step crashed or ran out of time.
What to paste back: everything it prints.

[0] environment: versions, the GPU, a one-op torch.compile on the device, a one-op CUDA graph
    replayed.
[1] per-pass truth at full depth, no inductor: random bf16 weights built on the device, the
    Qwen3-8B target (36 layers) with two drafters, Qwen3-1.7B's shape (28 layers) and a 31-layer
    one of the 8B's width; every pass shape of a decode (B = 16) captured as a CUDA graph in a pool
    of its own, replayed 20 times, timed by events: ms, TB/s and TFLOP/s achieved; verification
    and the packed pass replayed side by side on two streams (the floor of an async hit round);
    the sync and async round in target steps, and the speedup each gives at tau = 4, 6, 8, 10.
[2] the shared-pool question alone: a verification graph and a packed-pass graph captured into
    one pool (the second after the first's outputs are freed, as torch.compile's CUDA-graph trees
    do) or into two, replayed together on two streams or one after the other: max |delta| and
    argmax mismatches against two pools one after the other.
[3] the project's compiled path (fast.compile_passes): two full-width layers, B = 4, a scripted
    drafter that is right except at every 7th position (so rejection hits and full-acceptance
    hits happen; none of the latter fails): compile seconds per mode; after the warm-up a
    recompile is an error and no CUDA graph may be skipped; compiled decoding equals eager
    target-only or differs only at near-ties (forensics.classify_divergence); two compiled lanes
    against one (runtime.async_lanes refuses them; lifted here for this comparison only);
    regional compilation (fast.compile_passes(regional=True)) beside it: compile seconds, ms per
    token, equal to eager; the attention kernel each pass shape uses; a trace of a few async
    rounds in two lanes (OUT_DIR/trace-async.json, the project's spans a track per stream;
    OUT_DIR/profile-async.json, torch.profiler's, with the kernels where it records them).
[4] if time is left: the CUDA tests (SANITIZER_TESTS: tests/test_cuda.py, where every test that
    needs CUDA lives) under TORCH_CUDA_SANITIZER=1 (a tensor read on one stream while another
    writes it is an error).
--tiny: the same steps at toy sizes; what needs CUDA (graphs, pools, streams, events, all of [2],
[4]) is skipped, each skip with its reason; [1] times every pass shape on the host clock; [3]
traces with backend="eager".
"""

from __future__ import annotations

# torch and the project are imported inside the steps: the parent process only starts them, each in
# a process of its
# own (a step that hangs or crashes the CUDA context takes nothing else with it)
import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# n: (name, time limit in s with --tiny, without). A --tiny limit is a net for a hung step, ten
# times what the step takes on a slow quiet CPU (the suite runs --tiny, on machines busy with
# other work); the limits without --tiny are what the GPU run's five minutes allow
STEPS = {
    0: ("environment", 400, 60),
    1: ("passes", 300, 150),
    2: ("shared-pool", 120, 60),
    3: ("compiled-path", 700, 240),
    4: ("sanitizer", 120, None),  # None: what is left of --budget
}
BUDGET = 320.0  # seconds for all steps without --tiny; with it, the sum of the --tiny limits
B_FULL, B_COMPILED = 16, 4  # block sizes of steps [1]-[2] and [3]
PAST = {
    False: (512, 1024),
    True: (32, 512),
}  # by --tiny: tokens in a cache while a pass is timed, and its slots
TAUS, HIT_RATE = (
    (4, 6, 8, 10),
    0.7,
)  # the speedup table's acceptance lengths and assumed async hit rate
MISS_EVERY = 7  # step [3]'s scripted drafter misses the token at every position divisible by this
QWEN3_8B = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=36,
    tie_word_embeddings=False,
)
QWEN3_1_7B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    num_hidden_layers=28,
    tie_word_embeddings=True,
)
TOY = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


# --------------------------------------------------------------------------------------------------
# The parent: each step in its own process, its file written as it finishes


def run_steps(out: str, tiny: bool, steps: list[int], budget: float, device: str | None) -> int:
    os.makedirs(out, exist_ok=True)
    start, rows = time.perf_counter(), []
    for n in steps:
        name, tiny_limit, limit = STEPS[n]
        left = budget - (time.perf_counter() - start)
        limit = min(tiny_limit if tiny else (limit or left), left)
        path = os.path.join(out, f"{n}-{name}.txt")
        if limit < 10:
            status, seconds = (
                f"SKIPPED (no time left: {left:.0f} s of --budget {budget:.0f} s)",
                0.0,
            )
            write_step_file(path, n, name, status, "")
        else:
            status, seconds = run_step(out, n, name, path, tiny, limit, device)
        with open(path) as f:
            print(f.read(), end="", flush=True)
        rows.append((status, f"[{n}] {name:<14}{status.split(' (')[0]:<9}{seconds:6.0f} s  {path}"))
    failed = sum(status.startswith("FAILED") for status, _ in rows)
    summary = (
        "\n".join(
            [
                "gpu_check "
                + ("--tiny " if tiny else "")
                + f"{out}: {len(rows)} steps, {failed} failed, "
                f"{time.perf_counter() - start:.0f} s"
            ]
            + [row for _, row in rows]
        )
        + "\n"
    )
    with open(os.path.join(out, "summary.txt"), "w") as f:
        f.write(summary)
    print("\n" + summary, end="")
    return 1 if failed else 0


def run_step(out, n, name, path, tiny, limit, device) -> tuple[str, float]:
    """Step n in a process of its own, its output into `path`; its status from the result file it
    writes at its end (none: it crashed or ran out of time, and what it printed so far stays)."""
    result_path = os.path.join(out, f"{n}-{name}.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    cmd = (
        [sys.executable, os.path.abspath(__file__), out, "--step", str(n)]
        + (["--tiny"] if tiny else [])
        + (["--device", device] if device else [])
    )
    start = time.perf_counter()
    with open(path, "w") as log:
        try:
            code = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit, cwd=ROOT
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.perf_counter() - start
    if os.path.exists(result_path):
        with open(result_path) as f:
            status = json.load(f)["status"]
    elif code is None:
        status = f"FAILED (ran past its time limit of {limit:.0f} s)"
    else:
        status = (
            f"FAILED (the step's process ended with exit code {code} before writing its result)"
        )
    with open(path) as f:
        write_step_file(path, n, name, status, f.read(), seconds)
    return status, seconds


def write_step_file(path, n, name, status, body, seconds=0.0):
    with open(path, "w") as f:
        f.write(f"[{n}] {name}: {status}, {seconds:.0f} s\n{body}")


class Report:
    """One step's findings, printed as they come (the parent keeps the lines): checks (a failed one
    fails the step), skips with their reasons, and numbers kept in the step's result file."""

    def __init__(self):
        self.checks, self.skips, self.numbers = [], [], {}

    def line(self, text: str = "") -> None:
        print(text, flush=True)

    def check(self, name: str, ok, detail: str = "") -> bool:
        self.checks.append((name, bool(ok)))
        self.line(f"  {'ok' if ok else 'FAILED':<7}{name}" + (f": {detail}" if detail else ""))
        return bool(ok)

    def skip(self, name: str, why: str) -> None:
        self.skips.append(name)
        self.line(f"  {'skip':<7}{name}: {why}")

    @contextlib.contextmanager
    def guarded(self, name: str):
        """An exception inside fails the check `name` with its message, and the step goes on."""
        try:
            yield
        # a check that crashed is a failed check, with its reason
        except Exception as error:  # noqa: BLE001
            self.check(name, False, f"{type(error).__name__}: {error}")

    def status(self) -> str:
        failed = [name for name, ok in self.checks if not ok]
        if failed:
            return f"FAILED ({len(failed)} of {len(self.checks)} checks: {'; '.join(failed)})"
        if not self.checks:
            return "SKIPPED (" + "; ".join(self.skips) + ")"
        return f"PASSED ({len(self.checks)} checks" + (
            f", {len(self.skips)} skipped)" if self.skips else ")"
        )


# --------------------------------------------------------------------------------------------------
# What the steps share


def build(shape: dict, device, dtype, seed: int, layers: int | None = None, init: float = 0.02):
    """A Qwen3 causal LM of `shape`, random weights made directly in `dtype` on `device` (an 8B
    model built in fp32 on the host would take minutes)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = {**shape, **({"num_hidden_layers": layers} if layers else {})}
    config = Qwen3Config(
        max_position_embeddings=4096, attn_implementation="sdpa", initializer_range=init, **shape
    )
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return Qwen3ForCausalLM(
                config
            ).eval()  # rotary frequencies stay fp32, as from_pretrained keeps them
    finally:
        torch.set_default_dtype(default)


def as_drafter(model, block_size: int):
    """A D3D drafter of `model`, for a tokenizer of all but its last 10 ids (MASK: the first of
    those)."""
    import d3d

    rows = model.get_output_embeddings().weight.shape[0]

    class Tokenizer:  # what make_drafter reads of a tokenizer: its size and its table
        def __len__(self):
            return rows - 10

        def get_vocab(self):
            return {f"t{i}": i for i in range(rows - 10)}

        def convert_tokens_to_ids(self, token):
            return None

    return d3d.make_drafter(
        model, tokenizer=Tokenizer(), block_size=block_size, target_vocab_size=rows
    )


def setting(tiny: bool, device: str | None):
    import torch

    cuda = torch.cuda.is_available() and device != "cpu" and not (tiny and device is None)
    device = torch.device(device or ("cuda" if cuda else "cpu"))
    return (
        device,
        device.type == "cuda",
        (torch.bfloat16 if device.type == "cuda" else torch.float32),
    )


def pass_inputs(cache, q: int, vocab: int, seed: int = 0):
    """ids, positions and a causal mask over all slots for a pass of q tokens after what `cache`
    holds (a pass's cost does not depend on which slots its mask opens: attention reads every
    slot)."""
    import torch
    import torch.nn.functional as F

    import runtime

    device = cache.device
    ids = torch.randint(0, vocab - 10, (1, q), generator=torch.Generator().manual_seed(seed)).to(
        device
    )
    mask = F.pad(
        runtime.causal_mask(q, cache.length, device), (0, cache.max_len - cache.length - q)
    )
    return ids, cache.positions(q, device), mask


def fixed_pass(cache, q: int, vocab: int):
    """A function running one pass of q tokens at the cache's current length and moving the cache
    back, so that every call (or graph replay) writes the same slots."""
    ids, positions, mask = pass_inputs(cache, q, vocab)

    def run():
        out = cache.forward(ids, positions, mask)
        for layer in cache.hf.layers:
            layer.cumulative_length.sub_(q)  # the StaticCache moved by q: back, on the device
        return out

    return run


def capture(fn, pool=None):
    """fn() captured as a CUDA graph in `pool` (default: a pool of its own), after warm-up calls on
    a side stream, as torch.cuda.graph asks. Returns the graph and the output fn made during capture
    (it lives in the pool)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool if pool is not None else torch.cuda.graph_pool_handle()):
        out = fn()
    return graph, out


def time_ms(run, cuda: bool, repeats: int = 20) -> float:
    """Mean ms of `run()` (a graph's replay on CUDA, timed by events; elsewhere a call, on the host
    clock)."""
    import torch

    run()
    if not cuda:
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        return 1e3 * (time.perf_counter() - start) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def side_by_side(first, second) -> None:
    """first() on a high-priority stream and second() on another, both after the current stream's
    work; the current stream waits for both (as _Overlap.both)."""
    import torch

    main = torch.cuda.current_stream()
    streams = (torch.cuda.Stream(priority=-1), torch.cuda.Stream())
    for stream, fn in zip(streams, (first, second)):
        stream.wait_stream(main)  # the inputs the current stream made
        with torch.cuda.stream(stream):
            fn()
    for stream in streams:
        main.wait_stream(stream)  # join: what both made is read on the current stream


# --------------------------------------------------------------------------------------------------
# [0] environment


def step_environment(report: Report, tiny: bool, device: str | None, out: str) -> None:
    import torch
    import transformers

    device, cuda, _ = setting(tiny, device)
    report.line(
        f"python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {platform.machine()}, {os.cpu_count()} CPU cores"
    )
    report.numbers["versions"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if cuda:
        props = torch.cuda.get_device_properties(device)
        report.line(
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} "
            f"SMs, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, capability "
            f"{props.major}.{props.minor}"
        )
    else:
        report.line(
            f"device {device}: "
            f"{'no CUDA' if not torch.cuda.is_available() else 'CUDA not used (--tiny)'}; "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
        )
    x = torch.arange(8, dtype=torch.float32, device=device)
    with report.guarded("a one-op torch.compile on the device"):
        start = time.perf_counter()
        y = torch.compile(lambda t: t * 2 + 1, fullgraph=True)(x)
        report.check(
            "a one-op torch.compile on the device",
            torch.equal(y, x * 2 + 1),
            f"{time.perf_counter() - start:.1f} s",
        )
    if not cuda:
        return report.skip("a one-op CUDA graph replayed", "needs CUDA")
    with report.guarded("a one-op CUDA graph replayed"):
        graph, y = capture(lambda: x * 2 + 1)
        x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        report.check("a one-op CUDA graph replayed", torch.equal(y, x * 2 + 1))


# --------------------------------------------------------------------------------------------------
# [1] per-pass truth at full depth


def pass_shapes(block_size: int) -> dict:
    """Tokens per pass of a decode (fast.py lists them): target step, verify; sync draft, fallback
    draft, packed."""
    import d3d

    coverage, fanout = d3d.default_budget(block_size)
    return {
        "target step": 1,
        "verify": block_size + 1,
        "sync draft": 2 * block_size + 1,
        "fallback draft": 1 + block_size,
        "packed pass": 1 + block_size + (coverage * fanout + 1) * (1 + block_size),
    }


def cost(model, q: int, logits_rows: int, dtype, slots: int) -> tuple[float, float]:
    """Bytes read and FLOPs of a pass of q tokens through HF causal LM `model`: its decoder layers'
    weights (and the output layer's where the pass makes `logits_rows` rows of logits) and every
    slot of its KV cache; 2 FLOPs a weight a token, 4 an attention score a head dimension."""
    config, size = model.config, dtype.itemsize
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    head_params = model.get_output_embeddings().weight.numel() if logits_rows else 0
    kv_bytes = (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * slots * size
    )
    attention = (
        4 * q * slots * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    )
    flops = 2 * (q * layer_params + logits_rows * head_params) + attention
    return (layer_params + head_params) * size + kv_bytes, flops


TARGET_PASSES = ("target step", "verify")


def step_passes(report: Report, tiny: bool, device: str | None, out: str) -> None:
    import torch

    import runtime

    device, cuda, dtype = setting(tiny, device)
    block_size, shapes, (past, slots) = B_FULL, pass_shapes(B_FULL), PAST[tiny]
    repeats = 5 if tiny else 20
    if not cuda:
        torch.set_num_threads(
            1
        )  # toy passes: threads would only wait on each other (and on other jobs)
    if tiny:
        models = {
            "target (toy, 6 layers)": build(TOY, device, dtype, 0, 6),
            "drafter (toy, 4 layers)": build(TOY, device, dtype, 1, 4),
            "drafter (toy, 5 layers)": build(TOY, device, dtype, 2, 5),
        }
    else:
        models = {
            "Qwen3-8B target (36 layers)": build(QWEN3_8B, device, dtype, 0),
            "Qwen3-1.7B drafter (28 layers)": build(QWEN3_1_7B, device, dtype, 1),
            "8B-width drafter (31 layers)": build(QWEN3_8B, device, dtype, 2, 31),
        }
    (target_name, target), *drafters = models.items()
    vocab = target.config.vocab_size
    report.line(
        f"{device}, {dtype}, B = {block_size}, {past} tokens in each cache of {slots} slots; "
        + (
            f"CUDA graphs, each in a pool of its own, {repeats} replays timed by events"
            if cuda
            else f"host clock, {repeats} calls (no CUDA: no graphs)"
        )
    )
    report.line(f"{'model':<32}{'pass':<16}{'tokens':>7}{'ms':>10}{'TB/s':>8}{'TFLOP/s':>9}")
    times, graphs = {}, {}
    for name, hf in models.items():
        is_target = hf is target
        model = hf if is_target else as_drafter(hf, block_size)
        cache = runtime.KVCache(model, slots)
        runtime.prefill(cache, pass_inputs(cache, past, vocab)[0])
        jobs = [
            (key, fixed_pass(cache, q, vocab), q, *cost(hf, q, q if is_target else 0, dtype, slots))
            for key, q in shapes.items()
            if (key in TARGET_PASSES) == is_target
        ]
        if not is_target:  # a draft's B block rows, projected to the vocabulary after its pass
            hidden = torch.zeros(block_size, hf.config.hidden_size, dtype=dtype, device=device)
            head = hf.get_output_embeddings().weight.numel()
            jobs.append(
                (
                    "head",
                    lambda m=model, h=hidden: m.logits(h),
                    block_size,
                    head * dtype.itemsize,
                    2 * block_size * head,
                )
            )
        for label, fn, tokens, nbytes, flops in jobs:
            with report.guarded(f"{name}: {label} timed"), torch.no_grad():
                graph = capture(fn)[0] if cuda else None
                ms = times[(name, label)] = time_ms(graph.replay if cuda else fn, cuda, repeats)
                graphs[(name, label)] = graph
                report.line(
                    f"{name[:31]:<32}{label:<16}{tokens:>7}{ms:10.3f}{nbytes / ms / 1e9:8.2f}"
                    f"{flops / ms / 1e9:9.1f}"
                )
    report.numbers["ms"] = {f"{m} | {p}": v for (m, p), v in times.items()}
    expected = len(TARGET_PASSES) + (len(shapes) - len(TARGET_PASSES) + 1) * len(drafters)
    report.check("every pass shape timed", len(times) == expected, f"{len(times)} of {expected}")
    step_ms = times.get((target_name, "target step"))
    for name, _ in drafters:
        both = None
        verify_graph, packed_graph = (
            graphs.get((target_name, "verify")),
            graphs.get((name, "packed pass")),
        )
        if not cuda:
            report.skip(f"{name}: verification beside the packed pass", "two streams need CUDA")
        elif verify_graph is not None and packed_graph is not None:
            with report.guarded(f"{name}: verification beside the packed pass"):
                both = times[(name, "both")] = time_ms(
                    lambda: side_by_side(verify_graph.replay, packed_graph.replay), cuda
                )
                report.line(
                    f"{name}: verify and packed pass on two streams {both:.3f} ms (one after the "
                    f"other {times[(target_name, 'verify')] + times[(name, 'packed pass')]:.3f} ms)"
                )
        if step_ms:
            speedup_table(report, name, times, target_name, step_ms, both)


def speedup_table(
    report: Report, name: str, times: dict, target_name: str, step_ms: float, both
) -> None:
    """The rounds in target steps and the speedup they give at each tau (rounds from the passes
    above; host work and small kernels left out: an upper bound). Async: a hit round is verify
    beside the packed pass, a miss adds a fallback draft; hit rate HIT_RATE assumed, and 1.0 as the
    ceiling."""
    t = lambda key: times.get((name, key), float("nan"))  # noqa: E731
    verify, head = times.get((target_name, "verify"), float("nan")), t("head")
    rounds = {
        "sync": t("sync draft") + head + verify,
        "async, 1 lane": verify
        + t("packed pass")
        + head
        + (1 - HIT_RATE) * (t("fallback draft") + head),
    }
    if both is not None:
        rounds["async, 2 lanes"] = both + head + (1 - HIT_RATE) * (t("fallback draft") + head)
        rounds["async, 2 lanes, every hit"] = both + head
    report.line(
        f"{name}: round in target steps ({step_ms:.3f} ms), speedup at tau = "
        + ", ".join(map(str, TAUS))
        + f" (async hit rate {HIT_RATE:.0%} unless said)"
    )
    for label, ms in rounds.items():
        speedups = "  ".join(f"{tau * step_ms / ms:5.2f}x" for tau in TAUS)
        report.line(f"  {label:<28}{ms / step_ms:6.2f} steps   {speedups}")
    report.numbers.setdefault("rounds", {})[name] = {k: v / step_ms for k, v in rounds.items()}


# --------------------------------------------------------------------------------------------------
# [2] the shared-pool question


def step_shared_pool(report: Report, tiny: bool, device: str | None, out: str) -> None:
    import torch

    import runtime

    device, cuda, dtype = setting(tiny, device)
    if not cuda:
        return report.skip("one graph pool for two streams", "graph pools and streams need CUDA")
    target = build(QWEN3_8B, device, dtype, 0, 4)
    drafter = as_drafter(build(QWEN3_1_7B, device, dtype, 1, 4), B_FULL)
    shapes = pass_shapes(B_FULL)
    past, slots = PAST[tiny]
    caches = runtime.Caches.make(target, drafter, slots)
    for cache in (caches.target, caches.drafter):
        runtime.prefill(cache, pass_inputs(cache, past // 2, target.config.vocab_size)[0])
    passes = {
        "verify": fixed_pass(caches.target, shapes["verify"], target.config.vocab_size),
        "packed": fixed_pass(caches.drafter, shapes["packed pass"], target.config.vocab_size),
    }
    with torch.no_grad():
        outputs = {
            k: fn().clone() for k, fn in passes.items()
        }  # static buffers, outside every pool

        def into(key):
            def run():
                outputs[key].copy_(
                    passes[key]()
                )  # the pass's own output is freed at the end: back to the pool

            return run

        truth_graphs = {k: capture(into(k))[0] for k in passes}
        shared = torch.cuda.graph_pool_handle()
        shared_graphs = {
            k: capture(into(k), shared)[0] for k in passes
        }  # packed captured after verify's freed
        for graph in truth_graphs.values():
            graph.replay()
        truth = {k: v.clone() for k, v in outputs.items()}
        truth_argmax = {
            "verify": truth["verify"].argmax(-1),
            "packed": drafter.logits(truth["packed"]).argmax(-1),
        }
        report.line(
            f"4 layers each at full width, {dtype}; verify {shapes['verify']} tokens, packed pass "
            f"{shapes['packed pass']}; 20 replays each against two pools one after the other"
        )
        for label, graphs, together in (
            ("two pools, together", truth_graphs, True),
            ("one pool, one after the other", shared_graphs, False),
            ("one pool, together", shared_graphs, True),
        ):
            worst, mismatches = {"verify": 0.0, "packed": 0.0}, {"verify": 0, "packed": 0}
            for _ in range(20):
                if together:
                    side_by_side(graphs["verify"].replay, graphs["packed"].replay)
                else:
                    graphs["verify"].replay()
                    graphs["packed"].replay()
                torch.cuda.synchronize()
                for k in passes:
                    worst[k] = max(
                        worst[k], (outputs[k].float() - truth[k].float()).abs().max().item()
                    )
                    got = (
                        outputs[k].argmax(-1)
                        if k == "verify"
                        else drafter.logits(outputs[k]).argmax(-1)
                    )
                    mismatches[k] += int((got != truth_argmax[k]).sum())
            report.line(
                f"  {label:<32}max |delta| verify {worst['verify']:.3g}, packed "
                f"{worst['packed']:.3g}; "
                f"argmax mismatches verify {mismatches['verify']}, packed {mismatches['packed']}"
            )
            report.numbers[label] = {"max_abs_delta": worst, "argmax_mismatches": mismatches}
    pools = report.numbers["two pools, together"]
    report.check(
        "two pools replayed together equal one after the other",
        max(pools["max_abs_delta"].values()) == 0,
        "a pool each, as the passes of step [3] need",
    )


# --------------------------------------------------------------------------------------------------
# [3] the project's compiled path


def oracle_drafter(drafter, reference_len: int):
    """`drafter` with its outputs replaced by a script in tensor operations (so its passes compile
    and capture; its KV cache moves as usual): the draft for absolute position P is reference[P]
    (the target's own greedy tokens, set into .reference), except where P % MISS_EVERY == 0: there a
    wrong token, with reference[P] as the runner-up (a rejection branch can catch it). A MASK at P
    drafts P; a causal token at P drafts P + 1 (d_1 from the causal head). Its "hidden states" are
    the scripted logits, which its `logits` returns as they are."""
    import torch

    import d3d

    class Oracle(d3d.Drafter):
        def __init__(self):
            super().__init__(drafter.model, drafter.d3d_config)
            self.register_buffer(
                "reference", torch.zeros(reference_len, dtype=torch.long, device=drafter.device)
            )

        def hidden_states(self, ids, positions, mask, cache=None):
            super().hidden_states(ids, positions, mask, cache)  # the cache moves
            config = self.d3d_config
            drafts = torch.where(ids == config.mask_token_id, positions, positions + 1)
            right = self.reference[drafts.clamp(max=reference_len - 1)]
            miss = drafts % MISS_EVERY == 0
            drafted = torch.where(
                miss, (right + 1) % config.mask_token_id, right
            )  # never MASK, never `right`
            logits = torch.zeros(*ids.shape, config.target_vocab_size, device=ids.device)
            logits.scatter_(-1, drafted[..., None], 10.0)
            return logits.scatter_add(-1, right[..., None], 5.0 * miss[..., None].float())

        def logits(self, hidden):
            return hidden.float()

    return Oracle()


def attention_ops(passes: dict) -> dict:
    """{label: the scaled-dot-product attention ops an eager call of passes[label]() dispatches to},
    from one torch.profiler session (host-side ops, each pass inside a record_function of its
    label)."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for label, fn in passes.items():
            with torch.profiler.record_function(label):
                fn()
    events = prof.events()
    found = {}
    for label in passes:
        span = next(e.time_range for e in events if e.name == label)
        names = {
            e.name
            for e in events
            if "scaled_dot_product" in e.name and span.start <= e.time_range.start <= span.end
        }
        found[label] = sorted(n for n in names if n.startswith("aten::_")) or sorted(
            names
        )  # the chosen backend
    return found


def step_compiled(report: Report, tiny: bool, device: str | None, out: str) -> None:
    import torch
    from torch._dynamo.utils import counters

    import d3d
    import runtime

    device, cuda, dtype = setting(tiny, device)
    block_size, max_new = B_COMPILED, 32
    target_shape, drafter_shape = (TOY, TOY) if tiny else (QWEN3_8B, QWEN3_1_7B)
    target = build(
        target_shape, device, dtype, 0, 2, init=0.2
    )  # large weights: decisive logits, few near-ties
    base = as_drafter(build(drafter_shape, device, dtype, 1, 2), block_size)
    prompts = [
        torch.randint(
            0, base.d3d_config.mask_token_id, (1, n), generator=torch.Generator().manual_seed(n)
        ).to(device)
        for n in (5, 17, 33)
    ]
    reference_len = max(p.shape[1] for p in prompts) + max_new + 4 * block_size
    drafter = oracle_drafter(base, reference_len)
    eager = [
        d3d.generate(
            target, None, prompt, max_new_tokens=reference_len - prompt.shape[1], mode="target"
        )[0][0].tolist()
        for prompt in prompts
    ]  # target-only greedy tokens: the reference, and the oracle's script
    backend = "eager" if tiny else "inductor"
    report.line(
        f"{device}, {dtype}, 2 layers each (target {target_shape['hidden_size']} wide, drafter "
        f"{drafter_shape['hidden_size']}), B = {block_size}, {len(prompts)} prompts x {max_new} "
        f"tokens, backend {backend}" + (", mode reduce-overhead (CUDA graphs)" if cuda else "")
    )
    need = runtime.cache_len(reference_len, max_new, block_size, *d3d.default_budget(block_size))
    setup = (target, drafter, prompts, eager, max_new)
    torch._dynamo.reset()
    counters.clear()
    caches = compiled_caches(report, setup, need, backend, regional=False)
    torch._dynamo.config.error_on_recompile = True  # from here a recompile raises
    runs = {}
    with report.guarded("compiled decoding after the warm-up"):
        runs = decode_each(
            setup,
            caches,
            (
                ("target", "target", 1),
                ("sync", "sync", 1),
                ("async, 1 lane", "async", 1),
                ("async, 2 lanes", "async", 2),
            ),
        )
        report.check("no recompile after the warm-up", True)
    torch._dynamo.config.error_on_recompile = False
    skips = counters["inductor"].get("cudagraph_skips", 0)
    report.check("no CUDA graph skipped", skips == 0, f"{skips} skipped" if skips else "")
    check_against_eager(report, setup, runs, "compiled")
    if runs.get("async, 1 lane") and runs.get("async, 2 lanes"):
        hits = [
            sum(col) for col in zip(*(s["hits_per_position"] for _, s in runs["async, 1 lane"]))
        ]
        misses = [
            sum(col) for col in zip(*(s["misses_per_position"] for _, s in runs["async, 1 lane"]))
        ]
        report.line(
            f"  async hits per outcome (rejection at 1..{block_size}, full acceptance): {hits}; "
            f"misses {misses}"
        )
        report.check(
            "rejection branches and the full-acceptance block both hit",
            sum(hits[:-1]) > 0 and hits[-1] > 0,
            f"{sum(hits[:-1])} rejection hits, {hits[-1]} full-acceptance hits",
        )
        same = [a[0] == b[0] for a, b in zip(runs["async, 1 lane"], runs["async, 2 lanes"])]
        report.check(
            "two compiled lanes decode the same tokens as one (lifted refusal)",
            all(same),
            f"{sum(same)} of {len(same)} prompts" + ("" if all(same) else ": the refusal stays"),
        )
    with report.guarded(
        "regional compilation"
    ):  # fast.compile_passes(regional=True), timed beside the default
        regional = decode_each(
            setup,
            compiled_caches(report, setup, need, backend, regional=True),
            (("target", "target", 1), ("sync", "sync", 1)),
        )
        check_against_eager(report, setup, regional, "regional")
        for label in regional:
            report.line(
                f"  {label}: ms per token, whole-model graphs "
                f"{ms_per_token(runs.get(label, [])):.2f}, "
                f"regional {ms_per_token(regional[label]):.2f}"
            )
    eager_caches = runtime.Caches.make(target, drafter, need)
    with torch.no_grad():
        for cache in (eager_caches.target, eager_caches.drafter):
            runtime.prefill(cache, prompts[0])  # the cache's first write
        shapes = pass_shapes(block_size)
        passes = {
            label: fixed_pass(
                eager_caches.target if label in TARGET_PASSES else eager_caches.drafter,
                q,
                target.config.vocab_size,
            )
            for label, q in shapes.items()
        }
        for label, ops in attention_ops(passes).items():
            report.line(
                f"  attention in the {label} ({shapes[label]} tokens, eager): "
                f"{', '.join(ops) or 'none seen'}"
            )
    trace(report, target, drafter, prompts[0], eager[0], max_new, cuda, out)


def compiled_caches(report: Report, setup, need: int, backend: str, regional: bool):
    """New caches with their passes compiled (fast.compile_passes), every mode warmed up (async in
    two lanes too: on a CPU each runs with half the threads, which dynamo's guards see); the seconds
    and graphs each mode took."""
    import torch
    from torch._dynamo.utils import counters

    import d3d
    import runtime
    from systems import fast

    target, drafter, prompts, eager, _ = setup
    caches = runtime.Caches.make(target, drafter, need)
    fast.compile_passes(caches, backend=backend, regional=regional)
    drafter.reference.copy_(torch.tensor(eager[0], device=prompts[0].device))
    with report.guarded(f"{'regional' if regional else 'whole-model'} compile and warm-up"):
        for mode, lanes in (*((m, 1) for m in d3d.MODES), ("async", 2)):
            graphs, start = counters["stats"]["unique_graphs"], time.perf_counter()
            with runtime.unproven_compiled_lanes() if lanes == 2 else contextlib.nullcontext():
                fast.warm_up(target, drafter, caches, prompts[0], (mode,), lanes=lanes)
            report.line(
                f"  {'regional' if regional else 'whole-model'}: compiled and warmed up {mode}"
                f"{', 2 lanes' if lanes == 2 else ''}: "
                f"{counters['stats']['unique_graphs'] - graphs} new "
                f"graph(s) in {time.perf_counter() - start:.1f} s"
            )
    return caches


def decode_each(setup, caches, settings) -> dict:
    """{label: [(new tokens, stats) per prompt]} for each (label, mode, lanes) of `settings`, the
    oracle scripted with each prompt's reference; two compiled lanes are let through (they are what
    this step compares)."""
    import torch

    import d3d
    import runtime

    target, drafter, prompts, eager, max_new = setup
    runs = {}
    for i, prompt in enumerate(prompts):
        drafter.reference.copy_(torch.tensor(eager[i], device=prompt.device))
        for label, mode, lanes in settings:
            with runtime.unproven_compiled_lanes() if lanes == 2 else contextlib.nullcontext():
                tokens, stats = d3d.generate(
                    target,
                    drafter if mode != "target" else None,
                    prompt,
                    mode=mode,
                    lanes=lanes,
                    max_new_tokens=max_new,
                    caches=caches,
                )
            runs.setdefault(label, []).append((tokens[0, prompt.shape[1] :].tolist(), stats))
    return runs


def check_against_eager(report: Report, setup, runs: dict, kind: str) -> None:
    """Each label's outputs against eager target-only: identical, or the first difference a near-tie
    (forensics.classify_divergence); an error fails the check."""
    from systems import forensics

    target, _, prompts, eager, max_new = setup
    for label, decoded in runs.items():
        classes = []
        for prompt, full, (tokens, _) in zip(prompts, eager, decoded):
            reference = full[prompt.shape[1] :][:max_new]
            found = "identical"
            if tokens != reference:
                found = forensics.classify_divergence(target, prompt, reference, tokens)["class"]
            classes.append(found)
        report.check(
            f"{kind} {label} equals eager target-only or differs at near-ties",
            "error" not in classes,
            ", ".join(f"{c} {classes.count(c)}" for c in ("identical", "near-tie", "error")),
        )


def ms_per_token(decoded: list) -> float:
    """Decode time per token after the first (prefill excluded), over all prompts."""
    seconds = sum(s["time_total"] - s["time_prefill"] for _, s in decoded)
    tokens = sum(s["num_new_tokens"] - 1 for _, s in decoded)
    return 1e3 * seconds / tokens if tokens else float("nan")


def trace(
    report: Report, target, drafter, prompt, reference, max_new, cuda: bool, out: str
) -> None:
    """A few async rounds with eager passes in two lanes: the project's spans (generate(trace=True))
    and torch.profiler's events, each written to OUT_DIR."""
    import torch

    import d3d

    drafter.reference.copy_(torch.tensor(reference, device=prompt.device))
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    with report.guarded("a trace of async rounds in two lanes"):
        with torch.profiler.profile(activities=activities) as prof:
            _, stats = d3d.generate(
                target,
                drafter,
                prompt,
                max_new_tokens=min(max_new, 3 * B_COMPILED + 1),
                mode="async",
                lanes=2,
                trace=True,
            )
        spans_path, profile_path = (
            os.path.join(out, "trace-async.json"),
            os.path.join(out, "profile-async.json"),
        )
        with open(spans_path, "w") as f:
            json.dump(stats["trace"], f)
        prof.export_chrome_trace(profile_path)
        events = stats["trace"]["traceEvents"]
        tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        on = {
            key: sorted({tracks[e["tid"]] for e in events if e["name"] == key})
            for key in ("verify", "packed_draft")
        }
        apart = set(on["verify"]).isdisjoint(on["packed_draft"])
        report.check(
            "verification and the packed pass on tracks of their own",
            apart,
            f"{stats['num_rounds']} rounds; "
            f"verify on {on['verify']}, packed pass on {on['packed_draft']}: {spans_path}",
        )
        if not cuda:
            return report.skip(
                "kernels in the profiler's trace",
                f"no CUDA: {profile_path} holds host-side ops only",
            )
        with open(profile_path) as f:
            kernels = [e for e in json.load(f).get("traceEvents", []) if e.get("cat") == "kernel"]
        streams = sorted({e.get("args", {}).get("stream") for e in kernels} - {None})
        report.line(
            f"  {profile_path}: "
            + (
                f"{len(kernels)} kernels on streams {streams}"
                if kernels
                else "the profiler recorded no kernels on this machine "
                "(some sandboxed GPUs forbid it); the spans "
                f"in {spans_path} are timed by CUDA events, a track per stream"
            )
        )


# --------------------------------------------------------------------------------------------------
# [4] the stream sanitizer


# Every test that needs CUDA lives in tests/test_cuda.py (tests/test_gpu_check.py holds it so);
# the training step has no second stream to check and the most memory to ask of the sanitizer
SANITIZER_TESTS = ("tests/test_cuda.py", "-k", "not training_step")


def step_sanitizer(report: Report, tiny: bool, device: str | None, out: str) -> None:
    _, cuda, _ = setting(tiny, device)
    if not cuda:
        return report.skip("the CUDA tests under TORCH_CUDA_SANITIZER=1", "needs CUDA")
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", *SANITIZER_TESTS]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    report.line("\n".join(result.stdout.splitlines()[-15:]))
    report.check(
        "the CUDA tests pass under the stream sanitizer",
        result.returncode == 0,
        f"pytest exit code {result.returncode}",
    )


STEP_FUNCTIONS = {
    0: step_environment,
    1: step_passes,
    2: step_shared_pool,
    3: step_compiled,
    4: step_sanitizer,
}


def run_one(out: str, n: int, tiny: bool, device: str | None) -> int:
    """Step n in this process: its findings on stdout, its status and numbers in
    OUT_DIR/<n>-<name>.json."""
    sys.path.insert(0, ROOT)
    report = Report()
    with report.guarded(f"step {n} ran to its end"):
        STEP_FUNCTIONS[n](report, tiny, device, out)
    with open(os.path.join(out, f"{n}-{STEPS[n][0]}.json"), "w") as f:
        json.dump(
            {
                "status": report.status(),
                "checks": report.checks,
                "skips": report.skips,
                "numbers": report.numbers,
            },
            f,
            indent=1,
            default=str,
        )
    return 0 if all(ok for _, ok in report.checks) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "out", metavar="OUT_DIR", help="folder for each step's file, the traces and summary.txt"
    )
    p.add_argument(
        "--tiny", action="store_true", help="toy sizes, on the CPU unless --device (about a minute)"
    )
    p.add_argument(
        "--steps",
        type=int,
        nargs="+",
        default=list(STEPS),
        choices=list(STEPS),
        help="which steps (default: all, in order)",
    )
    p.add_argument(
        "--budget",
        type=float,
        help="seconds for all steps together; a step gets at most what is left (default: "
        f"{BUDGET:.0f}, with --tiny the sum of the steps' --tiny limits)",
    )
    p.add_argument(
        "--device", help="cuda, cuda:1 or cpu (default: cuda if available, cpu with --tiny)"
    )
    p.add_argument(
        "--step", type=int, choices=list(STEPS), help=argparse.SUPPRESS
    )  # the parent runs each step so
    return p


if __name__ == "__main__":
    args = build_parser().parse_args()
    if args.step is not None:
        sys.exit(run_one(args.out, args.step, args.tiny, args.device))
    budget = args.budget
    if budget is None:
        budget = sum(STEPS[n][1] for n in args.steps) if args.tiny else BUDGET
    sys.exit(run_steps(args.out, args.tiny, args.steps, budget, args.device))
