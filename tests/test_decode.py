"""Tests for decode.py: a tiny Qwen3 target and drafter built from configs and saved to a tmp
folder, with a character-level tokenizer that has a chat template. CPU, fp32, no network, no
downloaded models.

Run: python -m pytest -q tests/test_decode.py"""

import collections
import inspect
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import d3d
import decode
import runtime
import toy
from systems import decode_flags, decoding, explain, figures, forensics, peers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # decode.py lives there

torch.set_num_threads(1)
MODES = d3d.MODES
SPECULATIVE = [m for m in MODES if m != "target"]


def make_tokenizer(chars="0123456789+-*= \nabcdefghijklmnopqrstuvwxyz?"):
    specials = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + list(chars))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|end|>"
    )
    tok.add_special_tokens({"additional_special_tokens": specials[2:]})
    tok.chat_template = (
        "{% for m in messages %}"
        "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    return tok


def tiny_qwen3(tok, seed, free_rows=13, tied=False):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tok) + free_rows,
        tie_word_embeddings=tied,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        initializer_range=0.5,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    return build_setting(tmp_path_factory.mktemp("decode"))


def build_setting(root):
    """A saved target, a drafter for it (train_args.json names the target), a drafter for
    another tokenizer, and GSM8K-, HumanEval- and MT-Bench-style prompt files."""
    tok = make_tokenizer()
    target = tiny_qwen3(tok, seed=0)
    target.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    drafter = d3d.make_drafter(tiny_qwen3(tok, seed=1), tokenizer=tok, block_size=3)
    drafter.save_pretrained(str(root / "drafter"), tokenizer=tok)
    (root / "drafter" / "train_args.json").write_text(json.dumps({"target": str(root / "target")}))
    other_tok = make_tokenizer(
        chars="abcdefghijklmnopqrstuvwxyz0123456789 \n+-*=?"
    )  # same size, other ids
    d3d.make_drafter(tiny_qwen3(other_tok, seed=2), tokenizer=other_tok).save_pretrained(
        str(root / "other")
    )
    files = {
        "gsm": [{"question": "12 + 7 * 3"}, {"question": "what is 5 - 2?"}],
        "humaneval": [{"task_id": "x/0", "prompt": "def add(a b)"}],
        "mtbench": [{"turns": ["hello there", "and again"]}],
        "empty": [],
    }
    for name, rows in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def cli(*argv):
    """decode.py's command line, in process."""
    return decode.main(decode.parse_args(argv))


def models_args(root):
    return [
        "--drafter",
        root / "drafter",
        "--max-new-tokens",
        10,
        "--no-color",
        "--dtype",
        "float32",
    ]


def reference(root, prompts, mode="target", max_new_tokens=10, **kwargs):
    """(answer, stats) of d3d.generate itself for each prompt, outside decode.py: the saved tiny
    target (and drafter), greedy, fp32, the settings models_args gives decode.py."""
    tok = make_tokenizer()
    target = transformers_target(root)
    drafter = None
    if mode != "target" or kwargs.get("keep_ratio") is not None:
        drafter = d3d.Drafter.from_pretrained(
            str(root / "drafter"), torch.float32, torch.device("cpu")
        ).eval()
    answers = []
    for prompt in prompts:
        ids = decoding.encode(tok, prompt, False, "cpu")
        out, stats = d3d.generate(
            target,
            drafter,
            ids,
            max_new_tokens=max_new_tokens,
            mode=mode,
            eos_token_id=[tok.eos_token_id],
            **kwargs,
        )
        answers.append((tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), stats))
    return answers


def mean(values):
    values = list(values)
    return sum(values) / len(values)


def s_per_token(records):
    """Decode seconds per output token over some prompts' records, prefill excluded (the
    benchmark's rule)."""
    return sum(r["decode_time"] for r in records) / sum(r["decode_tokens"] for r in records)


