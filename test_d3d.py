"""Tests for d3d.py: tiny models built from configs (odd sizes), CPU, fp32, no network.

Run: python -m pytest -q test_d3d.py
"""
import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import d3d

torch.set_num_threads(1)  # tiny models: one thread is fastest and leaves a core to the other tests
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*deprecated")  # see d3d.py's import block
TEXT_VOCAB = 90  # tokens the tokenizer knows; the models have 99 rows (free slots, like Qwen3's padded vocab)


def make_tokenizer(size=TEXT_VOCAB, prefix="t"):
    vocab = {f"{prefix}{i}": i for i in range(size)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=f"{prefix}0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def tiny_qwen3(seed=0, vocab_size=99, layers=2, init=0.02):
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=37, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         initializer_range=init, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).eval()


def tiny_llama(seed=0, vocab_size=90):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(seed=1)


class ScriptedDrafter(d3d.Drafter):
    """A real drafter (its KV cache evolves as usual) whose logits are replaced by a script keyed on position.

    `reference` is the target's greedy continuation (reference[pos] = token at absolute position pos). A MASK token
    at index i (1-based) of its block predicts reference[pos] if i <= right_upto, else a token the target never
    chooses there; a causal token at pos predicts reference[pos + 1]. right_upto = B: always right (oracle);
    0: never right; j: right up to position j of every block."""

    def __init__(self, drafter, reference, right_upto):
        super().__init__(drafter.model, drafter.d3d_config)
        self.reference, self.right_upto = reference, right_upto

    def forward(self, input_ids, position_ids, attention_mask, past_key_values=None, logits_to_keep=0):
        logits = super().forward(input_ids, position_ids, attention_mask, past_key_values, logits_to_keep)
        keep = logits_to_keep if torch.is_tensor(logits_to_keep) else torch.arange(input_ids.shape[1])
        is_mask = input_ids[0] == self.d3d_config.mask_token_id
        run = torch.zeros(input_ids.shape[1], dtype=torch.long)  # 1-based index of a MASK inside its block
        for j in range(input_ids.shape[1]):
            run[j] = (run[j - 1] + 1 if j > 0 else 1) if is_mask[j] else 0
        ref = lambda p: self.reference[p] if p < len(self.reference) else 0  # noqa: E731
        scripted = torch.zeros_like(logits)
        for row, j in enumerate(keep.tolist()):
            pos = int(position_ids[0, j])
            if is_mask[j]:
                good = ref(pos)
                token = good if run[j] <= self.right_upto else (good + 1) % TEXT_VOCAB
            else:
                token = ref(pos + 1)
            scripted[0, row, token] = 10.0
        return scripted


def reference_continuation(target, prompt, n):
    out, _ = d3d.generate(target, None, prompt, max_new_tokens=n, mode="target")
    return out[0].tolist()


# ----------------------------------------------------------------------------------------------------------------------
# Mask


def slow_mask(num_causal, anchors, block_size, prefix_lens, past_len):
    """The rules of method.md section 1, one (query, key) pair at a time."""
    tokens = [("c", None, i) for i in range(num_causal)]  # (kind, segment, index)
    for s, _ in enumerate(anchors):
        tokens += [("s", s, i) for i in range(prefix_lens[s] + block_size)]
    q = len(tokens)
    mask = torch.zeros(q, past_len + q, dtype=torch.bool)
    positions = []
    for qi, (kind, seg, idx) in enumerate(tokens):
        positions.append(past_len + (idx if kind == "c" else anchors[seg] + 1 + idx))
        mask[qi, :past_len] = True
        for ki, (kkind, kseg, kidx) in enumerate(tokens):
            if kind == "c":
                ok = kkind == "c" and kidx <= idx
            elif kkind == "c":
                ok = kidx <= anchors[seg]
            else:
                ok = kseg == seg and (kidx <= idx or idx >= prefix_lens[seg])
            mask[qi, past_len + ki] = ok
    return mask, torch.tensor(positions)


