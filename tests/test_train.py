"""Tests of train.py with tiny models built from configs (CPU, seconds; nothing downloaded)."""

import contextlib
import copy
import dataclasses
import functools
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Qwen3Config, Qwen3ForCausalLM

import d3d
import runtime
import toy
import train
from systems import answers, checkpoints, evaluation, memory, pictures, pruning, train_flags

# train.py lives there
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUESTIONS = [
    "1 + 2",
    "3 * 4 - 5",
    "7 - 2 + 9",
    "12 + 30 * 2",
    "8 * 3",
    "40 - 17",
    "5 + 5 + 5",
    "9 * 9 - 1",
    "2 + 3 * 4",
    "11 - 1",
    "6 * 7",
    "25 + 25",
]
FAST = dict(
    dtype="float32",
    max_new_tokens=10,
    gen_batch_size=4,
    batch_size=4,
    num_anchors=6,
    block_size=4,
    val_anchors=4,
    max_len=64,
    lr=1e-2,
    warmup=1,
    eval_every=1000,
    num_val=3,
    device="cpu",
)


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _tiny_model(tok, layers=4, seed=0):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=(len(tok) // 16 + 1) * 16,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random 4-layer Qwen3 target with the toy's character tokenizer and chat template,
    and a prompts file."""
    return make_setup(tmp_path_factory.mktemp("tiny"))


def make_setup(root) -> dict:
    """What the `setup` fixture returns, written under `root` (test_fsdp.py's fixture too)."""
    tok = toy.make_tokenizer()
    _tiny_model(tok).save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    _write_jsonl(root / "prompts.jsonl", [{"question": q} for q in QUESTIONS])
    return {
        "root": root,
        "target": str(root / "target"),
        "prompts": str(root / "prompts.jsonl"),
        "tok": tok,
    }


def _run(setup, out, **kw):
    return train.main(
        target=setup["target"], prompts=setup["prompts"], out=str(out), **{**FAST, **kw}
    )


def test_data_is_cached_and_resumed(setup, tmp_path, monkeypatch):
    calls = []
    real = answers.load_target
    monkeypatch.setattr(answers, "load_target", lambda *a, **k: calls.append(1) or real(*a, **k))
    answering = answers.Answering(max_new_tokens=6, gen_batch_size=5, cache_dir=str(tmp_path))
    kw = dict(tokenizer=setup["tok"], answering=answering)
    first = answers.load_data(setup["target"], prompts=setup["prompts"], **kw)
    assert len(calls) == 1 and len(first) == len(QUESTIONS)
    assert all(0 < len(r) <= 6 for _, r in first)
    assert answers.load_data(setup["target"], prompts=setup["prompts"], **kw) == first
    assert len(calls) == 1  # the rerun read the cache and never loaded the target
    # an interrupted run: the header, 5 whole lines and one cut in the middle; the rerun
    # answers only the other 7
    (cache,) = tmp_path.glob("answers-*.jsonl")
    lines = cache.read_text().splitlines(keepends=True)
    assert json.loads(lines[0]) == answers.answers_header(setup["target"], setup["tok"], 6)
    cache.write_text("".join(lines[:6]) + lines[6][:10])
    assert answers.load_data(setup["target"], prompts=setup["prompts"], **kw) == first
    assert (
        len(calls) == 2 and len(cache.read_text().splitlines()) == 1 + 5 + 7
    )  # the cut line was dropped


def test_loss_mask_covers_response_only():
    examples = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9, 10])]
    input_ids, loss_mask = answers.collate(examples, pad_id=0, max_len=64)
    assert input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert loss_mask.tolist() == [
        [False, False, False, True, True],
        [False, True, True, True, True],
    ]
    input_ids, loss_mask = answers.collate(
        [([1, 2], [3]), ([4], [5, 6, 7, 8])], pad_id=0, max_len=4
    )
    assert input_ids.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7]]  # right padding; cut at max_len
    assert loss_mask.tolist() == [[False, False, True, False], [False, True, True, True]]


def test_layer_selection_keeps_the_right_layers(setup):
    assert train.select_layers(30, 8) == [0, 4, 8, 12, 17, 21, 25, 29]
    assert train.select_layers(4, 2) == [0, 3] and train.select_layers(4, 4) == [0, 1, 2, 3]
    assert (
        train.select_layers(30, "0,14,29") == [0, 14, 29] and train.select_layers(30, None) is None
    )
    with pytest.raises(ValueError):
        train.select_layers(4, 5)
    full = _tiny_model(setup["tok"], layers=4)
    drafter = train.build_drafter(
        setup["target"], setup["tok"], target_vocab_size=full.config.vocab_size, layers="3"
    )
    assert drafter.d3d_config.layer_ids == [0, 2, 3] and drafter.model.config.num_hidden_layers == 3
    for new, old in enumerate([0, 2, 3]):
        a, b = (
            drafter.model.model.layers[new].mlp.up_proj.weight,
            full.model.layers[old].mlp.up_proj.weight,
        )
        assert torch.equal(a, b)


def test_training_on_from_a_drafter_keeps_its_layer_ids_and_mask(setup, tmp_path):
    """--drafter-init may be a trained drafter: its MASK row is reused and layer ids stay
    those of the original."""
    vocab = _tiny_model(setup["tok"], layers=4).config.vocab_size
    first = train.build_drafter(setup["target"], setup["tok"], target_vocab_size=vocab, layers="3")
    first.save_pretrained(str(tmp_path / "d"), tokenizer=setup["tok"])
    again = train.build_drafter(str(tmp_path / "d"), setup["tok"], target_vocab_size=vocab)
    assert again.d3d_config.layer_ids == [0, 2, 3]
    assert again.d3d_config.mask_token_id == first.d3d_config.mask_token_id
    torch.testing.assert_close(
        again.model.get_input_embeddings().weight, first.model.get_input_embeddings().weight
    )
    fewer = train.build_drafter(
        str(tmp_path / "d"), setup["tok"], target_vocab_size=vocab, layers="0,2"
    )
    assert fewer.d3d_config.layer_ids == [0, 3] and fewer.model.config.num_hidden_layers == 2