def check_cell(cell, records, baseline):
    """A Table 1 cell holds what its prompts' records give: speedup, tok/s, tau (mean over
    rounds, averaged per prompt), TTFT, the acceptance histogram, the hit rate (pooled hits /
    (hits + misses))."""
    assert cell["speedup"] == pytest.approx(s_per_token(baseline) / s_per_token(records), rel=1e-12)
    assert cell["tokens_per_s"] == pytest.approx(1 / s_per_token(records), rel=1e-12)
    assert cell["ttft_s"] == pytest.approx(mean(r["time_prefill"] for r in records), rel=1e-12)
    if all(r["accept_lengths"] for r in records):
        assert all(r["tau"] == pytest.approx(mean(r["accept_lengths"]), rel=1e-12) for r in records)
        assert cell["tau"] == pytest.approx(
            mean(mean(r["accept_lengths"]) for r in records), rel=1e-12
        )
        lengths = [n for r in records for n in r["accept_lengths"]]
        assert {int(n): c for n, c in cell["histogram"].items()} == {
            n: lengths.count(n) for n in set(lengths)
        }
    if "hits_per_position" in records[0]:
        hits = sum(sum(r["hits_per_position"]) for r in records)
        misses = sum(sum(r["misses_per_position"]) for r in records)
        assert cell["hit_rate"] == pytest.approx(hits / (hits + misses), rel=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_interactive_every_mode(setting, mode, monkeypatch, capsys):
    """Each mode answers with the target's own greedy tokens (d3d.generate's target-only answers,
    decoded outside decode.py), and its tau is the mean of the accept lengths its rounds
    recorded, averaged per prompt."""
    answer = decode.answer
    recorded = []

    def record(*args, **kwargs):
        # the demo's own decode of each prompt (the warm-up is not one)
        kept = answer(*args, **kwargs)
        recorded.append(kept)
        return kept

    monkeypatch.setattr(decode, "answer", record)
    result = cli(*models_args(setting), "--mode", mode, "--prompts-file", setting / "gsm.jsonl")
    out = capsys.readouterr().out
    assert "prompt 2/2: what is 5 - 2?" in out and len(recorded) == 2
    assert result["answers"] == [
        answer for answer, _ in reference(setting, ["12 + 7 * 3", "what is 5 - 2?"])
    ]
    rows = {
        line.split()[0]: line
        for line in out.splitlines()
        if line.split()[:1] in (["target"], [mode])
    }
    assert set(rows) == {"target", mode}  # the comparison table: the target and the chosen mode
    if mode != "target":
        tau = mean(mean(r["accept_lengths"]) for r in recorded)
        assert (
            result["summary"]["tau"] == pytest.approx(tau, rel=1e-12)
            and rows[mode].split()[3] == f"{tau:.2f}"
        )
        assert "acceptance histogram" in out and rows[mode].endswith("2/2")
        assert ("%" in rows[mode]) == (mode == "async")  # the hit rate


def test_demo_shows_sync_beside_async_and_the_target_on_cpu(setting, capsys):
    result = cli(*models_args(setting), "--prompts-file", setting / "gsm.jsonl")
    out = capsys.readouterr().out
    table = [
        line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["target"], ["sync"], ["async"])
    ]
    assert [row[0] for row in table] == ["target", "sync", "async"] and all(
        row[-1] == "2/2" for row in table[1:]
    )
    # the rule, said under the table in the table's words
    lines = out.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("the answers above used sync")]
    async_row = [i for i, line in enumerate(lines) if line.split()[:1] == ["async"]]
    assert len(said) == 1 and said[0] > async_row[0], out
    assert "on a CPU a pass costs" in lines[said[0]] and "speedups: sync " in lines[said[0]]
    assert "sync: acceptance histogram" in out
    assert set(result["summaries"]) == {"target", "sync", "async"}
    assert (
        "async: the packed pass ran after the verification (1 lane)" in out
    )  # a tiny target: the rule's one lane


