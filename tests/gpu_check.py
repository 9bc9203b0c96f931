"""The GPU check, one script: about 5 minutes on one H100/H200, nothing downloaded.

    python tests/gpu_check.py             # on a CUDA machine (the paper's shapes, 4 layers of each model)
    python tests/gpu_check.py --tiny      # anywhere: the same steps at toy sizes (a CPU runs it in a minute or two)

1. The CUDA tests of test_d3d.py under TORCH_CUDA_SANITIZER=1 (the stream sanitizer: a tensor read on one stream
   while another writes it is an error), the training step at the 1.7B drafter's full shapes without it.
2. Full-width Qwen3-8B target layers and Qwen3-1.7B drafter layers (hidden 4096 / 2048, the 151,936-token vocabulary,
   random weights, bf16; --layers of each): target-only, sync and async, eager and compiled (CUDA graphs), async with
   one lane and with two streams. A random drafter accepts nothing, so this measures what a round costs, not a
   speedup: ms per target step, per round (draft, verify, packed pass), the host time launching each pass against
   its device time, and the overlap the second stream bought. The full-depth line scales the per-layer part by
   36 / layers (target) and 28 / layers (drafter): an estimate, labelled so.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import d3d  # noqa: E402
import fast  # noqa: E402


def models(tiny: bool, layers: int, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    if tiny:
        shape = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16)
        target_shape, drafter_shape = shape, shape
    else:  # Qwen3-8B and Qwen3-1.7B
        target_shape = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128)
        drafter_shape = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    made = []
    for shape in (target_shape, drafter_shape):
        config = Qwen3Config(num_hidden_layers=layers, max_position_embeddings=4096, attn_implementation="sdpa",
                             **shape)
        with torch.device(device):
            made.append(Qwen3ForCausalLM(config).to(dtype).eval())
    target, drafter_model = made
    vocab = target_shape["vocab_size"]

    class Tok:  # what make_drafter reads of a tokenizer: its size and its table
        def __len__(self):
            return vocab - 10

        def get_vocab(self):
            return {f"t{i}": i for i in range(vocab - 10)}

        def convert_tokens_to_ids(self, token):
            return None
    drafter = d3d.make_drafter(drafter_model, tokenizer=Tok(), block_size=16, target_vocab_size=vocab)
    return target, drafter


def measure(target, drafter, prompt, mode, lanes, caches, new_tokens, repeats=3):
    """The mean stats of `repeats` decodes (after one not timed)."""
    d3d.generate(target, drafter, prompt, max_new_tokens=8, mode=mode, lanes=lanes, caches=caches)
    runs = [d3d.generate(target, drafter, prompt, max_new_tokens=new_tokens, mode=mode, lanes=lanes,
                         caches=caches)[1] for _ in range(repeats)]
    rounds = sum(r["num_rounds"] or (r["num_new_tokens"] - 1) for r in runs)
    ms = lambda key: 1000 * sum(r.get(key, 0.0) for r in runs) / rounds  # noqa: E731
    return {"round": ms("time_total") - ms("time_prefill"), "draft": ms("time_draft"), "verify": ms("time_verify"),
            "packed": ms("time_packed_draft"), "verify_launch": ms("time_verify_launch"),
            "packed_launch": ms("time_packed_draft_launch"),
            "overlap": ms("time_verify") + ms("time_packed_draft") - ms("time_both")}


def main(tiny: bool, layers: int, new_tokens: int, skip_tests: bool):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not skip_tests and device.type == "cuda":
        # the training step at the 1.7B drafter's full shapes runs without the sanitizer, whose bookkeeping of every
        # kernel would take minutes there; it checks memory, not streams
        plain = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_SANITIZER"}  # set at all = on
        for tests, env in (("cuda and not training_step", {**plain, "TORCH_CUDA_SANITIZER": "1"}),
                           ("cuda and training_step", plain)):
            start = time.perf_counter()
            result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-k", tests, "test_d3d.py"],
                                    cwd=ROOT, env=env)
            print(f"[1] pytest -k '{tests}'{' under TORCH_CUDA_SANITIZER=1' if env is not plain else ''}: exit "
                  f"{result.returncode} ({time.perf_counter() - start:.0f} s)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, drafter = models(tiny, layers, device, dtype)
    prompt = torch.randint(0, 1000, (1, 128), device=device)
    print(f"[2] {'toy sizes' if tiny else 'Qwen3-8B target, Qwen3-1.7B drafter'}, {layers} layers each, {dtype}, "
          f"{device}, B 16, prompt 128, {new_tokens} new tokens; ms per round (target: per token)")
    print(f"{'setting':<28}{'round':>8}{'draft':>8}{'verify':>8}{'packed':>8}{'launch v/p':>14}{'overlap':>9}")
    rows = {}
    for compiled in (False, True):
        max_len = d3d.cache_len(prompt.shape[1], new_tokens, 16, *d3d.default_budget(16))
        caches = d3d.Caches.make(target, drafter, max_len)
        if compiled:
            start = time.perf_counter()
            fast.compile_passes(caches)
            fast.warm_up(target, drafter, caches, prompt[:, :16], d3d.MODES)
            fast.warm_up(target, drafter, caches, prompt[:, :16], ("async",), lanes=2)
            print(f"compile and warm-up: {time.perf_counter() - start:.0f} s")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")  # a host sync inside a decode is printed
        for mode, lanes in (("target", 1), ("sync", 1), ("async", 1), ("async", 2)):
            name = f"{'compiled' if compiled else 'eager'} {mode}" + (f", {lanes} lanes" if mode == "async" else "")
            r = rows[name] = measure(target, drafter, prompt, mode, lanes, caches, new_tokens)
            print(f"{name:<28}{r['round']:8.2f}{r['draft']:8.2f}{r['verify']:8.2f}{r['packed']:8.2f}"
                  f"{r['verify_launch']:7.2f}/{r['packed_launch']:<6.2f}{r['overlap']:9.2f}")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    for compiled in ("eager", "compiled"):  # per-layer parts scaled to full depth: an estimate
        t = rows[f"{compiled} target"]["round"]
        print(f"estimate, {compiled}, full depth: target step ~{t * 36 / layers:.1f} ms (upper bound: the head and "
              f"embedding do not scale), sync round ~{rows[f'{compiled} sync']['verify'] * 36 / layers:.1f} + "
              f"{rows[f'{compiled} sync']['draft'] * 28 / layers:.1f} ms (verify + draft)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy sizes (runs anywhere, CPU included)")
    p.add_argument("--layers", type=int, default=4, help="layers of each model (default: 4)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per timed decode (default: 64)")
    p.add_argument("--skip-tests", action="store_true", help="skip step 1 (the CUDA tests)")
    main(**{k.replace("-", "_"): v for k, v in vars(p.parse_args()).items()})