def test_training_lowers_loss_and_saves_a_lossless_drafter(setup, tmp_path):
    out = tmp_path / "drafter"
    result = _run(setup, out, steps=12, drafter_layers="2", eval_every=12)
    drafter = d3d.Drafter.from_pretrained(str(out))
    assert drafter.d3d_config.layer_ids == [0, 3] and drafter.d3d_config.block_size == 4
    for key, value in drafter.state_dict().items():  # main returns the drafter it saved
        assert torch.equal(value, result["drafter"].state_dict()[key]), key
    record = json.loads((out / "train_args.json").read_text())
    assert (
        record["target"] == os.path.abspath(setup["target"]) and record["history"][-1]["step"] == 12
    )
    # the loss on a fixed batch fell from the initial drafter to the trained one
    answering = answers.Answering(max_new_tokens=10, cache_dir=str(tmp_path))
    examples = answers.load_data(setup["target"], setup["tok"], setup["prompts"], answering)
    input_ids, loss_mask = answers.collate(examples, setup["tok"].pad_token_id, 64)
    initial = train.build_drafter(
        setup["target"],
        setup["tok"],
        target_vocab_size=drafter.d3d_config.target_vocab_size,
        layers="2",
        block_size=4,
    )
    # both on K = 6 blocks, the same anchors
    same_k = [
        d3d.Drafter(m.model, dataclasses.replace(m.d3d_config, num_anchors=6))
        for m in (initial, drafter)
    ]
    losses = [
        d3d.d3d_loss(m, input_ids, loss_mask, generator=torch.Generator().manual_seed(0))[0]
        for m in same_k
    ]
    assert losses[1] < 0.7 * losses[0]
    target = answers.load_target(setup["target"], "cpu")
    prompt = torch.tensor([examples[0][0]])
    ref, _ = d3d.generate(target, None, prompt, max_new_tokens=20, mode="target")
    out_ids, stats = d3d.generate(target, drafter, prompt, max_new_tokens=20, mode="sync")
    assert torch.equal(out_ids, ref) and stats["tau"] > 1.0
    # `train.py eval` measures the saved drafter on the same held-out blocks as the end of
    # training, both ways
    taus = evaluation.eval_main(["--drafter", str(out)])
    assert taus["causal"] == pytest.approx(record["offline_tau"])
    assert taus["mask"] == pytest.approx(record["offline_tau_d1_from_mask"])
    for first in (
        "causal",
        "mask",
    ):  # the acceptance curve: falls with the position, sums to the mean accepted length
        curve = taus["curve"][first]
        assert len(curve) == 4 and all(a >= b for a, b in zip(curve, curve[1:]))
        assert 1 + sum(curve) == pytest.approx(taus[first])


def test_resume_continues_at_the_right_step(setup, tmp_path, monkeypatch, capsys):
    straight = _run(setup, tmp_path / "a", steps=4, drafter_layers="2")["drafter"]
    real_loss = d3d.d3d_loss
    calls = []

    def crash_at_step_3(*a, **k):  # a run killed after its step-2 checkpoint
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_loss(*a, **k)

    monkeypatch.setattr(d3d, "d3d_loss", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        _run(setup, tmp_path / "b", steps=4, drafter_layers="2", save_every=2)
    monkeypatch.setattr(d3d, "d3d_loss", real_loss)
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["step"] == 2
    resumed = _run(setup, tmp_path / "b", steps=4, drafter_layers="2", save_every=2)["drafter"]
    assert "resumed from" in capsys.readouterr().out
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["step"] == 4
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), (
            name
        )  # the same data, anchors and optimizer state as one uninterrupted run


def test_checkpoint_pieces_hold_plain_types_only(setup, tmp_path):
    """Every piece of a checkpoint loads with torch.load(weights_only=True), as a resume
    does: tensors, numbers, strings and containers of them, no pickled class (which
    weights_only refuses to run)."""
    out = tmp_path / "d"
    _run(setup, out, steps=1, drafter_layers="2")
    pieces = sorted(out.glob("*.pt"))
    assert [p.name for p in pieces] == [
        "checkpoint.pt",
        "optimizer-exp_avg.pt",
        "optimizer-exp_avg_sq.pt",
    ]
    for piece in pieces:
        assert torch.load(piece, weights_only=True)["step"] == 1, piece.name


def spoiled_loss(bad_calls):
    """d3d.d3d_loss made NaN (hence every gradient) at the given 1-based calls; one call
    per training step here."""
    real_loss = d3d.d3d_loss
    calls = []

    def loss(*a, **k):
        calls.append(1)
        value, metrics = real_loss(*a, **k)
        return (value * float("nan") if len(calls) in bad_calls else value), metrics

    return loss


def _nan_loss_at(monkeypatch, bad_steps):
    monkeypatch.setattr(d3d, "d3d_loss", spoiled_loss(bad_steps))


def test_a_non_finite_step_is_skipped_and_training_goes_on(setup, tmp_path, monkeypatch):
    _nan_loss_at(monkeypatch, {2})
    out = tmp_path / "d"
    result = _run(setup, out, steps=4, drafter_layers="2")
    assert result["skipped_steps"] == 1 and result["history"][-1]["skipped"] == 1
    assert all(torch.isfinite(p).all() for p in result["drafter"].parameters())
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["piece"]
    assert {int(s) for s in saved["adam_steps"].values()} == {
        3
    }  # steps 1, 3 and 4 reached AdamW, step 2 did not
    for key in ("exp_avg", "exp_avg_sq"):
        moments = torch.load(out / f"optimizer-{key}.pt", weights_only=True)["piece"]
        assert all(torch.isfinite(m).all() for m in moments.values()), key
    assert json.loads((out / "train_args.json").read_text())["skipped_steps"] == 1


def test_non_finite_steps_in_a_row_stop_training(setup, tmp_path, monkeypatch):
    _nan_loss_at(monkeypatch, set(range(3, 100)))
    with pytest.raises(
        RuntimeError,
        match=f"step {2 + train.MAX_SKIPPED_IN_A_ROW}: {train.MAX_SKIPPED_IN_A_ROW} "
        "steps in a row.*--lr.*float32.*data",
    ):
        _run(setup, tmp_path / "d", steps=2 + train.MAX_SKIPPED_IN_A_ROW + 2, drafter_layers="2")


def test_resume_reads_through_the_cpu_and_keeps_adam_step_counts(setup, tmp_path, monkeypatch):
    """A checkpoint is read into host memory; load_state_dict places the tensors, and
    AdamW's step counts stay CPU tensors with their values (a step count on the GPU would
    make AdamW's update sync or fail)."""
    out = tmp_path / "d"
    _run(setup, out, steps=2, drafter_layers="2")
    saved = torch.load(out / "checkpoint.pt", weights_only=True)["piece"]["adam_steps"]
    real_load, real_restore, places, restored = (
        torch.load,
        torch.optim.AdamW.load_state_dict,
        [],
        [],
    )
    monkeypatch.setattr(
        torch, "load", lambda *a, **k: places.append(k.get("map_location")) or real_load(*a, **k)
    )
    monkeypatch.setattr(
        torch.optim.AdamW,
        "load_state_dict",
        lambda self, state: restored.append(self) or real_restore(self, state),
    )
    _run(setup, out, steps=2, drafter_layers="2")  # finished: resumes at step 2 and only evaluates
    assert places == ["cpu"] * 3  # checkpoint.pt and the two moments
    steps = [state["step"] for state in restored[0].state.values()]
    assert len(steps) == len(saved) and all(s.device.type == "cpu" for s in steps)
    assert [s.item() for s in steps] == [s.item() for s in saved.values()] == [2.0] * len(saved)