def test_the_demo_calls_generate_itself(setting, monkeypatch, capsys):
    """decode.py's demo reads as load -> generate -> print: each prompt's answer comes from a
    call to d3d.generate written in decode.py, with the coloured stream as its on_round."""
    generate = d3d.generate
    callers = []

    def counted(*args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        callers.append((os.path.basename(caller), kwargs.get("on_round")))
        return generate(*args, **kwargs)

    monkeypatch.setattr(d3d, "generate", counted)
    argv = [*models_args(setting), "--mode", "sync", "--prompts-file", setting / "gsm.jsonl"]
    cli(*argv)
    streams = [on_round for name, on_round in callers if name == "decode.py"]
    assert len(streams) == 2  # one per prompt
    assert all(isinstance(s, explain.ColoredStream) for s in streams)


@pytest.fixture(scope="module")
def toy_drafter(tmp_path_factory):
    """A tiny untrained drafter for the shipped toy target (its tokenizer, B = 4)."""
    tok = AutoTokenizer.from_pretrained(toy.SHIPPED)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    drafter = d3d.make_drafter(Qwen3ForCausalLM(config), tokenizer=tok, block_size=4)
    path = tmp_path_factory.mktemp("toy") / "drafter"
    drafter.save_pretrained(str(path), tokenizer=tok)
    return path


def toy_args(drafter):
    return ["--drafter", drafter, "--dtype", "float32", "--max-new-tokens", 16]


@pytest.mark.parametrize("mode", [None, "sync", "async"])
def test_explain_prints_one_block_per_round_and_the_answer(toy_drafter, mode, capsys):
    """--explain on the toy target: the first prompt decoded once, one block per round in
    order (the draft, the target's verdict, what was committed, both caches before and
    after; async: the prepared outcomes and the hit or the miss), then the answer's text.
    Without --mode: the demo's mode, sync."""
    argv = ["--explain", *toy_args(toy_drafter)]
    if mode is not None:
        argv += ["--mode", mode]
    result = cli(*argv)
    out = capsys.readouterr().out
    if mode is None:
        # the demo's mode; its reasoning goes with the demo's table, which --explain has not
        assert result["mode"] == "sync" and "the answers above" not in out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    num_rounds = result["stats"]["num_rounds"]
    assert num_rounds > 1
    assert [line.split(":")[0] for line in rounds] == [f"round {i}" for i in range(num_rounds)]
    for key in ("  draft ", "  target  ", "  committed ", "  target cache ", "  drafter cache "):
        assert sum(line.startswith(key) for line in out.splitlines()) == num_rounds, key
    outcomes = [line for line in out.splitlines() if line.startswith(("  hit ", "  miss "))]
    assert len(outcomes) == num_rounds * (result["mode"] == "async")
    assert result["answer"] and f"answer: {result['answer']}" in out
    first_prompt = decoding.read_prompts(decode.TOY_PROMPTS)[1][0]
    assert "── prompt (x_0 .. x_" in out and first_prompt in out


def test_explain_goes_alone(toy_drafter):
    """--explain describes one decode: with a benchmark or a picture it is refused before
    anything loads."""
    for extra in (["--bench", decode.TOY_PROMPTS], ["--plot", "x.png"], ["--trace", "t.json"]):
        with pytest.raises(runtime.UserError, match="--explain describes one decode"):
            cli("--explain", *extra, *toy_args(toy_drafter))


def test_plot_draws_the_demo_rounds(toy_drafter, tmp_path, capsys):
    """--plot on the toy: a PNG of the mode's rounds; the picture's bars (acceptance_data) are
    the counts of the demo's own table: every round of every prompt, hits and misses too."""
    pytest.importorskip("matplotlib")
    from systems import pictures

    path = tmp_path / "rounds.png"
    argv = ["--mode", "async", "--max-samples", 2, "--plot", path, "--no-color"]
    result = cli(*argv, *toy_args(toy_drafter))
    assert f"wrote {path}: the acceptance histogram and hits / misses" in capsys.readouterr().out
    assert path.stat().st_size > 0
    data = pictures.acceptance_data(result["stats"], result["block_size"])
    summary = result["summary"]
    counts = collections.Counter(summary["histogram"])
    assert data["counts"] == [counts[t] for t in data["tau"]]
    assert sum(data["counts"]) == summary["num_rounds"] > 2
    assert data["hits"] == summary["hits_per_position"]
    assert data["misses"] == summary["misses_per_position"]


def test_the_demo_and_generate_take_mode_and_lanes_from_one_rule(setting, monkeypatch, capsys):
    """decode.py without --mode or --lanes follows runtime.default_mode and runtime.async_lanes,
    the rule d3d.generate(lanes=None) follows: sync on CUDA as on a CPU; lanes from the target's
    size on a CPU."""
    assert runtime.default_mode("cuda")[0] == runtime.default_mode("cpu")[0] == "sync"
    monkeypatch.setattr(
        runtime, "TWO_LANES_MIN_PARAMS", 1
    )  # every target is large enough for a second thread
    cli(*models_args(setting), "--prompts-file", setting / "gsm.jsonl", "--max-samples", 1)
    assert "async: the packed pass ran beside the verification (2 lanes)" in capsys.readouterr().out


def test_two_compiled_lanes_on_cuda_are_refused_before_anything_loads(setting):
    """--compile (or +compiled) with two lanes on CUDA: a clear error naming the ways out,
    before the models load (the drafter folder here does not exist: loading would fail with
    another error)."""
    missing = ["--drafter", setting / "no-such-drafter", "--device", "cuda", "--prompt", "hi"]
    for argv in (
        ["--compile", "--lanes", "2", "--mode", "async"],
        ["--compile", "--lanes", "2"],
        ["--bench", setting / "gsm.jsonl", "--modes", "sync", "async+compiled+2lanes"],
        ["--bench", setting / "gsm.jsonl", "--compile", "--modes", "async+2lanes"],
    ):
        with pytest.raises(ValueError, match=r"refused.*lanes=1.*--lanes 1.*eager passes"):
            cli(*missing, *argv)
    for argv in (
        ["--compile", "--mode", "async"],
        ["--lanes", "2", "--mode", "async"],  # one lane; eager passes
        ["--bench", setting / "gsm.jsonl", "--modes", "async+compiled", "async+2lanes"],
    ):
        with pytest.raises(runtime.UserError, match="no such folder"):
            cli(*missing, *argv)


def test_compiled_two_lanes_are_warmed_up_with_the_threads_each_lane_runs_with(
    setting, monkeypatch
):
    """On a CPU each of two lanes runs with half of torch's threads, and dynamo's guards see the
    thread count: the warm-up decodes async in the lanes the benchmark uses (+2lanes, or --lanes
    2 with --compile), so no pass compiles again while it is timed (a recompile raises here)."""
    from systems import fast

    compile_passes = fast.compile_passes
    prepare = decoding.prepare
    monkeypatch.setattr(
        fast, "compile_passes", lambda caches, **kw: compile_passes(caches, backend="eager", **kw)
    )

    def prepare_then_no_recompiles(*args):
        torch._dynamo.config.error_on_recompile = False  # the warm-up compiles
        prepare(*args)
        torch._dynamo.config.error_on_recompile = True

    monkeypatch.setattr(decoding, "prepare", prepare_then_no_recompiles)
    try:
        for argv in (
            ["--modes", "async+compiled+2lanes"],
            ["--modes", "async", "--compile", "--lanes", 2],
        ):
            torch._dynamo.reset()
            result = cli(
                "--bench",
                setting / "gsm.jsonl",
                "--threads",
                2,
                "--out",
                "",
                *argv,
                *models_args(setting),
            )
            assert result["mismatches"]["count"] == 0
    finally:
        torch._dynamo.config.error_on_recompile = False
        torch._dynamo.reset()
        torch.set_num_threads(1)


def test_compile_regional_compiles_one_layer_for_all(setting, monkeypatch):
    """--compile regional: fast.compile_passes(regional=True), one decoder layer compiled and
    reused by every layer; the flag alone, or a '+compiled' mode, the whole-model graphs. Output
    equals target-only either way."""
    from systems import fast

    compile_passes = fast.compile_passes
    seen = []

    def record(caches, regional=False):
        seen.append(regional)
        compile_passes(caches, backend="eager", regional=regional)

    monkeypatch.setattr(fast, "compile_passes", record)
    for argv, regional in (
        (["--compile", "regional", "--modes", "sync", "async"], True),
        (["--compile", "--modes", "sync"], False),
        (["--modes", "sync+compiled"], False),
    ):
        torch._dynamo.reset()
        result = cli("--bench", setting / "gsm.jsonl", "--out", "", *argv, *models_args(setting))
        assert seen[-1] is regional and result["mismatches"]["count"] == 0
    torch._dynamo.reset()


def test_trace_puts_each_lane_on_its_own_track(setting, tmp_path, capsys):
    """--trace PATH: the first prompt decoded once more, its phases as a Chrome trace read back
    here: with two lanes on a CPU, the verification on the main thread's track, the packed pass
    on the worker's, rounds in order."""
    path = tmp_path / "trace.json"
    cli(
        *models_args(setting),
        "--prompts-file",
        setting / "gsm.jsonl",
        "--mode",
        "async",
        "--lanes",
        "2",
        "--max-new-tokens",
        12,
        "--trace",
        path,
    )
    assert f"wrote {path}" in capsys.readouterr().out
    trace = json.loads(path.read_text())
    tracks = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]

    def on(key):
        """The tracks that spans named `key` ran on."""
        return {tracks[e["tid"]] for e in spans if e["name"] == key}

    assert on("verify") == {"thread MainThread"} and on("packed_draft") == {"thread packed-pass_0"}
    assert on("both") == on("prefill") == {"thread MainThread"}
    verify = sorted(e["ts"] for e in spans if e["name"] == "verify")
    packed = sorted(e["ts"] for e in spans if e["name"] == "packed_draft")
    assert (
        len(verify) == len(packed) == trace["otherData"]["num_rounds"] > 1
        and trace["otherData"]["lanes"] == 2
    )
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    with pytest.raises(ValueError, match="--trace goes with"):
        cli(
            *models_args(setting),
            "--bench",
            setting / "gsm.jsonl",
            "--concurrency",
            1,
            "--trace",
            path,
        )