@pytest.mark.parametrize("num_causal,anchors,block_size,prefix_lens,past_len", [
    (7, [0, 2, 3], 3, [0, 0, 0], 0),  # overlapping spans
    (5, [1, 1, 4], 1, [0, 0, 0], 0),  # two blocks off the same point, block size 1
    (9, [2, 3, 8], 5, [1, 1, 0], 4),  # async shape: rejection branches with a causal prefix token, a cache
    (1, [0], 16, [0], 11),  # synchronous drafting: one token, one block
])
def test_mask_matches_slow_reference(num_causal, anchors, block_size, prefix_lens, past_len):
    mask, positions = d3d.packed_attention_mask(num_causal, torch.tensor(anchors), block_size,
                                                prefix_lens=torch.tensor(prefix_lens), past_len=past_len)
    expected_mask, expected_pos = slow_mask(num_causal, anchors, block_size, prefix_lens, past_len)
    assert torch.equal(mask[0, 0], expected_mask)
    assert torch.equal(positions[0], expected_pos)


def test_mask_is_per_row_for_batched_anchors():
    anchors = torch.tensor([[0, 4], [2, 3]])
    mask, positions = d3d.packed_attention_mask(6, anchors, 3)
    for row in range(2):
        expected_mask, expected_pos = slow_mask(6, anchors[row].tolist(), 3, [0, 0], 0)
        assert torch.equal(mask[row, 0], expected_mask) and torch.equal(positions[row], expected_pos)


def test_packed_blocks_equal_separate_passes(tok):
    """The model honours the mask: a block in the packed training pass equals drafting it alone after its prefix."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=5)
    x = torch.randint(0, TEXT_VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 6, 7], [5, 8, 10]])
    block_logits, causal_logits = d3d._packed_forward(drafter, x, anchors, 5, with_causal_logits=True)
    for row in range(2):
        for k, a in enumerate(anchors[row].tolist()):
            cache = d3d.new_cache(drafter.model)
            draft, _ = d3d.draft_block(drafter, cache, x[row: row + 1, : a + 1], 5)
            assert torch.equal(draft, block_logits[row, k].argmax(-1))
            assert cache.get_seq_length() == a + 1  # block KV cropped
    plain = drafter.model(x).logits[:, :-1, :TEXT_VOCAB]
    torch.testing.assert_close(causal_logits[..., :TEXT_VOCAB], plain, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# Loss


def batch(seed=0, b=3, length=21, prompt_len=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TEXT_VOCAB, (b, length), generator=g)
    loss_mask = torch.zeros(b, length, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    if b > 1:
        loss_mask[1, length - 4:] = False  # a right-padded row
    return x, loss_mask


def test_loss_starts_near_log_vocab_and_falls(tok):
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4, num_anchors=8)
    x, loss_mask = batch()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for step in range(25):
        loss, metrics = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(step))
        if step == 0:
            assert abs(metrics["loss_block"].item() - math.log(TEXT_VOCAB)) < 0.3  # -inf on MASK: V-1 classes
            assert abs(metrics["loss_ar"].item() - math.log(TEXT_VOCAB)) < 0.3
            assert metrics["block_acc"].shape == (4,)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_loss_gives_gradients_to_drafter_only(tok, target):
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4, num_anchors=8)
    x, loss_mask = batch()
    loss, _ = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(0))
    loss.backward()
    grads = [p.grad for p in drafter.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    embed_grad = drafter.model.get_input_embeddings().weight.grad
    assert embed_grad[drafter.d3d_config.mask_token_id].abs().sum() > 0  # MASK's embedding learns
    assert all(p.grad is None for p in target.parameters())


def test_loss_ignores_prompt_tokens(tok):
    """Only response tokens carry loss: anchors sit where the next token is a response token, and with a single
    response token the two terms are exactly its cross-entropy from a block and from the causal stream."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=3)
    x, loss_mask = batch(b=1, length=9)
    for seed in range(20):
        anchors, valid = d3d.sample_anchors(loss_mask, 5, torch.Generator().manual_seed(seed))
        assert loss_mask[0, anchors[valid] + 1].all()
    only_last = torch.zeros_like(loss_mask)
    only_last[0, -1] = True
    loss, metrics = d3d.d3d_loss(drafter, x, only_last, num_anchors=5, generator=torch.Generator().manual_seed(0))
    label = x[:, -1]
    causal = drafter.model(x).logits[0, -2, :99].float()
    causal[drafter.d3d_config.mask_token_id] = float("-inf")
    torch.testing.assert_close(metrics["loss_ar"], torch.nn.functional.cross_entropy(causal[None], label))
    mask, pos = d3d.packed_attention_mask(9, torch.tensor([7]), 3)
    inp = torch.cat([x, torch.full((1, 3), drafter.d3d_config.mask_token_id)], 1)
    block = drafter(inp, pos, mask, logits_to_keep=torch.tensor([9]))[0]
    torch.testing.assert_close(metrics["loss_block"], torch.nn.functional.cross_entropy(block, label))


