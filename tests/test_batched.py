"""Batched decoding (systems/batched.py): concurrent requests, each row as if alone.

Run: python -m pytest -q tests/test_batched.py
"""

import pytest
import torch

import d3d
from systems import batched
from test_d3d import (
    TEMPERATURES,
    ScriptedDrafter,
    batch_prompts,
    chi_square_p_value,
    exact_law,
    make_tokenizer,
    tiny_qwen3,
    wrong_temperature,
)

torch.set_num_threads(1)


def alone(target, prompt, max_new, eos=None) -> list[int]:
    """A 1-D prompt's own batch-1 target-only output."""
    out, _ = d3d.generate(
        target, None, prompt[None], max_new_tokens=max_new, mode="target", eos_token_id=eos
    )
    return out[0].tolist()


@pytest.mark.parametrize(
    "mode,d1_from", [("target", "causal"), ("sync", "causal"), ("sync", "mask")]
)
def test_batch_rows_equal_their_own_greedy_output(tok, target, mode, d1_from):
    """Prompts of 1, 4 and 9 tokens decoded together: every row equals its own batch-1 target-only
    output. In sync mode the rows accept different lengths in the same round (a drafter always
    right, one never, one right up to position 2 of 5), the budget (23) is no multiple of the block
    size, and finished rows leave the batch."""
    block_size, max_new = 5, 23
    prompts = batch_prompts()
    right_upto = [block_size, 0, 2]
    drafter = ScriptedDrafter(
        d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=tok, block_size=block_size, d1_from=d1_from),
        [alone(target, p, max_new + block_size + 2) for p in prompts],
        right_upto,
    )
    outs, stats = batched.generate(
        target, drafter if mode == "sync" else None, prompts, max_new_tokens=max_new, mode=mode
    )
    assert [out.tolist() for out in outs] == [alone(target, p, max_new) for p in prompts]
    assert [row["num_new_tokens"] for row in stats["rows"]] == [max_new] * 3
    assert stats["num_new_tokens"] == 3 * max_new
    if mode == "target":
        assert stats["num_rounds"] == max_new - 1  # one pass per token after the prefill's
        return
    for row, upto in zip(stats["rows"], right_upto):
        assert (
            all(n == upto + 1 for n in row["accept_lengths"][:-1])
            and sum(row["accept_lengths"]) == max_new - 1
        )
    # 22 tokens after the prefill: the oracle row needs 4 rounds (6 + 6 + 6 + 4), the partial one 8,
    # the last 22
    assert drafter.batch_sizes == [3] * 4 + [2] * 4 + [1] * 14 and stats["num_rounds"] == 22


def test_batch_eos_inside_an_accepted_block_stops_one_row(tok, target):
    """EOS inside the oracle row's first accepted block: that row stops there (EOS kept) and leaves
    the batch after one round; the other rows go on to their budget."""
    block_size, max_new = 8, 30
    prompts = batch_prompts()
    references = [alone(target, p, max_new + 2 * block_size) for p in prompts]
    new = [r[len(p) :] for r, p in zip(references, prompts)]
    # a token that first appears as row 0's k-th new token (1 < k < 8) and never among the other
    # rows' new tokens
    k = next(
        k
        for k in range(2, 8)
        if new[0][k] not in new[0][:k] and all(new[0][k] not in n for n in new[1:])
    )
    eos = new[0][k]
    drafter = ScriptedDrafter(
        d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=tok, block_size=block_size),
        references,
        [block_size, 3, 0],
    )
    outs, stats = batched.generate(
        target, drafter, prompts, max_new_tokens=max_new, mode="sync", eos_token_id=eos
    )
    assert [out.tolist() for out in outs] == [alone(target, p, max_new, eos) for p in prompts]
    assert outs[0].tolist() == references[0][: len(prompts[0]) + k + 1] and outs[0][-1] == eos
    outs, _ = batched.generate(
        target, None, prompts, max_new_tokens=max_new, mode="target", eos_token_id=eos
    )
    # rows after row 0 left
    assert [out.tolist() for out in outs] == [alone(target, p, max_new, eos) for p in prompts]
    assert [row["num_new_tokens"] for row in stats["rows"]] == [k + 1, max_new, max_new]
    assert drafter.batch_sizes[:2] == [3, 2]


