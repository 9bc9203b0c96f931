"""generate(on_round=...): one RoundInfo per round, built from the round's one host read.

The callback changes nothing (same tokens, same number of host reads), and what it reports holds
together: the rounds add up to the output, the caches end where the rewinds put them, and in
async mode the segment a round selects is the one that drafts the next round.
Tiny models built from configs (odd sizes), CPU, no network.
"""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import d3d
import runtime

torch.set_num_threads(1)
TEXT_VOCAB = 90  # tokens the tokenizer knows; the models have 99 rows
MODES = ("target", "sync", "async")


def make_tokenizer(size=TEXT_VOCAB):
    vocab = {f"t{i}": i for i in range(size)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def tiny_qwen3(seed=0, vocab_size=99):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).eval()


class PositionDrafter(d3d.Drafter):
    """A real drafter (its KV cache moves as usual) whose logits follow a script keyed on the
    position a row drafts: a MASK at position p drafts p, a causal token at p drafts p + 1.
    The right token is reference[p] (the target's greedy output), except at p % 7 == 3 (wrong,
    the right token its runner-up: a rejection branch can catch it) and p % 11 == 5 (wrong, the
    right token nowhere near: a miss). So one decode has branch hits, misses and full
    acceptances."""

    def __init__(self, drafter, reference):
        super().__init__(drafter.model, drafter.d3d_config)
        self.reference = reference

    def hidden_states(self, ids, positions, mask, cache=None):
        super().hidden_states(ids, positions, mask, cache)
        vocab = self.d3d_config.target_vocab_size
        scripted = torch.zeros(*ids.shape, vocab)
        is_mask = ids == self.d3d_config.mask_token_id
        for b in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                p = int(positions[b, j])
                if not is_mask[b, j]:
                    p = p + 1
                good = 0
                if p < len(self.reference):
                    good = self.reference[p]
                wrong = (good + 1) % TEXT_VOCAB
                if p % 7 == 3:
                    scripted[b, j, wrong] = 10.0
                    scripted[b, j, good] = 5.0
                elif p % 11 == 5:
                    scripted[b, j, wrong] = 10.0
                    scripted[b, j, (good + 2) % TEXT_VOCAB] = 5.0
                else:
                    scripted[b, j, good] = 10.0
        return scripted  # "hidden states" that are already the scripted logits

    def logits(self, hidden):
        return hidden


BLOCK_SIZE = 4
MAX_NEW = 40
PROMPT = torch.tensor([[3, 1, 4, 1, 5, 9]])


@pytest.fixture(scope="module")
def models_():
    target = tiny_qwen3(seed=1)
    reference, _ = d3d.generate(
        target, None, PROMPT, max_new_tokens=MAX_NEW + 2 * BLOCK_SIZE + 2, mode="target"
    )
    base = d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=make_tokenizer(), block_size=BLOCK_SIZE)
    return target, PositionDrafter(base, reference[0].tolist())


def decode(models_, mode, on_round=None, **kwargs):
    target, drafter = models_
    return d3d.generate(
        target,
        drafter,
        PROMPT,
        max_new_tokens=MAX_NEW,
        mode=mode,
        coverage=2,
        fanout=1,
        on_round=on_round,
        **kwargs,
    )


@pytest.mark.parametrize("mode", MODES)
def test_the_callback_changes_no_token(models_, mode):
    rounds = []
    without, stats_without = decode(models_, mode)
    with_callback, stats_with = decode(models_, mode, rounds.append)
    assert with_callback.tolist() == without.tolist()
    assert stats_with["num_rounds"] == stats_without["num_rounds"]
    # one round per target pass after the prefill's (target mode counts no speculative rounds)
    assert len(rounds) == stats_with["num_rounds"] or mode == "target"
    assert len(rounds) == stats_with["num_new_tokens"] - 1 or mode != "target"
    if mode == "async":
        assert stats_with["hits_per_position"] == stats_without["hits_per_position"]


def test_the_callback_changes_no_sampled_token(models_):
    """The bonus guess the callback shows is the one the round drew: no extra draw."""
    sampled = []
    for on_round in (None, lambda info: None):
        generator = torch.Generator().manual_seed(0)
        out, _ = decode(models_, "async", on_round, temperature=1.0, generator=generator)
        sampled.append(out.tolist())
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("mode", MODES)
def test_the_callback_adds_no_host_read(models_, mode, monkeypatch):
    calls = []

    def counted(values, *caches):
        calls.append(len(values))
        return runtime.read_round(values, *caches)

    # the name d3d.py's loops call (d3d.py imports it from runtime.py)
    monkeypatch.setattr(d3d, "read_round", counted)
    decode(models_, mode)
    without = len(calls)
    calls.clear()
    decode(models_, mode, lambda info: None)
    assert len(calls) == without