def test_position_decay_weights_change_block_loss(tok):
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4)
    x, loss_mask = batch()
    plain, _ = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(0), ar_weight=0)
    decayed, _ = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(0), ar_weight=0,
                              decay_gamma=1.0)
    assert not torch.isclose(plain, decayed)


# ----------------------------------------------------------------------------------------------------------------------
# Drafter: making, saving, loading


def test_save_load_round_trip_gives_identical_logits(tok, tmp_path):
    drafter = d3d.make_drafter(tiny_qwen3(seed=4), tokenizer=tok, block_size=7, num_anchors=9, decay_gamma=3.0)
    drafter.save_pretrained(str(tmp_path))
    loaded = d3d.Drafter.from_pretrained(str(tmp_path))
    assert loaded.d3d_config == drafter.d3d_config
    x = torch.randint(0, TEXT_VOCAB, (1, 11))
    mask, pos = d3d.packed_attention_mask(11, torch.tensor([4, 9]), 7)
    inp = torch.cat([x, torch.full((1, 14), drafter.d3d_config.mask_token_id)], 1)
    assert torch.equal(drafter(inp, pos, mask), loaded(inp, pos, mask))


def test_mask_token_uses_free_slot_or_resizes(tok):
    with_room = d3d.make_drafter(tiny_qwen3(), tokenizer=tok)
    assert with_room.d3d_config.mask_token_id == TEXT_VOCAB
    assert with_room.model.get_input_embeddings().weight.shape[0] == 99  # no resize
    full = d3d.make_drafter(tiny_llama(vocab_size=TEXT_VOCAB), tokenizer=tok)  # SmolLM2-like: no free row
    assert full.d3d_config.mask_token_id == TEXT_VOCAB
    assert full.model.get_input_embeddings().weight.shape[0] == TEXT_VOCAB + 1
    assert full.d3d_config.target_vocab_size == TEXT_VOCAB
    logits = full(torch.tensor([[1, 2, TEXT_VOCAB]]), torch.arange(3)[None], torch.ones(1, 1, 3, 3, dtype=torch.bool))
    assert logits.shape[-1] == TEXT_VOCAB  # cut to the target's vocabulary: MASK is never drafted


def test_keep_layers_keeps_the_right_layers(tok):
    model = tiny_qwen3(seed=5, layers=4)
    originals = [layer.mlp.up_proj.weight.clone() for layer in model.model.layers]
    drafter = d3d.make_drafter(model, tokenizer=tok, layers=[0, 3])
    kept = drafter.model.model.layers
    assert len(kept) == 2 and drafter.model.config.num_hidden_layers == 2
    assert torch.equal(kept[0].mlp.up_proj.weight, originals[0]) and torch.equal(kept[1].mlp.up_proj.weight, originals[3])
    assert [layer.self_attn.layer_idx for layer in kept] == [0, 1]
    assert drafter.d3d_config.layer_ids == [0, 3]
    out, _ = d3d.generate(tiny_qwen3(seed=1), drafter, torch.tensor([[3, 4, 5]]), max_new_tokens=9, block_size=3)
    assert out.shape[1] == 12


# ----------------------------------------------------------------------------------------------------------------------
# Lossless decoding