@pytest.mark.parametrize("mode", SPECULATIVE)
def test_sampling_check_puts_a_lossless_mode_at_the_noise_floor(setting, mode, capsys):
    """--sampling-check: the total variation between the mode's samples and the target's stays
    at the noise floor, the TV between two target-only sets of the same size. Measured here (100
    answers a set, 4 tokens, seeds 0-9): mean TV 0.22-0.31, each mode within 0.06 of the floor;
    a mode that samples from the drafter's law (every draft accepted) gives 0.64-0.67, one at
    twice or half the target's temperature 0.43-0.50: 0.1 off the floor fails."""
    result = cli(
        *models_args(setting),
        "--mode",
        mode,
        "--temperature",
        1,
        "--sampling-check",
        100,
        "--prompt",
        "12 + 7",
        "--max-new-tokens",
        4,
        "--out",
        setting / "sampling.json",
    )
    out = capsys.readouterr().out
    assert f"TV({mode}, target)  TV(target, target again)" in out and len(result["positions"]) == 4
    for key in ("mode", "noise"):
        assert result[f"mean_tv_{key}"] == pytest.approx(
            mean(p[f"tv_{key}"] for p in result["positions"])
        )
    floor = result["mean_tv_noise"]
    assert floor > 0.1 and abs(result["mean_tv_mode"] - floor) < 0.1, (
        result["mean_tv_mode"],
        floor,
    )
    assert json.loads((setting / "sampling.json").read_text())["num_samples"] == 100
    with pytest.raises(ValueError, match="--temperature > 0"):
        cli(*models_args(setting), "--sampling-check", 30, "--prompt", "12 + 7")


def test_the_demo_answer_is_coloured_by_origin(setting, monkeypatch, capsys):
    """The demo streams each round into the answer: stripped of its colours it is the answer;
    the first token (the prefill's) is the target's, and the green pieces are exactly the
    draft tokens the rounds accepted (the tiny tokenizer: one character a token)."""
    rounds = []

    class Recorded(explain.ColoredStream):
        def __call__(self, info):
            rounds.append(info)
            super().__call__(info)

    monkeypatch.setattr(explain, "ColoredStream", Recorded)
    args = decode.parse_args(models_args(setting))
    target = str(setting / "target")
    drafter = str(setting / "drafter")
    flags = decode_flags.ModelFlags(target, drafter, device="cpu", dtype="float32")
    models = decode.load(flags, ["sync"])
    tok = models.tokenizer
    ids = decoding.encode(tok, "12 + 7 * 3", False, "cpu")
    config = decode.cli.settings_of(d3d.DecodeConfig, vars(args), decode_flags.NOT_FLAGS)
    kept = decode.answer(models, ids, "sync", decoding.Run(config), None, colour=True)
    printed = capsys.readouterr().out.rstrip("\n")
    text = tok.decode(kept["new_tokens"], skip_special_tokens=True)
    pieces = re.findall("(\033\\[3[23]m)(.*?)\033\\[0m", printed, re.S)
    assert "".join(piece for _, piece in pieces) == text
    assert pieces[0] == (explain.COLOURS["target"], text[0])
    green = [piece for colour, piece in pieces if colour == explain.COLOURS["draft"]]
    accepted = [info.committed[: info.num_accepted] for info in rounds]
    drafts = [tok.decode(tokens, skip_special_tokens=True) for tokens in accepted]
    assert "".join(green) == "".join(drafts)
    assert len(rounds) == kept["num_rounds"]


