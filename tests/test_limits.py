"""Sizes at the far end of their ranges, no network, no GPU: a request past the positions a model
has or the memory there is gets one line before anything is allocated or run; a model name that
is no local folder fails without waiting on the network and names local folders; a device that
is not there is named before anything loads; a drafter used at another B than it was trained
with says so once; Ctrl-C in decode.py is one line. Tiny models built from configs, CPU, no
network. What a run did is shown by what it called (passes, loads, connections), never by how
long it took.

Run: python -m pytest -q tests/test_limits.py"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import warnings

import pytest
import torch
from test_decode import ROOT, build_setting

import d3d
import decode
import runtime
import train
from systems import batched, cli

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved target (max_position_embeddings 256) and a drafter for it trained at B = 3."""
    return build_setting(tmp_path_factory.mktemp("limits"))


@pytest.fixture(scope="module")
def models(saved):
    target = runtime.load_causal_lm(str(saved / "target"), torch.float32)
    drafter = d3d.Drafter.from_pretrained(str(saved / "drafter"), torch.float32, "cpu")
    return target.eval(), drafter.eval()


def decode_py(saved, *argv, env=None, timeout=120):
    """`python decode.py ...` on the saved models, as a user runs it; (status, stderr)."""
    command = [sys.executable, "decode.py", "--drafter", str(saved / "drafter")]
    command += ["--no-color", "--dtype", "float32", *[str(a) for a in argv]]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stderr.strip()


def decode_recorded(saved, argv, monkeypatch, capsys) -> tuple[int, str, dict]:
    """decode.py on the saved models in this process, as its __main__ runs it (cli.run), with
    what it did counted: (status, stderr, {"loads": models loaded, "passes": KV cache passes})."""
    done = {"loads": 0, "passes": 0}
    run = runtime.KVCache.run
    load_causal_lm = runtime.load_causal_lm
    load_drafter = d3d.Drafter.from_pretrained

    def counted_run(cache, *args, **kwargs):
        done["passes"] += 1
        return run(cache, *args, **kwargs)

    def counted_target(*args, **kwargs):
        done["loads"] += 1
        return load_causal_lm(*args, **kwargs)

    def counted_drafter(*args, **kwargs):
        done["loads"] += 1
        return load_drafter(*args, **kwargs)

    monkeypatch.setattr(runtime.KVCache, "run", counted_run)
    monkeypatch.setattr(runtime, "load_causal_lm", counted_target)
    monkeypatch.setattr(d3d.Drafter, "from_pretrained", counted_drafter)
    command = ["--drafter", saved / "drafter", "--no-color", "--dtype", "float32", *argv]
    status = 0
    try:
        cli.run(decode.cli_main, [str(a) for a in command])
    except SystemExit as exit_info:
        status = exit_info.code
    return status, capsys.readouterr().err.strip(), done