def test_target_mode_equals_transformers_greedy(target):
    prompt = torch.tensor([[5, 17, 33, 2, 8]])
    ours, stats = d3d.generate(target, None, prompt, max_new_tokens=19, mode="target")
    theirs = target.generate(prompt, max_new_tokens=19, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
    assert stats["num_new_tokens"] == 19


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("prompt_len", [1, 7])
@pytest.mark.parametrize("kind", ["oracle", "never", "partial"])
def test_sync_equals_target_greedy(tok, target, block_size, prompt_len, kind):
    max_new = 23  # not a multiple of any block size here
    prompt = torch.randint(0, TEXT_VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    reference = reference_continuation(target, prompt, max_new + block_size + 2)
    right_upto = {"oracle": block_size, "never": 0, "partial": block_size // 2}[kind]
    drafter = ScriptedDrafter(d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=tok, block_size=block_size),
                              reference, right_upto)
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=max_new, mode="target")
    out, stats = d3d.generate(target, drafter, prompt, max_new_tokens=max_new, mode="sync")
    assert out.tolist() == expected.tolist()
    full_rounds = stats["accept_lengths"][:-1]  # the last round may be cut short by max_new_tokens
    assert all(n == right_upto + 1 for n in full_rounds)
    assert sum(stats["accept_lengths"]) == max_new - 1  # the first token comes from the target's prefill
    if kind == "oracle" and len(full_rounds) > 0:
        assert stats["tau"] <= block_size + 1


def test_sync_stops_at_eos_inside_an_accepted_block(tok, target):
    prompt = torch.tensor([[4, 8, 15, 16, 23]])
    reference = reference_continuation(target, prompt, 60)
    new = reference[5:]
    # a token that first appears as the k-th new token, 2 < k < 16: inside the first accepted block of 16
    k = next(k for k in range(2, 15) if new[k] not in new[:k])
    eos, first = new[k], 5 + k
    drafter = ScriptedDrafter(d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=tok, block_size=16), reference, 16)
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=40, mode="target", eos_token_id=eos)
    out, stats = d3d.generate(target, drafter, prompt, max_new_tokens=40, mode="sync", eos_token_id=eos)
    assert out.tolist() == expected.tolist() == [reference[: first + 1]]
    assert out[0, -1].item() == eos


def test_sync_with_real_drafters_equals_target(tok, target):
    """Unscripted drafters (random, and the target's own weights) through the real code path."""
    prompt = torch.tensor([[7, 1, 9]])
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=30, mode="target")
    for model in (tiny_qwen3(seed=11), tiny_qwen3(seed=1)):
        drafter = d3d.make_drafter(model, tokenizer=tok, block_size=4)
        out, stats = d3d.generate(target, drafter, prompt, max_new_tokens=30)
        assert out.tolist() == expected.tolist()
        assert stats["num_rounds"] == len(stats["accept_lengths"]) and stats["time_verify"] > 0


def test_zero_new_tokens(target, tok):
    prompt = torch.tensor([[1, 2]])
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok)
    for mode in ("target", "sync"):
        out, _ = d3d.generate(target, drafter, prompt, max_new_tokens=0, mode=mode)
        assert out.tolist() == prompt.tolist()


# ----------------------------------------------------------------------------------------------------------------------
# Lossless sampling


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected=5.0) -> float:
    """Goodness of fit of observed counts to exact probabilities; cells with small expected counts are pooled."""
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def test_accept_rule_is_lossless():
    """accept_draft alone, on fixed distributions (rows that do not depend on the prefix): the first emitted token
    follows p_target[0] exactly, and after an accepted d_1 the second follows p_target[1], whatever q_draft is.
    Chi-square tests at alpha = 1e-3: a correct rule fails with probability 0.1 % per test; the seeds are fixed, so
    the outcome is repeatable."""
    g = torch.Generator().manual_seed(0)
    vocab, block_size, n = 6, 2, 6000
    p_logits = torch.randn(block_size + 1, vocab, generator=g) * 1.5
    q_draft = torch.softmax(torch.randn(block_size, vocab, generator=g) * 1.5, -1)
    p_target = torch.softmax(p_logits, -1)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    rejected_first = 0
    for _ in range(n):
        draft = torch.multinomial(q_draft, 1, generator=g)[:, 0]
        num_accepted, next_token = d3d.accept_draft(p_logits, draft, q_draft, 1.0, g)
        emitted = draft[:num_accepted].tolist() + [next_token]
        first[emitted[0]] += 1
        rejected_first += num_accepted == 0
        if num_accepted >= 1:
            second[emitted[1]] += 1
    assert 0.1 * n < rejected_first < 0.9 * n  # both acceptance and residual draws happen
    assert chi_square_p_value(first, p_target[0]) > 1e-3
    assert chi_square_p_value(second, p_target[1]) > 1e-3
    assert chi_square_p_value(first, q_draft[0]) < 1e-3  # the test has power: the drafter's law is rejected