def check_rounds(rounds, out, stats, mode):
    """The invariants every mode's rounds hold."""
    prompt_len = PROMPT.shape[1]
    new_tokens = out[0, prompt_len:].tolist()
    assert [info.index for info in rounds] == list(range(len(rounds)))
    assert all(info.mode == mode for info in rounds)
    # the rounds add up to the output: the prefill's first token, then each round's commit
    assert [new_tokens[0]] + sum((info.committed for info in rounds), []) == new_tokens
    if mode != "target":
        assert [len(info.committed) for info in rounds] == stats["accept_lengths"]
    n = prompt_len
    for info in rounds:
        assert info.n == n
        n += len(info.committed)
        accepted = info.draft[: info.num_accepted] + [info.next_token]
        if info is rounds[-1]:  # the last round may be cut at the budget
            assert info.committed == accepted[: len(info.committed)]
        else:
            assert info.committed == accepted
        assert 0 <= info.num_accepted <= info.num_real <= len(info.draft)
        # the target's cache: x_0 .. x_{n-1} at the start, x_0 .. x_{n'-1} at the end
        assert info.target_cache == (info.n, info.n + len(info.committed))
    for before, after in zip(rounds, rounds[1:]):  # nothing touches a cache between rounds
        assert after.target_cache[0] == before.target_cache[1]
        assert after.drafter_cache[0] == before.drafter_cache[1]


def test_target_rounds_are_one_token_each(models_):
    rounds = []
    out, stats = decode(models_, "target", rounds.append)
    check_rounds(rounds, out, stats, "target")
    for info in rounds:
        assert info.draft == [] and info.num_real == 0 and info.num_accepted == 0
        assert info.drafted_by == "" and info.drafter_cache == (0, 0)
        assert info.outcomes is None and info.segment is None


def test_sync_rounds_hold_together(models_):
    rounds = []
    out, stats = decode(models_, "sync", rounds.append)
    check_rounds(rounds, out, stats, "sync")
    assert {info.num_accepted for info in rounds} != {BLOCK_SIZE}  # the script rejects some
    for info in rounds:
        assert len(info.draft) == info.num_real == BLOCK_SIZE
        assert info.drafted_by == "draft pass" and info.d1_from == "causal"
        assert info.outcomes is None and info.segment is None
        # the drafter reads the unread committed tokens up to x_n, then keeps x_0 .. x_n
        assert info.n - BLOCK_SIZE <= info.drafter_cache[0] <= info.n
        assert info.drafter_cache[1] == info.n + 1


def test_async_rounds_hold_together(models_):
    rounds = []
    out, stats = decode(models_, "async", rounds.append)
    check_rounds(rounds, out, stats, "async")
    coverage, fanout = 2, 1
    assert rounds[0].drafted_by == "draft pass"
    for info in rounds:
        assert len(info.draft) == BLOCK_SIZE
        L = info.num_real
        assert len(info.outcomes) == coverage * fanout + 1
        assert [k for k, _ in info.outcomes] == [1, 2, L + 1]
        assert info.segment in range(-1, len(info.outcomes))
        k = info.num_accepted + 1
        t = info.next_token
        if info.segment >= 0:  # the selected segment was planned for this very outcome
            assert info.outcomes[info.segment] == (min(k, L + 1), t)
        else:
            assert (min(k, L + 1), t) not in info.outcomes
        # the drafter's cache: x_0 .. x_{n-1} at the start (x_n is read again by the packed
        # pass), x_0 .. x_n, d_1 .. d_a at the end
        assert info.drafter_cache == (info.n, info.n + 1 + info.num_accepted)
    for before, after in zip(rounds, rounds[1:]):
        expected = "branch"
        if before.segment < 0:
            expected = "draft pass"
        elif before.segment == len(before.outcomes) - 1:
            expected = "full acceptance"
        assert after.drafted_by == expected
        # a full-acceptance hit: the next draft is B - 1 real tokens and a pad
        assert after.num_real == BLOCK_SIZE - (expected == "full acceptance")
    # the script makes every kind of round happen
    kinds = {after.drafted_by for after in rounds[1:]}
    assert kinds == {"branch", "draft pass", "full acceptance"}
    assert sum(stats["hits_per_position"]) == sum(info.segment >= 0 for info in rounds)