@pytest.mark.parametrize("d1_from", ["causal", "mask"])
def test_batch_sync_with_real_drafters_equals_batch1(tok, target, d1_from):
    """Unscripted drafters through the real code path: every row equals its target-only output, and
    its rounds (accept lengths) equal decoding it alone: the drafter's ragged cache reads each row
    as it would alone."""
    prompts = batch_prompts((3, 1, 6, 2))
    for model in (tiny_qwen3(seed=11), tiny_qwen3(seed=1)):  # random, and the target's own weights
        drafter = d3d.make_drafter(model, tokenizer=tok, block_size=4, d1_from=d1_from)
        outs, stats = batched.generate(target, drafter, prompts, max_new_tokens=30)
        for prompt, out, row in zip(prompts, outs, stats["rows"]):
            single, single_stats = d3d.generate(target, drafter, prompt[None], max_new_tokens=30)
            assert out.tolist() == single[0].tolist() == alone(target, prompt, 30)
            assert row["accept_lengths"] == single_stats["accept_lengths"]
        assert stats["time_draft"] > 0 and stats["time_verify"] > 0 and stats["tokens_per_s"] > 0


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_batch_sampling_matches_target_distribution_per_row(temperature):
    """Sampling stays lossless per row, at each temperature: one batch of 2 x 400 rows, two prompts
    of different lengths interleaved (the short one left-padded); each row's tokens 3 and 4 follow
    its own prompt's exact target law at T (chi-square at alpha = 1e-3, as in test_d3d.py), and
    the same counts reject the law at wrong_temperature(T) and the other prompt's law (rows mixed
    up). The drafter has the target's weights: its d_1 (the causal row) is the target's and is
    accepted, its d_2 (read at MASK) is not, so rows accept and reject in the same round and
    residual draws happen."""
    vocab, block_size, num_samples = 8, 2, 400
    tok = make_tokenizer(vocab)
    target = tiny_qwen3(seed=21, vocab_size=16, init=0.6)
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=21, vocab_size=16, init=0.6), tokenizer=tok, block_size=block_size
    )
    prompts = [[3, 1], [5, 2, 6, 1]]
    outs, stats = batched.generate(
        target,
        drafter,
        [torch.tensor(p) for p in prompts] * num_samples,
        max_new_tokens=4,
        mode="sync",
        temperature=temperature,
        generator=torch.Generator().manual_seed(1234),
    )
    counts = torch.zeros(2, 16 * 16)
    for i, out in enumerate(outs):
        n = len(prompts[i % 2])
        counts[i % 2, 16 * out[n + 2] + out[n + 3]] += 1
    # the last round may be cut by the budget
    lengths = [n for row in stats["rows"] for n in row["accept_lengths"][:-1]]
    rejections = sum(n <= block_size for n in lengths)
    acceptances = sum(n > 1 for n in lengths)
    assert rejections > 0.05 * len(lengths) and acceptances > 0.05 * len(lengths)
    laws = [exact_law(target, p, temperature).flatten() for p in prompts]
    wrong_laws = [exact_law(target, p, wrong_temperature(temperature)).flatten() for p in prompts]
    for own, other in ((0, 1), (1, 0)):
        assert chi_square_p_value(counts[own], laws[own]) > 1e-3, f"prompt {own}"
        assert chi_square_p_value(counts[own], laws[other]) < 1e-3
        assert chi_square_p_value(counts[own], wrong_laws[own]) < 1e-3


def test_batch_bad_inputs_raise_clear_errors(tok, target):
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok)
    prompt = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        batched.generate(
            target, drafter, [prompt, torch.zeros(0, dtype=torch.long)], max_new_tokens=5
        )
    for bad in ([prompt, prompt[None]], [], [prompt.tolist()], prompt):
        with pytest.raises(ValueError, match="list of 1-D id tensors"):
            batched.generate(target, drafter, bad, max_new_tokens=5)
    with pytest.raises(ValueError, match="batched async is not built"):
        batched.generate(target, drafter, [prompt], max_new_tokens=5, mode="async")
    with pytest.raises(ValueError, match="batched.generate"):  # d3d.generate decodes one prompt
        d3d.generate(target, drafter, [prompt], max_new_tokens=5)
    outs, stats = batched.generate(target, drafter, [prompt, prompt[:1]], max_new_tokens=0)
    assert [out.tolist() for out in outs] == [[1, 2, 3], [1]] and stats["num_new_tokens"] == 0


def eos_forms(token: int, other: int) -> dict:
    """Every form an EOS takes (DecodeConfig.eos_token_id: a token or a list of them): a token,
    a list and a tuple of it alone, and of it after a token the output never holds."""
    return {
        "int": token,
        "list": [token],
        "tuple": (token,),
        "list of two": [other, token],
        "tuple of two": (other, token),
    }


def test_every_eos_form_stops_every_decode_at_the_same_token(tok, target):
    """The same EOS given as an int, a list or a tuple: d3d.generate in each mode and a batch
    in each of its modes stop at its first occurrence, EOS kept, as target-only decoding with
    the int does."""
    max_new = 20
    prompts = batch_prompts()
    drafter = d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=tok, block_size=4)
    references = [alone(target, p, max_new) for p in prompts]
    new = [r[len(p) :] for r, p in zip(references, prompts)]
    # a token row 0 first makes as its k-th new token: each row stops at its first occurrence
    # of it, or runs to its budget
    k = next(k for k in range(2, max_new) if new[0][k] not in new[0][:k])
    token = new[0][k]
    vocab = range(target.config.vocab_size)
    other = next(t for t in vocab if all(t not in r for r in references))
    expected = [alone(target, p, max_new, token) for p in prompts]
    assert expected[0] == references[0][: len(prompts[0]) + k + 1]
    for name, eos in eos_forms(token, other).items():
        for mode in d3d.MODES:
            for prompt, wanted in zip(prompts, expected):
                out, _ = d3d.generate(
                    target,
                    drafter,
                    prompt[None],
                    max_new_tokens=max_new,
                    mode=mode,
                    eos_token_id=eos,
                )
                assert out[0].tolist() == wanted, f"{name} {mode}"
        for mode in ("target", "sync"):
            outs, _ = batched.generate(
                target, drafter, prompts, max_new_tokens=max_new, mode=mode, eos_token_id=eos
            )
            assert [out.tolist() for out in outs] == expected, f"{name} batch {mode}"
