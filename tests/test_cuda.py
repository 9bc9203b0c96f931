"""The CUDA checks: streams, bf16 decoding, a training step at Qwen3's shapes, the timers.
Skipped without CUDA; tests/gpu_check.py runs them under the stream sanitizer.

Run on a GPU machine: python -m pytest -q -s tests/test_cuda.py (about a minute)
"""

import time

import pytest
import torch

import d3d
import runtime
from test_d3d import (
    TEXT_VOCAB,
    make_tokenizer,
    tiny_qwen3,
)

torch.set_num_threads(1)


# Skipped where torch sees no CUDA device
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def overlap_saved(stats: dict) -> float:
    """What running verification and the packed pass side by side saved: below zero where it cost
    time."""
    return stats["time_verify"] + stats["time_packed_draft"] - stats["time_both"]


@needs_cuda
@pytest.mark.parametrize("lanes", [1, 2])
def test_cuda_async_streams_equal_target(tok, lanes):
    """One stream and two: async output equals target-only; the overlap, measured by events and not
    clamped, stays within what physics allows: none on one stream, at most the shorter pass on two
    (events on the wrong stream, or a side stream that did not wait, break these bounds)."""
    target = tiny_qwen3(seed=1).cuda()
    prompt = torch.tensor([[7, 1, 9, 4]], device="cuda")
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=40, mode="target")
    for model in (tiny_qwen3(seed=11), tiny_qwen3(seed=1)):
        drafter = d3d.make_drafter(model, tokenizer=tok, block_size=6).cuda()
        for cover in ("first", "likely"):
            out, stats = d3d.generate(
                target, drafter, prompt, max_new_tokens=40, mode="async", cover=cover, lanes=lanes
            )
            assert out.tolist() == expected.tolist()
            verify, packed, saved = (
                stats["time_verify"],
                stats["time_packed_draft"],
                overlap_saved(stats),
            )
            assert verify > 0 and packed > 0
            print(
                f"\n[cuda] lanes {lanes}: verify {verify * 1e3:.2f} ms, "
                f"packed {packed * 1e3:.2f} ms, overlap {saved * 1e3:.3f} ms"
            )
            assert saved <= (1e-3 * (verify + packed) if lanes == 1 else min(verify, packed) + 1e-5)


@needs_cuda
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_bf16_decoding_has_no_errors_in_the_greedy_check(tok, mode):
    """bf16 on a GPU: a speculative output may leave target-only's at a near-tie (passes of
    different shapes round differently), never beyond rounding. Each divergence is classified by the
    greedy check (systems/forensics.py)."""
    from systems import forensics

    target = tiny_qwen3(seed=1, layers=4, init=0.2).cuda().to(torch.bfloat16)
    drafter = d3d.make_drafter(tiny_qwen3(seed=1, layers=4, init=0.2), tokenizer=tok, block_size=8)
    drafter = drafter.cuda().to(torch.bfloat16)
    classes = []
    for seed in range(8):
        prompt = torch.randint(
            0, TEXT_VOCAB, (1, 9), generator=torch.Generator().manual_seed(seed)
        ).cuda()
        reference, _ = d3d.generate(target, None, prompt, max_new_tokens=64, mode="target")
        out, _ = d3d.generate(target, drafter, prompt, max_new_tokens=64, mode=mode)
        reference = reference[0, 9:].tolist()
        other = out[0, 9:].tolist()
        found = "identical"
        if other != reference:
            found = forensics.classify_divergence(target, prompt, reference, other)["class"]
        classes.append(found)
    print(
        f"\n[cuda] bf16 {mode}: "
        + ", ".join(f"{c} {classes.count(c)}" for c in ("identical", "near-tie", "error"))
    )
    assert "error" not in classes


@needs_cuda
def test_cuda_training_step_at_qwen3_shapes_fits():
    """One training step of the Qwen3-1.7B drafter at its full shapes: 28 layers, the 151,936-token
    vocabulary, K 64, B 16, batch 8 of 1,024 tokens, bf16 autocast, activation checkpointing, AdamW:
    peak under 80 GiB (one 80 GB GPU). Prints the peak and the time."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    )
    with torch.device(
        "cuda"
    ):  # made on the GPU: 2B parameters initialised on the host take minutes
        model = Qwen3ForCausalLM(config)
    drafter = d3d.make_drafter(
        model, tokenizer=make_tokenizer(151643), block_size=16, num_anchors=64
    ).train()
    drafter.model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False}
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-5)
    x = torch.randint(0, 151643, (8, 1024), device="cuda")
    loss_mask = torch.zeros_like(x, dtype=torch.bool)
    loss_mask[:, 200:] = True
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert runtime.finite_step(optimizer, list(drafter.parameters()), 1.0)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(
        "\n[cuda] training step of the Qwen3-1.7B drafter (28 layers, batch 8 x 1024): "
        f"loss {loss.item():.3f}, "
        f"peak {peak:.2f} GiB, {time.perf_counter() - start:.2f} s"
    )
    assert torch.isfinite(loss) and peak < 80


@needs_cuda
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_cuda_decode_times_launch_and_device(tok, mode):
    """Sync and async decoding of a 4-layer target on CUDA: exact, and the split of a round printed
    (the host time spent launching each pass next to its device time). Every phase has a device time
    and a launch time; phases that follow one another fit in the total; async's verify and packed
    pass each fit in the span that holds both."""
    target = tiny_qwen3(seed=1, layers=4).cuda()
    drafter = d3d.make_drafter(tiny_qwen3(seed=1, layers=4), tokenizer=tok, block_size=8).cuda()
    prompt = torch.tensor([[7, 1, 9, 4]], device="cuda")
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=200, mode="target")
    out, stats = d3d.generate(target, drafter, prompt, max_new_tokens=200, mode=mode)
    assert out.tolist() == expected.tolist()
    ms = {
        k: 1000 * v / stats["num_rounds"]
        for k, v in stats.items()
        if k.startswith("time_") and k != "time_prefill"
    }
    print(
        f"\n[cuda] {mode}: tau {stats['tau']:.2f}, ms per round: "
        + ", ".join(f"{k[5:]} {v:.3f}" for k, v in ms.items())
    )
    phases = ["draft", "verify"] if mode == "sync" else ["fallback_draft", "both"]
    inner = [] if mode == "sync" else ["verify", "packed_draft"]
    assert all(stats[f"time_{k}"] > 0 and stats[f"time_{k}_launch"] > 0 for k in phases + inner), (
        stats
    )
    assert stats["time_prefill"] + sum(stats[f"time_{k}"] for k in phases) <= stats["time_total"]
    assert all(stats[f"time_{k}"] <= stats["time_both"] * (1 + 1e-3) for k in inner)