def test_the_sample_is_the_readme_snippet_and_decodes_as_the_target(setting, capsys):
    """decode.py's first function is README's "Watch a round" program, word for word, and it
    prints the rounds and the target's own greedy answer."""
    source = inspect.getsource(decode.sample)
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert source in readme, "README's snippet is decode.sample: copy it again"
    first = min(
        (obj.__code__.co_firstlineno, name)
        for name, obj in vars(decode).items()
        if inspect.isfunction(obj) and obj.__module__ == "decode"
    )
    assert first[1] == "sample", f"decode.py opens with {first[1]}"
    prompt = "12 + 7 * 3"
    out, stats = decode.sample(str(setting / "target"), str(setting / "drafter"), prompt)
    printed = capsys.readouterr().out
    tok = transformers.AutoTokenizer.from_pretrained(setting / "target")
    target = transformers.AutoModelForCausalLM.from_pretrained(setting / "target").eval()
    chat = [{"role": "user", "content": prompt}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"]
    config = d3d.DecodeConfig(max_new_tokens=64, eos_token_id=tok.eos_token_id, mode="target")
    expected, _ = d3d.generate(target, None, ids, config)
    assert torch.equal(out, expected)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert printed.rstrip().endswith(f"{answer} (tau {stats['tau']:.2f}, the mean over its rounds)")
    assert printed.count("round") >= stats["num_rounds"], printed


def test_bench_writes_table_and_json(setting, capsys):
    out_file = setting / "bench.json"
    files = [setting / f"{n}.jsonl" for n in ("gsm", "humaneval", "mtbench")]
    result = cli(*models_args(setting), "--bench", *files, "--out", out_file)
    printed = capsys.readouterr().out
    assert "Speedup  τ" in printed and "Avg." in printed
    assert (
        f"greedy check: identical {4 * len(SPECULATIVE)}, near-tie divergences 0, errors 0"
        in printed
    )
    for mode in SPECULATIVE:
        assert f"{mode} (3)" in printed  # rows: modes (block size)
    saved = json.loads(out_file.read_text())
    assert list(saved["datasets"]) == ["gsm", "humaneval", "mtbench"]
    assert [saved["datasets"][n]["field"] for n in saved["datasets"]] == [
        "question",
        "prompt",
        "turns",
    ]
    for mode in SPECULATIVE:
        cell = saved["datasets"]["gsm"]["modes"][mode]
        assert {
            "speedup",
            "tau",
            "tokens_per_s",
            "ttft_s",
            "ms_per_round",
            "histogram",
            "mismatches",
        } <= set(cell)
        assert cell["mismatches"] == 0 and {"round", "draft", "verify"} <= set(cell["ms_per_round"])
        assert ("hit_rate" in cell) == (mode == "async")
        for name, dataset in saved["datasets"].items():
            per_prompt = dataset["per_prompt"]
            assert (
                len(per_prompt[mode])
                == dataset["num_prompts"]
                == {"gsm": 2, "humaneval": 1, "mtbench": 1}[name]
            )
            check_cell(dataset["modes"][mode], per_prompt[mode], per_prompt["target"])
        everything = [saved["datasets"][n]["per_prompt"] for n in saved["datasets"]]
        check_cell(
            saved["overall"][mode],
            [r for p in everything for r in p[mode]],
            [r for p in everything for r in p["target"]],
        )
        assert saved["mean"][mode] == pytest.approx(
            {
                k: mean(d["modes"][mode][k] for d in saved["datasets"].values())
                for k in ("speedup", "tau")
            },
            rel=1e-12,
        )
    env = saved["env"]
    assert (
        env["dtype"] == "torch.float32"
        and env["torch"] == torch.__version__
        and env["target"].endswith("target")
    )
    assert (
        env["drafter_config"]["block_size"] == 3
        and saved["block_size"] == 3
        and saved["mismatches"]["count"] == 0
    )
    assert saved["table"] in printed and result["mismatches"]["checked"] == 4 * len(SPECULATIVE)


def test_bench_reports_a_mismatch(setting, monkeypatch, capsys):
    generate = d3d.generate

    def corrupt(target, drafter, ids, config, **kwargs):
        # speculative outputs get their 3rd new token changed
        out, stats = generate(target, drafter, ids, config, **kwargs)
        if config.mode != "target":
            out = out.clone()
            prompt_len = ids.shape[1]
            out[0, prompt_len + 2] = (out[0, prompt_len + 2] + 1) % 40
        return out, stats

    monkeypatch.setattr(d3d, "generate", corrupt)
    result = cli(
        *models_args(setting), "--bench", setting / "gsm.jsonl", "--modes", "sync", "--out", ""
    )
    printed = capsys.readouterr().out
    assert (
        result["mismatches"]["count"] == 2
        and "identical 0, near-tie divergences 0, errors 2" in printed
    )
    first = result["mismatches"]["list"][0]
    assert (first["dataset"], first["prompt_index"], first["mode"], first["position"]) == (
        "gsm",
        0,
        "sync",
        2,
    )
    assert (
        first["target_token"]["id"] != first["mode_token"]["id"]
        and "gsm prompt 0, sync, new token 2" in printed
    )
    assert (
        first["class"] == "error"
        and first["margin"] > first["tolerance"]
        and "first error" in printed
    )
    assert result["datasets"]["gsm"]["modes"]["sync"]["mismatches"] == 2


def test_clear_errors(setting, tmp_path, monkeypatch):
    with pytest.raises(runtime.UserError, match="no such folder"):
        cli("--drafter", tmp_path / "missing", "--prompt", "hi")
    with pytest.raises(ValueError, match="different tokenizer"):
        cli("--drafter", setting / "other", "--target", setting / "target", "--prompt", "hi")
    with pytest.raises(runtime.UserError, match="not a D3D drafter"):
        cli("--drafter", setting / "target", "--prompt", "hi")
    with pytest.raises(runtime.UserError, match="is empty"):
        cli(*models_args(setting), "--bench", setting / "gsm.jsonl", setting / "empty.jsonl")
    with pytest.raises(ValueError, match="--prompt-field"):
        cli(*models_args(setting), "--bench", setting / "gsm.jsonl", "--prompt-field", "turns")
    with pytest.raises(ValueError, match="empty prompt"):
        cli(*models_args(setting), "--prompt", "  ")
    monkeypatch.chdir(tmp_path)  # no runs/toy here: the default says how to make it
    with pytest.raises(runtime.UserError, match="python train.py"):
        cli("--prompt", "hi")


def test_subprocess_reads_prompts_from_stdin(setting):
    cmd = [sys.executable, "decode.py", *map(str, models_args(setting)), "--prompt", "-"]
    run = subprocess.run(
        cmd, input="12 + 3\n\nhello\n", capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    assert (
        "prompt 1/2: 12 + 3" in run.stdout
        and "prompt 2/2: hello" in run.stdout
        and "same tokens" in run.stdout
    )
    bad = subprocess.run(
        [sys.executable, "decode.py", "--drafter", str(setting / "nope"), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert (
        bad.returncode == 2 and "error: --drafter" in bad.stderr and "no such folder" in bad.stderr
    )
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_bench_sweeps_async_budgets(setting, capsys):
    """--modes async:C,F[,cover] rows: the paper's Fig. 3 sweep in miniature; every row is
    checked for equality."""
    result = cli(
        "--bench",
        setting / "gsm.jsonl",
        "--modes",
        "sync",
        "async:0,2",
        "async:2,1",
        "async:3,2,likely",
        "--out",
        "",
        *models_args(setting),
    )
    out = capsys.readouterr().out
    for row, budget in (
        ("async:0,2", (0, 2, "first")),
        ("async:2,1", (2, 1, "first")),
        ("async:3,2,likely", (3, 2, "likely")),
    ):
        assert row in out
        records = result["datasets"]["gsm"]["per_prompt"][row]
        assert all(
            (r["coverage"], r["fanout"], r["cover"]) == budget for r in records
        )  # the budget it names
        check_cell(
            result["datasets"]["gsm"]["modes"][row],
            records,
            result["datasets"]["gsm"]["per_prompt"]["target"],
        )
    assert result["mismatches"]["count"] == 0
    with pytest.raises(ValueError, match="async:C,F"):
        cli("--bench", setting / "gsm.jsonl", "--modes", "async:x", *models_args(setting))


def test_keep_ratio_and_prefill_bench(setting, capsys):
    prompt = "what is 12 + 7 * 3 - 5 * 4 + 1?"
    result = cli(
        "--prompt",
        prompt,
        "--mode",
        "sync",
        "--keep-ratio",
        "0.5",
        "--chunk-size",
        "4",
        *models_args(setting),
    )
    ((answer, stats),) = reference(setting, [prompt], "sync", keep_ratio=0.5, chunk_size=4)
    assert result["answers"] == [answer] and stats["chunks_kept"] < stats["num_chunks"]
    result = cli(
        "--prefill-bench",
        setting / "gsm.jsonl",
        "--num-docs",
        "3",
        "--keep-ratios",
        "1.0",
        "0.3",
        "--chunk-size",
        "4",
        "--max-samples",
        "2",
        "--out",
        "",
        *models_args(setting),
    )
    rows = result["prefill_bench"]
    assert list(rows) == ["target, full prefill", "100% + D3D (sync)", "30% + D3D (sync)"]
    assert rows["100% + D3D (sync)"]["same_answer"] == 1.0  # keeping every chunk changes nothing
    assert (
        rows["30% + D3D (sync)"]["prompt_tokens_prefilled"]
        < rows["100% + D3D (sync)"]["prompt_tokens_prefilled"]
    )
    assert "TTFT" in capsys.readouterr().out


def test_target_only_decoding_with_selective_prefilling_answers_as_generate_does(setting):
    """--mode target --keep-ratio: the drafter scores the prompt's chunks, the target prefills
    the kept ones and decodes alone; the run's caches hold the drafter's too (prepare)."""
    prompt = "what is 12 + 7 * 3 - 5 * 4 + 1?"
    flags = ["--mode", "target", "--keep-ratio", "0.5", "--chunk-size", "4"]
    result = cli("--prompt", prompt, *flags, *models_args(setting))
    ((answer, stats),) = reference(setting, [prompt], "target", keep_ratio=0.5, chunk_size=4)
    assert result["answers"] == [answer] and stats["chunks_kept"] < stats["num_chunks"]


def test_concurrency_bench_writes_table_2(setting, capsys):
    """--concurrency: the paper's Table 2 in miniature (throughput and speedup per concurrency,
    per dataset; where a round goes), async at concurrency 1 only; every greedy row checked
    against batched target-only decoding."""
    out_file = setting / "bench-concurrency.json"
    files = [setting / f"{n}.jsonl" for n in ("gsm", "humaneval", "mtbench")]
    modes = ["sync", "async"] if "async" in MODES else ["sync"]
    result = cli(
        *models_args(setting),
        "--bench",
        *files,
        "--modes",
        *modes,
        "--concurrency",
        1,
        2,
        "--out",
        out_file,
    )
    printed = capsys.readouterr().out
    assert (
        "throughput in tokens/s over wall time" in printed and "c=1" in printed and "c=2" in printed
    )
    assert (
        "gsm (2 prompts)" in printed
        and "sync (3)" in printed
        and "draft" in printed
        and "other" in printed
    )
    saved = json.loads(out_file.read_text())
    assert saved["concurrency"] == [1, 2] and list(saved["datasets"]) == [
        "gsm",
        "humaneval",
        "mtbench",
    ]
    gsm = saved["datasets"]["gsm"]["levels"]
    alone = [stats for _, stats in reference(setting, ["12 + 7 * 3", "what is 5 - 2?"], "sync")]
    for c in ("1", "2"):
        target = gsm[c]["target"]
        sync = gsm[c]["sync"]
        assert target["speedup"] == 1.0 and sync["num_new_tokens"] == target["num_new_tokens"]
        for cell in (
            target,
            sync,
        ):  # throughput: new tokens of all requests / wall time of the batches
            assert cell["tokens_per_s"] == pytest.approx(
                cell["num_new_tokens"] / cell["wall_s"], rel=1e-12
            )
        assert sync["speedup"] == pytest.approx(
            sync["tokens_per_s"] / target["tokens_per_s"], rel=1e-12
        )
        # each row commits what d3d.generate commits for its prompt alone: tau over all rows' rounds
        assert sync["tau"] == pytest.approx(
            mean(n for stats in alone for n in stats["accept_lengths"]), rel=1e-12
        )
        assert {"round", "draft", "verify", "other"} == set(gsm[c]["sync"]["ms_per_round"])
    assert (
        gsm["2"]["sync"]["num_batches"] == 1 and gsm["1"]["sync"]["num_batches"] == 2
    )  # consecutive groups
    if "async" in modes:
        assert (
            "async" in gsm["1"]
            and "async" not in gsm["2"]
            and "async runs at concurrency 1 only" in printed
        )
    checked = 4 * 2 + (
        4 if "async" in modes else 0
    )  # 4 prompts: sync at c = 1 and 2, async at c = 1 only
    assert saved["mismatches"] == {
        "count": 0,
        "checked": checked,
        "identical": checked,
        "near_ties": 0,
        "errors": 0,
        "list": [],
    }
    assert (
        saved["table"] in printed
        and f"identical {checked}, near-tie divergences 0, errors 0" in printed
    )
    assert saved["env"]["args"]["concurrency"] == [1, 2]
    for c in (1, 2):  # all datasets: every dataset's requests
        assert result["overall"][c]["sync"]["num_new_tokens"] == sum(
            result["datasets"][n]["levels"][c]["sync"]["num_new_tokens"] for n in result["datasets"]
        )


# ---------------------------------------------------------------------------------------------
# Peers (transformers' own decoding) and the greedy check's classes


def test_bench_baselines_land_in_table_and_json(setting, capsys):
    """hf, hf-assisted and hf-lookup run end to end next to sync, reproduce target-only greedy
    output, and get rows, JSON cells and the target-only vs generate line."""
    result = cli(
        *models_args(setting),
        "--bench",
        setting / "gsm.jsonl",
        "--modes",
        "sync",
        *peers.BASELINES,
        "--out",
        setting / "peers.json",
    )
    printed = capsys.readouterr().out
    assert "hf  " in printed and "hf-assisted (3)" in printed and "hf-lookup (3)" in printed
    assert "target-only (this repo) vs transformers generate:" in printed
    assert "identical 8, near-tie divergences 0, errors 0" in printed
    saved = json.loads((setting / "peers.json").read_text())
    per_prompt = saved["datasets"]["gsm"]["per_prompt"]
    for mode in peers.BASELINES:
        cell = saved["datasets"]["gsm"]["modes"][mode]
        assert cell["errors"] == 0 and all(r["decode_tokens"] == 9 for r in per_prompt[mode])
        check_cell(cell, per_prompt[mode], per_prompt["target"])
    assert saved["datasets"]["gsm"]["modes"]["hf"]["tau"] is None  # plain generate has no rounds
    assert all(r["accept_lengths"] for r in per_prompt["hf-assisted"])  # its tau: check_cell's
    assert result["target_vs_hf"] == pytest.approx(
        s_per_token(per_prompt["hf"]) / s_per_token(per_prompt["target"])
    )


@pytest.mark.parametrize("tied", [False, True])
def test_hf_assisted_with_a_drafter_that_has_an_extra_mask_row(tmp_path, tied):
    """A target with no free vocabulary row (like SmolLM2, tied or not): the drafter has one row
    more (MASK). The assistant shares the drafter's weights, cut to the target's rows; the
    drafter itself stays whole."""
    tok = make_tokenizer()
    target = tiny_qwen3(tok, seed=0, free_rows=0, tied=tied)
    target.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    drafter = d3d.make_drafter(
        tiny_qwen3(tok, seed=1, free_rows=0, tied=tied), tokenizer=tok, block_size=3
    )
    assert drafter.model.get_output_embeddings().weight.shape[0] == len(tok) + 1  # the MASK row
    assistant = peers.assistant_model(drafter, len(tok))
    for get in ("get_input_embeddings", "get_output_embeddings"):
        cut, whole = getattr(assistant, get)().weight, getattr(drafter.model, get)().weight
        assert (
            cut.shape[0] == len(tok) and cut.data_ptr() == whole.data_ptr()
        )  # the same tensor, one row less
    assert drafter.model.get_output_embeddings().weight.shape[0] == len(tok) + 1
    assert (
        assistant.get_input_embeddings().weight is assistant.get_output_embeddings().weight
    ) == tied
    assert peers.assistant_model(drafter, len(tok)) is assistant  # built once
    drafter.save_pretrained(str(tmp_path / "drafter"), tokenizer=tok)
    (tmp_path / "gsm.jsonl").write_text(json.dumps({"question": "12 + 7 * 3"}) + "\n")
    result = cli(
        "--drafter",
        tmp_path / "drafter",
        "--target",
        tmp_path / "target",
        "--max-new-tokens",
        12,
        "--bench",
        tmp_path / "gsm.jsonl",
        "--modes",
        "hf-assisted",
        "--out",
        "",
    )
    (record,) = result["datasets"]["gsm"]["per_prompt"]["hf-assisted"]
    assert result["mismatches"]["count"] == 0 and record["accept_lengths"]
    assert result["datasets"]["gsm"]["modes"]["hf-assisted"]["tau"] == mean(
        record["accept_lengths"]
    )


def test_unknown_and_misused_modes_raise_clear_errors(setting):
    with pytest.raises(
        ValueError, match=r"unknown mode 'hf-spec'.*sync.*async.*hf, hf-assisted, hf-lookup"
    ):
        cli(*models_args(setting), "--bench", setting / "gsm.jsonl", "--modes", "sync", "hf-spec")
    with pytest.raises(ValueError, match="--bench"):
        cli(*models_args(setting), "--mode", "hf", "--prompt", "hi")
    with pytest.raises(ValueError, match="greedy"):
        cli(
            *models_args(setting),
            "--bench",
            setting / "gsm.jsonl",
            "--modes",
            "hf",
            "--temperature",
            "0.7",
        )


def test_greedy_check_reports_an_off_by_one_cache_as_error(setting, monkeypatch, capsys):
    """Sync decoding whose caches keep one position too few: its outputs leave target-only's
    where the target clearly prefers its own token, so every divergence is an error, with the
    margin in the JSON."""
    rewind = runtime.KVCache.rewind
    monkeypatch.setattr(
        runtime.KVCache, "rewind", lambda cache, length: rewind(cache, max(length - 1, 0))
    )
    result = cli(
        *models_args(setting), "--bench", setting / "gsm.jsonl", "--modes", "sync", "--out", ""
    )
    printed = capsys.readouterr().out
    checks = result["mismatches"]
    assert (
        checks["errors"] >= 1 and checks["near_ties"] == 0 and checks["errors"] == checks["count"]
    )
    assert f"errors {checks['errors']}" in printed and "first error: gsm prompt" in printed
    assert all(x["class"] == "error" and abs(x["margin"]) > x["tolerance"] for x in checks["list"])
    # a tolerance that forgives anything turns the same divergences into near-ties
    result = cli(
        *models_args(setting),
        "--bench",
        setting / "gsm.jsonl",
        "--modes",
        "sync",
        "--out",
        "",
        "--tie-tolerance",
        1e9,
    )
    assert (
        result["mismatches"]["near_ties"] == checks["count"] and result["mismatches"]["errors"] == 0
    )


def test_greedy_check_reports_a_near_tie(setting, tmp_path, monkeypatch, capsys):
    """A target whose output rows for tokens a and b differ by 1e-7: at a position where a wins,
    b is a tie. A mode that emits the other token of the pair there is a near-tie, not an error."""
    assert forensics.tie_tolerance(torch.tensor([20.0, -3.0]), torch.bfloat16) == 8 * 2**-7 * 20
    assert (
        forensics.tie_tolerance(torch.tensor([-20.0, 3.0]), torch.float32) == 8 * 2**-16 * 20
    )  # the fp32 floor
    tok = make_tokenizer()
    target = transformers_target(setting)
    ids = decoding.encode(tok, "12 + 7 * 3", False, "cpu")
    a = int(d3d.generate(target, None, ids, max_new_tokens=1, mode="target")[0][0, -1])
    b = next(t for t in range(len(tok)) if t not in (a, tok.eos_token_id))
    with torch.no_grad():
        head = target.get_output_embeddings().weight
        head[b] = head[a]
        head[b, 0] += 1e-7
    target.save_pretrained(tmp_path / "tied")
    tok.save_pretrained(tmp_path / "tied")
    generate = d3d.generate

    def other_of_the_pair(target, drafter, prompt, config, **kwargs):
        # speculative outputs take the other token of the tie at token 0
        out, stats = generate(target, drafter, prompt, config, **kwargs)
        if config.mode != "target":
            out = out.clone()
            first = ids.shape[1]
            out[0, first] = {a: b, b: a}[int(out[0, first])]
        return out, stats

    monkeypatch.setattr(d3d, "generate", other_of_the_pair)
    result = cli(
        *models_args(setting),
        "--target",
        tmp_path / "tied",
        "--bench",
        setting / "gsm.jsonl",
        "--max-samples",
        1,
        "--modes",
        "sync",
        "--out",
        "",
    )
    printed = capsys.readouterr().out
    (x,) = result["mismatches"]["list"]
    assert (x["position"], x["class"]) == (0, "near-tie") and abs(x["margin"]) < 1e-5 < x[
        "tolerance"
    ]
    assert (
        "identical 0, near-tie divergences 1 (largest margin" in printed and "errors 0" in printed
    )


def transformers_target(root):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "target").eval()


def test_speedups_are_also_given_against_generate_when_it_is_the_faster_baseline():
    results = {
        "d": {
            "modes": {
                "sync": {"speedup": 1.5, "tau": 2.0},
                "hf": {"speedup": 1.25, "tau": math.nan},
            }
        }
    }

    def row(tokens_per_s):
        return {"tokens_per_s": tokens_per_s, "ttft_s": 0.01, "ms_per_round": {}}

    text = figures.table(
        results, {"target": row(100.0), "sync": row(150.0), "hf": row(125.0)}, ["sync", "hf"], 4
    )
    assert (
        "vs transformers generate: 0.80×" in text
        and "against transformers generate (the faster" in text
    )
    assert "sync 1.20×" in text  # 150 / 125
    slower = figures.table(
        results, {"target": row(100.0), "sync": row(150.0), "hf": row(90.0)}, ["sync", "hf"], 4
    )
    assert "1.11×" in slower and "the faster baseline" not in slower


def test_a_refused_demo_prints_nothing_before_its_error(setting, capsys):
    """The demo's reasoning (which mode it uses without --mode) belongs under its table: a
    command refused at its flags prints nothing before the one-line error."""
    with pytest.raises(runtime.UserError, match="--concurrency"):
        cli(*models_args(setting), "--concurrency", 4)
    assert capsys.readouterr().out == ""