def test_activation_checkpointing_uses_the_current_transformers_api(setup, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", FutureWarning
        )  # the deprecated gradient_checkpointing_enable warns
        result = _run(
            setup, tmp_path / "d", steps=1, drafter_layers="2", gradient_checkpointing=True
        )
    assert result["drafter"].model.is_activation_checkpointing


def test_checkpoint_pieces_are_replaced_one_at_a_time_and_resume_after_a_cut_save(
    setup, tmp_path, monkeypatch, capsys
):
    """Weights (checkpoint.pt) and each AdamW moment (optimizer-KEY.pt) are separate pieces,
    each renamed over its old version: no .tmp stays behind, and a kill between two renames
    still resumes (that moment one save behind)."""
    out = tmp_path / "d"
    _run(setup, out, steps=2, drafter_layers="2", save_every=1)
    assert sorted(p.name for p in out.glob("*.pt*")) == [
        "checkpoint.pt",
        "optimizer-exp_avg.pt",
        "optimizer-exp_avg_sq.pt",
    ]
    real_save = torch.save

    def cut_before_the_last_piece(
        obj, path, *a, **k
    ):  # the weights and exp_avg of step 3 land, exp_avg_sq not
        if str(path).endswith("optimizer-exp_avg_sq.pt.tmp") and obj["step"] == 3:
            raise KeyboardInterrupt
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", cut_before_the_last_piece)
    with pytest.raises(KeyboardInterrupt):
        _run(setup, out, steps=3, drafter_layers="2", save_every=1)
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 3
    assert torch.load(out / "optimizer-exp_avg_sq.pt", weights_only=True)["step"] == 2
    _run(setup, out, steps=4, drafter_layers="2", save_every=1)
    assert "AdamW exp_avg_sq is from step 2, the weights from step 3" in capsys.readouterr().out
    assert torch.load(out / "optimizer-exp_avg_sq.pt", weights_only=True)["step"] == 4


def test_bf16_training_saves_a_bf16_drafter(setup, tmp_path):
    with (
        pytest.warns(UserWarning)
        if not runtime.native_bf16(torch.device("cpu"))
        else contextlib.nullcontext()
    ):
        result = _run(setup, tmp_path / "d", steps=2, drafter_layers="2", dtype="bfloat16")
    saved = d3d.Drafter.from_pretrained(str(tmp_path / "d"))
    assert (
        next(saved.parameters()).dtype == torch.bfloat16
    )  # the training dtype, half the disk of fp32
    assert next(result["drafter"].parameters()).dtype == torch.bfloat16
    master = torch.load(tmp_path / "d" / "checkpoint.pt", weights_only=True)["piece"]["model"]
    assert all(
        v.dtype == torch.float32 for v in master.values() if v.is_floating_point()
    )  # resumes exactly


def _ddp_worker(rank, setup_paths, out, port):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    result = train.main(
        target=setup_paths["target"],
        prompts=setup_paths["prompts"],
        out=out,
        steps=3,
        drafter_layers="2",
        **FAST,
    )
    torch.save(result["drafter"].state_dict(), os.path.join(out, f"rank{rank}.pt"))


def test_ddp_two_processes_end_with_identical_weights(setup, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "drafter")
    os.makedirs(out)
    mp.spawn(
        _ddp_worker,
        args=({"target": setup["target"], "prompts": setup["prompts"]}, out, port),
        nprocs=2,
    )
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    vocab = (len(setup["tok"]) // 16 + 1) * 16
    initial = train.build_drafter(
        setup["target"], setup["tok"], target_vocab_size=vocab, layers="2"
    ).state_dict()
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    assert not all(torch.equal(ranks[0][k], initial[k]) for k in ranks[0])  # it did train
    assert os.path.exists(os.path.join(out, "train_args.json"))
    assert json.load(open(os.path.join(out, "train_args.json")))["world_size"] == 2


def test_clear_errors(setup, tmp_path):
    _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "1 + 1"}])
    with pytest.raises(ValueError, match="no field 'question'.*--prompt-field"):
        _run({**setup, "prompts": str(tmp_path / "p.jsonl")}, tmp_path / "d")
    other = setup["tok"].__class__.from_pretrained(setup["target"])
    other.add_tokens(["xyz"])  # another tokenizer: ids mean other text
    _tiny_model(other).save_pretrained(tmp_path / "init")
    other.save_pretrained(tmp_path / "init")
    with pytest.raises(ValueError, match="different tokenizer"):
        train.build_drafter(str(tmp_path / "init"), setup["tok"], target_vocab_size=64)
    with pytest.raises(runtime.UserError, match="unrecognized arguments: --bogus-flag"):
        train.parse_args(["--bogus-flag", "1"])
    # where d_1 is read: --d1-from
    assert train.parse_args([]).d1_from == "causal"
    assert train.parse_args(["--d1-from", "mask"]).d1_from == "mask"


def test_prune_command_removes_layers_and_keeps_decoding_lossless(setup, tmp_path, capsys):
    """`python train.py prune`: on a trained drafter and its cached answers, one layer
    leaves per iteration, the table and the pruned folder are written, and the pruned
    drafter still decodes exactly like the target."""
    _run(setup, tmp_path / "drafter", steps=2, drafter_layers="3")
    argv = [
        "--drafter",
        str(tmp_path / "drafter"),
        "--min-layers",
        "1",
        "--recovery-steps",
        "1",
        "--batch-size",
        "4",
        "--num-val",
        "3",
        "--val-anchors",
        "4",
        "--compare-prompts",
        "2",
        "--max-new-tokens",
        "8",
        "--gradient-checkpointing",
    ]
    result = pruning.prune_main(**vars(pruning.parse_prune_args(argv)))
    assert [row["layers"] for row in result["table"]] == [3, 2, 1]
    assert (
        result["checkpointing"] and result["dtype"] == "float32"
    )  # the flag, and a CPU's default dtype
    assert set(result["decode"]) == {
        "unpruned sync",
        "unpruned async",
        "pruned sync",
        "pruned async",
    }
    pruned = d3d.Drafter.from_pretrained(str(tmp_path / "drafter-pruned"))
    assert pruned.model.config.num_hidden_layers == 1 and len(pruned.d3d_config.layer_ids) == 1
    assert os.path.isfile(tmp_path / "drafter-pruned" / "prune_table.json")
    target = answers.load_target(setup["target"], "cpu")
    ids = torch.tensor([setup["tok"].encode("<|user|>\n3 * 4<|end|>\n<|assistant|>\n")])
    expected, _ = d3d.generate(target, None, ids, max_new_tokens=12, mode="target")
    for mode in ("sync", "async"):
        assert (
            d3d.generate(target, pruned, ids, max_new_tokens=12, mode=mode)[0].tolist()
            == expected.tolist()
        )
    printed = capsys.readouterr().out
    assert "removed" in printed and "estimated peak of a recovery step" in printed
    with pytest.raises(runtime.UserError, match="unrecognized arguments: --bogus"):
        pruning.parse_prune_args(["--bogus"])