def test_sampling_matches_target_distribution():
    """End to end through generate: the joint law of generated tokens 2 and 3 (the first speculative round; token 1
    comes from the target's prefill) matches the target's exact law, computed by enumeration. Chi-square test at
    alpha = 1e-3 (false-failure rate 0.1 %; fixed seeds make the run repeatable). A drafter unlike the target makes
    both acceptance and rejection (residual) paths happen."""
    vocab, temperature, num_samples = 8, 1.0, 800
    tok = make_tokenizer(vocab)
    target = tiny_qwen3(seed=21, vocab_size=16, init=0.6)
    drafter = d3d.make_drafter(tiny_qwen3(seed=22, vocab_size=16, init=0.6), tokenizer=tok, block_size=2)
    prompt = [3, 1]
    with torch.no_grad():  # the target's exact law of (t2, t3), summed over t1
        def dist(ids):
            return torch.softmax(target(torch.tensor([ids])).logits[0, -1].float() / temperature, -1)
        p1 = dist(prompt)
        joint = torch.zeros(16, 16)
        for t1 in range(16):
            p2 = dist(prompt + [t1])
            for t2 in range(16):
                joint[t2] += p1[t1] * p2[t2] * dist(prompt + [t1, t2])
    counts = torch.zeros(16, 16)
    generator = torch.Generator().manual_seed(1234)
    rejections_at_first = 0
    for _ in range(num_samples):
        out, stats = d3d.generate(target, drafter, torch.tensor([prompt]), max_new_tokens=3,
                                  temperature=temperature, generator=generator)
        counts[out[0, 3], out[0, 4]] += 1
        rejections_at_first += stats["num_rounds"] > 1  # d_1 rejected: the round gave one token, a second round ran
    assert 0.05 * num_samples < rejections_at_first < 0.95 * num_samples  # both paths exercised
    assert chi_square_p_value(counts.flatten(), joint.flatten()) > 1e-3


def test_sampling_is_reproducible_with_a_generator(tok, target):
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=3)
    runs = [d3d.generate(target, drafter, torch.tensor([[2, 3]]), max_new_tokens=12, temperature=0.8,
                         generator=torch.Generator().manual_seed(7))[0] for _ in range(2)]
    assert torch.equal(*runs)


# ----------------------------------------------------------------------------------------------------------------------
# Bad input: clear errors, never a wrong answer


def test_bad_inputs_raise_clear_errors(tok, target, tmp_path):
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok)
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="block_size"):
        d3d.generate(target, drafter, prompt, max_new_tokens=5, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        d3d.make_drafter(tiny_qwen3(), tokenizer=tok, block_size=0)
    with pytest.raises(ValueError, match="empty"):
        d3d.generate(target, drafter, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=5)
    with pytest.raises(ValueError, match="batch 1"):
        d3d.generate(target, drafter, prompt.repeat(2, 1), max_new_tokens=5)
    with pytest.raises(ValueError, match="needs a drafter"):
        d3d.generate(target, None, prompt, max_new_tokens=5, mode="sync")
    with pytest.raises(ValueError, match="unknown mode"):
        d3d.generate(target, drafter, prompt, max_new_tokens=5, mode="fast")
    with pytest.raises(ValueError, match="target vocabulary"):  # a drafter for a target with another vocabulary
        d3d.generate(tiny_qwen3(vocab_size=120), drafter, prompt, max_new_tokens=5)
    with pytest.raises(ValueError, match="does not cover"):  # drafter model smaller than the tokenizer
        d3d.make_drafter(tiny_qwen3(vocab_size=64), tokenizer=tok)
    with pytest.raises(ValueError, match="does not cover"):  # drafter model smaller than the target's vocabulary
        d3d.make_drafter(tiny_qwen3(), tokenizer=tok, target_vocab_size=128)
    with pytest.raises(ValueError, match="text token"):  # MASK would collide with text
        d3d.make_drafter(tiny_qwen3(), 17, tokenizer=tok)
    with pytest.raises(ValueError, match="different tokenizer"):
        d3d.check_tokenizer(drafter, make_tokenizer(prefix="w"))
    d3d.check_tokenizer(drafter, tok)  # the right one passes
    with pytest.raises(FileNotFoundError, match="no drafter folder"):
        d3d.Drafter.from_pretrained(str(tmp_path / "missing"))
    target.save_pretrained(str(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError, match="not a D3D drafter"):
        d3d.Drafter.from_pretrained(str(tmp_path / "plain"))
