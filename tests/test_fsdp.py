"""train.py --fsdp (FSDP2) on CPU: two gloo processes spawned by torch.multiprocessing, tiny
models from configs (the setup of test_train.py), and one run of train.py --fsdp under
torchrun from the command line."""

import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.multiprocessing as mp
from test_train import FAST, _run, make_setup, spoiled_loss
from torch.distributed.tensor import DTensor

import d3d
import train
from systems import distributed, memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """test_train.py's tiny target (a random 4-layer Qwen3) and its prompts file."""
    return make_setup(tmp_path_factory.mktemp("tiny"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(model):
    return itertools.chain(model.named_parameters(), model.named_buffers())


@contextlib.contextmanager
def _probe(out, rank):
    """Record in OUT/probe-rankR.pt the timeout init_process_group was given (seconds),
    which weights and buffers were on the meta device when distributed.shard_model began,
    rank 0's values of them then, and every rank's whole values once sharded
    (DTensor.full_tensor: all ranks gather them together)."""
    record, real_init, real_shard = (
        {},
        torch.distributed.init_process_group,
        distributed.shard_model,
    )

    def init(*a, **k):
        record["timeout"] = (
            k["timeout"].total_seconds() if "timeout" in k else None
        )  # None: the backend's
        return real_init(*a, **k)

    def shard(model, *a, **k):
        record["meta"] = {name: t.is_meta for name, t in _tensors(model)}
        record["loaded"] = (
            {name: t.detach().clone() for name, t in _tensors(model)} if rank == 0 else {}
        )
        real_shard(model, *a, **k)
        record["sharded"] = {
            name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for name, t in _tensors(model)
        }

    with (
        mock.patch.object(torch.distributed, "init_process_group", init),
        mock.patch.object(distributed, "shard_model", shard),
    ):
        yield
    torch.save(record, os.path.join(out, f"probe-rank{rank}.pt"))


def _worker(rank, world, paths, runs, port):
    """Run train.main once per entry of `runs` ({"out", "kw", "crash_at", "nan_at",
    "copy_to", "probe"}) in this process of a world of `world`; rank 0 saves the returned
    drafter's weights as OUT/final.pt."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1"
    )
    torch.set_num_threads(1)
    for n, run in enumerate(runs):
        os.environ["MASTER_PORT"] = str(port + n)
        real_loss = d3d.d3d_loss
        if run.get(
            "crash_at"
        ):  # a run killed in the step crash_at, after the checkpoint of the step before
            calls = []

            def crash(*a, **k):
                calls.append(1)
                if len(calls) == run["crash_at"]:
                    raise KeyboardInterrupt
                return real_loss(*a, **k)

            d3d.d3d_loss = crash
        if run.get("nan_at"):
            d3d.d3d_loss = spoiled_loss(run["nan_at"])
        try:
            with _probe(run["out"], rank) if run.get("probe") else contextlib.nullcontext():
                result = train.main(
                    target=paths["target"],
                    prompts=paths["prompts"],
                    out=run["out"],
                    **{**FAST, **run["kw"]},
                )
        except KeyboardInterrupt:
            torch.distributed.destroy_process_group()
            if rank == 0 and run.get("copy_to"):
                shutil.copytree(run["out"], run["copy_to"])
            continue
        finally:
            d3d.d3d_loss = real_loss
        if rank == 0:
            torch.save(
                {
                    "weights": result["drafter"].state_dict(),
                    "skipped": result["skipped_steps"],
                    "history": result["history"],
                },
                os.path.join(run["out"], "final.pt"),
            )


def _spawn(setup, runs, world=2):
    paths = {"target": setup["target"], "prompts": setup["prompts"]}
    mp.spawn(_worker, args=(world, paths, runs, _free_port()), nprocs=world)
    return [
        torch.load(os.path.join(r["out"], "final.pt"))
        if os.path.exists(os.path.join(r["out"], "final.pt"))
        else None
        for r in runs
    ]


def _initial(setup, layers="2"):
    vocab = (len(setup["tok"]) // 16 + 1) * 16
    return train.build_drafter(
        setup["target"], setup["tok"], target_vocab_size=vocab, layers=layers
    ).state_dict()


def test_fsdp_ends_with_the_weights_of_ddp(setup, tmp_path):
    """3 steps on 2 processes over the same data: FSDP (sharded weights, reduce-scattered
    gradients, clipping over DTensor gradients) ends where DDP does, and the gathered
    drafter is an ordinary fp32 folder."""
    kw = dict(steps=3, drafter_layers="2", grad_clip=0.5)
    ddp, fsdp = _spawn(
        setup,
        [
            {"out": str(tmp_path / "ddp"), "kw": kw},
            {"out": str(tmp_path / "fsdp"), "kw": {**kw, "fsdp": True}},
        ],
    )
    initial = _initial(setup)
    assert ddp["weights"].keys() == fsdp["weights"].keys()
    for key in ddp["weights"]:
        torch.testing.assert_close(
            fsdp["weights"][key], ddp["weights"][key], rtol=1e-4, atol=1e-5, msg=key
        )
    assert not all(torch.equal(fsdp["weights"][k], initial[k]) for k in initial)  # it did train
    saved = d3d.Drafter.from_pretrained(str(tmp_path / "fsdp"))
    for key, value in saved.state_dict().items():
        assert torch.equal(value, fsdp["weights"][key]), key
    record = json.loads((tmp_path / "fsdp" / "train_args.json").read_text())
    assert record["fsdp"] and record["world_size"] == 2 and record["offline_tau_d1_from_mask"] > 0
    assert os.path.exists(tmp_path / "fsdp" / distributed.SHARDED_CHECKPOINT / ".metadata")
    assert not os.path.exists(tmp_path / "fsdp" / "checkpoint.pt")


def test_fsdp_reads_the_weights_on_rank_0_only_and_broadcasts_them(setup, tmp_path):
    """Under --fsdp on 2 processes rank 1 builds the drafter on the meta device (no weights
    read: one host copy, not one a process) and, once sharded, holds rank 0's weights and
    the buffers outside the state dict (rotary frequencies, computed on rank 0), as rank 0
    does; both process groups have --dist-timeout."""
    out = str(tmp_path / "d")
    _spawn(
        setup,
        [
            {
                "out": out,
                "probe": True,
                "kw": dict(steps=1, drafter_layers="2", fsdp=True, dist_timeout=7),
            }
        ],
    )
    probes = [torch.load(os.path.join(out, f"probe-rank{rank}.pt")) for rank in range(2)]
    assert not any(probes[0]["meta"].values()) and all(probes[1]["meta"].values())
    loaded = probes[0]["loaded"]
    assert any(name.endswith("rotary_emb.inv_freq") for name in loaded)
    for rank, probe in enumerate(probes):
        assert probe["timeout"] == 7 * 60, rank
        assert probe["sharded"].keys() == loaded.keys(), rank
        for name, value in loaded.items():
            assert torch.equal(probe["sharded"][name], value), (rank, name)


def test_a_group_of_one_has_the_timeout_too(setup, tmp_path, monkeypatch):
    """python train.py --fsdp without torchrun: its group of one waits --dist-timeout
    minutes too."""
    made, real_init = [], torch.distributed.init_process_group
    monkeypatch.setattr(
        torch.distributed,
        "init_process_group",
        lambda *a, **k: made.append(k.get("timeout")) or real_init(*a, **k),
    )
    _run(setup, tmp_path / "d", steps=1, drafter_layers="2", fsdp=True, dist_timeout=2.5)
    assert made == [datetime.timedelta(minutes=2.5)]


def test_fsdp_resumes_exactly_and_with_another_number_of_processes(setup, tmp_path, capsys):
    """A 2-process run cut in step 3 resumes from its step-2 checkpoint and ends where the
    uncut run ends. The same step-2 checkpoint, copied, resumes in 1 process: the weights
    are the saved ones, AdamW counts on from 2."""
    kw = dict(steps=4, drafter_layers="2", save_every=2, fsdp=True)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    uncut, _, resumed = _spawn(
        setup,
        [
            {"out": a, "kw": kw},
            {"out": b, "kw": kw, "crash_at": 3, "copy_to": str(tmp_path / "at2")},
            {"out": b, "kw": kw},
        ],
    )
    for key, value in uncut["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key
    # the same final evaluation (the loss shown is a running mean, which starts afresh on a resume)
    assert [h["offline_tau"] for h in uncut["history"]] == [
        h["offline_tau"] for h in resumed["history"]
    ]
    # the step-2 checkpoint, read without any process group: whole tensors (DCP stores
    # them with global shapes)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(
        str(tmp_path / "at2" / distributed.SHARDED_CHECKPOINT), str(tmp_path / "at2.pt")
    )
    saved = torch.load(tmp_path / "at2.pt", weights_only=True)["model"]
    # what train.py itself writes beside DCP's files holds plain types only (resumes load
    # it with weights_only)
    state = torch.load(
        tmp_path / "at2" / distributed.SHARDED_CHECKPOINT / "train_state.pt", weights_only=True
    )
    assert state["step"] == 2 and state["world"] == 2 and len(state["rngs"]) == 2
    one = train.main(
        target=setup["target"],
        prompts=setup["prompts"],
        out=str(tmp_path / "at2"),
        **{**FAST, **kw, "steps": 2},
    )  # finished at step 2: loads, evaluates, gathers
    assert "at step 2 (saved by 2 processes, resumed by 1)" in capsys.readouterr().out
    for key, value in one["drafter"].state_dict().items():
        assert torch.equal(value, saved[f"drafter.{key}"]), key
    train.main(
        target=setup["target"],
        prompts=setup["prompts"],
        out=str(tmp_path / "at2"),
        **{**FAST, **kw, "steps": 3},
    )
    dcp_to_torch_save(
        str(tmp_path / "at2" / distributed.SHARDED_CHECKPOINT), str(tmp_path / "at3.pt")
    )
    optimizer = torch.load(tmp_path / "at3.pt", weights_only=True)["optimizer"]
    counts = {float(s["step"]) for s in optimizer["state"].values()}
    assert counts == {
        3.0
    }  # AdamW's moments and step counts came back from the 2-process checkpoint
    with pytest.raises(ValueError, match="checkpoint of an --fsdp run.*--fsdp"):
        _run(
            setup, tmp_path / "at2", steps=4, drafter_layers="2"
        )  # a sharded checkpoint needs --fsdp
    _run(setup, tmp_path / "plain", steps=1, drafter_layers="2")
    with pytest.raises(ValueError, match="checkpoint of a run without --fsdp.*--no-resume"):
        _run(
            setup, tmp_path / "plain", steps=2, drafter_layers="2", fsdp=True
        )  # and checkpoint.pt needs no --fsdp
    torch.distributed.destroy_process_group()  # the group of one that main set up before the error


def test_fsdp_keeps_frozen_rows_frozen_and_skips_a_non_finite_step(setup, tmp_path):
    """--freeze-embeddings under FSDP, in bf16 (FSDP's mixed precision): every embedding row
    but MASK's stays as it was; a NaN loss in step 2 is skipped on both processes (the norm
    of DTensor gradients decides alike everywhere) and training goes on; the drafter is
    saved in bf16."""
    out = str(tmp_path / "d")
    (result,) = _spawn(
        setup,
        [
            {
                "out": out,
                "nan_at": {2},
                "kw": dict(
                    steps=3, drafter_layers="2", dtype="bfloat16", freeze_embeddings=True, fsdp=True
                ),
            }
        ],
    )
    initial = {k: v.to(torch.bfloat16) for k, v in _initial(setup).items()}
    weights = result["weights"]
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    mask = d3d.Drafter.from_pretrained(out).d3d_config.mask_token_id
    embedding = "model.model.embed_tokens.weight"
    rows = torch.arange(initial[embedding].shape[0]) != mask
    assert torch.equal(weights[embedding][rows], initial[embedding][rows])  # frozen on both shards
    assert not torch.equal(weights[embedding][mask], initial[embedding][mask])  # MASK's row trains
    assert not torch.equal(weights["model.model.norm.weight"], initial["model.model.norm.weight"])
    assert result["skipped"] == 1 and all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.skipif(
    shutil.which("torchrun") is None
    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="torchrun not installed",
)
def test_torchrun_fsdp_end_to_end(setup, tmp_path):
    """torchrun --nproc-per-node 2 train.py --fsdp from the command line on the tiny target
    (toy tokenizer and chat template) with evaluation, checkpointing, activation
    checkpointing and frozen embeddings; a rerun resumes; decode.py and train.py prune load
    the folder it writes (~1 min on 2 cores)."""
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = str(tmp_path / "drafter")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fast = {k: v for k, v in FAST.items() if k not in ("device", "eval_every")}
    flags = [
        "--fsdp",
        "--target",
        setup["target"],
        "--prompts",
        setup["prompts"],
        "--eval-every",
        "2",
        "--save-every",
        "2",
        "--gradient-checkpointing",
        "--freeze-embeddings",
        "--drafter-layers",
        "2",
        "--out",
        out,
    ] + [f"--{k.replace('_', '-')}={v}" for k, v in fast.items()]

    def train_run(steps):
        cmd = [
            torchrun,
            "--nproc-per-node",
            "2",
            "--master-port",
            str(_free_port()),
            "train.py",
            "--steps",
            str(steps),
        ] + flags
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    first = train_run(4)
    assert "[train] step 2:" in first and "[done] offline tau" in first
    again = train_run(6)
    assert "at step 4 (saved by 2 processes, resumed by 2)" in again
    record = json.load(open(os.path.join(out, "train_args.json")))
    assert record["fsdp"] and record["world_size"] == 2 and record["history"][-1]["step"] == 6
    decoded = subprocess.run(
        [
            sys.executable,
            "decode.py",
            "--drafter",
            out,
            "--prompt",
            "12 + 30",
            "--mode",
            "sync",
            "--max-new-tokens",
            "8",
            "--no-color",
            "--threads",
            "1",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert decoded.returncode == 0, decoded.stderr[-3000:]
    pruned = subprocess.run(
        [
            sys.executable,
            "train.py",
            "prune",
            "--drafter",
            out,
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
            "1",
            "--max-new-tokens",
            "8",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert pruned.returncode == 0, pruned.stderr[-3000:]
    assert d3d.Drafter.from_pretrained(out + "-pruned").model.config.num_hidden_layers == 1


def test_fsdp_memory_estimate_fits_the_qwen3_8b_drafter_on_eight_80gb_gpus():
    """Qwen3-8B as its own drafter at full depth (36 layers, hidden 4,096, MLP 12,288, vocab
    151,936, untied head: 8.19e9 parameters), the README's shapes: batch 8 of 1,024 answer
    tokens + K 64 x B 16 MASKs, checkpointing."""
    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128
    root = 2 * 151936 * 4096 + 4096
    shapes = memory.StepShapes(
        num_params=36 * layer + root,
        hidden=4096,
        layers=36,
        batch=8,
        seq_len=1024 + 64 * 16,
        vocab=151936,
    )
    # the parameters FSDP gathers whole: the root's and one layer's
    gathered = dict(root_params=root, layer_params=layer)
    est = {n: memory.fsdp_memory_estimate(shapes, **gathered, world=n) for n in (1, 2, 4, 8)}
    assert 8.1e9 < shapes.num_params < 8.3e9
    for n, e in est.items():
        states = e["weights"] + e["gradients"] + e["adamw_moments"]
        assert states == pytest.approx(16 * shapes.num_params / n / 2**30)
        assert e["total"] == pytest.approx(sum(v for k, v in e.items() if k != "total"))
    assert (
        est[1]["total"] > 140 and est[2]["total"] > 80 and est[8]["total"] < 40
    )  # 8 x 80 GB: room to spare
    no_checkpointing = dataclasses.replace(shapes, checkpointing=False)
    assert memory.fsdp_memory_estimate(no_checkpointing, **gathered, world=8)["total"] > 140