def test_prune_in_bf16_reads_the_weights_recovery_changed(setup, tmp_path):
    """Pruning runs in one bf16 autocast context; recovery steps change the weights inside
    it. Every later pass must read the new weights, not the bf16 copies autocast's cast
    cache keeps for the whole context."""
    _run(setup, tmp_path / "drafter", steps=2, drafter_layers="3")
    trained = evaluation.load_trained(str(tmp_path / "drafter"), torch.device("cpu"))
    drafter = trained.drafter
    batches = [answers.collate(trained.val[:3], trained.pad_id, 1024)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        list(
            d3d.prune_drafter(
                drafter, batches, batches, min_layers=2, recovery_steps=3, lr=1e-2, val_anchors=4
            )
        )
        ids = batches[0][0][:, :12]
        args = (torch.arange(12)[None], torch.ones(1, 1, 12, 12, dtype=torch.bool).tril())
        with torch.no_grad():
            fresh = copy.deepcopy(drafter)  # new tensors: nothing cached
            assert torch.equal(
                drafter.hidden_states(ids[:1], *args), fresh.hidden_states(ids[:1], *args)
            )


def test_random_init_keeps_the_architecture_and_d1_from_is_recorded(setup):
    tok = setup["tok"]
    vocab = _tiny_model(tok).config.vocab_size
    pretrained = train.build_drafter(setup["target"], tok, target_vocab_size=vocab, layers="2")
    torch.manual_seed(1)
    random_a = train.build_drafter(
        setup["target"], tok, target_vocab_size=vocab, layers="2", random_init=True, d1_from="mask"
    )
    torch.manual_seed(1)
    random_b = train.build_drafter(
        setup["target"], tok, target_vocab_size=vocab, layers="2", random_init=True
    )

    def shapes(drafter):
        return {k: v.shape for k, v in drafter.state_dict().items()}

    assert shapes(random_a) == shapes(pretrained) and random_a.d3d_config.layer_ids == [0, 3]
    weight = "model.model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(random_a.state_dict()[weight], pretrained.state_dict()[weight])
    assert torch.equal(random_a.state_dict()[weight], random_b.state_dict()[weight])  # seeded
    assert random_a.d3d_config.d1_from == "mask" and pretrained.d3d_config.d1_from == "causal"


def test_every_toy_run_uses_the_shipped_toy_and_its_answers(monkeypatch, tmp_path):
    """Wherever --out puts the drafter, a toy run trains on the shipped target's own
    answers: the target is never loaded (nothing is answered again) and nothing is written
    into the shipped folder."""
    monkeypatch.setattr(
        answers, "load_target", lambda *a, **k: pytest.fail("the shipped answers were not used")
    )
    monkeypatch.setattr(train_flags, "TOY_RUNS", str(tmp_path / "toy"))
    before = {f: os.path.getmtime(os.path.join(toy.SHIPPED, f)) for f in os.listdir(toy.SHIPPED)}
    result = train.main(
        out=str(tmp_path / "lam0" / "drafter"),
        steps=1,
        num_prompts=8,
        num_val=4,
        **{
            k: v
            for k, v in FAST.items()
            if k not in ("max_new_tokens", "num_val", "block_size", "num_anchors", "lr")
        },
    )
    assert result["drafter"].d3d_config.layer_ids == [
        0,
        1,
    ]  # the toy's default: a prefix of the target
    assert result["drafter"].d3d_config.block_size == 8
    assert {
        f: os.path.getmtime(os.path.join(toy.SHIPPED, f)) for f in os.listdir(toy.SHIPPED)
    } == before
    recipe = json.load(open(tmp_path / "lam0" / "drafter" / "train_args.json"))
    # the toy's files recorded relative to the repository: the record survives moving the clone
    assert recipe["target"] == "toy-target"
    assert recipe["answers"] == os.path.join("toy-target", "answers-train.jsonl")
    answers_file = runtime.find_recorded(recipe["answers"], "answers")
    assert os.path.abspath(answers_file) == os.path.join(toy.SHIPPED, "answers-train.jsonl")
    shipped = [json.loads(line) for line in open(answers_file)][1:9]
    # another folder, as after moving the clone: eval and prune still find the toy
    monkeypatch.chdir(tmp_path)
    examples = evaluation.load_trained(str(tmp_path / "lam0" / "drafter"), "cpu").train
    assert examples == [(r["prompt"], r["response"]) for r in shipped]


def test_train_refuses_a_toy_whose_files_do_not_match_toy_json(monkeypatch, tmp_path):
    import shutil

    folder = tmp_path / "toy"
    shutil.copytree(toy.SHIPPED, folder)
    lines = (folder / "answers-train.jsonl").read_text().splitlines(keepends=True)
    (folder / "answers-train.jsonl").write_text(
        "".join(lines[:5] + [lines[6], lines[5]] + lines[7:])
    )
    with pytest.raises(ValueError, match="answers-train.jsonl does not match .*toy.json"):
        train.main(toy=str(folder), out=str(tmp_path / "drafter"), steps=1, device="cpu")


def test_the_answering_flags_reach_the_target(setup, tmp_path, monkeypatch):
    """train.py's flags of how the target answers (--prompt-field, --thinking,
    --max-new-tokens, --gen-batch-size) are the ones load_answers hands to the target: the field
    read, the chat template's thinking switch, the cap on an answer (in the cache's header too),
    the prompts per generate call."""
    _write_jsonl(tmp_path / "asked.jsonl", [{"asked": q} for q in QUESTIONS])
    batches = []
    real_load = answers.load_target

    def load_target(*args, **kwargs):
        target = real_load(*args, **kwargs)
        real_generate = target.generate

        def generate(*gen_args, **gen_kwargs):
            batches.append(gen_kwargs["input_ids"].shape[0])
            return real_generate(*gen_args, **gen_kwargs)

        target.generate = generate
        return target

    monkeypatch.setattr(answers, "load_target", load_target)
    thinking = []
    tok = copy.deepcopy(setup["tok"])
    real_template = tok.apply_chat_template

    def apply_chat_template(*args, **kwargs):
        thinking.append(kwargs.get("enable_thinking"))
        return real_template(*args, **kwargs)

    monkeypatch.setattr(tok, "apply_chat_template", apply_chat_template)
    flags = dict(prompt_field="asked", thinking=True, max_new_tokens=3, gen_batch_size=5)
    flags.update(num_prompts=None, num_val=4, val_fraction=0.25)
    where = str(tmp_path / "asked.jsonl")
    inputs = train_flags.Inputs(setup["target"], where, cache_dir=str(tmp_path / "cache"))
    train_rows, val_rows = train_flags.load_answers(inputs, flags, tok)
    assert len(train_rows) + len(val_rows) == len(QUESTIONS) and len(val_rows) == 3
    assert all(0 < len(response) <= 3 for _, response in train_rows + val_rows)
    assert thinking == [True] * len(QUESTIONS)
    assert batches == [5, 5, 2]
    (cache,) = (tmp_path / "cache").glob("answers-*.jsonl")
    header = json.loads(cache.read_text().splitlines()[0])
    assert header == answers.answers_header(setup["target"], tok, 3)


def test_answers_that_do_not_match_the_prompts_are_refused(setup, tmp_path):
    """An answers file answers given prompt lines in given ids: other prompts, or one
    missing, are an error."""
    answering = answers.Answering(max_new_tokens=4, gen_batch_size=12, cache_dir=str(tmp_path))
    kw = dict(tokenizer=setup["tok"], answering=answering)
    answers.load_data(setup["target"], prompts=setup["prompts"], **kw)
    (cache,) = tmp_path.glob("answers-*.jsonl")
    assert len(
        answers.load_data(setup["target"], prompts=setup["prompts"], answers=str(cache), **kw)
    ) == len(QUESTIONS)
    _write_jsonl(tmp_path / "other.jsonl", [{"question": q} for q in QUESTIONS[::-1]])
    with pytest.raises(
        ValueError, match="does not answer line 1 of .*other.jsonl.*prompt ids differ"
    ):
        answers.load_data(
            setup["target"], prompts=str(tmp_path / "other.jsonl"), answers=str(cache), **kw
        )
    _write_jsonl(tmp_path / "more.jsonl", [{"question": q} for q in QUESTIONS + ["1 + 1"]])
    with pytest.raises(ValueError, match="does not answer line 13 .*no answer"):
        answers.load_data(
            setup["target"], prompts=str(tmp_path / "more.jsonl"), answers=str(cache), **kw
        )


def test_answers_in_another_tokenizers_ids_are_refused(setup, tmp_path):
    """A cached answers file names the tokenizer whose ids it holds; a target with another
    tokenizer must not read it (the same ids would decode to other text), neither as a cache
    nor as a given answers file."""
    answering = answers.Answering(max_new_tokens=4, gen_batch_size=12, cache_dir=str(tmp_path))
    kw = dict(answering=answering)
    answers.load_data(setup["target"], setup["tok"], prompts=setup["prompts"], **kw)
    (cache,) = tmp_path.glob("answers-*.jsonl")
    other = toy.make_tokenizer()
    other.add_tokens(["<|tool|>"])  # one more token: another id table, the same prompts' ids
    with pytest.raises(ValueError, match="in the ids of a tokenizer with fingerprint"):
        answers.load_data(
            setup["target"], other, prompts=setup["prompts"], answers=str(cache), **kw
        )
    with pytest.raises(ValueError, match="in the ids of a tokenizer with fingerprint"):
        answers._read_cache([str(cache)], other)


def test_dtype_auto_picks_bf16_only_where_native(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(runtime, "native_bf16", lambda device: True)
    assert runtime.resolve_dtype("auto", cpu) == runtime.resolve_dtype(None, cpu) == torch.bfloat16
    monkeypatch.setattr(runtime, "native_bf16", lambda device: False)
    assert runtime.resolve_dtype("auto", cpu) == torch.float32
    with pytest.warns(UserWarning, match="slow fallback kernels"):
        assert (
            runtime.resolve_dtype("bfloat16", cpu) == torch.bfloat16
        )  # asked for: honoured, with the cost
    with pytest.raises(ValueError, match="unknown dtype"):
        runtime.resolve_dtype("float8", cpu)


def test_prune_memory_estimate_fits_the_qwen3_drafter_on_one_80gb_gpu():
    """Qwen3-1.7B as a drafter (28 layers, hidden 2,048, vocab 151,936, 2.03e9 parameters),
    recovery on 27 layers after the first removal: batch 8 of 1,024 answer tokens + K 16 x B
    16 MASKs, bf16 autocast on CUDA."""
    shapes = memory.StepShapes(
        num_params=2.03e9, hidden=2048, layers=27, batch=8, seq_len=1024 + 16 * 16, vocab=151936
    )
    on = memory.prune_memory_estimate(shapes, "cuda")
    off = memory.prune_memory_estimate(dataclasses.replace(shapes, checkpointing=False), "cuda")
    assert on["total"] < 80 and on["activations"] < off["activations"]
    assert on["total"] == pytest.approx(sum(v for k, v in on.items() if k != "total"))
    assert on["weights"] + on["gradients"] + on["adamw_moments"] + on["teacher"] == pytest.approx(
        20 * 2.03e9 / 2**30
    )
    assert on["logits"] == pytest.approx(
        4 * (2**28 // 151936) * 151936 * 4 / 2**30
    )  # 4 chunks of ~1 GiB


def test_resume_with_another_recipe_says_which_setting_differs(setup, tmp_path, capsys):
    """Each setting the recipe records, changed on a resume: refused in one line that names
    its flag and the value trained with, and the checkpoint left as it was."""
    shutil.copytree(setup["target"], tmp_path / "init")
    out = tmp_path / "d"
    _run(setup, out, steps=2, save_every=1, drafter_layers="2")
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    changes = {
        "init": (
            dict(drafter_init=str(tmp_path / "init")),
            f"--drafter-init = {setup['target']!r}",
        ),
        "random_init": (dict(random_init=True), "--random-init = False"),
        "layer_ids": (dict(drafter_layers="3"), "--drafter-layers = [0, 3]"),
        "block_size": (dict(block_size=3), "--block-size = 4"),
        "num_anchors": (dict(num_anchors=5), "--num-anchors = 6"),
        "ar_weight": (dict(ar_weight=0.5), "--ar-weight = 1.0"),
        "decay_gamma": (dict(decay_gamma=7.0), "--decay-gamma = None"),
        "d1_from": (dict(d1_from="mask"), "--d1-from = 'causal'"),
        "freeze_embeddings": (dict(freeze_embeddings=True), "--freeze-embeddings = False"),
        "answers": (dict(num_prompts=11), "the training answers (--target, --prompts"),
        "max_len": (dict(max_len=48), "--max-len = 64"),
        "batch_size": (dict(batch_size=3), "--batch-size = 4"),
        "grad_accum": (dict(grad_accum=2), "--grad-accum = 1"),
        "seed": (dict(seed=1), "--seed = 0"),
        "lr": (dict(lr=5e-3), "--lr = 0.01"),
        "warmup": (dict(warmup=2), "--warmup = 1"),
        "weight_decay": (dict(weight_decay=0.1), "--weight-decay = 0.0"),
        "grad_clip": (dict(grad_clip=0.5), "--grad-clip = 1.0"),
    }
    for key, (change, flag) in changes.items():
        with pytest.raises(runtime.UserError, match=re.escape(flag) + ".*--no-resume"):
            _run(setup, out, **{"steps": 3, "save_every": 1, "drafter_layers": "2", **change})
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    # the tokenizer alone: the same target folder, its tokenizer replaced by one with a token
    # more (its answers cached apart: a cache in another tokenizer's ids is refused)
    replaced = tmp_path / "replaced"
    shutil.copytree(setup["target"], replaced)
    alone = {**setup, "target": str(replaced)}
    _run(alone, tmp_path / "t", steps=2, drafter_layers="2", data_dir=str(tmp_path / "a"))
    longer = toy.make_tokenizer()
    longer.add_tokens(["<|tool|>"])
    longer.save_pretrained(replaced)
    flag = "--target (its tokenizer) = "
    with pytest.raises(runtime.UserError, match=re.escape(flag) + ".*--no-resume"):
        _run(alone, tmp_path / "t", steps=3, drafter_layers="2", data_dir=str(tmp_path / "b"))
    assert {*changes, "tokenizer"} == set(checkpoints.RECIPE_FLAGS)
    # the same recipe resumes; --no-resume starts afresh with the new one
    _run(setup, out, steps=3, save_every=1, drafter_layers="2")
    capsys.readouterr()
    _run(setup, out, steps=1, save_every=1, drafter_layers="2", block_size=3, resume=False)
    assert "[train] --no-resume: starting from step 0" in capsys.readouterr().out


def test_resume_refuses_a_checkpoint_whose_recipe_lacks_a_setting(setup, tmp_path):
    """A checkpoint from a train.py whose recipe recorded fewer settings: whatever it lacks
    cannot be compared, so the resume is refused in one line naming that flag (never resumed
    under another gamma in silence), and the checkpoint is left as it was."""
    out = tmp_path / "d"
    _run(setup, out, steps=2, save_every=1, drafter_layers="2")
    path = out / "checkpoint.pt"
    saved = torch.load(path, weights_only=True)
    del saved["piece"]["recipe"]["decay_gamma"]
    torch.save(saved, path)
    before = path.read_bytes()
    for gamma in (7.0, None):
        with pytest.raises(runtime.UserError) as refused:
            _run(setup, out, steps=3, save_every=1, drafter_layers="2", decay_gamma=gamma)
        said = str(refused.value)
        assert "records no --decay-gamma" in said and "--no-resume" in said, said
        assert "\n" not in said, said
    assert path.read_bytes() == before
    # every setting of the recipe alike
    recipe = saved["piece"]["recipe"]
    recipe["decay_gamma"] = None
    for key, flag in checkpoints.RECIPE_FLAGS.items():
        lacking = {name: value for name, value in recipe.items() if name != key}
        with pytest.raises(runtime.UserError, match=re.escape(f"records no {flag} — ")):
            checkpoints.check_resume({"recipe": lacking}, recipe, str(out))
    checkpoints.check_resume({"recipe": recipe}, recipe, str(out))


def test_a_rerun_of_a_finished_run_says_what_it_found_not_a_nan_loss(setup, tmp_path, capsys):
    out = tmp_path / "d"
    _run(setup, out, steps=2, drafter_layers="2")
    assert f"[train] no checkpoint in {out}: starting from step 0" in capsys.readouterr().out
    tau = json.loads((out / "train_args.json").read_text())["offline_tau"]
    _run(setup, out, steps=2, drafter_layers="2")
    printed = capsys.readouterr().out
    found = f"holds a finished run of 2 steps (offline tau (B=4) {tau:.3f} in train_args.json)"
    assert found in printed, printed
    assert f"[train] step 2: offline tau (B=4) {tau:.3f}" in printed, printed
    assert "loss nan" not in printed, printed


# ---------------------------------------------------------------------------------------------
# Stopped by a signal: the step in progress ends and is saved, and the same command goes on


def _train_py(setup, out, **flags) -> list[str]:
    """`python train.py` on the tiny target with FAST's settings and `flags`, as argv."""
    settings = {**FAST, "drafter_layers": "2", "threads": 1, **flags}
    argv = [sys.executable, "train.py", "--target", setup["target"], "--prompts", setup["prompts"]]
    argv += ["--out", str(out)]
    for name, value in settings.items():
        argv += [runtime.flag_name(name), str(value)]
    return argv


def _wait_for_step(stream, step: int) -> None:
    """Read the progress bar off a child's stderr until it shows `step` done or more."""
    seen = ""
    while True:
        char = stream.read(1)
        assert char, f"the run ended before step {step}: {seen[-2000:]}"
        seen += char
        done = re.findall(r"train drafter:.*?\| *(\d+)/", seen[-300:])
        if done and int(done[-1]) >= step:
            return


def test_sigint_mid_run_saves_its_step_and_the_same_command_ends_with_the_uninterrupted_weights(
    setup, tmp_path
):
    """`python train.py`, Ctrl-C in the middle: the step in progress ends and is saved, one
    line says where and how to go on, exit status 130, no traceback; the command it names
    resumes at that step and ends with the weights of a run never interrupted."""
    steps = 400
    flags = dict(steps=steps, save_every=1000, data_dir=str(tmp_path))
    straight = _train_py(setup, tmp_path / "straight", **flags)
    done = subprocess.run(straight, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    cut = tmp_path / "cut"
    command = _train_py(setup, cut, **flags)
    child = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a background process ignores SIGINT unless it resets the handler
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    _wait_for_step(child.stderr, 5)
    child.send_signal(signal.SIGINT)
    printed, err = child.communicate(timeout=600)
    assert child.returncode == 130, err
    assert "Traceback" not in err, err
    assert f"[train] no checkpoint in {cut}: starting from step 0" in printed
    (line,) = [line for line in printed.splitlines() if "stopped after" in line]
    stopped_at = int(re.search(rf"\[train\] SIGINT: stopped after step (\d+) of {steps}", line)[1])
    assert 5 <= stopped_at < steps, line
    assert f"saved in {cut / 'checkpoint.pt'}; go on with: " in line
    saved = torch.load(cut / "checkpoint.pt", weights_only=True)
    assert saved["step"] == stopped_at
    go_on = shlex.split(line.split("go on with: ")[1])
    assert go_on[0] == "python" and go_on[1:] == command[1:], line
    again = subprocess.run(
        [sys.executable, *go_on[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr
    assert f"[train] resumed from {cut / 'checkpoint.pt'} at step {stopped_at}" in again.stdout
    uninterrupted = d3d.Drafter.from_pretrained(str(tmp_path / "straight")).state_dict()
    resumed = d3d.Drafter.from_pretrained(str(cut)).state_dict()
    assert uninterrupted.keys() == resumed.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


def test_sigterm_stops_at_the_end_of_its_step_and_the_rerun_goes_on(setup, tmp_path, monkeypatch):
    """SIGTERM (what a scheduler sends before it kills) as Ctrl-C: the step it came in ends
    and is saved; in process, train.main raises checkpoints.Interrupted with the line."""
    straight = _run(setup, tmp_path / "a", steps=6, drafter_layers="2")["drafter"]
    real_loss = d3d.d3d_loss
    calls = []

    def signalled_in_step_3(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGTERM)
        return real_loss(*a, **k)

    monkeypatch.setattr(d3d, "d3d_loss", signalled_in_step_3)
    handlers = [signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)]
    with pytest.raises(checkpoints.Interrupted, match="SIGTERM: stopped after step 3 of 6"):
        _run(setup, tmp_path / "b", steps=6, drafter_layers="2", save_every=1000)
    monkeypatch.setattr(d3d, "d3d_loss", real_loss)
    # the signal handlers are the ones before the run
    assert [signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)] == handlers
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["step"] == 3
    resumed = _run(setup, tmp_path / "b", steps=6, drafter_layers="2")["drafter"]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_second_sigint_stops_at_once_and_the_last_checkpoint_resumes(
    setup, tmp_path, monkeypatch, capsys
):
    """`python train.py`, Ctrl-C twice within step 3: the second does not wait for the step to
    end. The run stops there with one line and exit status 130, step 3 is never saved (the
    checkpoint of step 2 stays whole), and the same command goes on from step 2."""
    real_loss = d3d.d3d_loss
    calls = []

    def signalled_twice_in_step_3(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        return real_loss(*a, **k)

    monkeypatch.setattr(d3d, "d3d_loss", signalled_twice_in_step_3)
    out = tmp_path / "d"
    argv = _train_py(setup, out, steps=6, save_every=1)[2:]
    # Python's own Ctrl-C handler, also where the tests run with SIGINT ignored
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            train.run_command(argv)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert stopped.value.code == 130
    printed, err = capsys.readouterr()
    waited = [line for line in (printed + err).splitlines() if "stopped after" in line]
    assert not waited, f"the run waited for the end of its step: {waited}"
    assert err.strip().splitlines()[-1].startswith("[train] interrupted, not at a step"), err
    assert "Traceback" not in err, err
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 2
    monkeypatch.setattr(d3d, "d3d_loss", real_loss)
    train.run_command(argv)
    assert f"[train] resumed from {out / 'checkpoint.pt'} at step 2" in capsys.readouterr().out


def test_a_signal_the_process_ignores_stays_ignored(setup, tmp_path, monkeypatch):
    """A shell's background job ignores SIGINT (Ctrl-C is meant for the foreground job):
    training keeps ignoring it and runs to its end."""
    real_loss = d3d.d3d_loss

    def signalled(*a, **k):
        signal.raise_signal(signal.SIGINT)
        return real_loss(*a, **k)

    monkeypatch.setattr(d3d, "d3d_loss", signalled)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = _run(setup, tmp_path / "d", steps=2, drafter_layers="2")
    finally:
        signal.signal(signal.SIGINT, before)
    assert result["history"][-1]["step"] == 2
    assert torch.load(tmp_path / "d" / "checkpoint.pt", weights_only=True)["step"] == 2


def _signalled_ddp_worker(rank, setup_paths, out, port):
    """A DDP process of 2 in which only rank 0 receives SIGINT, in step 2; each writes the
    line it stopped with."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    # a process started with SIGINT ignored (the tests run in the background) passes that on
    # to the processes it spawns: each takes Python's own Ctrl-C handler back, as one started
    # in the foreground has
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if rank == 0:
        real_loss = d3d.d3d_loss
        calls = []

        def signalled_in_step_2(*a, **k):
            calls.append(1)
            if len(calls) == 2:
                signal.raise_signal(signal.SIGINT)
            return real_loss(*a, **k)

        d3d.d3d_loss = signalled_in_step_2
    line = "not stopped"
    try:
        train.main(
            target=setup_paths["target"],
            prompts=setup_paths["prompts"],
            out=out,
            steps=6,
            drafter_layers="2",
            dist_timeout=1,
            **FAST,
        )
    except checkpoints.Interrupted as stop:
        line = str(stop)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(line)
    # leave without taking the process group down: gloo's teardown, with the other process
    # gone or going, can wait forever (the verdict is in the file)
    os._exit(0)


def test_ddp_processes_agree_on_a_stop_only_one_of_them_was_signalled(setup, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "drafter")
    os.makedirs(out)
    paths = {"target": setup["target"], "prompts": setup["prompts"]}
    mp.spawn(_signalled_ddp_worker, args=(paths, out, port), nprocs=2)
    lines = [open(os.path.join(out, f"rank{rank}.txt")).read() for rank in range(2)]
    assert lines[0].startswith("[train] SIGINT: stopped after step 2 of 6"), lines
    assert lines[1].startswith("[train] another process's signal: stopped after step 2 of 6"), lines
    assert torch.load(os.path.join(out, "checkpoint.pt"), weights_only=True)["step"] == 2


# ---------------------------------------------------------------------------------------------
# Pictures: train.py --plot, train.py eval --plot, train.py prune --plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# the toy at its smallest: 5 steps, B = 4, 8 held-out answers (seconds on a CPU)
TOY_SMALL = dict(
    steps=5,
    block_size=4,
    num_anchors=8,
    batch_size=4,
    num_val=8,
    val_anchors=4,
    eval_every=1000,
    device="cpu",
)


def _spy(monkeypatch, name):
    """Record every call of pictures.<name> (path, data, keywords); the picture is still drawn."""
    calls = []
    real = getattr(pictures, name)

    def spy(path, data, **keywords):
        calls.append((path, data, keywords))
        return real(path, data, **keywords)

    monkeypatch.setattr(pictures, name, spy)
    return calls


def _printed_curves(printed: str) -> dict:
    """The table print_curves wrote: per d_1 source, the column of shares with d_1 .. d_i all
    accepted, as printed (3 decimals)."""
    lines = printed.splitlines()
    start = next(k for k, line in enumerate(lines) if "head: all" in line) + 1
    rows = []
    for line in lines[start:]:
        if not re.fullmatch(r"\s*\d+(\s+\d+\.\d+){4}", line):
            break
        rows.append(line.split())
    return {"causal": [r[1] for r in rows], "mask": [r[3] for r in rows]}


def _check_curve_picture(calls, curves: dict, printed: str, block_size: int):
    """The picture drawn once, from the curves returned, which are also those printed."""
    (path, data, _), *others = calls
    assert not others
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    bars = pictures.block_accuracy_data(data)
    assert bars["positions"] == list(range(1, block_size + 1))
    assert bars["percent"] == {
        "d_1 from the head": [100 * v for v in curves["causal"]],
        "d_1 from MASK 1": [100 * v for v in curves["mask"]],
    }
    assert _printed_curves(printed) == {
        first: [f"{v:.3f}" for v in curve] for first, curve in curves.items()
    }
    assert f"{path}" in printed


@pytest.fixture(scope="module")
def plotted(tmp_path_factory):
    """The toy's drafter at the smallest sizes, trained with --plot: the run's result, what it
    printed, the pictures drawn."""
    pytest.importorskip("matplotlib")
    root = tmp_path_factory.mktemp("plotted")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch:
        calls = _spy(monkeypatch, "draw_block_accuracy")
        with contextlib.redirect_stdout(printed):
            result = train.main(
                out=str(root / "drafter"),
                data_dir=str(root),
                plot=str(root / "acc.png"),
                **TOY_SMALL,
            )
    return {"root": root, "result": result, "printed": printed.getvalue(), "calls": calls}


def test_train_plot_draws_the_held_out_acceptance_by_position(plotted):
    """`python train.py --plot P.png`: at the end of training, the share of held-out blocks
    with d_1 .. d_i all accepted, by position i, d_1 from the head and from MASK 1: the
    numbers the run printed and returned, whose sum + 1 is the offline tau it reported."""
    result = plotted["result"]
    curves = result["curve"]
    _check_curve_picture(plotted["calls"], curves, plotted["printed"], 4)
    assert plotted["calls"][0][0] == str(plotted["root"] / "acc.png")
    first = result["drafter"].d3d_config.d1_from
    assert 1 + sum(curves[first]) == pytest.approx(result["offline_tau"], abs=1e-5)
    other = {"causal": "mask", "mask": "causal"}[first]
    assert 1 + sum(curves[other]) == pytest.approx(result[f"offline_tau_d1_from_{other}"], abs=1e-5)


def test_eval_plot_draws_the_curves_it_prints(plotted, tmp_path, monkeypatch, capsys):
    """`python train.py eval --plot P.png` draws the acceptance by position it prints and
    returns; on the same held-out blocks as training's own picture."""
    calls = _spy(monkeypatch, "draw_block_accuracy")
    drafter = str(plotted["root"] / "drafter")
    result = evaluation.eval_main(["--drafter", drafter, "--plot", str(tmp_path / "e.png")])
    _check_curve_picture(calls, result["curve"], capsys.readouterr().out, 4)
    assert calls[0][0] == str(tmp_path / "e.png")
    for first in ("causal", "mask"):
        assert 1 + sum(result["curve"][first]) == pytest.approx(result[first], abs=1e-5)
    assert result["curve"] == plotted["result"]["curve"]


def test_eval_block_accuracy_reads_d1_where_decoding_does(plotted, capsys):
    """`train.py eval` prints block accuracy by position: position 1 is d_1 where decoding
    reads it (the causal row, by default), so on the same held-out blocks its
    accuracy is the share of blocks whose d_1 is accepted, not MASK 1's."""
    drafter = str(plotted["root"] / "drafter")
    result = evaluation.eval_main(["--drafter", drafter])
    assert plotted["result"]["drafter"].d3d_config.d1_from == "causal"
    assert len(result["block_acc"]) == 4
    assert result["block_acc"][0] == pytest.approx(result["curve"]["causal"][0], abs=1e-6)
    assert result["curve"]["causal"][0] != result["curve"]["mask"][0]  # the test can tell
    printed = capsys.readouterr().out.split("d_i read from")[1]
    rows = re.findall(r"^\s+(\d)\s+(\d\.\d{3})  (.+)$", printed, flags=re.M)
    assert rows == [
        (str(i), f"{accuracy:.3f}", where)
        for i, (accuracy, where) in enumerate(
            zip(
                result["block_acc"],
                [
                    "d_1 (as decoding reads it): the causal row",
                    "MASK 2",
                    "MASK 3",
                    "MASK 4",
                ],
            ),
            start=1,
        )
    ]


def test_prune_plot_draws_the_rows_prune_drafter_yields(plotted, tmp_path, monkeypatch, capsys):
    """`python train.py prune --plot P.png`: the curve's points are the table's rows, τ
    before and after recovery at each depth, as printed."""
    calls = _spy(monkeypatch, "draw_pruning_curve")
    png = tmp_path / "prune.png"
    argv = ["--drafter", str(plotted["root"] / "drafter"), "--out", str(tmp_path / "pruned")]
    argv += ["--min-layers", "1", "--recovery-steps", "1", "--batch-size", "4"]
    argv += ["--num-val", "3", "--val-anchors", "4", "--compare-prompts", "0"]
    argv += ["--plot", str(png)]
    result = pruning.prune_main(**vars(pruning.parse_prune_args(argv)))
    (path, rows, _), *others = calls
    assert not others and path == str(png)
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC
    table = result["table"]
    assert [row["layers"] for row in table] == [2, 1]
    points = pictures.pruning_curve_data(rows)
    assert points["layers"] == [row["layers"] for row in table]
    assert points["tau_before"] == [row["tau_before_recovery"] for row in table]
    assert points["tau_after"] == [row["tau_after_recovery"] for row in table]
    printed = capsys.readouterr().out
    for row in table:
        assert f"{row['tau_after_recovery']:>11.3f}" in printed
    assert f"pruning curve: {png}" in printed


def test_plot_without_matplotlib_is_one_line_naming_the_install(setup, tmp_path, monkeypatch):
    """Without matplotlib each --plot is refused before any work, in one line that names
    requirements-plots.txt."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    png = str(tmp_path / "p.png")
    prune_argv = ["--drafter", "nowhere", "--min-layers", "1", "--plot", png]
    prune_args = pruning.parse_prune_args(prune_argv)
    runs = {
        "train.py": functools.partial(_run, setup, tmp_path / "d", steps=1, plot=png),
        "train.py eval": functools.partial(
            evaluation.eval_main, ["--drafter", "nowhere", "--plot", png]
        ),
        "train.py prune": functools.partial(pruning.prune_main, **vars(prune_args)),
    }
    for name, run in runs.items():
        with pytest.raises(runtime.UserError) as error:
            run()
        message = str(error.value)
        assert "pip install -r requirements-plots.txt" in message, (name, message)
        assert "\n" not in message
    assert not os.path.exists(tmp_path / "d")