@pytest.fixture
def no_network(monkeypatch) -> list:
    """A machine whose network is down: every connection and name lookup fails at once (an
    OSError, as it would) and is recorded here, (what was called, its arguments)."""
    tried = []

    def down(name):
        def refuse(*args, **kwargs):
            tried.append((name, args, kwargs))
            raise OSError(f"no network in this test ({name})")

        return refuse

    monkeypatch.setattr(socket, "create_connection", down("create_connection"))
    monkeypatch.setattr(socket, "getaddrinfo", down("getaddrinfo"))
    monkeypatch.setattr(socket.socket, "connect", down("connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", down("connect_ex"))
    return tried


def asked_the_hub_once_at_most(tried: list, loads: int) -> None:
    """The only connections a name that is no local folder may try: runtime.hub_reachable's,
    one a load, each bounded by runtime.HUB_TIMEOUT (nothing that waits on a client's retries)."""
    assert len(tried) <= loads, tried
    for name, args, kwargs in tried:
        assert name == "create_connection", tried
        timeout = kwargs.get("timeout")
        if len(args) > 1:
            timeout = args[1]
        assert timeout is not None and timeout <= runtime.HUB_TIMEOUT, tried


def one_line_error(status: int, err: str) -> str:
    """The error line a driver ended with (transformers' loading bars come before it)."""
    assert status == 2, f"exit status 2 for bad input, got {status}: {err}"
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("error: "), err
    return last


def prompt_ids(length: int) -> torch.Tensor:
    return torch.arange(5, 5 + length)[None] % 40 + 5


def needed_bytes(error: runtime.UserError) -> int:
    """The bytes a memory error says the request needs."""
    return int(re.search(r"needs at least ([\d,]+) bytes", str(error))[1].replace(",", ""))


# --------------------------------------------------------------------------------------------------
# Positions: prompt + max_new_tokens + B + 1 against max_position_embeddings


def test_block_size_past_the_positions_is_one_line_before_any_pass(saved, monkeypatch, capsys):
    argv = ["--prompt", "1 + 2", "--block-size", 100000]
    status, err, done = decode_recorded(saved, argv, monkeypatch, capsys)
    err = one_line_error(status, err)
    # the run's caches, or the first request's positions: each names the flag
    assert "--block-size" in err, err
    assert done["passes"] == 0, f"refused after {done['passes']} passes: {err}"


def test_max_new_tokens_past_the_positions_is_one_line_not_a_cache_diagnosis(
    saved, monkeypatch, capsys
):
    argv = ["--prompt", "1 + 2", "--max-new-tokens", 100000000, "--mode", "sync"]
    status, err, done = decode_recorded(saved, argv, monkeypatch, capsys)
    err = one_line_error(status, err)
    assert "--max-new-tokens" in err, err
    assert "ignored the cache" not in err, err
    assert done["passes"] == 0, f"refused after {done['passes']} passes: {err}"


@pytest.mark.parametrize("mode", ["target", "sync", "async"])
def test_the_last_position_the_model_has_decodes_and_one_more_is_refused(models, mode):
    target, drafter = models
    ids = prompt_ids(20)
    block_size = 3
    # the target's 256 positions: x_n + B and one past it; async's block off d_B is B further
    last_new = 256 - 20 - block_size - 1
    if mode == "async":
        last_new -= block_size
    settings = dict(mode=mode, block_size=block_size)
    if mode == "target":
        settings = dict(mode=mode)
        last_new = 256 - 20 - 1 - 1
    out, stats = d3d.generate(target, drafter, ids, max_new_tokens=last_new, **settings)
    assert stats["num_new_tokens"] == last_new
    with pytest.raises(runtime.UserError, match="max_position_embeddings 256"):
        d3d.generate(target, drafter, ids, max_new_tokens=last_new + 1, **settings)


def test_a_batch_is_checked_at_its_longest_prompt(models):
    target, drafter = models
    block_size = drafter.d3d_config.block_size
    short = prompt_ids(4)[0]
    longest = prompt_ids(30)[0]
    new = 256 - 30 - block_size - 1 + 1
    with pytest.raises(runtime.UserError, match="a prompt of 30 tokens"):
        batched.generate(target, drafter, [short, longest], max_new_tokens=new)


# --------------------------------------------------------------------------------------------------
# Memory: the bytes certainly needed against the memory there is (D3D_MEMORY_LIMIT lowers it)


def test_fanout_at_the_vocabulary_decodes_and_past_it_is_refused(models):
    target, drafter = models
    vocab = drafter.d3d_config.target_vocab_size
    ids = prompt_ids(6)
    settings = dict(mode="async", coverage=1, max_new_tokens=4)
    out, _ = d3d.generate(target, drafter, ids, fanout=vocab - 1, **settings)
    greedy, _ = d3d.generate(target, None, ids, mode="target", max_new_tokens=4)
    assert out.tolist() == greedy.tolist()
    with pytest.raises(runtime.UserError, match=f"at most {vocab - 1}"):
        d3d.generate(target, drafter, ids, fanout=vocab, **settings)


def test_a_fanout_past_the_vocabulary_is_one_line_before_any_pass(saved, monkeypatch, capsys):
    argv = ["--prompt", "1 + 2", "--mode", "async", "--fanout", 100000]
    status, err, done = decode_recorded(saved, argv, monkeypatch, capsys)
    err = one_line_error(status, err)
    assert "fanout 100000" in err and "at most" in err, err
    assert done["passes"] == 0, f"refused after {done['passes']} passes: {err}"


# (drafter used, settings, the caches' slots: cache_len's prompt, new tokens, B, C, F)
MEMORY_CASES = {
    "target": (False, dict(mode="target"), (12, 8)),
    "sync": (True, dict(mode="sync"), (12, 8, 3)),
    "async": (True, dict(mode="async", coverage=2, fanout=2), (12, 8, 3, 2, 2)),
}


@pytest.mark.parametrize("mode", list(MEMORY_CASES))
def test_the_memory_limit_holds_at_the_need_and_refuses_one_byte_less(models, mode, monkeypatch):
    target, drafter = models
    uses_drafter, settings, sizes = MEMORY_CASES[mode]
    if not uses_drafter:
        drafter = None
    ids = prompt_ids(12)
    monkeypatch.setenv(runtime.MEMORY_LIMIT, "1")
    with pytest.raises(runtime.UserError, match=f"{runtime.MEMORY_LIMIT} allows") as refused:
        d3d.generate(target, drafter, ids, max_new_tokens=8, **settings)
    assert "lower max_new_tokens" in str(refused.value)
    need = needed_bytes(refused.value)
    monkeypatch.setenv(runtime.MEMORY_LIMIT, str(need - 1))
    with pytest.raises(runtime.UserError):
        d3d.generate(target, drafter, ids, max_new_tokens=8, **settings)
    monkeypatch.setenv(runtime.MEMORY_LIMIT, str(need))
    caches = runtime.Caches.make(target, drafter, runtime.cache_len(*sizes))
    d3d.generate(target, drafter, ids, max_new_tokens=8, caches=caches, **settings)
    # the need counts at least the KV caches the decode wrote
    written = 0
    for cache in (caches.target, caches.drafter):
        if cache is None:
            continue
        for layer in cache.hf.layers:
            written += layer.keys.nbytes + layer.values.nbytes
    assert 0 < written <= need


def test_the_memory_limit_is_one_line_in_decode_py(saved):
    argv = ["--prompt", "1 + 2", "--mode", "sync", "--max-new-tokens", 8]
    status, err = decode_py(saved, *argv, env={runtime.MEMORY_LIMIT: "1000"})
    err = one_line_error(status, err)
    assert "D3D_MEMORY_LIMIT allows 1,000 bytes" in err and "--max-new-tokens" in err, err


def test_a_memory_limit_that_is_no_number_says_how_to_write_it(models, monkeypatch):
    target, drafter = models
    monkeypatch.setenv(runtime.MEMORY_LIMIT, "8G")
    with pytest.raises(runtime.UserError, match="digits only"):
        d3d.generate(target, drafter, prompt_ids(4), max_new_tokens=2)


def test_kv_caches_larger_than_the_memory_are_refused_when_made(models):
    target, drafter = models
    # a terabyte of slots: refused at once, with nothing allocated
    with pytest.raises(runtime.UserError, match="KV caches of 1,000,000,000,000 slots"):
        runtime.Caches.make(target, drafter, 10**12)


def test_a_pass_that_runs_out_of_memory_says_so_not_that_the_cache_was_ignored(models):
    target, _ = models
    # a petabyte of mask: no machine allocates it, and torch says so at once
    cache = runtime.KVCache(target, 10**15)
    with pytest.raises(runtime.UserError, match="ran out of memory") as refused:
        runtime.causal_pass(cache, prompt_ids(1))
    assert "ignored the cache" not in str(refused.value)


# --------------------------------------------------------------------------------------------------
# Training: the packed mask b x (max_len + K B)^2 and what it implies


def test_training_past_the_positions_or_the_memory_is_one_line(models, monkeypatch):
    _, drafter = models
    # the longest sequence, 40 + 30 tokens, cut to max_len 64
    examples = [([5] * 10, [6] * 20), ([5] * 40, [6] * 30)]
    sizes = dict(batch_size=1, max_len=64, device="cpu")
    runtime.check_training_size(drafter, examples, **sizes)
    with pytest.raises(runtime.UserError, match="--block-size") as refused:
        wide = d3d.Drafter(drafter.model, _with_block(drafter, 100000))
        runtime.check_training_size(wide, examples, **sizes)
    assert "max_position_embeddings 256" in str(refused.value)
    # the last B the positions allow, then one past it
    last = d3d.Drafter(drafter.model, _with_block(drafter, 192))
    runtime.check_training_size(last, examples, **sizes)
    past = d3d.Drafter(drafter.model, _with_block(drafter, 193))
    with pytest.raises(runtime.UserError, match="positions"):
        runtime.check_training_size(past, examples, **sizes)
    # sequences shorter than max_len: their own length counts
    short = [([5] * 10, [6] * 20)]
    runtime.check_training_size(past, short, **{**sizes, "max_len": 1024})
    monkeypatch.setenv(runtime.MEMORY_LIMIT, "1")
    with pytest.raises(runtime.UserError, match="packed tokens") as refused:
        runtime.check_training_size(drafter, examples, **sizes)
    need = needed_bytes(refused.value)
    # the mask alone: b (L + K B)^2, a bool and an fp32 float each
    tokens = 64 + drafter.d3d_config.num_anchors * drafter.d3d_config.block_size
    assert need > tokens**2 * 5
    monkeypatch.setenv(runtime.MEMORY_LIMIT, str(need))
    runtime.check_training_size(drafter, examples, **sizes)


@pytest.mark.parametrize("bf16", [False, True])
def test_training_memory_need_is_the_mask_the_hidden_states_and_adamw(models, monkeypatch, bf16):
    """The bytes a training step certainly needs, worked out here from check_training_size's
    docstring: the packed mask b (L + K B)^2 as a bool and an additive float, the hidden states
    of every layer, AdamW's fp32 gradient and two moments of every trained weight. The limit at
    that need trains; one byte less is refused."""
    _, drafter = models
    examples = [([5] * 10, [6] * 20), ([5] * 40, [6] * 30)]
    b, max_len = 2, 64
    # the longest sequence, 70 tokens, cut to max_len; K blocks of B hang off it
    length = 64
    config = drafter.d3d_config
    packed = length + config.num_anchors * config.block_size
    float_bytes = 2 if bf16 else 4
    text = drafter.model.config
    mask = b * packed * packed * (1 + float_bytes)
    hidden = b * packed * text.hidden_size * float_bytes * text.num_hidden_layers
    adamw = 3 * 4 * sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    need = mask + hidden + adamw
    sizes = dict(batch_size=b, max_len=max_len, device="cpu", bf16=bf16)
    monkeypatch.setenv(runtime.MEMORY_LIMIT, str(need))
    runtime.check_training_size(drafter, examples, **sizes)
    monkeypatch.setenv(runtime.MEMORY_LIMIT, str(need - 1))
    with pytest.raises(runtime.UserError, match=f"needs at least {need:,} bytes"):
        runtime.check_training_size(drafter, examples, **sizes)


def _with_block(drafter, block_size):
    config = d3d.D3DConfig(**{**vars(drafter.d3d_config), "block_size": block_size})
    return config


# --------------------------------------------------------------------------------------------------
# No network, no GPU


def test_a_model_name_that_is_no_local_folder_fails_without_waiting_naming_local_folders(
    no_network,
):
    """With the network down: the hub asked once a load at most, within HUB_TIMEOUT, then one
    line naming local folders."""
    for load in (runtime.load_causal_lm, runtime.load_tokenizer):
        with pytest.raises(runtime.UserError) as refused:
            load("no-such-org/no-such-model")
        message = str(refused.value)
        assert "toy-target" in message and "save_pretrained" in message, message
        assert message.startswith("--target no-such-org/no-such-model"), message
        assert "\n" not in message
    asked_the_hub_once_at_most(no_network, loads=2)


# Loads a hub name with every connection and name lookup refused and recorded, and the path
# every from_pretrained call was given recorded; prints what it found as JSON. In a process of
# its own: huggingface_hub reads HF_HUB_CACHE when it is imported.
HUB_CACHE_SCRIPT = """
import json, socket

network = []


def refuse(*args, **kwargs):
    network.append(repr(args[-1:]))
    raise OSError("no network in this test")


socket.create_connection = socket.getaddrinfo = refuse
socket.socket.connect = socket.socket.connect_ex = refuse

import transformers

import runtime

read_from = []


def recording(load):
    def recorded(path, *args, **kwargs):
        answer = load(path, *args, **kwargs)
        read_from.append(str(path))
        return answer

    return recorded


for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
    auto.from_pretrained = recording(auto.from_pretrained)
model = runtime.load_causal_lm("someone/tiny-target")
runtime.load_tokenizer("someone/tiny-target")
print(json.dumps(dict(vocab_size=model.config.vocab_size, network=network, read_from=read_from)))
"""


def test_a_hub_name_in_the_local_cache_loads_without_the_network(saved, tmp_path):
    """A hub name the Hugging Face cache holds: the model and its tokenizer read from the
    cache's folder on the first try, and no connection or name lookup made (HF_HUB_OFFLINE not
    set)."""
    # the Hugging Face cache's layout: models--owner--name/snapshots/<commit>, refs/main
    repo = tmp_path / "hub" / "models--someone--tiny-target"
    commit = "0" * 40
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in os.listdir(saved / "target"):
        (snapshot / name).write_bytes((saved / "target" / name).read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    script = HUB_CACHE_SCRIPT
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub")}
    env.pop("HF_HUB_OFFLINE", None)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    target = runtime.load_causal_lm(str(saved / "target"))
    assert found["vocab_size"] == target.config.vocab_size
    assert found["network"] == [], f"it asked the network: {found['network']}"
    # the model and the tokenizer, each read from the cache's snapshot on its first try
    assert found["read_from"] == [str(snapshot)] * 2, found


def cuda_devices() -> int:
    """How many CUDA devices this machine has."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def cuda_past_the_devices() -> tuple[str, str]:
    """A CUDA device this machine lacks, and the words its error says (with or without CUDA
    here: the tests run on both)."""
    count = cuda_devices()
    if count == 0:
        return "cuda", "this machine has no CUDA device"
    return f"cuda:{count}", f"this machine has {count} CUDA device"


def test_a_cuda_device_past_those_the_machine_has_is_one_line():
    count = cuda_devices()
    names = [f"cuda:{count}"]
    if count == 0:
        names.append("cuda")
    else:
        assert runtime.resolve_device(f"cuda:{count - 1}").index == count - 1
    _, said = cuda_past_the_devices()
    for name in names:
        with pytest.raises(runtime.UserError, match=said) as refused:
            runtime.resolve_device(name)
        assert "\n" not in str(refused.value)
        if count == 0:
            assert "--device cpu" in str(refused.value)


def test_mps_where_there_is_none_and_a_word_that_is_no_device_are_one_line():
    if not torch.backends.mps.is_available():
        with pytest.raises(runtime.UserError, match="MPS is not available"):
            runtime.resolve_device("mps")
    with pytest.raises(runtime.UserError, match="is not a device"):
        runtime.resolve_device("gpu")
    assert runtime.resolve_device("cpu") == torch.device("cpu")


def test_decode_py_names_a_word_that_is_no_device_before_anything_loads():
    with pytest.raises(runtime.UserError, match="--device gpu is not a device") as refused:
        decode.main(decode.parse_args(["--device", "gpu"]))
    assert "\n" not in str(refused.value)


# --------------------------------------------------------------------------------------------------
# A drafter at another B than it was trained with: legal, said once


def test_a_drafter_at_another_block_size_warns_once_with_both_values(models):
    target, drafter = models
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            d3d.generate(target, drafter, prompt_ids(5), max_new_tokens=4, block_size=5)
        d3d.generate(target, drafter, prompt_ids(5), max_new_tokens=4)
    said = [str(w.message) for w in caught if "trained at B" in str(w.message)]
    assert len(said) == 1, said
    assert "trained at B = 3 and decodes at B = 5" in said[0], said


def test_decode_py_at_another_block_size_says_it_once(saved):
    argv = ["--prompts-file", saved / "gsm.jsonl", "--max-new-tokens", 6, "--block-size", 5]
    status, err = decode_py(saved, *argv)
    assert status == 0, err
    lines = [line for line in err.splitlines() if "trained at B = 3 and decodes at B = 5" in line]
    assert len(lines) == 1, err
    # one line: "warning: ...", with no source location and no echo of the code after it
    assert lines[0].startswith("warning: the drafter was trained at B = 3"), err
    assert "warnings.warn" not in err, err


# --------------------------------------------------------------------------------------------------
# The drivers: train.py's sizes before its first step; devices and model names before anything
# loads; Ctrl-C


def train_settings(saved, tmp_path, **settings) -> dict:
    """train.py's flags for one short step on the saved target (256 positions), every sequence
    cut at 12 tokens (each prompt alone is longer)."""
    prompts = str(saved / "gsm.jsonl")
    flags = dict(target=str(saved / "target"), prompts=prompts, val_prompts=prompts, steps=1)
    flags.update(out=str(tmp_path / "drafter"), max_len=12, num_anchors=2, max_new_tokens=8)
    flags.update(batch_size=2, device="cpu", dtype="float32")
    return {**flags, **settings}


def test_train_block_size_at_the_last_position_trains_and_one_more_is_refused(saved, tmp_path):
    # 12 tokens + B positions of the 256 the drafter has
    train.main(**train_settings(saved, tmp_path, block_size=256 - 12))
    with pytest.raises(runtime.UserError, match="needs 257 positions") as refused:
        train.main(**train_settings(saved, tmp_path, block_size=256 - 12 + 1, resume=False))
    assert "max_position_embeddings 256" in str(refused.value)
    assert "--block-size" in str(refused.value)


def test_train_py_block_size_100000_is_one_line_before_the_first_step(saved, tmp_path):
    flags = train_settings(saved, tmp_path, block_size=100000)
    command = [sys.executable, "train.py"]
    for name, value in flags.items():
        command += [runtime.flag_name(name), str(value)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    err = one_line_error(done.returncode, done.stderr.strip())
    assert "needs 100012 positions" in err and "lower --block-size" in err, err
    assert not os.path.exists(tmp_path / "drafter" / "checkpoint.pt")


def test_decode_py_device_past_the_machines_is_one_line_before_anything_loads(
    saved, monkeypatch, capsys
):
    device, said = cuda_past_the_devices()
    argv = ["--prompt", "1 + 2", "--device", device]
    status, err, done = decode_recorded(saved, argv, monkeypatch, capsys)
    err = one_line_error(status, err)
    assert f"--device {device}: {said}" in err, err
    assert done["loads"] == 0, f"refused after {done['loads']} models loaded: {err}"
    # the device that is there decodes
    status, err = decode_py(saved, "--prompt", "1 + 2", "--device", "cpu", "--max-new-tokens", 4)
    assert status == 0, err


def test_train_device_past_the_machines_is_one_line(saved, tmp_path):
    device, said = cuda_past_the_devices()
    with pytest.raises(runtime.UserError, match=f"--device {device}: {said}"):
        train.main(**train_settings(saved, tmp_path, device=device))
    assert not os.path.exists(tmp_path / "drafter")


def test_a_target_that_is_no_local_folder_is_one_line_in_both_drivers(
    saved, tmp_path, no_network, monkeypatch, capsys
):
    """With the network down: one line naming local folders, the hub asked once at most."""
    name = "no-such-org/no-such-model"
    argv = ["--prompt", "1 + 2", "--target", name]
    status, err, _ = decode_recorded(saved, argv, monkeypatch, capsys)
    err = one_line_error(status, err)
    assert f"--target {name}" in err and "toy-target" in err, err
    asked_the_hub_once_at_most(no_network, loads=1)
    no_network.clear()
    with pytest.raises(runtime.UserError, match=f"--target {name}: .*toy-target"):
        train.main(**train_settings(saved, tmp_path, target=name))
    asked_the_hub_once_at_most(no_network, loads=1)


def test_ctrl_c_in_decode_py_ends_with_one_line(saved, tmp_path):
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"{i} + {i}"}) + "\n" for i in range(300)))
    command = [sys.executable, "decode.py", "--drafter", str(saved / "drafter"), "--no-color"]
    command += ["--dtype", "float32", "--mode", "sync", "--prompts-file", str(prompts)]
    command += ["--max-samples", "300", "--max-new-tokens", "100"]
    child = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a background process ignores SIGINT unless it resets the handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # the third answer on its way: decoding has begun
    for line in child.stdout:
        if "prompt 3/300" in line:
            break
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("decode.py: interrupted (Ctrl-C)"), err
