"""The spec of d3d.py, in the paper's order: tiny models built from configs (odd sizes), CPU,
fp32, no network. Each section opens with its clearest test.

    mask, loss, drafter, synchronous decoding (lossless), sampling (lossless), asynchronous
    decoding (lossless, then what makes it fast), pruning, selective prefill, bad input and
    settings (DecodeConfig), a transformers streamer

What is not the method's claims lives in tests/: test_compiled.py (compiled and regional
passes), test_cuda.py (CUDA only), test_lanes.py (lanes and threads), test_batched.py
(batched serving), test_layers.py (import layering), test_docs.py (the docs' commands).

Run: python -m pytest -q test_d3d.py
"""

import dataclasses
import math
import re
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import d3d
import runtime
from systems import batched, fast

torch.set_num_threads(1)  # tiny models: one thread is fastest and leaves a core to the other tests
# tokens the tokenizer knows; the models have 99 rows (free slots, like Qwen3's padded vocab)
TEXT_VOCAB = 90


def make_tokenizer(size=TEXT_VOCAB, prefix="t"):
    vocab = {f"{prefix}{i}": i for i in range(size)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=f"{prefix}0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def tiny_qwen3(seed=0, vocab_size=99, layers=2, init=0.02):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        initializer_range=init,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(config).eval()


def tiny_llama(seed=0, vocab_size=90):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(seed=1)


class ScriptedDrafter(d3d.Drafter):
    """A real drafter (its KV cache evolves as usual) whose logits are replaced by a script keyed on
    position.

    `reference` is the target's greedy continuation (reference[pos] = token at absolute position
    pos). A MASK token at index i (1-based) of its block predicts reference[pos] if i <= right_upto,
    else a token the target never chooses there, with reference[pos] as its runner-up (so an
    asynchronous branch can hit); a causal token at pos predicts reference[pos + 1] (right iff
    right_upto >= 1; it drafts d_1 when d1_from == "causal"). right_upto = B: always right (oracle);
    0: never right; j: right up to position j of every block. A batch of prompts: `reference` and
    `right_upto` are lists, one per prompt; batch rows are the prompts in order at a decode's first
    drafter pass, then follow the rows the decoder keeps (DynamicCache.batch_select_indices)."""

    def __init__(self, drafter, reference, right_upto):
        super().__init__(drafter.model, drafter.d3d_config)
        self.reference, self.right_upto = reference, right_upto
        self.references = reference if isinstance(reference[0], list) else [reference]
        self.right_uptos = (
            right_upto if isinstance(right_upto, list) else [right_upto] * len(self.references)
        )
        self.cache, self.rows, self.batch_sizes = None, [], []

    def hidden_states(self, ids, positions, mask, cache=None):
        # the cache moves as usual
        super().hidden_states(ids, positions, mask, cache)
        self.follow(cache, ids.shape[0])
        self.batch_sizes.append(ids.shape[0])
        scripted = torch.zeros(*ids.shape, self.d3d_config.target_vocab_size)
        for b, prompt in enumerate(self.rows):
            reference, right_upto = self.references[prompt], self.right_uptos[prompt]

            def ref(pos, reference=reference):
                if pos < len(reference):
                    return reference[pos]
                return 0

            is_mask = ids[b] == self.d3d_config.mask_token_id
            # MASK tokens in a row; blocks (of the config's size) can follow each other directly
            run = 0
            for j in range(ids.shape[1]):
                run = run + 1 if is_mask[j] else 0
                index_in_block = (run - 1) % self.d3d_config.block_size + 1
                pos = int(positions[b, j])
                if is_mask[j]:
                    good = ref(pos)
                    if index_in_block > right_upto:  # wrong, with the right token as the runner-up
                        scripted[b, j, good] = 5.0
                        good = (good + 1) % TEXT_VOCAB
                    scripted[b, j, good] = 10.0
                else:  # a causal token's next-token guess: d_1 when d1_from == "causal"
                    good = ref(pos + 1)
                    if right_upto < 1:
                        scripted[b, j, good] = 5.0
                        good = (good + 1) % TEXT_VOCAB
                    scripted[b, j, good] = 10.0
        return scripted  # "hidden states" that are already the scripted logits

    def logits(self, hidden):
        return hidden

    def follow(self, cache, batch_size):
        """Which prompt each batch row drafts for: a new cache starts a decode (rows = prompts in
        order); then the rows its batch_select_indices keeps."""
        if cache is not self.cache:
            self.cache, self.rows = cache, list(range(batch_size))
            select = cache.batch_select_indices

            def keep(indices):
                self.rows = [self.rows[i] for i in indices.tolist()]
                select(indices)

            cache.batch_select_indices = keep
        assert len(self.rows) == batch_size


def reference_continuation(target, prompt, n):
    out, _ = d3d.generate(target, None, prompt, max_new_tokens=n, mode="target")
    return out[0].tolist()


def batch_prompts(lengths=(1, 4, 9)):
    return [
        torch.randint(0, TEXT_VOCAB, (n,), generator=torch.Generator().manual_seed(100 + n))
        for n in lengths
    ]


# --------------------------------------------------------------------------------------------------
# Mask: Fig. 1a's packed attention


def slow_mask(num_causal, roots, block_size, prefix_lens, past_len):
    """The rules of packed_attention_mask's docstring, one (query, key) pair at a time. Returns
    the mask (q, past_len + q), the positions (q,), and for each pair the rule that decides it."""
    tokens = [("c", None, i) for i in range(num_causal)]  # (kind, segment, index)
    for s, _ in enumerate(roots):
        tokens += [("s", s, i) for i in range(prefix_lens[s] + block_size)]
    q = len(tokens)
    mask = torch.zeros(q, past_len + q, dtype=torch.bool)
    past = "every token sees the past_len cached tokens, which come first"
    rules = [[past] * past_len for _ in range(q)]
    positions = []
    for qi, (kind, seg, idx) in enumerate(tokens):
        positions.append(past_len + (idx if kind == "c" else roots[seg] + 1 + idx))
        mask[qi, :past_len] = True
        for ki, (kkind, kseg, kidx) in enumerate(tokens):
            if kind == "c" and kkind == "c":
                ok, rule = kidx <= idx, "a causal token sees the causal tokens up to itself"
            elif kind == "c":
                ok, rule = False, "a causal token sees no segment"
            elif kkind == "c":
                ok = kidx <= roots[seg]
                rule = "a segment sees the causal tokens up to its root, none after it"
            elif kseg != seg:
                ok, rule = False, "a segment sees no other segment"
            elif idx < prefix_lens[seg]:
                ok, rule = kidx <= idx, "a segment's prefix sees its segment causally"
            else:
                ok, rule = True, "a MASK sees all of its segment"
            mask[qi, past_len + ki] = ok
            rules[qi].append(rule)
    return mask, torch.tensor(positions), rules


def mask_is_as_the_rules_say(mask, positions, num_causal, roots, block_size, prefix_len, past_len):
    """Assert that one row of packed_attention_mask's output (mask (W, past_len + W), positions
    (W,)) follows the docstring's rules; a failure names the first pair that breaks one, and
    the rule it breaks."""
    expected_mask, expected_pos, rules = slow_mask(
        num_causal, roots, block_size, [prefix_len] * len(roots), past_len
    )
    wrong = (mask != expected_mask).nonzero().tolist()
    if wrong:
        row, key = wrong[0]
        may = "may" if mask[row, key] else "may not"
        pytest.fail(
            f"{len(wrong)} wrong pairs; the first: row {row} {may} attend to key {key} (roots "
            f"{roots}, B = {block_size}, prefix_len = {prefix_len}, past_len = {past_len}): "
            f"{rules[row][key]}"
        )
    assert torch.equal(positions, expected_pos), (
        f"positions {positions.tolist()}, expected {expected_pos.tolist()}: causal token i sits at "
        "past_len + i, a segment's token t (0-based) at past_len + root + 1 + t, right after "
        "its root's"
    )


@pytest.mark.parametrize(
    "num_causal,roots,block_size,prefix_len,past_len",
    [
        (7, [0, 2, 3], 3, 0, 0),  # overlapping spans
        (5, [1, 1, 4], 1, 0, 0),  # two blocks off the same point, block size 1
        (9, [2, 3, 8], 5, 1, 4),  # async shape: branches with a causal prefix token, a cache
        (
            4,
            [-1, 0, 3],
            2,
            1,
            6,
        ),  # async after a fallback draft: x_n in the cache, a branch hanging off it (index -1)
        (1, [0], 16, 0, 11),  # synchronous drafting: one token, one block
    ],
)
def test_mask_matches_slow_reference(num_causal, roots, block_size, prefix_len, past_len):
    mask, positions = d3d.packed_attention_mask(
        num_causal, torch.tensor(roots), block_size, prefix_len=prefix_len, past_len=past_len
    )
    width = num_causal + len(roots) * (prefix_len + block_size)
    shapes = f"mask {tuple(mask.shape)} {mask.dtype}, positions {tuple(positions.shape)}"
    assert mask.shape == (1, 1, width, past_len + width) and mask.dtype == torch.bool, (
        f"{shapes}: the mask is bool (b, 1, W, past_len + W), W = {width} here, b = 1 for roots "
        "(S,)"
    )
    assert positions.shape == (1, width), f"{shapes}: the positions are (b, W), W = {width} here"
    mask_is_as_the_rules_say(
        mask[0, 0], positions[0], num_causal, roots, block_size, prefix_len, past_len
    )


def test_mask_is_per_row_for_batched_roots():
    roots = torch.tensor([[0, 4], [2, 3]])
    mask, positions = d3d.packed_attention_mask(6, roots, 3)
    assert mask.shape[0] == positions.shape[0] == 2, (
        f"mask {tuple(mask.shape)}, positions {tuple(positions.shape)} for roots (2, S): one "
        "row each"
    )
    for row in range(2):
        mask_is_as_the_rules_say(mask[row, 0], positions[row], 6, roots[row].tolist(), 3, 0, 0)


def mask_pictures(doc: str) -> list[list[tuple[int, list[bool]]]]:
    """The '#' pictures of a docstring, each as its rows: (the row's position, a bool per column,
    True where the row's line has a '#' under that column's name)."""
    lines = doc.splitlines()
    pictures = []
    for place, header in enumerate(lines):
        if not header.strip().startswith("x_0 x_1"):
            continue
        # a column's name starts where its '#' marks stand: x_0, x_1, ..., t, m
        columns = [found.start() for found in re.finditer(r"x_\d|\b[tm]\b", header)]
        rows = []
        for line in lines[place + 1 :]:
            found = re.search(r"\(pos (\d+)\)", line)
            if found is None:
                break
            cells = [column < len(line) and line[column] == "#" for column in columns]
            rows.append((int(found.group(1)), cells))
        pictures.append(rows)
    return pictures


def test_the_pictures_of_packed_attention_mask_are_its_output():
    """The two pictures in packed_attention_mask's docstring (blocks of 2 off x_1 and x_3 of
    x_0 .. x_4; a segment [t, m, m] off x_1 of x_0 .. x_2) are what the function returns, mark
    by mark and position by position: a reader may trust them without checking by hand."""
    calls = [
        ((5, torch.tensor([1, 3]), 2), {}),
        ((3, torch.tensor([1]), 2), {"prefix_len": 1}),
    ]
    pictures = mask_pictures(d3d.packed_attention_mask.__doc__)
    assert len(pictures) == len(calls), f"{len(pictures)} pictures found, want {len(calls)}"
    for picture, (args, kwargs) in zip(pictures, calls):
        mask, positions = d3d.packed_attention_mask(*args, **kwargs)
        given = f"packed_attention_mask{args[:1] + (args[1].tolist(),) + args[2:]} {kwargs}"
        drawn_positions = [position for position, _ in picture]
        assert positions[0].tolist() == drawn_positions, f"{given}: the pictured positions"
        for row, (_, drawn) in enumerate(picture):
            assert mask[0, 0, row].tolist() == drawn, f"{given}: row {row} of the picture"


class HostReads(TorchDispatchMode):
    """While active, records every read of a tensor's values back to the host (on CUDA each
    waits for the device): .item(), int(), bool(), float() or an index of a tensor, .tolist()
    and .numpy(), and the ops whose output shape depends on values (nonzero, boolean indexing,
    masked_select, unique, repeat_interleave by a tensor). `reads` names them; `ops` counts the
    device ops run. torch.nn.functional.one_hot given num_classes reads its values to check them
    on a CPU only, never on CUDA: those reads are not counted."""

    SHAPE_FROM_VALUES = {
        torch.ops.aten.nonzero.default: "nonzero",
        torch.ops.aten.masked_select.default: "masked_select",
        torch.ops.aten._unique2.default: "unique",
        torch.ops.aten.unique_dim.default: "unique",
        torch.ops.aten.unique_consecutive.default: "unique_consecutive",
        torch.ops.aten.repeat_interleave.Tensor: "repeat_interleave by a tensor",
    }

    def __init__(self):
        super().__init__()
        self.reads, self.ops, self.checking = [], 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default and not self.checking:
            self.reads.append(".item(), int(), bool() or an index of a tensor")
        elif func in self.SHAPE_FROM_VALUES:
            self.reads.append(self.SHAPE_FROM_VALUES[func])
        elif func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default):
            index = [i for i in args[1] if isinstance(i, torch.Tensor)]
            if any(i.dtype == torch.bool for i in index):
                self.reads.append("indexing by a boolean tensor")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, self.recorded(name, method))
        self.one_hot = torch.nn.functional.one_hot
        torch.nn.functional.one_hot = self.checked_one_hot
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self.methods.items():
            setattr(torch.Tensor, name, method)
        torch.nn.functional.one_hot = self.one_hot
        return super().__exit__(*exc)

    def checked_one_hot(self, tensor, num_classes=-1):
        self.checking = num_classes >= 0
        try:
            return self.one_hot(tensor, num_classes)
        finally:
            self.checking = False

    def recorded(self, name, method):
        def read(tensor, *args, **kwargs):
            self.reads.append(f".{name}()")
            return method(tensor, *args, **kwargs)

        return read


def test_the_mask_is_built_without_reading_the_device():
    """packed_attention_mask reads nothing back to the host: every size is a host int, the rest
    device ops (no .item(), .tolist(), int() or bool() of a tensor, no nonzero or boolean
    indexing). A mask built by a Python loop over the roots' values is told that its values
    are right, and where they are read."""
    cases = [(9, [[2, 3, 8]], 5, 1, 4), (6, [[0, 4], [2, 3]], 3, 0, 0)]
    for num_causal, roots, block_size, prefix_len, past_len in cases:
        roots = torch.tensor(roots)
        with HostReads() as host:
            mask, positions = d3d.packed_attention_mask(
                num_causal, roots, block_size, prefix_len=prefix_len, past_len=past_len
            )
        if not host.reads:
            continue
        right = mask.dim() == 4 and positions.dim() == 2
        for row, row_roots in enumerate(roots.tolist()):
            prefix_lens = [prefix_len] * len(row_roots)
            expected = slow_mask(num_causal, row_roots, block_size, prefix_lens, past_len)
            right = right and torch.equal(mask[row, 0], expected[0])
            right = right and torch.equal(positions[row], expected[1])
        verdict = "and"
        if right:
            verdict = "its mask and positions are right, but"
        pytest.fail(
            f"packed_attention_mask read the device back {len(host.reads)} times "
            f"({', '.join(sorted(set(host.reads)))}): {verdict} every size is a host int and "
            "nothing is read back: build it from torch.arange and comparisons"
        )


@pytest.mark.parametrize("d1_from", ["causal", "mask"])
def test_packed_blocks_equal_separate_passes(tok, d1_from):
    """The model honours the mask: a block in the packed training pass equals drafting it alone
    after its prefix, and draft_rows reads d_1 where decoding does: with d1_from "causal" the
    next-token prediction at the anchor."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=5, d1_from=d1_from)
    x = torch.randint(0, TEXT_VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 6, 7], [5, 8, 10]])
    # (2, 13 + 3 * 5, H)
    hidden = drafter.hidden_states(*d3d._packed_inputs(drafter, x, anchors, 5))
    logits = drafter.logits(hidden)
    causal_logits, block_logits = logits[:, :13], logits[:, 13:].unflatten(1, (3, 5))
    rows = d3d.draft_rows(anchors, 13 + 5 * torch.arange(3), 5, d1_from)  # (2, 3, 5)
    draft_logits = torch.stack([logits[i, rows[i]] for i in range(2)])  # (2, 3, 5, V)
    anchor_logits = causal_logits.gather(
        1, anchors[..., None].expand(-1, -1, causal_logits.shape[-1])
    )
    for row in range(2):
        for k, a in enumerate(anchors[row].tolist()):
            cache = runtime.KVCache(drafter, 32)
            # 2 pads after x_a
            alone = d3d.draft_block(drafter, cache, x[row : row + 1, : a + 1], 5, width=a + 3)
            torch.testing.assert_close(alone[:, :TEXT_VOCAB], draft_logits[row, k, :, :TEXT_VOCAB])
            torch.testing.assert_close(
                alone[1:, :TEXT_VOCAB], block_logits[row, k, 1:, :TEXT_VOCAB]
            )
            # pads and block KV dropped
            assert cache.length == int(cache.hf.get_seq_length()) == a + 1
    plain = drafter.model(x).logits[:, :, :TEXT_VOCAB]
    torch.testing.assert_close(
        anchor_logits[..., :TEXT_VOCAB],
        plain.gather(1, anchors[..., None].expand(-1, -1, TEXT_VOCAB)),
        atol=1e-5,
        rtol=1e-5,
    )
    if d1_from == "causal":
        torch.testing.assert_close(draft_logits[:, :, 0], anchor_logits)
    else:
        assert not torch.allclose(draft_logits[:, :, 0], anchor_logits)
    torch.testing.assert_close(causal_logits[..., :TEXT_VOCAB], plain, atol=1e-5, rtol=1e-5)


# rows given to draft_rows: (prefix_row, first_mask_row), broadcast together
DRAFT_ROWS_CASES = [
    (torch.tensor(6), torch.tensor(9)),  # draft_block: x_n's row, then the block
    (torch.tensor([[3, 6, 7], [5, 8, 10]]), torch.tensor([13, 18, 23])),  # offline_tau
    (torch.tensor([4, 9, 14]), torch.tensor([5, 10, 15])),  # build_branch_pass
]


@pytest.mark.parametrize("d1_from", ["causal", "mask"])
def test_draft_rows_reads_d1_where_d1_from_says_and_the_rest_at_masks_2_to_b(d1_from):
    """draft_rows, row by row: d_2 .. d_B at MASK 2 .. B (first_mask_row + 1 ..), d_1 at
    prefix_row under d1_from "causal", at MASK 1 under "mask"; prefix_row and first_mask_row
    broadcast together, the rows (..., B)."""
    block_size = 4
    for prefix_row, first_mask_row in DRAFT_ROWS_CASES:
        given = f"draft_rows(prefix_row {tuple(prefix_row.shape)}, first_mask_row "
        given += f"{tuple(first_mask_row.shape)}, B = {block_size}, {d1_from!r})"
        try:
            rows = d3d.draft_rows(prefix_row, first_mask_row, block_size, d1_from)
        except (RuntimeError, IndexError, ValueError) as error:
            pytest.fail(
                f"{given} raised {type(error).__name__}: {error} / prefix_row and first_mask_row "
                "broadcast together"
            )
        prefix, first = torch.broadcast_tensors(prefix_row, first_mask_row)
        assert rows.shape == (*first.shape, block_size), (
            f"{given} is {tuple(rows.shape)}: the rows are (..., B), prefix_row and "
            "first_mask_row broadcast together"
        )
        masks = first[..., None] + torch.arange(block_size)
        assert torch.equal(rows[..., 1:], masks[..., 1:]), (
            f"{given}: d_2 .. d_B at rows {rows[..., 1:].tolist()}, not at MASK 2 .. B "
            f"{masks[..., 1:].tolist()} (first_mask_row + 1 ..)"
        )
        d1 = prefix if d1_from == "causal" else first
        where = "prefix_row" if d1_from == "causal" else "MASK 1 (first_mask_row)"
        assert torch.equal(rows[..., 0], d1), (
            f"{given}: d_1 at rows {rows[..., 0].tolist()}: under d1_from={d1_from!r} d_1 is read "
            f"at {where}, {d1.tolist()}"
        )


def test_draft_rows_reads_nothing_back():
    """draft_rows is tensor ops only: no .item(), .tolist(), int() or bool() of a tensor, no
    nonzero or boolean indexing (the async pass builds its rows without waiting)."""
    for d1_from in ("causal", "mask"):
        for prefix_row, first_mask_row in DRAFT_ROWS_CASES:
            with HostReads() as host:
                d3d.draft_rows(prefix_row, first_mask_row, 4, d1_from)
            assert not host.reads, (
                f"draft_rows read the device back ({', '.join(sorted(set(host.reads)))}): tensor "
                "ops only, nothing is read back"
            )


# --------------------------------------------------------------------------------------------------
# Loss: L_block + lambda L_AR


def with_config(drafter, **fields):
    """The drafter's model under a D3DConfig with `fields` replaced: an ablation's drafter."""
    return d3d.Drafter(drafter.model, dataclasses.replace(drafter.d3d_config, **fields))


def batch(seed=0, b=3, length=21, prompt_len=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, TEXT_VOCAB, (b, length), generator=g)
    loss_mask = torch.zeros(b, length, dtype=torch.bool)
    loss_mask[:, prompt_len:] = True
    if b > 1:
        loss_mask[1, length - 4 :] = False  # a right-padded row
    return x, loss_mask


@pytest.mark.parametrize("ar_weight", [0.5, 1.5])
def test_loss_weighs_the_ar_term_by_lambda(tok, ar_weight):
    """L = L_block + lambda * L_AR at weights other than 0 and 1 (where a loss that ignored lambda
    would agree)."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4)
    x, loss_mask = batch()
    weighted = with_config(drafter, ar_weight=ar_weight)
    loss, metrics = d3d.d3d_loss(weighted, x, loss_mask, generator=torch.Generator().manual_seed(0))
    without_ar = with_config(drafter, ar_weight=0.0)
    block_only, _ = d3d.d3d_loss(
        without_ar, x, loss_mask, generator=torch.Generator().manual_seed(0)
    )
    assert metrics["loss_ar"] > 1
    why = f"the loss is L_block + lambda * L_AR, here L_block + {ar_weight} * L_AR"
    torch.testing.assert_close(loss, block_only + ar_weight * metrics["loss_ar"], msg=why)
    torch.testing.assert_close(
        loss, metrics["loss_block"] + ar_weight * metrics["loss_ar"], msg=why
    )


@pytest.mark.parametrize("gamma", [None, 1.0, 2.5])
def test_block_loss_weights_position_i_by_exp_minus_i_minus_1_over_gamma(tok, gamma):
    """L_block is the mean of the block rows' cross-entropies weighted w_i = exp(-(i-1)/gamma) (1
    without gamma), computed here from the same anchors, one row at a time."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4)
    x, loss_mask = batch()
    drafter = with_config(drafter, ar_weight=0.0, decay_gamma=gamma)
    _, metrics = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(0))
    anchors, valid = d3d.sample_anchors(
        loss_mask, drafter.d3d_config.num_anchors, torch.Generator().manual_seed(0)
    )
    labels, counts = d3d._block_labels(x, loss_mask, anchors, valid, 4)
    with torch.no_grad():
        _, block = d3d._packed_hidden(drafter, x, anchors, 4)
        ce = torch.nn.functional.cross_entropy(
            drafter.logits(block).flatten(0, 2).float(),
            labels.flatten().clamp(min=0),
            reduction="none",
        ).view(labels.shape)
    total = weight_sum = 0.0
    for b, k, i in counts.nonzero().tolist():
        w = math.exp(-i / gamma) if gamma else 1.0  # i is 0-based here: position i + 1 of the block
        total, weight_sum = total + w * ce[b, k, i].item(), weight_sum + w
    assert metrics["loss_block"].item() == pytest.approx(total / weight_sum, rel=1e-5), (
        f"gamma = {gamma}: L_block is the mean of the counted labels' cross-entropies weighted "
        "w_i = exp(-(i-1)/gamma) (1 without gamma): their weighted sum over the weights' sum"
    )


def test_block_loss_at_a_tiny_gamma_is_the_first_positions_cross_entropy(tok):
    """gamma = 0.02: w_1 = 1 and w_2 = exp(-50) ~ 2e-22, so L_block is the mean cross-entropy of
    the rows at block position 1 alone, worked out here from the same anchors. Weights that fell
    under the 1e-8 clamp of their sum (w_i = exp(-i/gamma), all ~ 0) would give a loss of ~0."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4)
    x, loss_mask = batch()
    drafter = with_config(drafter, ar_weight=0.0, decay_gamma=0.02)
    _, metrics = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(0))
    anchors, valid = d3d.sample_anchors(
        loss_mask, drafter.d3d_config.num_anchors, torch.Generator().manual_seed(0)
    )
    labels, counts = d3d._block_labels(x, loss_mask, anchors, valid, 4)
    with torch.no_grad():
        _, block = d3d._packed_hidden(drafter, x, anchors, 4)
        first = drafter.logits(block[:, :, 0]).float()
    rows = counts[:, :, 0].nonzero().tolist()
    assert len(rows) > 1
    total = 0.0
    for b, k in rows:
        total += torch.nn.functional.cross_entropy(first[b, k], labels[b, k, 0]).item()
    assert metrics["loss_block"].item() == pytest.approx(total / len(rows), rel=1e-4)
    assert metrics["loss_block"].item() > 1


def test_loss_ignores_prompt_tokens(tok):
    """Only response tokens carry loss: anchors sit where the next token is a response token, and
    with a single response token the two terms are exactly its cross-entropy from a block and from
    the causal stream."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=3)
    x, loss_mask = batch(b=1, length=9)
    for seed in range(20):
        anchors, valid = d3d.sample_anchors(loss_mask, 5, torch.Generator().manual_seed(seed))
        assert loss_mask[0, anchors[valid] + 1].all()
    only_last = torch.zeros_like(loss_mask)
    only_last[0, -1] = True
    loss, metrics = d3d.d3d_loss(
        with_config(drafter, num_anchors=5),
        x,
        only_last,
        generator=torch.Generator().manual_seed(0),
    )
    label = x[:, -1]
    causal = drafter.model(x).logits[0, -2, :99].float()
    causal[drafter.d3d_config.mask_token_id] = float("-inf")
    torch.testing.assert_close(
        metrics["loss_ar"],
        torch.nn.functional.cross_entropy(causal[None], label),
        msg="L_AR: the causal row j against x_{j+1}, where x_{j+1} is a response token; here "
        "only the last token is one, so L_AR is row N - 2's cross-entropy against it",
    )
    mask, pos = d3d.packed_attention_mask(9, torch.tensor([7]), 3)
    inp = torch.cat([x, torch.full((1, 3), drafter.d3d_config.mask_token_id)], 1)
    block = drafter.logits(drafter.hidden_states(inp, pos, mask)[:, [9]])[0]
    torch.testing.assert_close(
        metrics["loss_block"],
        torch.nn.functional.cross_entropy(block, label),
        msg="L_block counts response labels only; here only the last token is one, so L_block "
        "is the cross-entropy of MASK 1 of the block off x_{N-2} against it",
    )


def test_loss_starts_near_log_vocab_and_falls(tok):
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4, num_anchors=8)
    x, loss_mask = batch()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = []
    for step in range(25):
        loss, metrics = d3d.d3d_loss(
            drafter, x, loss_mask, generator=torch.Generator().manual_seed(step)
        )
        if step == 0:
            # -inf on MASK: V-1 classes
            assert abs(metrics["loss_block"].item() - math.log(TEXT_VOCAB)) < 0.3
            assert abs(metrics["loss_ar"].item() - math.log(TEXT_VOCAB)) < 0.3
            assert metrics["block_acc"].shape == (4,), (
                f"block_acc is {tuple(metrics['block_acc'].shape)}: (B,), one accuracy per "
                "block position"
            )
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


def test_the_losss_metrics_carry_no_gradient(tok):
    """d3d_loss's metrics are read for logs and progress bars: detached, so that keeping them
    keeps no graph (and no activations) alive between steps."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4, num_anchors=8)
    x, loss_mask = batch()
    loss, metrics = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(0))
    assert loss.requires_grad
    attached = [name for name, value in metrics.items() if value.requires_grad]
    assert not attached, f"metrics {attached} carry a graph: detach them"


def test_offline_tau_drafts_the_d1_from_where_decoding_does(tok, target):
    """The target's own weights as drafter, on the target's own greedy continuation: its next-token
    head is always right, so with d1_from "causal" every sampled block accepts at least d_1; MASK 1
    of this untrained drafter is not, so "mask" scores lower."""
    prompt = torch.tensor([[5, 3, 8]])
    ids = reference_continuation(target, prompt, 40)
    input_ids, loss_mask = torch.tensor([ids]), torch.zeros(1, len(ids), dtype=torch.bool)
    loss_mask[0, 3:] = True
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=4)
    taus = {
        first: d3d.offline_tau(
            with_config(drafter, d1_from=first),
            input_ids,
            loss_mask,
            val_anchors=16,
            generator=torch.Generator().manual_seed(0),
        )
        for first in ("causal", "mask")
    }
    assert len(taus["causal"]) == 16 and taus["causal"].min() >= 2
    assert taus["mask"].mean() < taus["causal"].mean()
    drafter.d3d_config.d1_from = "mask"  # the default comes from the config
    assert torch.equal(
        d3d.offline_tau(
            drafter,
            input_ids,
            loss_mask,
            val_anchors=16,
            generator=torch.Generator().manual_seed(0),
        ),
        taus["mask"],
    )


def test_loss_ignores_blocks_of_invalid_anchors(tok):
    """A block whose anchor is invalid (sample_anchors' valid False: a sequence with fewer than K
    places for one) counts nowhere: the loss and every metric equal those of the valid blocks
    alone, though the invalid blocks' labels are response tokens."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=3)
    x, loss_mask = batch(b=1, length=15, prompt_len=4)
    anchors = torch.tensor([[4, 6, 9, 11]])
    valid = torch.tensor([[True, False, True, False]])
    loss, metrics = d3d.d3d_loss(drafter, x, loss_mask, at=(anchors, valid))
    kept = anchors[valid][None]
    kept_loss, kept_metrics = d3d.d3d_loss(
        drafter, x, loss_mask, at=(kept, torch.ones_like(kept, dtype=torch.bool))
    )
    why = "a block whose anchor is invalid (valid False) must carry no loss and count in no metric"
    for name in ("loss_block", "loss_ar", "block_acc"):
        torch.testing.assert_close(metrics[name], kept_metrics[name], msg=f"{name}: {why}")
    torch.testing.assert_close(loss, kept_loss, msg=why)


def test_the_ar_term_is_zero_at_lambda_0(tok):
    """At lambda = 0 L_AR is not computed: loss_ar is 0 and the loss is L_block alone."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4)
    x, loss_mask = batch()
    without_ar = with_config(drafter, ar_weight=0.0)
    loss, metrics = d3d.d3d_loss(
        without_ar, x, loss_mask, generator=torch.Generator().manual_seed(0)
    )
    assert metrics["loss_ar"].item() == 0.0, (
        f"loss_ar is {metrics['loss_ar'].item():.4f} at lambda = 0: L_AR is computed only if "
        "lambda > 0"
    )
    torch.testing.assert_close(loss, metrics["loss_block"], msg="at lambda = 0 the loss is L_block")


@pytest.mark.parametrize("d1_from", ["causal", "mask"])
def test_block_acc_reads_d1_where_d1_from_says(tok, target, d1_from):
    """block_acc[0] is the share of blocks whose d_1, read where decoding reads it (d1_from:
    the anchor's causal row, or MASK 1), is the label x_{j_k+1}: on the same anchors, the share
    of blocks whose d_1 offline_tau accepts. The target's weights drafting the target's own
    continuation: its causal row is always right, its untrained MASK 1 is not."""
    prompt = torch.tensor([[5, 3, 8]])
    ids = reference_continuation(target, prompt, 40)
    input_ids, loss_mask = torch.tensor([ids]), torch.zeros(1, len(ids), dtype=torch.bool)
    loss_mask[0, 3:] = True
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=4, d1_from=d1_from)
    at = d3d.sample_anchors(loss_mask, 16, torch.Generator().manual_seed(0))
    _, metrics = d3d.d3d_loss(drafter, input_ids, loss_mask, at=at)
    d1_accepted = (d3d.offline_tau(drafter, input_ids, loss_mask, at=at) >= 2).float().mean()
    assert metrics["block_acc"][0].item() == pytest.approx(d1_accepted.item()), (
        f"block_acc[0] = {metrics['block_acc'][0].item():.3f}, but d_1 read where d1_from="
        f"{d1_from!r} says is right in {d1_accepted.item():.3f} of the blocks: block_acc reads "
        "d_1 at the anchor's causal row under 'causal', at MASK 1 under 'mask'"
    )


def test_block_labels_are_the_b_tokens_after_each_anchor_where_they_count():
    """_block_labels, label by label: MASK i of the block off x_j is labelled x_{j+i} (i = 1 ..
    B), and it counts only where x_{j+i} is inside the sequence, is a response token and the
    anchor is valid; checked on a right-padded row, anchors near the end, an invalid anchor."""
    x, loss_mask = batch(b=2, length=9, prompt_len=3)  # row 1: its last 4 tokens are padding
    anchors = torch.tensor([[2, 5, 7], [2, 3, 4]])
    valid = torch.tensor([[True, True, True], [True, False, True]])
    block_size = 3
    labels, counts = d3d._block_labels(x, loss_mask, anchors, valid, block_size)
    assert labels.shape == counts.shape == (2, 3, block_size), (
        f"labels {tuple(labels.shape)}, counts {tuple(counts.shape)}: both (b, K, B)"
    )
    for b, k, i in [(b, k, i) for b in range(2) for k in range(3) for i in range(block_size)]:
        j, place = anchors[b, k].item(), anchors[b, k].item() + i + 1
        where = f"row {b}, MASK {i + 1} of the block off x_{j}"
        inside = place < x.shape[1]
        if inside:
            assert labels[b, k, i] == x[b, place], (
                f"{where}: labelled {labels[b, k, i].item()}, not x_{place} = {x[b, place].item()}"
                ": MASK i of a block predicts x_{j+i}, i = 1 .. B"
            )
        if not inside:
            why = f"x_{place} is past the end of the sequence: its label counts nowhere"
        elif not loss_mask[b, place]:
            why = f"x_{place} is not a response token (loss_mask): its label counts nowhere"
        elif not valid[b, k]:
            why = "its anchor is invalid (valid False): the block's labels count nowhere"
        else:
            why = f"x_{place} is inside, a response token, its anchor valid: the label counts"
        assert counts[b, k, i] == (inside and loss_mask[b, place] and valid[b, k]), (
            f"{where}: counts is {counts[b, k, i].item()}; {why}"
        )


def test_the_loss_takes_its_anchors_from_at_else_draws_k_with_the_generator(tok):
    """The anchors: `at` where it is given (the generator then changes nothing), else K =
    num_anchors drawn with `generator` (sample_anchors): the loss and metrics of at =
    sample_anchors(loss_mask, K, the same seed)."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=3, num_anchors=5)
    x, loss_mask = batch()
    drawn = d3d.d3d_loss(drafter, x, loss_mask, generator=torch.Generator().manual_seed(7))
    at = d3d.sample_anchors(loss_mask, 5, torch.Generator().manual_seed(7))
    given = d3d.d3d_loss(drafter, x, loss_mask, at=at)
    why = "without `at`, K = num_anchors (5) anchors are drawn with `generator` (sample_anchors)"
    torch.testing.assert_close(drawn[0], given[0], msg=why)
    for name in ("loss_block", "loss_ar", "block_acc"):
        torch.testing.assert_close(drawn[1][name], given[1][name], msg=f"{name}: {why}")
    other = d3d.d3d_loss(drafter, x, loss_mask, at=at, generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(
        other[0], given[0], msg="with `at` given, those are the anchors: the generator is unused"
    )


def test_block_acc_is_each_positions_share_of_the_counted_blocks_it_gets_right(tok):
    """block_acc[i - 1] is the share of the blocks whose label i counts that draft it right: its
    denominator is the counted blocks at that position, not every block. One anchor per row
    (labels after an anchor change nothing its block sees): some labels are set to the
    drafter's own guesses, some fall past the end or on padding."""
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=2), tokenizer=tok, block_size=3, num_anchors=1, d1_from="mask"
    )
    x, loss_mask = batch(b=3, length=10, prompt_len=2)  # row 1: its last 4 tokens are padding
    anchors = torch.tensor([[3], [4], [8]])  # row 1: only label 5 counts; row 2: only 9
    at = (anchors, torch.ones_like(anchors, dtype=torch.bool))
    with torch.no_grad():
        _, block_hidden = d3d._packed_hidden(drafter, x, anchors, 3)
        guess = drafter.logits(block_hidden[:, 0]).argmax(-1)  # (b, B) each MASK's token
    for b, i in ((0, 0), (0, 2), (1, 0), (2, 0)):  # these guesses become the labels
        x[b, anchors[b, 0] + i + 1] = guess[b, i]
    _, metrics = d3d.d3d_loss(drafter, x, loss_mask, at=at)
    expected, num_counted = [], []
    for i in range(3):
        counted = [b for b in range(3) if anchors[b, 0] + i + 1 < 10]
        counted = [b for b in counted if loss_mask[b, anchors[b, 0] + i + 1]]
        right = [b for b in counted if guess[b, i] == x[b, anchors[b, 0] + i + 1]]
        expected.append(len(right) / len(counted))
        num_counted.append(len(counted))
    assert metrics["block_acc"].tolist() == pytest.approx(expected), (
        f"block_acc {[round(a, 3) for a in metrics['block_acc'].tolist()]}, expected "
        f"{[round(a, 3) for a in expected]}: at each block position, the share of the blocks "
        f"whose label there counts ({num_counted} of 3 here) that draft it right"
    )


def test_chunked_loss_equals_the_plain_computation(tok, monkeypatch):
    """cross_entropy projects a few rows at a time and recomputes them in backward: its value and
    its gradients (for the hidden states and the shared embedding / output layer) equal
    cross-entropy on all logits at once."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 32, generator=g, requires_grad=True)
    labels = torch.randint(0, TEXT_VOCAB, (11,), generator=g)
    weight = drafter.model.get_output_embeddings().weight
    expected = torch.nn.functional.nll_loss(
        torch.log_softmax(drafter.logits(hidden), -1), labels, reduction="none"
    )
    expected_grads = torch.autograd.grad(expected.sum(), [hidden, weight])
    # 3 rows per chunk: 4 chunks, the last one short
    monkeypatch.setitem(runtime.LOGITS_PER_CHUNK, "cpu", 3 * 99)
    loss, argmax = d3d.cross_entropy(drafter, hidden, labels)
    grads = torch.autograd.grad(loss.sum(), [hidden, weight])
    torch.testing.assert_close(loss, expected)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b)
    assert torch.equal(argmax, drafter.logits(hidden).argmax(-1))
    empty, _ = d3d.cross_entropy(drafter, hidden[:0], labels[:0])
    assert empty.shape == (0,) and empty.requires_grad


def test_chunked_distillation_equals_one_chunk(tok, monkeypatch):
    """The recovery loss in chunks of 3 rows equals it in one chunk, value and gradients."""
    student = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4, num_anchors=4)
    teacher = d3d.make_drafter(tiny_qwen3(seed=4), tokenizer=tok, block_size=4, num_anchors=4)
    x, loss_mask = batch()
    results = []
    for rows in (10**6, 3):
        monkeypatch.setitem(runtime.LOGITS_PER_CHUNK, "cpu", rows * 99)
        config = d3d.PruneConfig(val_anchors=4)
        loss = d3d.distill_loss(
            student, teacher, x, loss_mask, config, torch.Generator().manual_seed(0)
        )
        results.append((loss, torch.autograd.grad(loss, list(student.parameters()))))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)


def test_loss_chunks_are_sized_by_device():
    assert runtime.loss_chunk_rows(151_936, "cpu") == 220  # 128 MiB of fp32 logits
    # 1 GiB on a GPU, whatever its index
    assert runtime.loss_chunk_rows(151_936, torch.device("cuda", 1)) == 1766
    assert runtime.loss_chunk_rows(10**9, "cuda") == 1


# --------------------------------------------------------------------------------------------------
# Drafter: making, saving, loading


def test_save_load_round_trip_gives_identical_logits(tok, tmp_path):
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=4), tokenizer=tok, block_size=7, num_anchors=9, decay_gamma=3.0
    )
    drafter.save_pretrained(str(tmp_path))
    loaded = d3d.Drafter.from_pretrained(str(tmp_path))
    assert loaded.d3d_config == drafter.d3d_config
    x = torch.randint(0, TEXT_VOCAB, (1, 11))
    mask, pos = d3d.packed_attention_mask(11, torch.tensor([4, 9]), 7)
    inp = torch.cat([x, torch.full((1, 14), drafter.d3d_config.mask_token_id)], 1)

    def logits_of(d):
        return d.logits(d.hidden_states(inp, pos, mask))

    assert torch.equal(logits_of(drafter), logits_of(loaded))


def test_keep_layers_keeps_the_right_layers(tok):
    model = tiny_qwen3(seed=5, layers=4)
    originals = [layer.mlp.up_proj.weight.clone() for layer in model.model.layers]
    drafter = d3d.make_drafter(model, tokenizer=tok, layers=[0, 3])
    kept = drafter.model.model.layers
    assert len(kept) == 2 and drafter.model.config.num_hidden_layers == 2
    assert torch.equal(kept[0].mlp.up_proj.weight, originals[0])
    assert torch.equal(kept[1].mlp.up_proj.weight, originals[3])
    assert [layer.self_attn.layer_idx for layer in kept] == [0, 1]
    assert drafter.d3d_config.layer_ids == [0, 3]
    out, _ = d3d.generate(
        tiny_qwen3(seed=1), drafter, torch.tensor([[3, 4, 5]]), max_new_tokens=9, block_size=3
    )
    assert out.shape[1] == 12
    with pytest.raises(ValueError, match="at least one decoder layer"):
        d3d.make_drafter(tiny_qwen3(seed=5), tokenizer=tok, layers=[])


def test_mask_token_uses_free_slot_or_resizes(tok):
    with_room = d3d.make_drafter(tiny_qwen3(), tokenizer=tok)
    assert with_room.d3d_config.mask_token_id == TEXT_VOCAB
    assert with_room.model.get_input_embeddings().weight.shape[0] == 99  # no resize
    # SmolLM2-like: no free row
    full = d3d.make_drafter(tiny_llama(vocab_size=TEXT_VOCAB), tokenizer=tok)
    assert full.d3d_config.mask_token_id == TEXT_VOCAB
    assert full.model.get_input_embeddings().weight.shape[0] == TEXT_VOCAB + 1
    assert full.d3d_config.target_vocab_size == TEXT_VOCAB
    logits = full(
        torch.tensor([[1, 2, TEXT_VOCAB]]),
        torch.arange(3)[None],
        torch.ones(1, 1, 3, 3, dtype=torch.bool),
    )
    assert logits.shape[-1] == TEXT_VOCAB  # cut to the target's vocabulary: MASK is never drafted


def test_models_load_straight_to_the_device_in_their_dtype(tmp_path, monkeypatch):
    """In the dtype asked for; on a GPU with accelerate, placed by from_pretrained itself (no host
    copy first)."""
    import importlib.util

    import transformers

    model = tiny_qwen3(seed=1)
    model.save_pretrained(tmp_path)
    assert (
        next(runtime.load_causal_lm(str(tmp_path), torch.bfloat16, "cpu").parameters()).dtype
        == torch.bfloat16
    )
    calls = []

    def from_pretrained(path, **kwargs):
        calls.append(kwargs)
        return model

    def find_spec(name):
        if name == "accelerate":
            return object()
        return None

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    runtime.load_causal_lm(str(tmp_path), torch.bfloat16, "cuda:1")
    assert calls == [{"dtype": torch.bfloat16, "device_map": torch.device("cuda", 1)}]


# --------------------------------------------------------------------------------------------------
# Synchronous decoding is lossless: the target's greedy tokens; caches hold what was committed


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("prompt_len", [1, 7])
@pytest.mark.parametrize("kind", ["oracle", "never", "partial"])
def test_sync_equals_target_greedy(tok, target, block_size, prompt_len, kind):
    max_new = 23  # not a multiple of any block size here
    prompt = torch.randint(
        0, TEXT_VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len)
    )
    reference = reference_continuation(target, prompt, max_new + block_size + 2)
    right_upto = {"oracle": block_size, "never": 0, "partial": block_size // 2}[kind]
    drafter = ScriptedDrafter(
        d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=tok, block_size=block_size),
        reference,
        right_upto,
    )
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=max_new, mode="target")
    out, stats = d3d.generate(target, drafter, prompt, max_new_tokens=max_new, mode="sync")
    tokens, wanted = out[0].tolist(), expected[0].tolist()
    if tokens != wanted:
        at = next((i for i, (x, y) in enumerate(zip(tokens, wanted)) if x != y), len(wanted))
        pytest.fail(
            f"B = {block_size}, a drafter {kind}: the output leaves the target's greedy tokens "
            f"at position {at}: verify [x_n, d_1 .. d_B], commit d_1 .. d_a and t, rewind the "
            "target to all but x_n"
        )
    lengths = stats["accept_lengths"]
    full_rounds = lengths[:-1]  # the last round may be cut short by max_new_tokens
    # the first token comes from the target's prefill
    assert all(n == right_upto + 1 for n in full_rounds) and sum(lengths) == max_new - 1, (
        f"B = {block_size}, a drafter {kind}: the rounds committed {lengths} tokens: each commits "
        f"a + 1 = {right_upto + 1}, recorded by out.commit_round ({max_new - 1} in all)"
    )
    if kind == "oracle" and len(full_rounds) > 0:
        assert stats["tau"] <= block_size + 1


def test_target_mode_equals_transformers_greedy(target):
    prompt = torch.tensor([[5, 17, 33, 2, 8]])
    ours, stats = d3d.generate(target, None, prompt, max_new_tokens=19, mode="target")
    theirs = target.generate(prompt, max_new_tokens=19, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
    assert stats["num_new_tokens"] == 19


def test_sync_stops_at_eos_inside_an_accepted_block(tok, target):
    """An EOS the target says inside the first block, which the drafter has right: the round
    that commits it cuts its commit there and the decode stops (out.done), with the target's
    output to that EOS; no round commits after it."""
    prompt = torch.tensor([[4, 8, 15, 16, 23]])
    reference = reference_continuation(target, prompt, 60)
    new = reference[5:]
    # a token that first appears as the k-th new token, 2 < k < 16: inside the first accepted block
    # of 16
    k = next(k for k in range(2, 15) if new[k] not in new[:k])
    eos, first = new[k], 5 + k
    drafter = ScriptedDrafter(
        d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=tok, block_size=16), reference, 16
    )
    expected, _ = d3d.generate(
        target, None, prompt, max_new_tokens=40, mode="target", eos_token_id=eos
    )
    try:
        out, stats = d3d.generate(
            target, drafter, prompt, max_new_tokens=40, mode="sync", eos_token_id=eos
        )
    except RuntimeError as error:
        if "finished sequence" not in str(error):
            raise
        pytest.fail(
            f"a round committed after the EOS ({error}): rounds run until out.done, the budget "
            "or an EOS committed"
        )
    assert out.tolist() == expected.tolist() == [reference[: first + 1]], (
        "the output is not the target's up to the EOS: rounds run until out.done"
    )
    assert out[0, -1].item() == eos


@pytest.mark.parametrize("d1_from", ["causal", "mask"])
def test_sync_with_real_drafters_equals_target(tok, target, d1_from):
    """Unscripted drafters (random, and the target's own weights) through the real code path."""
    prompt = torch.tensor([[7, 1, 9]])
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=30, mode="target")
    for model in (tiny_qwen3(seed=11), tiny_qwen3(seed=1)):
        drafter = d3d.make_drafter(model, tokenizer=tok, block_size=4, d1_from=d1_from)
        out, stats = d3d.generate(target, drafter, prompt, max_new_tokens=30)
        assert out.tolist() == expected.tolist()
        assert stats["num_rounds"] == len(stats["accept_lengths"]) and stats["time_verify"] > 0


def test_sync_times_its_draft_and_its_verification_apart(tok, target):
    """The two phases of a sync round each go into their own clock span, so that stats say where
    a round's time went: time_draft and time_verify, each positive and together within the
    decode's time."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=4)
    _, stats = d3d.generate(target, drafter, torch.tensor([[7, 1, 9]]), max_new_tokens=20)
    phases = {key: stats.get(key, 0.0) for key in ("time_draft", "time_verify")}
    assert all(seconds > 0 for seconds in phases.values()), f"untimed phases: {phases}"
    assert sum(phases.values()) <= stats["time_total"]


def test_zero_new_tokens(target, tok):
    prompt = torch.tensor([[1, 2]])
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok)
    for mode in d3d.MODES:
        out, _ = d3d.generate(target, drafter, prompt, max_new_tokens=0, mode=mode)
        assert out.tolist() == prompt.tolist()


def test_eos_inside_an_accepted_block_is_committed_there(tok, target):
    """EOS as the 3rd..14th token of a block the drafter has right: the round that commits it stops
    at it, in sync and async, with the tokens after it in the block dropped."""
    prompt = torch.tensor([[4, 8, 15, 16, 23]])
    for mode in ("sync", "async"):
        drafter, _ = scripted(tok, target, prompt, 16, "oracle", 60)
        new = drafter.reference[5:]
        k = next(k for k in range(2, 15) if new[k] not in new[:k])
        out, stats = d3d.generate(
            target, drafter, prompt, max_new_tokens=40, mode=mode, eos_token_id=new[k]
        )
        assert out[0, 5:].tolist() == new[: k + 1]
        # one round: tokens 2 .. k+1 (the first is the prefill's), EOS last
        assert stats["accept_lengths"] == [k]


class WatchedDrafter(d3d.Drafter):
    """Wraps a drafter (scripted or real): each pass runs on it, after `seen` looks at the pass's
    input. A subclass says what to look at."""

    def __init__(self, drafter):
        super().__init__(drafter.model, drafter.d3d_config)
        self.inner = drafter

    def hidden_states(self, ids, positions, mask, cache=None):
        self.seen(ids, positions, cache)
        return self.inner.hidden_states(ids, positions, mask, cache)

    def logits(self, hidden):
        return self.inner.logits(hidden)

    def seen(self, ids, positions, cache) -> None:
        raise NotImplementedError


class AuditedDrafter(WatchedDrafter):
    """Checks, before each pass of the drafter it wraps, that its KV cache holds exactly the
    committed tokens the pass takes for granted: as many as the position of the pass's first
    token, with the keys and values a fresh pass over those tokens gives. `committed`: the
    decode's output (greedy: the target's)."""

    def __init__(self, drafter, committed):
        super().__init__(drafter)
        self.committed, self.checked = committed, 0

    def seen(self, ids, positions, cache) -> None:
        if cache is not None and int(positions[0, 0]) > 0:
            self.check(cache, int(positions[0, 0]))

    def check(self, cache, length):
        from transformers import DynamicCache

        rule = (
            f"before a pass at position {length} the drafter's cache holds x_0 .. x_{length - 1}, "
            "the committed tokens, each once and nothing else (it reads those it has not read)"
        )
        held_length = int(cache.get_seq_length())
        assert held_length == length, f"it holds {held_length} tokens: {rule}"
        fresh = DynamicCache(config=self.model.config)
        self.model.get_decoder()(
            input_ids=torch.tensor([self.committed[:length]]), cache=fresh, use_cache=True
        )
        for held, clean in zip(cache.layers, fresh.layers):
            for kind in ("keys", "values"):
                torch.testing.assert_close(
                    getattr(held, kind)[:, :, :length],
                    getattr(clean, kind),
                    atol=1e-5,
                    rtol=1e-4,
                    msg=f"its {kind} are not those of x_0 .. x_{length - 1}: {rule}",
                )
        self.checked += 1


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("kind", ["oracle", "never", "partial", "real"])
def test_drafter_cache_holds_the_committed_tokens_each_pass_assumes(tok, target, mode, kind):
    """Before each of its passes, hit or miss, the drafter's cache holds exactly the committed
    tokens the pass takes for granted, with their true keys and values (sync: what was committed
    when the round began; async: every committed token but x_n). A scripted drafter ignores its
    cache, so only this check sees a wrong one; the caches are reused by the next request."""
    block_size, max_new = 5, 31
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=max_new, mode="target")
    if kind == "real":
        # the target's weights
        inner = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=block_size)
    else:
        inner, _ = scripted(tok, target, prompt, block_size, kind, max_new)
    drafter = AuditedDrafter(inner, expected[0].tolist())
    caches = runtime.Caches.make(target, drafter, 96)
    for _ in range(2):  # the second request finds the caches the first one left
        out, stats = d3d.generate(
            target, drafter, prompt, max_new_tokens=max_new, mode=mode, caches=caches
        )
        assert out.tolist() == expected.tolist()
        drafter.check(caches.drafter.hf, caches.drafter.length)  # and after the last round
    assert drafter.checked >= 2 * stats["num_rounds"]
    if mode == "async" and kind in (
        "oracle",
        "partial",
    ):  # hits, so the cache after a hit is checked too
        assert sum(stats["hits_per_position"]) > 0


def test_a_sync_round_is_watched_once_after_its_commit_and_rewind(tok, target):
    """Each sync round reaches the watchers (generate's on_round) once, after its commit and the
    target's rewind: its record holds the draft it read (B = config.block_size tokens, all real,
    here not the drafter's trained B), (a, t), what it committed (d_1 .. d_a, t) and the caches
    as it left them (the target's: the committed tokens but the new x_n; the drafter's: those it
    read, up to the round's x_n). The rounds add up to the output."""
    prompt = torch.tensor([[4, 8, 15, 16, 23]])
    max_new, block_size = 23, 4
    # trained at B = 5, right at MASK 1 and 2 of every block: a = 2 each round
    drafter, _ = scripted(tok, target, prompt, 5, "partial", max_new)
    infos = []
    with pytest.warns(UserWarning, match="decodes at B = 4"):
        out, stats = d3d.generate(
            target,
            drafter,
            prompt,
            max_new_tokens=max_new,
            block_size=block_size,
            on_round=infos.append,
        )
    tokens = out[0].tolist()
    assert len(infos) == stats["num_rounds"] > 3, (
        f"{len(infos)} rounds watched, {stats['num_rounds']} decoded: each round goes to watch once"
    )
    n = prompt.shape[1]  # x_n: the prefill's token
    for info in infos:
        where = f"round {info.index} (n = {info.n})"
        assert (len(info.draft), info.num_real) == (block_size, block_size), (
            f"{where}: a draft of {len(info.draft)} tokens, R = {info.num_real}: B is "
            f"config.block_size ({block_size}, the drafter was trained at 5), every token real"
        )
        expected = info.draft[: info.num_accepted] + [info.next_token]
        assert info.committed and info.committed == expected[: len(info.committed)], (
            f"{where}: watched with {info.committed} committed, (a, t) = ({info.num_accepted}, "
            f"{info.next_token}): a round goes to watch after its commit, with the draft read"
        )
        assert (info.n, info.committed) == (n, tokens[n + 1 : n + 1 + len(info.committed)]), (
            f"{where}: the rounds do not add up to the output: each round goes to watch once"
        )
        n += len(info.committed)
        assert info.target_cache[1] == n and info.drafter_cache[1] == info.n + 1, (
            f"{where}: watched with the target's cache at {info.target_cache[1]} and the "
            f"drafter's at {info.drafter_cache[1]}, expected {n} and {info.n + 1}: a round goes "
            "to watch after its rewind (the target keeps the committed tokens but x_n)"
        )
    assert n == len(tokens) - 1


class PassWidths(WatchedDrafter):
    """Records the width (tokens) of each pass of the drafter it wraps."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.widths = []

    def seen(self, ids, positions, cache) -> None:
        self.widths.append(ids.shape[1])


@pytest.mark.parametrize("block_size", [1, 4])
def test_every_sync_draft_pass_has_one_shape_whatever_the_round_read(tok, target, block_size):
    """After the prompt's prefill, every drafter pass of a sync decode has B + 1 causal tokens
    (the committed tokens it has not read, 1 .. B + 1 of them, padded) and B MASKs, whether the
    rounds accept every token, none or some: one shape, so a compiled pass never recompiles
    (tests/test_compiled.py compiles them)."""
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    for kind in ("oracle", "never", "partial"):
        inner, _ = scripted(tok, target, prompt, block_size, kind, 20)
        drafter = PassWidths(inner)
        d3d.generate(target, drafter, prompt, max_new_tokens=20)
        prefill, *rounds = drafter.widths
        assert prefill == prompt.shape[1] and len(rounds) > 2, drafter.widths
        assert set(rounds) == {2 * block_size + 1}, (
            f"B = {block_size}, a drafter {kind}: draft passes of {sorted(set(rounds))} tokens: "
            f"every drafter pass has one shape, B + 1 causal tokens (padded) and B MASKs, "
            f"{2 * block_size + 1}"
        )


def test_a_cache_rewinds_only_to_what_it_holds(target):
    """rewind(n) drops tokens; an n past what the cache holds is refused and changes nothing:
    moving the length forward would let the next pass attend to slots never written."""
    cache = runtime.KVCache(target, 16)
    runtime.prefill(cache, torch.tensor([[5, 6, 7, 8, 9]]))
    with pytest.raises(ValueError, match="cannot rewind the KV cache to 6 tokens: it holds 5"):
        cache.rewind(6)
    assert cache.length == 5
    cache.rewind(5)
    cache.rewind(3)
    assert cache.length == 3 == int(cache.hf.get_seq_length())
    with pytest.raises(ValueError, match="it holds 3"):
        cache.rewind(4)
    cache.reset(skipped=4)  # prompt tokens left out of the cache count as held
    runtime.prefill(cache, torch.tensor([[1, 2]]))
    cache.rewind(6)
    with pytest.raises(ValueError, match="it holds 6"):
        cache.rewind(7)
    assert cache.length == 2


# --------------------------------------------------------------------------------------------------
# Sampling is lossless: the target's law, whatever the drafter proposes
#
# At every temperature T, not only at 1: accept_draft takes p and q both at T (p = softmax(p_logits
# / T); q is the law the draft was drawn from), so each test runs at each of TEMPERATURES and tells
# the target's law at T from its law at wrong_temperature(T).

# sampling temperatures of the lossless tests: below 1, 1, above 1
TEMPERATURES = (0.6, 1.0, 1.6)


def wrong_temperature(temperature: float) -> float:
    """The temperature of a wrong law that a sampling test at `temperature` must reject (its
    power): 1, the law a rule that takes p at T = 1 gives; at T = 1 itself, 1.6."""
    if temperature == 1:
        return 1.6
    return 1.0


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected=5.0) -> float:
    """Goodness of fit of observed counts to exact probabilities: counts (V,) against probs (V,),
    or each row of counts (R, V) against its own row of probs (R, V), as a Markov chain's
    transitions (the rows' statistics and degrees of freedom add up). In a row, cells with small
    expected counts are pooled; a count where the law gives probability 0 fails outright."""
    assert counts.shape == probs.shape, f"counts {tuple(counts.shape)}, probs {tuple(probs.shape)}"
    counts = counts.reshape(-1, counts.shape[-1])
    probs = probs.reshape(-1, probs.shape[-1])
    stat, dof = 0.0, 0
    for row_counts, row_probs in zip(counts, probs):
        n = row_counts.sum()
        if n == 0:
            continue
        if row_counts[row_probs == 0].sum() > 0:
            return 0.0
        expected = row_probs * n
        small = expected < min_expected
        obs = torch.cat([row_counts[~small], row_counts[small].sum()[None]])
        exp = torch.cat([expected[~small], expected[small].sum()[None]])
        keep = exp > 0
        stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        dof += int(keep.sum()) - 1
    assert dof > 0, "too few counts for a chi-square test"
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_accept_rule_is_lossless(temperature):
    """accept_draft alone, at temperature T, on fixed distributions (rows that do not depend on
    the prefix), p = softmax(p_logits / T) and a q far from p: the first emitted token follows
    p[0], and after an accepted d_1 the second follows p[1], whatever q is. Every other draft is
    padded (R = 1 real token and a pad whose q row is uniform, as after a full-acceptance hit):
    there the token after an accepted d_1 is the bonus, and it follows p[1] too, not the residual
    max(p[1] - q_pad, 0). Chi-square tests at alpha = 1e-3: a correct rule fails with probability
    0.1 % per test; the seeds are fixed, so the outcome is repeatable."""
    g = torch.Generator().manual_seed(0)
    vocab, block_size, n = 6, 2, 3000
    p_logits = torch.randn(block_size + 1, vocab, generator=g) * 1.5
    q_draft = torch.softmax(torch.randn(block_size, vocab, generator=g) * 1.5, -1)
    # d_2 is a pad: drawn from its uniform row, never accepted
    q_padded = torch.cat([q_draft[:1], torch.full((1, vocab), 1 / vocab)])
    sampler = d3d.Sampler(temperature, g)
    first, second, bonus = torch.zeros(vocab), torch.zeros(vocab), torch.zeros(vocab)
    rejected_first = 0
    for i in range(n):
        q, num_real, after_d1 = q_draft, block_size, second
        # every other draft is padded: R = 1, and the token after an accepted d_1 is the bonus
        if i % 2 == 1:
            q, num_real, after_d1 = q_padded, 1, bonus
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
        num_accepted, next_token = d3d.accept_draft(p_logits, draft, q, sampler, num_real)
        emitted = draft[:num_accepted].tolist() + [int(next_token)]
        first[emitted[0]] += 1
        rejected_first += num_accepted == 0
        if num_accepted >= 1:
            after_d1[emitted[1]] += 1
    # both acceptance and residual draws happen, and padded drafts accepted whole
    assert 0.1 * n < rejected_first < 0.9 * n and bonus.sum() > 0.05 * n, (
        f"d_1 rejected {rejected_first} times in {n}, {int(bonus.sum())} padded drafts accepted "
        "whole: d_i is accepted with probability min(1, p(d_i) / q(d_i)) (u q(d_i) <= p(d_i))"
    )
    p_target = torch.softmax(p_logits / temperature, -1)
    at_1 = torch.softmax(p_logits, -1)
    accepted = "accepted with probability min(1, p / q), else t ~ max(p - q, 0)"
    from_p = "after all R real tokens t ~ p, not the residual max(p - q_pad, 0)"
    for counts, row, what, rule in (
        (first, 0, "the first token", f"d_i is {accepted}"),
        (second, 1, "the token after d_1", f"each d_i has its own u_i: {accepted}"),
        (bonus, 1, "the bonus after a padded draft", from_p),
    ):
        fit = chi_square_p_value(counts, p_target[row])
        if temperature != 1 and fit <= 1e-3 and chi_square_p_value(counts, at_1[row]) > 1e-3:
            pytest.fail(
                f"T = {temperature}: {what} follows the target's p at T = 1, not at T: p is "
                "sampler.probs(p_logits), the target's law at the sampling temperature"
            )
        assert fit > 1e-3, (
            f"T = {temperature}: {what} leaves the target's p (chi-square p = {fit:.1e}): {rule}"
        )
    # the test has power: the same counts reject the drafter's law and the target's at another
    # temperature
    assert chi_square_p_value(first, q_draft[0]) < 1e-3
    wrong = torch.softmax(p_logits / wrong_temperature(temperature), -1)
    for counts, row in ((first, 0), (second, 1), (bonus, 1)):
        assert chi_square_p_value(counts, wrong[row]) < 1e-3


def exact_law(target, prompt: list[int], temperature: float) -> torch.Tensor:
    """The target's exact joint law (16, 16) of generated tokens 3 and 4 after `prompt` (a 16-token
    vocabulary), by enumerating every (t1, t2, t3) in one batched pass."""
    with torch.no_grad():  # P(t1, t2, t3, t4) for all 16^4 continuations
        grid = torch.cartesian_prod(*[torch.arange(16)] * 3)  # (4096, 3)
        ids = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], 1)
        # (4096, 4, 16)
        p = torch.softmax(target(ids).logits[:, len(prompt) - 1 :].float() / temperature, -1)
        t1, t2, t3 = grid.T
        law = p[:, 0].gather(1, t1[:, None])[:, 0] * p[:, 1].gather(1, t2[:, None])[:, 0]
        # (4096, 16): (t1, t2, t3) x t4
        law = (law * p[:, 2].gather(1, t3[:, None])[:, 0])[:, None] * p[:, 3]
        return law.view(16, 16, 16, 16).sum((0, 1))  # (t3, t4)


@pytest.mark.parametrize(
    "mode,block_size,d1_from",
    [("sync", 2, "causal"), ("async", 1, "causal"), ("async", 2, "causal"), ("async", 2, "mask")],
)
def test_sampling_matches_target_distribution(mode, block_size, d1_from):
    """End to end through generate: the joint law of generated tokens 3 and 4 matches the target's
    exact law, computed by enumerating every (t1, t2, t3) in one batched pass. Tokens 3 and 4 come
    from the first and second speculative rounds (token 1 is the target's prefill), so in async mode
    they include drafts taken from branch hits. Chi-square test at alpha = 1e-3 (false-failure rate
    0.1 %; the seeds are fixed, so the run repeats). A drafter unlike the target makes acceptance,
    rejection (residual draws), hits and misses all happen. Power: the same counts reject a law 0.13
    away in total variation. At T = 1 alone (600 decodes a case): the tests on a Markov chain below
    run each of TEMPERATURES, on each acceptance path."""
    vocab, temperature, num_samples = 8, 1.0, 600
    tok = make_tokenizer(vocab)
    target = tiny_qwen3(seed=21, vocab_size=16, init=0.6)
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=22, vocab_size=16, init=0.6),
        tokenizer=tok,
        block_size=block_size,
        d1_from=d1_from,
    )
    prompt = [3, 1]
    joint = exact_law(target, prompt, temperature)
    counts = torch.zeros(16, 16)
    generator = torch.Generator().manual_seed(1234)
    rejections, hits, misses = 0, 0, 0
    for _ in range(num_samples):
        out, stats = d3d.generate(
            target,
            drafter,
            torch.tensor([prompt]),
            max_new_tokens=4,
            mode=mode,
            temperature=temperature,
            generator=generator,
        )
        counts[out[0, 4], out[0, 5]] += 1
        rejections += sum(n <= block_size for n in stats["accept_lengths"][:-1])
        hits += sum(stats.get("hits_per_position", [0]))
        misses += sum(stats.get("misses_per_position", [0]))
    # residual draws happen (and acceptances: the drafter is not useless)
    assert rejections > 0.05 * num_samples
    if mode == "async":
        assert hits > 0.05 * num_samples and misses > 0.05 * num_samples
    assert chi_square_p_value(counts.flatten(), joint.flatten()) > 1e-3
    # power: the same counts tell the target's law from a law 0.13 away in TV (the target's at
    # temperature 1.2)
    hotter = exact_law(target, prompt, 1.2)
    assert 0.1 < 0.5 * (hotter - joint).abs().sum() < 0.2
    assert chi_square_p_value(counts.flatten(), hotter.flatten()) < 1e-3


def markov_model(logits: torch.Tensor) -> torch.nn.Module:
    """A tiny Qwen3 whose next-token law after any prefix depends on its last token x alone:
    softmax(logits[x]) (logits (V, V), V <= 32), a Markov chain. Attention and MLP add nothing
    (their output layers are zero), so the last hidden state is x's embedding, a one-hot row
    scaled to RMS 1 (the final norm keeps it), and the output layer maps it to logits[x]."""
    vocab = len(logits)
    model = tiny_qwen3(seed=4, vocab_size=vocab, layers=1)
    hidden = model.config.hidden_size
    one_hot = torch.eye(vocab, hidden)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(one_hot * hidden**0.5)
        model.lm_head.weight.copy_(logits.T @ one_hot / hidden**0.5)
    return model


def prefix_free_target(logits: torch.Tensor) -> torch.nn.Module:
    """A tiny Qwen3 whose next-token law is softmax(logits) after any prefix: a markov_model
    whose rows are all `logits`."""
    return markov_model(logits.expand(len(logits), -1))


# A Markov chain on 4 text tokens (row x: the logits of the token after x); id 4 is the drafters'
# MASK, which the target never produces
CHAIN = torch.tensor(
    [
        [1.5, 0.45, 0.75, -0.75],
        [0.0, 1.5, 1.2, -0.9],
        [0.9, 0.45, 0.3, -1.2],
        [1.5, -0.9, 0.6, 0.6],
    ]
)


def chain_logits(rows: torch.Tensor, mask_row: torch.Tensor) -> torch.Tensor:
    """Logits (V + 1, V + 1) of a markov_model over CHAIN's V text tokens and MASK (id V): row x
    < V is rows[x]; the row after MASK (a drafter's block rows) is mask_row; MASK itself is never
    produced."""
    vocab = len(rows)
    logits = torch.full((vocab + 1, vocab + 1), -30.0)
    logits[:vocab, :vocab] = rows
    logits[vocab, :vocab] = mask_row
    return logits


def chain_law(temperature: float) -> torch.Tensor:
    """The target's exact transition law at a temperature, (V + 1, V + 1)."""
    return torch.softmax(chain_logits(CHAIN, torch.zeros(len(CHAIN))) / temperature, -1)


def chain_drafter(rows: torch.Tensor, mask_row: torch.Tensor) -> d3d.Drafter:
    """A drafter of CHAIN at B = 2 whose causal rows (d_1, and the bonus guess) are `rows` and
    whose MASK rows (d_2) are mask_row, whatever the prefix."""
    tokenizer = make_tokenizer(len(CHAIN))
    model = markov_model(chain_logits(rows, mask_row))
    return d3d.make_drafter(model, tokenizer=tokenizer, block_size=2)


def add_transitions(counts: torch.Tensor, tokens: list[int]) -> None:
    """counts[x, y] += 1 for each token y and the token x before it."""
    for x, y in zip(tokens, tokens[1:]):
        counts[x, y] += 1


def sample_chain(drafter, mode: str, temperature: float, on_round=None):
    """Four decodes of 400 new tokens after the prompt [0] (one seeded generator, one pair of
    caches): the transition counts (V + 1, V + 1) of their tokens, and their stats."""
    target = markov_model(chain_logits(CHAIN, torch.zeros(len(CHAIN))))
    new_tokens = 400
    coverage, fanout = d3d.default_budget(2)
    slots = runtime.cache_len(1, new_tokens, 2, coverage, fanout)
    caches = runtime.Caches.make(target, drafter, slots)
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(len(CHAIN) + 1, len(CHAIN) + 1)
    runs = []
    for _ in range(4):
        out, stats = d3d.generate(
            target,
            drafter,
            torch.tensor([[0]]),
            max_new_tokens=new_tokens,
            mode=mode,
            temperature=temperature,
            generator=generator,
            caches=caches,
            on_round=on_round,
        )
        add_transitions(counts, out[0].tolist())
        runs.append(stats)
    return counts, runs


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_sync_sampling_follows_the_target_at_each_temperature(temperature):
    """Sync decoding of a Markov chain (the target's law depends on the token before alone) with
    a drafter far from it: its d_1 row is the target's shifted by one token, and its d_2 is token
    2 most of the time, whatever the prefix. Rejections and residual draws happen in most rounds,
    drafts accepted whole in over 5 %. The 1,600 transitions (x, y) follow the target's law at T
    (chi-square at alpha = 1e-3 over the rows x, fixed seeds) and reject its law at
    wrong_temperature(T)."""
    drafter = chain_drafter(CHAIN.roll(1, 1), torch.tensor([-2.0, -2.0, 2.0, -2.0]))
    counts, runs = sample_chain(drafter, "sync", temperature)
    # the last round may be cut by the budget
    lengths = [n for stats in runs for n in stats["accept_lengths"][:-1]]
    rejections = sum(n <= 2 for n in lengths)
    full_acceptances = sum(n == 3 for n in lengths)
    assert rejections > 0.5 * len(lengths) and full_acceptances > 0.05 * len(lengths)
    fit = chi_square_p_value(counts, chain_law(temperature))
    assert fit > 1e-3, (
        f"T = {temperature}: the tokens leave the target's law (chi-square p = {fit:.1e}): each "
        "round's draft is drawn from q (sampler.pick), which accept_draft is given with it"
    )
    assert chi_square_p_value(counts, chain_law(wrong_temperature(temperature))) < 1e-3


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_async_sampling_follows_the_target_after_hits_and_misses(temperature):
    """Async decoding of the Markov chain above with a drafter close to it (B = 2, C = 2, F = 2):
    rejections, branch hits, full-acceptance hits (then the draft is d_2's MASK row and a pad),
    padded drafts accepted whole and misses each happen in over 5 % of the rounds. The
    transitions follow the target's law at T: all of them (and they reject its law at
    wrong_temperature(T)), those committed by rounds whose draft a branch hit prepared, those
    committed by rounds whose draft a full-acceptance hit prepared, and the bonus tokens after
    padded drafts accepted whole (each set its own chi-square test at alpha = 1e-3)."""
    drafter = chain_drafter(0.7 * CHAIN + 0.3 * CHAIN.roll(1, 1), CHAIN.mean(0))
    paths = {
        "branch": torch.zeros(len(CHAIN) + 1, len(CHAIN) + 1),
        "full acceptance": torch.zeros(len(CHAIN) + 1, len(CHAIN) + 1),
    }
    bonus = torch.zeros(len(CHAIN) + 1, len(CHAIN) + 1)

    def on_round(info: d3d.RoundInfo):
        # the round's draft came from a hit: its path's transitions, from x_n on
        if info.drafted_by in paths:
            add_transitions(paths[info.drafted_by], [info.x_n, *info.committed])
        padded = info.num_real < len(info.draft)
        accepted_whole = padded and info.num_accepted == info.num_real
        # d_R, then the bonus token (unless the budget cut the round)
        if accepted_whole and len(info.committed) == info.num_real + 1:
            add_transitions(bonus, info.committed[-2:])

    counts, runs = sample_chain(drafter, "async", temperature, on_round)
    num_rounds = sum(stats["num_rounds"] for stats in runs)
    # per position, index i - 1: d_i rejected; index B = 2: full acceptance
    hits = torch.tensor([stats["hits_per_position"] for stats in runs]).sum(0).tolist()
    misses = torch.tensor([stats["misses_per_position"] for stats in runs]).sum(0).tolist()
    happened = {
        "rejections": sum(hits[:2]) + sum(misses[:2]),
        "branch hits": sum(hits[:2]),
        "full-acceptance hits": hits[2],
        "padded drafts accepted whole": sum(stats["pad_full_acceptances"] for stats in runs),
        "misses": sum(misses),
    }
    for what, count in happened.items():
        assert count > 0.05 * num_rounds, f"{what}: {count} of {num_rounds} rounds"
    law = chain_law(temperature)
    assert chi_square_p_value(counts, law) > 1e-3, "all transitions"
    for path, path_counts in paths.items():
        assert chi_square_p_value(path_counts, law) > 1e-3, f"after a {path} hit"
    assert chi_square_p_value(bonus, law) > 1e-3, "the bonus after a padded draft"
    assert chi_square_p_value(counts, chain_law(wrong_temperature(temperature))) < 1e-3


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_sampling_after_full_acceptance_hits_draws_the_bonus_from_the_target(temperature):
    """Async sampling after a full-acceptance hit: the next draft is B - 1 prepared tokens and a
    pad whose q row is uniform. When that draft is accepted whole, the bonus token follows the
    target's law p (at T), not the residual max(p - q_pad, 0). Target and drafter have the same
    prefix-free law p, so every draft is accepted, the output is i.i.d. p, and with B = 2 a round
    that commits 2 tokens is a padded draft accepted whole, its second token the bonus. One token
    of p outweighs 1/V at each T, most others do not: the residual's law, which the same counts
    reject, is nearly that token alone."""
    vocab, block_size = 8, 2
    logits = torch.tensor([2.0, 0.1, 0.1, 0.1, 0.0, -0.5, -1.0, -30.0])  # id 7: the drafter's MASK
    p = torch.softmax(logits / temperature, -1)
    drafter = d3d.make_drafter(
        prefix_free_target(logits), tokenizer=make_tokenizer(vocab - 1), block_size=block_size
    )
    out, stats = d3d.generate(
        prefix_free_target(logits),
        drafter,
        torch.tensor([[3, 1]]),
        max_new_tokens=480,
        mode="async",
        temperature=temperature,
        lanes=1,
        generator=torch.Generator().manual_seed(0),
    )
    new, lengths = out[0, 2:].tolist(), stats["accept_lengths"]
    assert set(lengths[:-1]) <= {block_size, block_size + 1}  # every draft accepted whole
    ends = [1 + sum(lengths[: i + 1]) for i in range(len(lengths) - 1)]  # after prefill's token
    bonuses = [new[end - 1] for end, n in zip(ends, lengths) if n == block_size]
    assert len(bonuses) <= stats["pad_full_acceptances"] <= len(bonuses) + 1  # + the last round
    assert len(bonuses) > 20 and len(bonuses) > 0.1 * stats["num_rounds"]
    counts = torch.bincount(torch.tensor(bonuses), minlength=vocab).float()
    assert chi_square_p_value(counts, p) > 1e-3
    everything = torch.bincount(torch.tensor(new), minlength=vocab).float()
    assert chi_square_p_value(everything, p) > 1e-3
    # power: a bonus drawn from the residual at the pad's row
    residual = (p - 1 / vocab).clamp(min=0)
    assert chi_square_p_value(counts, residual / residual.sum()) < 1e-3


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sampling_is_reproducible_with_a_generator(tok, target, mode):
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=3)
    runs = [
        d3d.generate(
            target,
            drafter,
            torch.tensor([[2, 3]]),
            max_new_tokens=12,
            temperature=0.8,
            mode=mode,
            generator=torch.Generator().manual_seed(7),
        )[0]
        for _ in range(2)
    ]
    assert torch.equal(*runs), (
        f"{mode}: two decodes with generators seeded alike differ ({runs[0][0].tolist()}, "
        f"{runs[1][0].tolist()}): every random number comes from the sampler (its generator)"
    )


def test_greedy_acceptance_takes_the_longest_agreeing_prefix_then_the_targets_token():
    """accept_draft at temperature 0 on one-hot target logits: a is the length of the longest
    prefix d_1 .. d_a equal to the target's argmax (a d_i that agrees after a disagreement is
    not accepted), t the target's argmax after it, p_logits[a] (the bonus p_logits[B] when all
    B agree); both 0-d tensors, left on the device for the round's one read."""
    vocab = 9
    # the target's argmax after x_n, d_1 .. d_i (row i)
    target_tokens = torch.tensor([4, 2, 6, 3, 1, 7])
    p_logits = torch.nn.functional.one_hot(target_tokens, vocab).float()
    cases = [
        ([4, 2, 6, 3, 1], 5, "every d_i agrees: all B, then the bonus p_logits[B]"),
        ([5, 2, 6, 3, 1], 0, "d_1 disagrees: none, then the target's own token for it"),
        ([4, 2, 0, 3, 1], 2, "d_3 disagrees: d_4 and d_5 agree, but after a disagreement"),
    ]
    for draft, expected, why in cases:
        verdict = d3d.accept_draft(p_logits, torch.tensor(draft), None, d3d.Sampler())
        shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else type(x) for x in verdict]
        assert len(verdict) == 2 and shapes == [(), ()], (
            f"accept_draft returned {shapes}: (a, t) are two 0-d tensors, left on the device"
        )
        a, t = (int(x) for x in verdict)
        assert a == expected, (
            f"greedy accepts the longest prefix equal to the target's argmax: a = {a}, expected "
            f"{expected} ({why}; draft {draft}, argmax {target_tokens.tolist()})"
        )
        assert t == int(target_tokens[a]), (
            f"then t is the target's own token, its argmax after d_1 .. d_a (p_logits[a]): t = "
            f"{t}, expected {int(target_tokens[a])} (a = {a}, draft {draft})"
        )


def test_acceptance_never_accepts_the_pad_even_where_it_is_the_targets_token():
    """A padded draft: R = 3 real tokens and a pad. The target's argmax agrees with every token,
    the pad's included: a = R, and t is the target's token at the pad's row, the bonus. Sampling
    the same: the target is sure of every token, so u q(d_i) <= p(d_i) holds at the pad too, yet
    a = R and t is drawn from p_logits[R]. Without num_real every token is real (R = B)."""
    vocab = 7
    draft = torch.tensor([4, 2, 6, 3])  # d_4 = 3 is the pad
    target_tokens = torch.tensor([4, 2, 6, 3, 1])  # the target's argmax after x_n, d_1 .. d_i
    p_logits = torch.nn.functional.one_hot(target_tokens, vocab).float()
    rule = "only d_1 .. d_R can be accepted: a pad never is, even where it is the target's token"
    a, t = d3d.accept_draft(p_logits, draft, None, d3d.Sampler(), num_real=3)
    assert (int(a), int(t)) == (3, 3), f"greedy, R = 3: (a, t) = ({int(a)}, {int(t)}); {rule}"
    # the same draft with four real tokens: all accepted, the bonus after d_4
    a, t = d3d.accept_draft(p_logits, draft, None, d3d.Sampler())
    assert (int(a), int(t)) == (4, 1), (
        f"greedy, num_real not given: (a, t) = ({int(a)}, {int(t)}), expected (4, 1): without "
        "num_real every draft token is real (R = B)"
    )
    sure = 50 * p_logits  # p(d_i) ~ 1 at every row, the pad's too; q is uniform
    q_draft = torch.full((4, vocab), 1 / vocab)
    for seed in range(4):
        sampler = d3d.Sampler(1.0, torch.Generator().manual_seed(seed))
        a, t = d3d.accept_draft(sure, draft, q_draft, sampler, num_real=3)
        assert (int(a), int(t)) == (3, 3), (
            f"sampling, R = 3, p(d_i) ~ 1: (a, t) = ({int(a)}, {int(t)}), expected (3, 3); {rule}"
        )


def test_accept_draft_without_a_generator_draws_on_the_logits_device():
    """With no generator the uniforms are drawn on the logits' device: a round copies nothing
    from the host. On meta tensors every tensor accept_draft makes is checked to be on meta (one
    made on the CPU would be a host draw copied over)."""
    from torch.overrides import TorchFunctionMode

    class Devices(TorchFunctionMode):
        """Records the device of every tensor a torch function returns."""

        def __init__(self):
            super().__init__()
            self.made = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for value in result if isinstance(result, tuple) else (result,):
                if isinstance(value, torch.Tensor):
                    self.made.add(value.device.type)
            return result

    p_logits = torch.randn(4, 7, device="meta")
    q_draft = torch.softmax(torch.randn(3, 7, device="meta"), -1)
    draft = torch.zeros(3, dtype=torch.long, device="meta")
    for num_real in (None, 2):
        with Devices() as devices:
            d3d.accept_draft(p_logits, draft, q_draft, d3d.Sampler(1.0), num_real=num_real)
        assert devices.made == {"meta"}, (
            f"num_real {num_real}: tensors made on {sorted(devices.made)}, the logits on meta: "
            "every random number comes from the sampler, drawn on the logits' device without a "
            "generator, none made on the host"
        )


def test_accept_draft_reads_nothing_back():
    """accept_draft leaves (a, t) on the device for the round's one read: greedy and sampled,
    a padded draft or not, it reads nothing back to the host (no .item(), int() or Python if on
    a tensor, no plain indexing by a 0-d tensor, no nonzero or boolean indexing)."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(5, 11, generator=g)
    q_draft = torch.softmax(torch.randn(4, 11, generator=g), -1)
    draft = torch.multinomial(q_draft, 1, generator=g)[:, 0]
    for temperature, q in ((0.0, None), (0.8, q_draft)):
        for num_real in (None, 3):
            sampler = d3d.Sampler(temperature, torch.Generator().manual_seed(1))
            with HostReads() as host:
                d3d.accept_draft(p_logits, draft, q, sampler, num_real)
            assert not host.reads, (
                f"temperature {temperature}, num_real {num_real}: accept_draft read the device "
                f"back ({', '.join(sorted(set(host.reads)))}): nothing is read back, the round "
                "reads (a, t) once, later (_at indexes by a 0-d tensor without reading it)"
            )


# --------------------------------------------------------------------------------------------------
# Asynchronous decoding: lossless, with the next block prepared for each likely outcome


def scripted(tok, target, prompt, block_size, kind, max_new):
    reference = reference_continuation(target, prompt, max_new + 2 * block_size + 2)
    right_upto = {"oracle": block_size, "never": 0, "partial": block_size // 2}[kind]
    drafter = d3d.make_drafter(tiny_qwen3(seed=9), tokenizer=tok, block_size=block_size)
    return ScriptedDrafter(drafter, reference, right_upto), right_upto


@pytest.mark.parametrize(
    "block_size,coverage,fanout,cover",
    [
        (1, 1, 1, "first"),
        (1, 1, 2, "first"),  # B = 1, F = 2: full acceptance, if ever selected, has no row left
        (5, 0, 2, "first"),
        (5, 2, 1, "first"),
        (5, 4, 2, "likely"),
        (4, 4, 2, "first"),  # C = B: the pad after a full-acceptance hit is covered
        (4, 4, 2, "likely"),
        (16, 12, 2, "first"),
        (16, 3, 3, "likely"),
    ],
)
@pytest.mark.parametrize("kind", ["oracle", "never", "partial"])
def test_async_equals_sync_and_target(tok, target, block_size, coverage, fanout, cover, kind):
    prompt = torch.randint(
        0, TEXT_VOCAB, (1, 6), generator=torch.Generator().manual_seed(block_size)
    )
    max_new = 29
    drafter, right_upto = scripted(tok, target, prompt, block_size, kind, max_new)
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=max_new, mode="target")
    sync_out, sync_stats = d3d.generate(
        target, drafter, prompt, max_new_tokens=max_new, mode="sync"
    )
    out, stats = d3d.generate(
        target,
        drafter,
        prompt,
        max_new_tokens=max_new,
        mode="async",
        coverage=coverage,
        fanout=fanout,
        cover=cover,
    )
    assert out.tolist() == sync_out.tolist() == expected.tolist()
    # accounting: every round is one outcome, a hit or a miss, at one position
    hits, misses = stats["hits_per_position"], stats["misses_per_position"]
    assert sum(hits) + sum(misses) == stats["num_rounds"] == len(stats["accept_lengths"])
    # where this drafter is first rejected
    outcome_slot = block_size if right_upto == block_size else right_upto
    # the last round may be cut short
    assert hits[outcome_slot] + misses[outcome_slot] >= stats["num_rounds"] - 1
    prepared = (right_upto == block_size and block_size > 1) or (
        coverage > right_upto and fanout >= 1 and cover == "first"
    )
    if prepared:  # the outcome was covered by a branch: every round but (maybe) the last is a hit
        assert hits[outcome_slot] >= stats["num_rounds"] - 1
    if coverage == 0 or fanout == 0:
        assert sum(hits[:block_size]) == 0  # no rejection branches at all
    if kind == "oracle" and block_size > 1:
        full_rounds = stats["accept_lengths"][:-1]
        assert all(n == block_size + 1 for n in full_rounds[:1]) and all(
            n >= block_size for n in full_rounds
        )
    assert stats["time_packed_draft"] > 0


def test_async_stops_at_eos_inside_a_block(tok, target):
    prompt = torch.tensor([[4, 8, 15, 16, 23]])
    drafter, _ = scripted(tok, target, prompt, 16, "partial", 60)
    new = drafter.reference[5:]
    k = next(k for k in range(2, 15) if new[k] not in new[:k])
    expected, _ = d3d.generate(
        target, None, prompt, max_new_tokens=40, mode="target", eos_token_id=new[k]
    )
    out, _ = d3d.generate(
        target, drafter, prompt, max_new_tokens=40, mode="async", eos_token_id=new[k]
    )
    assert out.tolist() == expected.tolist() and out[0, -1].item() == new[k]


@pytest.mark.parametrize("d1_from", ["causal", "mask"])
def test_async_with_real_drafters_equals_target(tok, target, d1_from):
    prompt = torch.tensor([[7, 1, 9]])
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=30, mode="target")
    for model in (tiny_qwen3(seed=11), tiny_qwen3(seed=1)):  # random, and the target's own weights
        drafter = d3d.make_drafter(model, tokenizer=tok, block_size=4, d1_from=d1_from)
        for cover in ("first", "likely"):
            out, stats = d3d.generate(
                target, drafter, prompt, max_new_tokens=30, mode="async", cover=cover
            )
            assert out.tolist() == expected.tolist()


def budget(coverage, fanout, cover="first", temperature=0.0):
    """The DecodeConfig plan_branches reads: C, F, which positions C covers, the temperature."""
    return d3d.DecodeConfig(coverage=coverage, fanout=fanout, cover=cover, temperature=temperature)


def test_plan_branches_chooses_positions_and_candidates():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0], [0.5, 9.0, 0.2, 0.1], [1.0, 1.1, 1.2, 5.0]])
    draft = torch.tensor([0, 1, 3])

    def plan(draft, *args):
        return tuple(x.tolist() for x in d3d.plan_branches(logits, draft, 3, budget(*args)))

    def candidates_rule(draft, covered, candidates):
        own = [i for i, tokens in zip(covered, candidates) if draft[i - 1] in tokens]
        if own:
            return f"d_{own[0]} is among its own candidates: d_i is never its own alternative"
        return "the candidates at i are the drafter's F likeliest tokens there, d_i left out"

    covered, candidates = plan(draft, 2, 2, "first")
    assert covered == [1, 2], (
        f'cover "first" at C = 2 covered {covered}: block positions 1 .. C, 1-based'
    )
    assert candidates == [[1, 2], [0, 2]], (
        f"candidates {candidates}, expected [[1, 2], [0, 2]]: "
        + candidates_rule(draft, covered, candidates)
    )
    # confident at 2 (q ~ 1): a first rejection there is unlikely; position 1 (q ~ 0.7) and 3
    # are likelier
    likely = plan(draft, 2, 1, "likely")[0]
    assert likely == [1, 3], f'cover "likely" covered {likely}, expected [1, 3] (ascending)'
    assert plan(draft, 0, 2) == ([], []), "C = 0 covers nothing: shapes (0,) and (0, F)"
    # at temperature > 0 d_i need not be the argmax: never a candidate
    sampled = torch.tensor([2, 1, 3])
    covered, candidates = plan(sampled, 1, 2)
    assert (covered, candidates) == ([1], [[0, 1]]), (
        f"a sampled draft [2, 1, 3]: covered {covered}, candidates {candidates}, expected [1] "
        "and [[0, 1]]: " + candidates_rule(sampled, covered, candidates)
    )


def likely_logits(confidences):
    """Draft logits (B, 4) whose drafter probability q(d_i) of d_i = 0 is confidences[i - 1] at
    temperature 1 (the other 3 tokens share the rest), and the draft, all zeros."""
    q = torch.tensor(confidences)
    rest = ((1 - q) / 3)[:, None].expand(-1, 3)
    logits = torch.cat([q[:, None], rest], 1).log()
    return logits, torch.zeros(len(q), dtype=torch.long)


def test_likely_cover_ranks_positions_by_the_chance_the_first_rejection_is_there():
    """cover="likely" keeps the C positions i of largest rho_i = q(d_1) .. q(d_{i-1}) * (1 -
    q(d_i)): the chance that d_1 .. d_{i-1} pass and d_i is the first rejected. Here the
    drafter's q(d_i), for d_i = 0, is set position by position; a product that took q(d_i) in
    too would pick other positions."""

    def likely(confidences, coverage):
        logits, draft = likely_logits(confidences)
        config = budget(coverage, 1, "likely")
        return d3d.plan_branches(logits, draft, len(draft), config)[0].tolist()

    why = 'cover "likely" keeps the C largest rho_i = q(d_1) .. q(d_{i-1}) (1 - q(d_i))'
    # rho = (0.5, 0.15, 0.315); with q(d_i) in the product: (0.25, 0.105, 0.0315): [1, 2]
    assert likely([0.5, 0.7, 0.1], 2) == [1, 3], f"q(d_i) = (0.5, 0.7, 0.1), C = 2: {why}"
    # rho = (0.3, 0.63, 0.063); with q(d_i) in the product: (0.21, 0.063, 0.0063): [1]
    assert likely([0.7, 0.1, 0.1], 1) == [2], f"q(d_i) = (0.7, 0.1, 0.1), C = 1: {why}"
    # rho = (0.5, 0.25, 0.225); by 1 - q(d_i) alone (0.5, 0.5, 0.9), without the chance that
    # d_1 .. d_{i-1} pass: [3]
    assert likely([0.5, 0.5, 0.1], 1) == [1], f"q(d_i) = (0.5, 0.5, 0.1), C = 1: {why}"


def test_likely_cover_scores_at_the_sampling_temperature_and_at_1_when_greedy():
    """Our reading of the scoring temperature: q at temperature 1 when decoding greedily, at the
    sampling temperature otherwise. Here the likeliest first rejection moves with it."""
    logits, draft = likely_logits([0.6, 0.5, 0.2])

    def likely(temperature):
        config = budget(1, 1, "likely", temperature)
        return d3d.plan_branches(logits, draft, 3, config)[0].tolist()

    why = "q is at the scoring temperature: 1 when greedy (temperature 0), else the sampling one"
    # T = 1: rho = (0.4, 0.3, 0.24): position 1
    assert likely(0.0) == likely(1.0) == [1], f"greedy and T = 1 cover position 1: {why}"
    # T = 0.25 sharpens q to (0.99, 0.96, 0.10): rho ~ (0.007, 0.036, 0.87): position 3
    assert likely(0.25) == [3], f"T = 0.25 covers position 3: {why}"


@pytest.mark.parametrize("cover", ["first", "likely"])
def test_the_pad_is_covered_only_where_coverage_exceeds_the_real_positions(cover):
    """After a full-acceptance hit the draft is B - 1 real tokens and a pad with no logits of its
    own (zeros). The pad can never be rejected: it gets a branch only where C exceeds the R real
    positions, under either cover; the packed pass keeps its C x F + 1 segments."""
    logits, draft = likely_logits([0.9, 0.8, 0.7, 0.25])
    logits[-1] = 0.0  # the pad's row: uniform, the likeliest first rejection if it were scored
    for coverage in (1, 2, 3):
        covered, candidates = d3d.plan_branches(logits, draft, 3, budget(coverage, 2, cover))
        assert 4 not in covered.tolist() and candidates.shape == (coverage, 2), (
            f"R = 3, C = {coverage}: covered {covered.tolist()}; the pad (i = 4) is never "
            "rejected, so it is covered only where C exceeds the R real positions"
        )
    covered, _ = d3d.plan_branches(logits, draft, 3, budget(4, 2, cover))
    assert covered.tolist() == [1, 2, 3, 4], f"R = 3, C = 4 = B: covered {covered.tolist()}"
    # with four real tokens, position 4 is a real rejection and the likeliest one
    if cover == "likely":
        covered, _ = d3d.plan_branches(logits, draft, 4, budget(1, 2, cover))
        assert covered.tolist() == [4]


def test_first_rejection_chance_is_rho_with_q_at_the_scoring_temperature():
    """first_rejection_chance, position by position: rho_i = q(d_1) .. q(d_{i-1}) (1 - q(d_i)),
    q(d_i) the drafter's probability of its own d_i (not of its likeliest token) at the scoring
    temperature (1 when greedy, else the sampling temperature), -inf at the pad (i > R)."""
    logits = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0], [0.0, 3.0, 1.0, 0.5], [1.0, 0.2, 0.1, 2.5], [0.3, 0.1, 0.4, 0.2]]
    )
    draft = torch.tensor([1, 1, 3, 2])  # sampled: d_1 is not the likeliest token at 1

    def rho_of(q):
        reach = torch.cat([torch.ones(1), torch.cumprod(q, 0)[:-1]])
        return (reach * (1 - q))[:3]

    for temperature in (0.0, 0.5, 2.0):
        scale = 1.0 if temperature == 0 else temperature
        probs = torch.softmax(logits / scale, -1)
        q = probs[torch.arange(4), draft]
        rho = d3d.first_rejection_chance(logits, draft, 3, temperature)
        assert rho.shape == (4,), f"rho is {tuple(rho.shape)}: (B,), one chance per position"
        assert rho[3] == float("-inf"), (
            f"rho at the pad (i = 4 > R = 3) is {rho[3].item()}: a pad is never rejected, -inf"
        )
        if torch.allclose(rho[:3], rho_of(q), atol=1e-6):
            continue
        slips = {
            "q(d_i) is in the product (reach is q(d_1) .. q(d_{i-1}), shifted by one)": (
                torch.cumprod(q, 0) * (1 - q)
            )[:3],
            "q(d_i) is q's entry at d_i, not the likeliest token's": rho_of(probs.max(-1).values),
            f"q is taken at the scoring temperature ({scale}), not at 1": rho_of(
                torch.softmax(logits, -1)[torch.arange(4), draft]
            ),
        }
        said = [why for why, slip in slips.items() if torch.allclose(rho[:3], slip, atol=1e-6)]
        pytest.fail(
            f"temperature {temperature}: rho {rho[:3].tolist()}, expected {rho_of(q).tolist()}: "
            + (said[0] if said else "rho_i = q(d_1) .. q(d_{i-1}) (1 - q(d_i))")
        )


def test_plan_branches_takes_c_and_f_from_the_budget_clipped_to_b_and_v_minus_1():
    """C and F come from branch_budget (the config's, else default_budget(B): C = 3, F = 2 at
    B = 4), C clipped to B and F to V - 1 (the tokens other than d_i): at each bound and on both
    sides of it, under both covers."""
    block_size, vocab = 4, 5
    logits = torch.randn(block_size, vocab, generator=torch.Generator().manual_seed(2))
    draft = logits.argmax(-1)

    def plan(coverage, fanout, cover, rule):
        try:
            covered, candidates = d3d.plan_branches(
                logits, draft, block_size, budget(coverage, fanout, cover)
            )
            own = (candidates == draft[covered - 1][:, None]).any()
        except (RuntimeError, IndexError, TypeError, ValueError) as error:
            pytest.fail(f"C = {coverage}, F = {fanout} ({cover}) raised {error!r}: {rule}")
        assert not own, f"C = {coverage}, F = {fanout}: d_i is among its candidates; {rule}"
        return covered.tolist(), tuple(candidates.shape)

    for cover in ("first", "likely"):
        rule = "C and F come from branch_budget: the config's, else default_budget(B)"
        covered, shape = plan(None, None, cover, rule)
        assert shape == (3, 2), f"no coverage or fanout given at B = 4: candidates {shape}; {rule}"
        rule = f"C is clipped to B = {block_size}: C >= B covers every position"
        for coverage in (block_size - 1, block_size, block_size + 1, block_size + 2):
            covered, shape = plan(coverage, 1, cover, rule)
            kept = min(coverage, block_size)
            assert len(covered) == kept and covered == sorted(set(covered)), (
                f"C = {coverage} at B = {block_size} ({cover}): covered {covered}; {rule}"
            )
        rule = f"F is clipped to V - 1 = {vocab - 1}: the tokens other than d_i"
        for fanout in (vocab - 2, vocab - 1, vocab, vocab + 1):
            _, shape = plan(2, fanout, cover, rule)
            assert shape == (2, min(fanout, vocab - 1)), (
                f"F = {fanout} at V = {vocab}: candidates {shape}; {rule}"
            )


def test_branches_are_planned_on_the_device_in_ops_that_do_not_grow_with_c_and_f():
    """plan_branches reads nothing back to the host (no .item(), .tolist(), int() or bool() of
    a tensor, no nonzero or boolean indexing) and runs no Python loop over positions or
    candidates: the same number of device ops for every C and F."""
    logits = torch.randn(5, 99, generator=torch.Generator().manual_seed(0))
    draft = logits.argmax(-1)
    for cover in ("first", "likely"):
        ops = {}
        for coverage, fanout in ((1, 1), (3, 1), (1, 3), (4, 2)):
            with HostReads() as host:
                d3d.plan_branches(logits, draft, 5, budget(coverage, fanout, cover))
            assert not host.reads, (
                f"plan_branches read the device back ({', '.join(sorted(set(host.reads)))}): "
                "on the device, no host read"
            )
            ops[coverage, fanout] = host.ops
        assert len(set(ops.values())) == 1, (
            f'device ops by (C, F), cover "{cover}": {ops}: they grow with C or F, a Python '
            "loop over positions or candidates; plan all of them with tensor ops at once"
        )


@pytest.mark.parametrize("d1_from", ["causal", "mask"])
def test_a_prepared_block_is_the_draft_its_outcome_would_get(tok, d1_from):
    """What a hit reuses is what a miss would draft: every segment of the packed pass gives the
    logits a fresh draft_block gives after the prefix its outcome commits (branch (i, t): x_0 ..
    x_n, d_1 .. d_(i-1), t; full acceptance: x_0 .. x_n, d_1 .. d_B), d_1 read where draft_block
    reads it (the causal head, or MASK 1)."""
    block_size = 4
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=3), tokenizer=tok, block_size=block_size, d1_from=d1_from
    )
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, TEXT_VOCAB, (1, 7), generator=g)  # x_0 .. x_n
    draft = torch.randint(0, TEXT_VOCAB, (block_size,), generator=g)
    covered, candidates = torch.tensor([1, 3]), torch.tensor([[5, 9], [2, 8]])
    cache = runtime.KVCache(drafter, 64)
    with torch.no_grad():
        # the cache holds x_0 .. x_(n-1)
        d3d.draft_block(drafter, cache, prefix[:, :-1], block_size)
        ids, position_ids, mask, rows = d3d.build_branch_pass(
            drafter,
            prefix[0, -1:],
            draft,
            covered,
            candidates,
            past_len=cache.length,
        )
        prepared = drafter.logits(cache.run(ids, position_ids, mask)[rows])  # (C * F + 1, B, V)
        outcomes = [
            torch.cat([prefix[0], draft[: i - 1], t.view(1)])
            for i, tokens in zip(covered, candidates)
            for t in tokens
        ] + [torch.cat([prefix[0], draft])]
        for segment, committed in enumerate(outcomes):
            fresh = d3d.draft_block(
                drafter, runtime.KVCache(drafter, 64), committed[None], block_size
            )
            torch.testing.assert_close(prepared[segment, :, :TEXT_VOCAB], fresh[:, :TEXT_VOCAB])


def test_a_branch_is_a_hit_only_for_the_position_and_token_it_was_planned_for(tok):
    """Segments: (i=1, t=5), (1, 6), (2, 5), (2, 7), then full acceptance. A branch drafted off
    another prefix is never reused because its token happens to match. At B = 1 the
    full-acceptance segment has no row after its guess to be the next draft: its guess is -1."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=4)
    draft_hidden = torch.randn(5, 4, 32, generator=torch.Generator().manual_seed(1))
    # the full-acceptance segment's bonus-token guess
    guess = d3d.bonus_guess(drafter, draft_hidden, d3d.Sampler())
    assert int(guess) == int(drafter.logits(draft_hidden[-1, 0]).argmax())
    g = int(guess)
    # the plan as the round reads it: host ints
    covered, candidates = [1, 2], [[5, 6], [5, 7]]
    order = (
        "the segments: each covered position's candidates in order, position by position "
        "(segment c * F + the token's place), then full acceptance (segment C * F)"
    )
    position = "a branch (i, t) is prepared for i = a + 1 only (d_1 .. d_a accepted, d_i not)"
    token = "a branch (i, t) is prepared for its own token t only"
    full = "full acceptance is prepared for a = R and t = g, its guess, only"
    cases = [
        # (a, t, the segment selected, the rule), the misses first
        (2, 5, -1, position),
        (2, 7, -1, position),
        (0, 7, -1, token),
        (1, 6, -1, token),
        (4, (g + 1) % TEXT_VOCAB, -1, full),
        (3, g, -1, full),
        (0, 5, 0, order),
        (0, 6, 1, order),
        (1, 5, 2, order),
        (1, 7, 3, order),
        (4, g, 4, order),
    ]
    for a, t, expected, rule in cases:
        chosen = d3d.select_segment(a, t, 4, covered, candidates, g)
        if type(chosen) is not int:
            rule = "the segment is an int, -1 on a miss"
        assert chosen == expected and type(chosen) is int, (
            f"{rule}: (a, t) = ({a}, {t}) selected {chosen!r}, expected {expected} (covered "
            f"{covered}, candidates {candidates}, R = 4, g = {g})"
        )
    # no branch (C = 0): full acceptance is segment 0
    chosen = d3d.select_segment(4, g, 4, [], [], g)
    assert chosen == 0, f"C = 0: full acceptance selected as {chosen!r}, expected 0: {order}"
    # B = 1: a block of one row; its guess is -1, so full acceptance misses whatever t is
    # (select_segment at B = 1: test_full_acceptance_is_never_selected_at_b_1)
    one_row = d3d.bonus_guess(drafter, draft_hidden[:, :1], d3d.Sampler())
    assert int(one_row) == -1


def test_a_branch_at_the_pad_is_selected_before_full_acceptance():
    """A padded draft (R = B - 1 = 3) accepted whole, when C = B covers the pad: the branch (4, t)
    and the full-acceptance segment (R + 1, g) with g = t were both prepared for the outcome. The
    branch is selected: its block has B real tokens where full acceptance's has B - 1."""
    covered = [1, 2, 3, 4]
    candidates = [[5, 6], [5, 7], [8, 9], [6, 5]]
    # the segments: 4 x 2 branches (index 7 is (4, 5)), then full acceptance (index 8)
    chosen = d3d.select_segment(3, 5, 3, covered, candidates, 5)
    assert chosen == 7, (
        f"a = R = 3, t = g = 5, a branch (4, 5) at the pad: selected {chosen}, expected 7: where "
        "a branch and full acceptance both match, the branch"
    )
    # without the branch, full acceptance
    chosen = d3d.select_segment(3, 2, 3, covered, candidates, 2)
    assert chosen == 8, (
        f"a = R = 3, t = g = 2, no branch for (4, 2): selected {chosen}, expected 8, full "
        "acceptance"
    )


def test_full_acceptance_is_never_selected_at_b_1():
    """At B = 1 the full-acceptance segment has no row after its guess to be the next draft:
    bonus_guess gives -1 there, and select_segment never selects that segment, whatever t is (a
    branch of the same round still can be)."""
    covered, candidates = [1], [[5, 6]]
    guess = -1  # bonus_guess at B = 1
    full_acceptance = 2  # the segments: (1, 5), (1, 6), then full acceptance
    for t in range(TEXT_VOCAB):
        chosen = d3d.select_segment(1, t, 1, covered, candidates, guess)
        assert chosen != full_acceptance, (
            f"a = R = 1, t = {t}, g = -1 (B = 1): full acceptance selected; at B = 1 it is "
            "never a hit (its guess is -1, never a token)"
        )
        assert chosen == -1, f"a = R = 1, t = {t}: selected {chosen}, no segment was prepared"
    chosen = d3d.select_segment(0, 6, 1, covered, candidates, guess)
    assert chosen == 1, f"(1, 6) is branch 1 at B = 1 too, got {chosen}"


# --------------------------------------------------------------------------------------------------
# What makes asynchronous decoding fast: bugs that keep the output lossless but cost speed


def test_branch_pass_is_planned_and_built_without_reading_the_device(tok, monkeypatch):
    """Between planning the branches and launching the passes nothing is read back to the host (on
    CUDA that would stall the host until the device drains its queue): no .item(), .tolist(), int()
    or bool() of a tensor."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=4)
    logits = torch.randn(4, 99, generator=torch.Generator().manual_seed(0))
    for name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__"):
        monkeypatch.setattr(
            torch.Tensor, name, lambda *a, **k: pytest.fail("read back to the host")
        )
    last = torch.tensor([11])  # x_n
    draft = logits.argmax(-1)
    for cover in ("first", "likely"):
        for num_real in (4, 3):
            plan = d3d.plan_branches(logits, draft, num_real, budget(3, 2, cover))
            d3d.build_branch_pass(drafter, last, draft, *plan, num_real, past_len=5)
    monkeypatch.undo()
    ids, position_ids, mask, rows = d3d.build_branch_pass(drafter, last, draft, *plan, past_len=5)
    # 3 x 2 branches + the full block
    assert ids.shape == (1, 1 + 4 + 7 * 5) and rows.shape == (
        7,
        4,
    )
    assert mask.shape == (1, 1, 40, 45)


@pytest.mark.parametrize("d1_from", ["causal", "mask"])
def test_branch_pass_lays_out_the_rows_of_its_docstring_table(tok, d1_from):
    """build_branch_pass at B = 4, C = 2, F = 1 (covered i = 1, 2), past_len = n = 10, row by row
    as its docstring's table: the tokens, the positions, each segment's root (the last causal row
    it sees) and the rows read. With R = 3 (after a full-acceptance hit) the full-acceptance
    segment is [d_3, 4 MASKs] off d_2."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=4, d1_from=d1_from)
    m = drafter.d3d_config.mask_token_id
    n = 10
    x_n = torch.tensor([40])
    draft = torch.tensor([49, 33, 74, 3])
    covered = torch.tensor([1, 2])
    candidates = torch.tensor([[50], [34]])
    for num_real, full_root in ((4, 3), (3, 2)):
        d_r = draft[num_real - 1].item()
        ids, position_ids, mask, rows = d3d.build_branch_pass(
            drafter, x_n, draft, covered, candidates, num_real, past_len=n
        )
        given = f"build_branch_pass at R = {num_real}, d1_from={d1_from!r}"
        expected_ids = [40, 49, 33, 74, 3, 50, m, m, m, m, 34, m, m, m, m, d_r, m, m, m, m]
        assert ids[0].tolist() == expected_ids, f"{given}: the tokens of the table"
        causal = list(range(n, n + 5))
        # a segment's first token sits one position after its root's
        segment_positions = [list(range(n + root + 1, n + root + 6)) for root in (0, 1, full_root)]
        expected_positions = causal + sum(segment_positions, [])
        assert position_ids[0].tolist() == expected_positions, f"{given}: the positions"
        # the last causal row each segment row sees is its root
        sees_causal = mask[0, 0, 5:, n : n + 5]
        last_seen = [max(r for r in range(5) if row[r]) for row in sees_causal.tolist()]
        assert last_seen == [0] * 5 + [1] * 5 + [full_root] * 5, f"{given}: the roots"
        first_read = [5, 10, 15] if d1_from == "causal" else [6, 11, 16]
        expected_rows = [
            [first, start + 2, start + 3, start + 4]
            for first, start in zip(first_read, (5, 10, 15))
        ]
        assert rows.tolist() == expected_rows, f"{given}: the rows read (draft_rows)"


def record_host_reads(monkeypatch, events: list) -> None:
    """Append "read" to `events` at every .item(), .tolist(), int(), bool(), index or float() of a
    tensor: each is a read back to the host (on CUDA it waits for the device)."""
    for name in ("item", "tolist", "__int__", "__bool__", "__index__", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(*args, __original=original, **kwargs):
            events.append("read")
            return __original(*args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize(
    "mode,temperature", [("target", 0), ("sync", 0), ("async", 0), ("sync", 1.0), ("async", 1.0)]
)
def test_a_round_reads_the_device_once(tok, target, monkeypatch, mode, temperature):
    """No round waits for the device more than once (on CUDA each read stalls the host until the
    queue drains): between two acceptances (one per round) at most one .item(), .tolist(), int(),
    bool(), float() or index of a tensor."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=4)
    prompt = torch.tensor([[7, 1, 9, 4, 4]])
    events = []
    record_host_reads(monkeypatch, events)
    # once a round (target: a token)
    owner, name = (d3d.Sampler, "pick") if mode == "target" else (d3d, "accept_draft")
    boundary = getattr(owner, name)

    def marked(*args, **kwargs):
        events.append("round")
        return boundary(*args, **kwargs)

    monkeypatch.setattr(owner, name, marked)
    generator = torch.Generator().manual_seed(0)
    d3d.generate(
        target,
        drafter,
        prompt,
        max_new_tokens=25,
        mode=mode,
        temperature=temperature,
        generator=generator,
    )
    prefill, *rounds = [r.split().count("read") for r in " ".join(events).split("round")]
    # prefill: the prompt, the first token
    assert prefill <= 2 and len(rounds) > 4 and max(rounds) <= 1, events


@pytest.mark.parametrize(
    "mode,temperature", [("sync", 0), ("async", 0), ("sync", 1.0), ("async", 1.0)]
)
def test_each_round_reads_the_device_once_between_two_reports(
    tok, target, monkeypatch, mode, temperature
):
    """The one host read per round, counted without touching d3d: every .item(), .tolist(),
    int(), bool(), float() or index of a tensor between two on_round reports (one per round,
    after its read) is one read; a round that waits for the device twice stalls the host twice
    on CUDA."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=4)
    prompt = torch.tensor([[7, 1, 9, 4, 4]])
    events = []
    record_host_reads(monkeypatch, events)
    d3d.generate(
        target,
        drafter,
        prompt,
        max_new_tokens=25,
        mode=mode,
        temperature=temperature,
        generator=torch.Generator().manual_seed(0),
        on_round=lambda info: events.append("round"),
    )
    monkeypatch.undo()
    first, *rounds = [r.split().count("read") for r in " ".join(events).split("round")][:-1]
    assert len(rounds) >= 3, events
    # the prefill (the prompt, the first token), then round 0's own read
    assert first <= 3, (
        f"{first} host reads up to the end of round 0 (the prefill's two, then the round's one): "
        "a round reads the device once"
    )
    assert max(rounds) <= 1, (
        f"a round read the device {max(rounds)} times (reads per round: {rounds}): one "
        "read_round per round, nothing else read back (no .item(), .tolist(), int() or if on a "
        "tensor)"
    )


def test_async_builds_no_tensor_from_host_values_after_its_first_round(tok, target, monkeypatch):
    """x_n comes from the round's own next_token, on the device: after the first round no tensor
    is made from host values (torch.tensor) in _decode_async or what it calls. On CUDA,
    torch.tensor(list, device=...) is a copy from pageable memory that waits for the work
    queued before it."""
    block_size, prompt = 4, torch.tensor([[3, 1, 4, 1, 5]])
    drafter, _ = scripted(tok, target, prompt, block_size, "partial", 30)
    rounds = []
    made_after_round_0 = []
    make_tensor = torch.tensor

    def in_the_async_loop(frame):
        while frame is not None:
            if frame.f_code is d3d._decode_async.__code__:
                return True
            frame = frame.f_back
        return False

    def tensor(*args, **kwargs):
        caller = sys._getframe(1)
        if rounds and in_the_async_loop(caller):
            made_after_round_0.append(caller.f_code.co_name)
        return make_tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    # d_3 is always rejected: C = 3 covers it (every round after the first a hit), C = 1 does not
    # (every round a miss, and its fallback draft)
    for coverage, counted in ((3, "hits_per_position"), (1, "misses_per_position")):
        rounds.clear()
        settings = dict(max_new_tokens=30, mode="async", coverage=coverage, fanout=1)
        _, stats = d3d.generate(target, drafter, prompt, on_round=rounds.append, **settings)
        assert len(rounds) > 4 and sum(stats[counted]) >= len(rounds) - 1
        assert made_after_round_0 == [], made_after_round_0


def test_every_verification_and_packed_pass_keeps_one_shape_through_full_acceptance_hits(
    tok, target, monkeypatch
):
    """After a full-acceptance hit the next draft has B - 1 real tokens and a pad: verification and
    the packed pass keep their shapes (a compiled pass would otherwise compile a new graph, a CUDA
    graph be captured again)."""
    block_size, prompt = 5, torch.tensor([[3, 1, 4, 1, 5]])
    drafter, _ = scripted(tok, target, prompt, block_size, "oracle", 40)
    shapes = {"verify": set(), "packed": set()}
    verify = d3d.verify_block
    build = d3d.build_branch_pass

    def verify_block(c, last, draft):
        shapes["verify"].add(tuple(draft.shape))
        return verify(c, last, draft)

    def build_branch_pass(*args, **kwargs):
        built = build(*args, **kwargs)
        shapes["packed"].add(tuple(built[0].shape))
        return built

    monkeypatch.setattr(d3d, "verify_block", verify_block)
    monkeypatch.setattr(d3d, "build_branch_pass", build_branch_pass)
    out, stats = d3d.generate(target, drafter, prompt, max_new_tokens=40, mode="async")
    assert stats["hits_per_position"][block_size] >= 3  # full-acceptance hits happened
    assert shapes["verify"] == {(block_size,)} and len(shapes["packed"]) == 1


# --------------------------------------------------------------------------------------------------
# Progressive layer pruning (Fig. 1b)


def prune_data(seed=0, num_batches=2):
    return [batch(seed=seed + i, b=2, length=17, prompt_len=4) for i in range(num_batches)]


def noop_layer_drafter(tok, layers=4, noop=2):
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=6, layers=layers), tokenizer=tok, block_size=3, num_anchors=4
    )
    layer = drafter.model.model.layers[noop]
    with torch.no_grad():  # both residual branches write zero: the layer changes nothing
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return drafter


@pytest.mark.parametrize("noop", [1, 2])
def test_pruning_removes_one_layer_per_iteration_and_the_noop_layer_first(tok, noop):
    drafter = noop_layer_drafter(tok, noop=noop)
    table = list(
        d3d.prune_drafter(
            drafter, prune_data(), prune_data(seed=10), min_layers=2, recovery_steps=2
        )
    )
    assert [row["layers"] for row in table] == [4, 3, 2]
    assert table[1]["removed_layer"] == noop  # the no-op layer goes first
    assert len(drafter.model.model.layers) == 2 == drafter.model.config.num_hidden_layers
    removed = {row["removed_layer"] for row in table[1:]}
    assert drafter.d3d_config.layer_ids == [i for i in range(4) if i not in removed]
    assert [layer.self_attn.layer_idx for layer in drafter.model.model.layers] == [0, 1]


def test_pruning_removes_the_layer_whose_removal_costs_least(tok, monkeypatch):
    """Scores fixed by the test (tau without each original layer), not by a trained drafter's
    chance: the greedy loop removes the layer with the highest tau without it, then the next highest
    of those left."""
    tau_without = {0: 1.5, 1: 1.2, 2: 1.9, 3: 1.1}

    def fixed_scores(drafter, batches, **_):
        original = drafter.d3d_config.layer_ids or list(range(len(drafter.model.model.layers)))
        return {i: tau_without[layer] for i, layer in enumerate(original)}

    drafter = d3d.make_drafter(
        tiny_qwen3(seed=3, layers=4), tokenizer=tok, block_size=3, num_anchors=4
    )
    table = list(
        d3d.prune_drafter(
            drafter, prune_data(), prune_data(), min_layers=1, recovery_steps=0, score=fixed_scores
        )
    )
    removed = [row["removed_layer"] for row in table[1:]]
    assert removed == [2, 0, 1] and drafter.d3d_config.layer_ids == [3], (
        f"removed {removed}, left {drafter.d3d_config.layer_ids}, expected [2, 0, 1] and [3]: "
        "each iteration removes the layer whose removal costs least tau (the highest tau "
        "without it), and a record names it by its original index"
    )
    for row in table[1:]:
        named = row["tau_without_layer"]
        left = {layer: tau_without[layer] for layer in named}
        assert named == left and row["removed_layer"] in named, (
            f"tau_without_layer {named}: each layer's tau without it, by its original index"
        )
    # layers 0 and 2 tie: the one whose removal changes the block loss least goes (the no-op)

    def tied(drafter, batches, **_):
        return {0: 2.0, 1: 1.0, 2: 2.0}

    drafter = noop_layer_drafter(tok, layers=3, noop=2)
    data = prune_data(num_batches=1)
    table = list(d3d.prune_drafter(drafter, data, data, min_layers=2, recovery_steps=0, score=tied))
    assert table[1]["removed_layer"] == 2, (
        f"layers 0 and 2 tie on tau; removed {table[1]['removed_layer']}: the layer removed is "
        "least_costly_layer's choice, a tie going to the smallest change in block loss (here "
        "layer 2, which does nothing)"
    )


def test_scoring_all_removals_in_one_pass_each_gives_the_full_passes_numbers(tok):
    """fast.tau_without_each_layer resumes from recorded layer inputs; it must equal, bit for bit,
    the tau of a full pass without that layer (d3d.tau_without_each_layer), first and last layer
    included."""
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=7, layers=4), tokenizer=tok, block_size=3, num_anchors=4
    )
    data = prune_data(num_batches=3)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    for step in range(30):  # fit the data a little: taus above 1 that differ by layer
        loss, _ = d3d.d3d_loss(
            drafter, *data[step % 3], generator=torch.Generator().manual_seed(step)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.eval()
    quick = fast.tau_without_each_layer(drafter, data, val_anchors=4, seed=3)
    slow = d3d.tau_without_each_layer(drafter, data, val_anchors=4, seed=3)
    # layers differ, blocks hit
    assert quick == slow and len(set(quick.values())) > 1 and max(quick.values()) > 1
    assert len(drafter.model.model.layers) == 4 == drafter.model.config.num_hidden_layers
    assert [layer.self_attn.layer_idx for layer in drafter.model.model.layers] == [0, 1, 2, 3]
    assert d3d.validation_tau(drafter, data, val_anchors=4, seed=3) == d3d.validation_tau(
        drafter, data, val_anchors=4, seed=3
    )


def test_adjusted_teacher_sums_to_one_and_moves_mass_to_label():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 3, 10, 3, 7])
    q = d3d.adjusted_teacher(logits, labels, beta=0.5)
    torch.testing.assert_close(q.sum(-1), torch.ones(5))
    p = torch.softmax(logits, -1)
    rows = torch.arange(5)
    assert (q[rows, labels] > p[rows, labels]).all()
    torch.testing.assert_close(q[rows, labels], 0.5 * p[rows, labels] + 0.5)
    torch.testing.assert_close(d3d.adjusted_teacher(logits, labels, beta=0.0), p)


def test_recovery_distils_toward_the_label_adjusted_teacher(tok, monkeypatch):
    """The recovery target is (1 - beta) * teacher + beta * label, and the loss is linear in it: at
    beta = 1 it is the cross-entropy on the labels alone, at 0.5 the mean of beta = 0 and 1.
    prune_drafter passes its beta on."""
    student = d3d.make_drafter(
        tiny_qwen3(seed=5, layers=3), tokenizer=tok, block_size=3, num_anchors=4
    )
    teacher = d3d.make_drafter(
        tiny_qwen3(seed=7, layers=3), tokenizer=tok, block_size=3, num_anchors=4
    )
    x, loss_mask = prune_data()[0]
    loss = {
        beta: d3d.distill_loss(
            student,
            teacher,
            x,
            loss_mask,
            d3d.PruneConfig(beta=beta, val_anchors=4),
            torch.Generator().manual_seed(3),
        ).item()
        for beta in (0.0, 0.5, 1.0)
    }
    anchors, valid = d3d.sample_anchors(loss_mask, 4, torch.Generator().manual_seed(3))
    labels, counts = d3d._block_labels(x, loss_mask, anchors, valid, 3)
    with torch.no_grad():
        causal, block = d3d._packed_hidden(student, x, anchors, 3)

        def ce(h, y):
            return torch.nn.functional.cross_entropy(student.logits(h).float(), y).item()

        has_label = loss_mask[:, 1:].bool()
        labels_only = ce(block[counts], labels[counts]) + ce(
            causal[:, :-1][has_label], x[:, 1:][has_label]
        )
    assert loss[1.0] == pytest.approx(labels_only, rel=1e-5)
    assert loss[0.5] == pytest.approx((loss[0.0] + loss[1.0]) / 2, rel=1e-5) and loss[
        0.0
    ] != pytest.approx(loss[1.0])
    betas = []
    real = d3d.distill_loss

    def distill_loss(student, teacher, input_ids, loss_mask, config, generator=None):
        betas.append(config.beta)
        return real(student, teacher, input_ids, loss_mask, config, generator)

    monkeypatch.setattr(d3d, "distill_loss", distill_loss)
    list(
        d3d.prune_drafter(
            student,
            prune_data(),
            prune_data(seed=10),
            min_layers=2,
            recovery_steps=1,
            beta=0.7,
            val_anchors=4,
        )
    )
    assert betas and set(betas) == {0.7}


def test_distillation_leaves_the_teacher_untouched(tok):
    teacher = d3d.make_drafter(
        tiny_qwen3(seed=5, layers=3), tokenizer=tok, block_size=3, num_anchors=4
    )
    student = d3d.make_drafter(
        tiny_qwen3(seed=5, layers=3), tokenizer=tok, block_size=3, num_anchors=4
    )
    d3d.remove_layer(student, 1)
    teacher.requires_grad_(False)
    before = [p.clone() for p in teacher.parameters()]
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-2)
    for i, (x, loss_mask) in enumerate(prune_data()):
        config = d3d.PruneConfig(val_anchors=4)
        loss = d3d.distill_loss(
            student, teacher, x, loss_mask, config, torch.Generator().manual_seed(i)
        )
        assert torch.isfinite(loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, teacher.parameters()))
    assert any(p.grad is not None for p in student.parameters())


def test_recovery_with_activation_checkpointing_takes_the_same_steps(tok):
    """Checkpointing recomputes each layer in backward (more layer passes in training) and changes
    nothing else."""
    drafters, training_passes = [], []
    for checkpointing in (False, True):
        drafter = noop_layer_drafter(tok, layers=3)
        count = [0]
        for layer in drafter.model.model.layers:
            layer.mlp.register_forward_pre_hook(
                lambda module, _: count.__setitem__(0, count[0] + module.training)
            )
        list(
            d3d.prune_drafter(
                drafter,
                prune_data(),
                prune_data(seed=10),
                min_layers=2,
                recovery_steps=2,
                checkpointing=checkpointing,
            )
        )
        assert not drafter.model.is_activation_checkpointing
        drafters.append(drafter)
        training_passes.append(count[0])
    assert training_passes[1] == 2 * training_passes[0] > 0
    for a, b in zip(*(d.parameters() for d in drafters)):
        torch.testing.assert_close(a, b)


def test_a_step_with_a_non_finite_gradient_is_skipped():
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1)
    layer(torch.ones(1, 3)).sum().backward()
    assert runtime.finite_step(optimizer, list(layer.parameters()), 1.0)
    weights = [p.detach().clone() for p in layer.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in layer.parameters()]
    (layer(torch.ones(1, 3)).sum() * float("nan")).backward()
    assert not runtime.finite_step(optimizer, list(layer.parameters()), 1.0)
    assert all(p.grad is None for p in layer.parameters())  # dropped: the next step starts clean
    assert all(torch.equal(a, b) for a, b in zip(weights, layer.parameters()))
    assert all(
        torch.equal(optimizer.state[p]["exp_avg"], m) for p, m in zip(layer.parameters(), moments)
    )


def test_pruning_stops_where_the_rules_say(tok):
    drafter = noop_layer_drafter(tok, layers=3)
    table = list(
        d3d.prune_drafter(drafter, prune_data(), prune_data(), min_layers=1, recovery_steps=0)
    )
    assert len(drafter.model.model.layers) == 1 and table[-1]["layers"] == 1
    drafter = noop_layer_drafter(tok, layers=3)
    before = [p.clone() for p in drafter.parameters()]
    table = list(
        d3d.prune_drafter(drafter, prune_data(), prune_data(), tau_floor=10.0, recovery_steps=1)
    )
    # an unreachable floor: the first removal is undone
    assert table[-1]["kept"] is False and len(table) == 2, (
        f"kept {[row['kept'] for row in table]}: a removal below the floor is undone (kept "
        "False) and pruning stops"
    )
    undone = "the undone removal leaves the drafter as it was before it"
    assert len(drafter.model.model.layers) == 3, (
        f"{len(drafter.model.model.layers)} layers: {undone}"
    )
    assert drafter.d3d_config.layer_ids is None, (
        f"layer_ids {drafter.d3d_config.layer_ids}: {undone}"
    )
    assert all(torch.equal(a, b) for a, b in zip(before, drafter.parameters())), (
        f"its weights changed: {undone}"
    )
    with pytest.raises(ValueError, match="stopping rule"):
        list(d3d.prune_drafter(drafter, prune_data(), prune_data()))


def test_the_tau_floor_is_a_fraction_of_the_unpruned_tau_and_keeps_a_removal_at_it(
    tok, monkeypatch
):
    """Scripted taus: unpruned 2.0 and tau_floor 0.75, so the floor is 1.5; every removal scores
    1.0 before recovery. The first removal recovers to 1.5, exactly the floor: kept. The second
    recovers to 1.4: below the floor, so it is undone and pruning stops, though 1.4 is above
    0.75 x its tau before recovery (0.75) and 0.75 x the tau after the first removal (1.125)."""
    taus = iter([2.0, 1.5, 1.4, 1.3, 1.2])  # the unpruned tau, then one per recovered removal

    def scripted_tau(drafter, batches, **_):
        return next(taus), 0.0

    def scores(drafter, batches, **_):  # layer 0 of those left costs least, and scores 1.0
        return {i: 1.0 - 0.1 * i for i in range(len(drafter.model.model.layers))}

    monkeypatch.setattr(d3d, "validation_tau", scripted_tau)
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=3, layers=4), tokenizer=tok, block_size=3, num_anchors=4
    )
    table = list(
        d3d.prune_drafter(
            drafter, prune_data(), prune_data(), tau_floor=0.75, recovery_steps=1, score=scores
        )
    )
    assert [row["kept"] for row in table] == [True, True, False], table
    assert [row["tau_after_recovery"] for row in table] == [2.0, 1.5, 1.4]
    assert [row["tau_before_recovery"] for row in table[1:]] == [1.0, 1.0]
    assert drafter.d3d_config.layer_ids == [1, 2, 3] and len(drafter.model.model.layers) == 3


def test_the_floor_is_a_fraction_of_the_unpruned_tau_with_scores_given(tok):
    """tau_floor is a fraction of the unpruned drafter's tau, not of the last depth's. Without
    recovery steps the removed layer's score is the new tau, so the scores set it: 0.8, 0.7, then
    0.6 x the unpruned tau, at tau_floor 0.75. The first removal is kept; the second is undone
    and pruning stops, though 0.7 is above 0.75 x the first removal's 0.8 (0.6)."""
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=3, layers=4), tokenizer=tok, block_size=3, num_anchors=4
    )
    data = prune_data()
    measure = d3d.PruneConfig(min_layers=1)
    tau0, _ = d3d.validation_tau(drafter, data, val_anchors=measure.val_anchors, seed=measure.seed)
    fractions = iter([0.8, 0.7, 0.6])

    def scores(drafter, batches, **_):  # layer 0 of those left costs least
        fraction = next(fractions)
        return {i: fraction * tau0 - 0.01 * i for i in range(len(drafter.model.model.layers))}

    table = list(
        d3d.prune_drafter(drafter, data, data, tau_floor=0.75, recovery_steps=0, score=scores)
    )
    assert [row["kept"] for row in table] == [True, True, False], (
        f"kept {[row['kept'] for row in table]}: a removal whose tau falls below tau_floor x "
        "the unpruned tau (here 0.7 < 0.75) is undone and pruning stops"
    )
    assert len(drafter.model.model.layers) == 3, "the undone removal's layer is back"


def test_pruning_checks_its_arguments_at_the_call(tok):
    """prune_drafter refuses bad arguments when called, before any row is asked for."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=3, layers=2), tokenizer=tok, block_size=3)
    data = prune_data(num_batches=1)
    with pytest.raises(ValueError, match="give a stopping rule"):
        d3d.prune_drafter(drafter, data, data)  # no next(): the call itself refuses
    for rule in ({"min_layers": 1}, {"tau_floor": 0.5}):
        try:
            d3d.prune_drafter(drafter, data, data, **rule)
        except ValueError as error:
            pytest.fail(f"{rule} refused ({error}): either stopping rule alone is enough")
    bad = [
        ({"min_layers": 0}, "PruneConfig.min_layers must be int >= 1, got 0"),
        ({"tau_floor": 0.0}, "PruneConfig.tau_floor must be float > 0, got 0.0"),
        ({"min_layers": 1, "recovery_steps": -1}, "PruneConfig.recovery_steps must be int >= 0"),
    ]
    for arguments, message in bad:
        with pytest.raises(ValueError, match=message):
            d3d.prune_drafter(drafter, data, data, **arguments)


def test_pruning_records_carry_every_key(tok):
    """Each record prune_drafter yields has the keys its docstring and the drivers read; the
    unpruned record has no removal, each later one its timings and skipped steps."""
    drafter = noop_layer_drafter(tok)
    data = prune_data()
    records = list(d3d.prune_drafter(drafter, data, data, min_layers=2, recovery_steps=0))
    first = {"iteration", "removed_layer", "layers", "tau_before_recovery", "tau_after_recovery"}
    first |= {"seconds", "score_seconds", "kept"}
    assert set(records[0]) >= first and records[0]["removed_layer"] is None
    later = first | {"recovery_skipped", "tau_without_layer"}
    for record in records[1:]:
        missing = later - set(record)
        assert not missing, f"a record lacks {sorted(missing)}"
        assert record["score_seconds"] <= record["seconds"], (
            f"score_seconds {record['score_seconds']:.3f} > seconds {record['seconds']:.3f}: "
            "seconds is the whole iteration, scoring included"
        )
        assert record["recovery_skipped"] == 0


def test_pruned_drafter_saves_loads_and_decodes_losslessly(tok, target, tmp_path):
    drafter = noop_layer_drafter(tok)
    list(d3d.prune_drafter(drafter, prune_data(), prune_data(), min_layers=2, recovery_steps=1))
    drafter.save_pretrained(str(tmp_path))
    loaded = d3d.Drafter.from_pretrained(str(tmp_path))
    assert loaded.model.config.num_hidden_layers == 2 and loaded.d3d_config == drafter.d3d_config
    prompt = torch.tensor([[5, 6, 7, 8]])
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=20, mode="target")
    for mode in ("sync", "async"):
        for model in (drafter, loaded):
            out, _ = d3d.generate(target, model, prompt, max_new_tokens=20, mode=mode)
            assert out.tolist() == expected.tolist()


def first_layer_costs_least(drafter, batches, **measure):
    """A `score` for prune_drafter: tau without each current layer, the first costing least."""
    return {i: 1.0 - 0.1 * i for i in range(len(drafter.model.model.layers))}


def test_pruning_keywords_replace_the_configs_fields(tok):
    """Keyword settings replace the given PruneConfig's fields and the others stay: with
    PruneConfig(min_layers=3, recovery_steps=0) and min_layers=2, pruning goes down to 2 layers
    with no recovery (each tau after recovery is the removed layer's score)."""
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=3, layers=4), tokenizer=tok, block_size=3, num_anchors=4
    )
    data = prune_data(num_batches=1)
    config = d3d.PruneConfig(min_layers=3, recovery_steps=0)
    table = list(
        d3d.prune_drafter(drafter, data, data, config, min_layers=2, score=first_layer_costs_least)
    )
    depths = [row["layers"] for row in table]
    assert depths == [4, 3, 2], f"depths {depths}: the keyword min_layers=2 replaces the config's 3"
    assert all(row["tau_after_recovery"] == row["tau_before_recovery"] for row in table[1:]), (
        "the config's recovery_steps=0 stays where no keyword replaces it: no recovery, so each "
        "tau after recovery is the removed layer's score"
    )


def test_recovery_distils_from_one_frozen_copy_of_the_unpruned_drafter(tok):
    """The teacher is the unpruned drafter, copied once before the first removal and frozen:
    every pass run of a drafter other than the one pruned is of one copy, with all 3 layers and
    the unpruned weights, in eval mode (a forward hook on every module sees the passes, however
    the copy is made)."""
    drafter = noop_layer_drafter(tok, layers=3)
    pruned = drafter.model.get_decoder()
    unpruned = sum(p.double().sum().item() for p in pruned.parameters())
    passes = []

    def seen(module, args, output):
        if isinstance(module, type(pruned)) and module is not pruned:
            weights = sum(p.double().sum().item() for p in module.parameters())
            passes.append((id(module), len(module.layers), weights, module.training))

    hook = torch.nn.modules.module.register_module_forward_hook(seen)
    try:
        list(
            d3d.prune_drafter(
                drafter,
                prune_data(num_batches=1),
                prune_data(seed=10, num_batches=1),
                min_layers=1,
                recovery_steps=2,
                score=first_layer_costs_least,
            )
        )
    finally:
        hook.remove()
    assert passes, (
        "recovery ran no pass of a drafter other than the one pruned: it distils toward a "
        "frozen copy of the unpruned drafter (copy.deepcopy), not toward itself"
    )
    copies = {copy for copy, _, _, _ in passes}
    assert len(copies) == 1, (
        f"recovery distilled toward {len(copies)} copies: the teacher is copied once, before "
        "the first removal, and kept to the end"
    )
    depths = sorted({layers for _, layers, _, _ in passes})
    assert depths == [3], f"the teacher had {depths} layers: it is the unpruned drafter (3)"
    assert all(weights == unpruned for _, _, weights, _ in passes), (
        "the teacher's weights are not the unpruned drafter's: it is copied before any removal "
        "or recovery, and never trained"
    )
    assert not any(training for _, _, _, training in passes), (
        "the teacher ran in training mode: it is frozen, in eval mode"
    )


def test_pruning_stops_at_min_layers_and_never_below_one_layer(tok):
    """min_layers is where pruning stops: a drafter at it, or shallower, loses no layer; one
    layer deeper, it loses one. With only tau_floor (never reached here), pruning stops at one
    layer."""
    data = prune_data(num_batches=1)
    for min_layers, tau_floor, depth in ((3, None, 3), (4, None, 3), (2, None, 2), (None, 1e-6, 1)):
        drafter = d3d.make_drafter(
            tiny_qwen3(seed=3, layers=3), tokenizer=tok, block_size=3, num_anchors=4
        )
        table = list(
            d3d.prune_drafter(
                drafter,
                data,
                data,
                min_layers=min_layers,
                tau_floor=tau_floor,
                recovery_steps=0,
                score=first_layer_costs_least,
            )
        )
        depths = [row["layers"] for row in table]
        left = len(drafter.model.model.layers)
        rule = "pruning stops at min_layers: it removes nothing from a drafter at or under it"
        if min_layers is None:
            rule = "with only tau_floor, pruning stops at one layer: a drafter keeps one"
        assert left == depth and depths == list(range(3, depth - 1, -1)), (
            f"3 layers, min_layers={min_layers}, tau_floor={tau_floor}: {left} left, records' "
            f"depths {depths}; {rule}"
        )


def test_the_floor_keeps_a_removal_at_it_and_undoes_one_below_it(tok):
    """tau_floor 0.5, scores given and no recovery (the removed layer's score is its tau): a
    removal at 0.75 tau0 (above the floor) is kept, at 0.5 tau0 (at it) kept, at 0.25 tau0
    (below) undone, its record keeping the depth it measured; then pruning stops."""
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=3, layers=4), tokenizer=tok, block_size=3, num_anchors=4
    )
    data = prune_data(num_batches=1)
    measure = d3d.PruneConfig(min_layers=1)
    tau0, _ = d3d.validation_tau(drafter, data, val_anchors=measure.val_anchors, seed=measure.seed)
    fractions = iter([0.75, 0.5, 0.25])

    def scores(drafter, batches, **_):  # layer 0 of those left costs least
        fraction = next(fractions)
        return {i: fraction * tau0 - 0.01 * i for i in range(len(drafter.model.model.layers))}

    table = list(
        d3d.prune_drafter(drafter, data, data, tau_floor=0.5, recovery_steps=0, score=scores)
    )
    kept = [row["kept"] for row in table]
    assert kept == [True, True, True, False], (
        f"kept {kept} for taus 0.75, 0.5 and 0.25 x the unpruned tau at tau_floor 0.5: a removal "
        "is undone only where its tau falls below the floor; one at the floor is kept"
    )
    taus = [row["tau_after_recovery"] / tau0 for row in table[1:]]
    assert taus == [0.75, 0.5, 0.25], (
        f"taus after recovery {taus} x tau0: without recovery steps the removed layer's score "
        "is its tau"
    )
    assert table[-1]["layers"] == 1 and len(drafter.model.model.layers) == 2, (
        f"the undone removal's record says {table[-1]['layers']} layers, the drafter has "
        f"{len(drafter.model.model.layers)}: the record keeps the depth it measured (1), the "
        "drafter is back at 2"
    )


def test_the_floor_judges_the_tau_after_recovery_not_the_score(tok):
    """The floor judges the tau re-measured after recovery, not the removed layer's score:
    scores far above an unreachable floor (10 x tau0) still end in an undone removal, scores of
    0 under a floor of 0.001 x tau0 still keep it; the record's tau after recovery is the
    pruned drafter's validation tau."""
    data = prune_data(num_batches=1)
    for score, tau_floor, kept in ((100.0, 10.0, False), (0.0, 1e-3, True)):
        drafter = d3d.make_drafter(
            tiny_qwen3(seed=3, layers=3), tokenizer=tok, block_size=3, num_anchors=4
        )

        def scores(drafter, batches, score=score, **_):
            return {i: score - 0.01 * i for i in range(len(drafter.model.model.layers))}

        settings = dict(min_layers=2, tau_floor=tau_floor, recovery_steps=1, score=scores)
        table = list(d3d.prune_drafter(drafter, data, data, **settings))
        row = table[1]
        assert row["kept"] is kept, (
            f"scores {score}, tau after recovery {row['tau_after_recovery']:.3f}, floor "
            f"{tau_floor} x tau0: kept {row['kept']}; the floor judges the tau re-measured after "
            "recovery, not the removed layer's score"
        )
    measured, _ = d3d.validation_tau(drafter, data, val_anchors=32, seed=0)
    assert row["tau_after_recovery"] == measured, (
        f"tau after recovery {row['tau_after_recovery']}, the pruned drafter's validation tau "
        f"{measured}: with recovery steps, tau is re-measured after recovery"
    )


def test_pruning_measures_with_the_configs_anchors_and_seed_and_repeats_itself(tok):
    """Every measurement takes the config's val_anchors and seed: `score` is called with them,
    the unpruned tau is validation_tau's with them; recovery's generator is seeded with the
    seed, so a second run, whatever the global random state, repeats the first exactly."""
    data, train = prune_data(num_batches=1), prune_data(seed=10, num_batches=1)
    config = d3d.PruneConfig(min_layers=2, recovery_steps=2, val_anchors=5, seed=3)
    calls = []

    def scores(drafter, batches, **measure):
        calls.append(measure)
        return first_layer_costs_least(drafter, batches)

    runs = []
    for global_seed in (0, 1):
        drafter = noop_layer_drafter(tok, layers=3)
        tau0, _ = d3d.validation_tau(drafter, data, val_anchors=5, seed=3)
        torch.manual_seed(global_seed)
        table = list(d3d.prune_drafter(drafter, data, train, config, score=scores))
        runs.append(([row["tau_after_recovery"] for row in table], list(drafter.parameters())))
    assert all(call == {"val_anchors": 5, "seed": 3} for call in calls), (
        f"score was called with {calls}: every measurement takes the config's val_anchors (5) "
        "and seed (3)"
    )
    assert runs[0][0][0] == tau0, (
        f"the unpruned tau {runs[0][0][0]}, validation_tau with the config's val_anchors and "
        f"seed {tau0}: every measurement takes them"
    )
    same = all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert same and runs[0][0] == runs[1][0], (
        "two runs of one config under different global random states differ: recovery's "
        "generator is seeded with the config's seed"
    )


def test_pruning_is_a_generator_that_prunes_as_its_records_are_taken(tok):
    """prune_drafter returns a generator: the call checks the settings and runs no pass of any
    model; the first record measures the unpruned drafter, and each later one runs its removal
    as it is taken."""
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=3, layers=4), tokenizer=tok, block_size=3, num_anchors=4
    )
    decoder = type(drafter.model.get_decoder())
    passes = []

    def seen(module, args, output):
        if isinstance(module, decoder):
            passes.append(module)

    data = prune_data(num_batches=1)
    hook = torch.nn.modules.module.register_module_forward_hook(seen)
    try:
        records = d3d.prune_drafter(
            drafter, data, data, min_layers=2, recovery_steps=0, score=first_layer_costs_least
        )
        assert not passes, (
            f"the call ran {len(passes)} passes: it checks the settings and returns a generator; "
            "each record's work runs when the record is taken"
        )
        assert iter(records) is records, f"prune_drafter returned a {type(records).__name__}"
        assert next(records)["removed_layer"] is None and passes, "record 0: the unpruned tau"
        next(records)
    finally:
        hook.remove()
    assert len(drafter.model.model.layers) == 3, (
        f"after two records the drafter has {len(drafter.model.model.layers)} layers: each "
        "record's removal runs when it is taken, one at a time"
    )


# --------------------------------------------------------------------------------------------------
# Selective prefilling (appendix, Fig. 5)


def test_kept_chunks_are_in_order_with_original_positions(tok):
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok)
    prompt = torch.randint(0, TEXT_VOCAB, (1, 45), generator=torch.Generator().manual_seed(4))
    # 7 chunks (the last has 3 tokens)
    sel = d3d.select_chunks(drafter, prompt, keep_ratio=0.4, chunk_size=7)
    assert sel["num_chunks"] == 7 and sel["chunks_kept"] == 3
    kept = sel["kept_chunks"]
    assert kept == sorted(kept), f"kept {kept}: the kept chunks stay in their order"
    assert kept[0] == 0 and kept[-1] == 6, (
        f"kept {kept} of 7 chunks: the first chunk and the last are always kept"
    )
    expected_positions = [p for c in kept for p in range(7 * c, min(7 * c + 7, 45))]
    assert sel["kept_positions"][0].tolist() == expected_positions, (
        f"kept_positions {sel['kept_positions'][0].tolist()}: the kept tokens keep their "
        f"original positions, {expected_positions}"
    )
    assert torch.equal(sel["kept_ids"][0], prompt[0, expected_positions]), (
        "kept_ids are the prompt's tokens at the kept positions"
    )
    middle = max(range(1, 6), key=lambda c: sel["chunk_scores"][c])
    assert kept[1] == middle, (
        f"kept {kept}: besides the first and the last, the best-scoring chunk ({middle})"
    )
    assert sel["drafter_cache"].length == 45  # the drafter keeps the whole prompt


def test_select_chunks_refuses_a_keep_ratio_outside_0_1_and_a_chunk_size_under_1(tok):
    """keep_ratio in (0, 1] and chunk_size >= 1, or a ValueError: at each bound and on both
    sides of it."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok)
    prompt = torch.randint(0, TEXT_VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    rule = "keep_ratio must be in (0, 1] and chunk_size >= 1"
    for keep_ratio, chunk_size in ((0.0, 4), (-0.5, 4), (1.0 + 1e-9, 4), (1.5, 4), (0.5, 0)):
        given = f"keep_ratio {keep_ratio}, chunk_size {chunk_size}"
        try:
            d3d.select_chunks(drafter, prompt, keep_ratio=keep_ratio, chunk_size=chunk_size)
        except ValueError:
            continue
        except (ArithmeticError, RuntimeError, IndexError) as error:
            pytest.fail(f"{given} raised {error!r}, not a ValueError that says why: {rule}")
        pytest.fail(f"{given} accepted: {rule}")
    for keep_ratio, chunk_size in ((1e-9, 4), (1.0, 4), (0.5, 1)):
        try:
            d3d.select_chunks(drafter, prompt, keep_ratio=keep_ratio, chunk_size=chunk_size)
        except ValueError as error:
            pytest.fail(
                f"keep_ratio {keep_ratio}, chunk_size {chunk_size} refused: {error}; {rule}"
            )


def attention_received(drafter, prompt, window):
    """The attention each prompt token receives from the last `window` prompt tokens, mean over
    layers, heads and those queries: one plain causal pass with eager attention."""
    model = drafter.model
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(prompt, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(implementation)
    # (layers, heads, window, prompt_len) -> (prompt_len,)
    return torch.stack(attentions)[:, 0, :, -window:].mean((0, 1, 2))


def test_a_chunks_score_is_the_attention_its_tokens_get_from_the_last_query_window(tok):
    """chunk_scores, chunk by chunk: the attention each token receives from the last
    query_window prompt tokens (all of them, where the prompt is shorter), mean over layers,
    heads and queries, summed over the chunk's tokens."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok)
    prompt = torch.randint(0, TEXT_VOCAB, (1, 23), generator=torch.Generator().manual_seed(7))
    chunk_size = 4  # 6 chunks, the last of 3 tokens
    for query_window in (5, 40):
        window = min(query_window, 23)
        attention = attention_received(drafter, prompt, window)
        expected = [attention[c : c + chunk_size].sum().item() for c in range(0, 23, chunk_size)]
        given = f"query_window {query_window}, a prompt of 23 tokens"
        try:
            sel = d3d.select_chunks(
                drafter, prompt, keep_ratio=0.5, chunk_size=chunk_size, query_window=query_window
            )
        except (RuntimeError, IndexError, ValueError) as error:
            pytest.fail(
                f"{given}: raised {error!r}; the last query_window prompt tokens ask (all of "
                "them where the prompt is shorter)"
            )
        scores = [float(score) for score in sel["chunk_scores"]]
        if scores == pytest.approx(expected, abs=1e-5):
            continue
        sizes = [min(chunk_size, 23 - c) for c in range(0, 23, chunk_size)]
        slips = {
            "the mean of its tokens', not their sum": [e / n for e, n in zip(expected, sizes)],
            f"from the last {window} prompt tokens only, not from every one": [
                attention_received(drafter, prompt, 23)[c : c + chunk_size].sum().item()
                for c in range(0, 23, chunk_size)
            ],
        }
        said = [why for why, slip in slips.items() if scores == pytest.approx(slip, abs=1e-5)]
        pytest.fail(
            f"{given}: chunk_scores {[round(x, 4) for x in scores]}, expected "
            f"{[round(x, 4) for x in expected]}: a chunk's score is the attention its tokens "
            "receive from the last query_window prompt tokens (mean over layers, heads and "
            "queries), summed over the chunk" + (f"; here {said[0]}" if said else "")
        )


@pytest.mark.parametrize(
    "prompt_len,keep_ratio,count,rule",
    [
        (24, 0.5, 3, "ceil(keep_ratio x chunks)"),  # 6 chunks: 3.0
        (24, 0.51, 4, "ceil(keep_ratio x chunks)"),  # 3.06
        (24, 0.49, 3, "ceil(keep_ratio x chunks)"),  # 2.94
        (24, 0.2, 2, "ceil(keep_ratio x chunks)"),  # 1.2
        (24, 0.1, 2, "at least 2"),  # 0.6
        (8, 0.1, 2, "at least 2"),  # 2 chunks
        (3, 0.5, 1, "never more than the chunks there are"),  # 1 chunk
        (5, 1.0, 2, "never more than the chunks there are"),  # 2 chunks, the last of 1 token
    ],
    ids=["3.0", "3.06", "2.94", "1.2", "0.6", "2-chunks", "1-chunk", "all-2"],
)
def test_as_many_chunks_as_ceil_keep_ratio_x_chunks_at_least_2_at_most_all(
    tok, prompt_len, keep_ratio, count, rule
):
    """How many chunks are kept: ceil(keep_ratio x num_chunks), but at least 2 and never more than
    the chunks there are: at the bounds and on both sides (chunks of 4 tokens)."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok)
    prompt = torch.randint(
        0, TEXT_VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(1)
    )
    num_chunks = math.ceil(prompt_len / 4)
    given = f"keep_ratio {keep_ratio} of {num_chunks} chunks"
    try:
        sel = d3d.select_chunks(drafter, prompt, keep_ratio=keep_ratio, chunk_size=4)
    except (RuntimeError, IndexError, ValueError) as error:
        pytest.fail(f"{given} raised {error!r}: the chunks kept are {rule}")
    assert len(sel["kept_chunks"]) == sel["chunks_kept"] == count, (
        f"{given}: kept {sel['kept_chunks']}, expected {count} chunks: {rule}"
    )


def test_the_drafters_cache_is_the_one_given_rewound_to_hold_the_whole_prompt(tok):
    """`cache`, where given, is the drafter's cache returned: rewound to 0 first, whatever it
    held, then holding the whole prompt, as a new cache would (the next draft reads the same)."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=3)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, TEXT_VOCAB, (1, 20), generator=g)
    cache = runtime.KVCache(drafter, 64)
    runtime.prefill(cache, torch.randint(0, TEXT_VOCAB, (1, 10), generator=g))  # an earlier text
    sel = d3d.select_chunks(drafter, prompt, keep_ratio=0.5, chunk_size=5, cache=cache)
    assert sel["drafter_cache"] is cache, "drafter_cache is the cache given, where one is"
    assert cache.length == 20, (
        f"the cache holds {cache.length} tokens: rewound to 0, then the whole prompt (20)"
    )
    fresh = runtime.KVCache(drafter, 64)
    d3d.select_chunks(drafter, prompt, keep_ratio=0.5, chunk_size=5, cache=fresh)
    with torch.no_grad():
        after = [d3d.draft_block(drafter, c, prompt[:, -1:], 3) for c in (cache, fresh)]
    torch.testing.assert_close(
        after[0], after[1], msg="the cache given holds the prompt as a new cache would"
    )


def needle_drafter(tok, needle):
    """A drafter whose first layer attends almost only to the token `needle` (a query bias aligned
    with that token's key, on the slowest-rotating RoPE pair so that distance hardly matters)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_bias=True,
        rope_theta=1e6,
    )
    model = LlamaForCausalLM(config).eval()
    attn, head_dim = model.model.layers[0].self_attn, 8
    with torch.no_grad():
        direction = (
            model.model.embed_tokens.weight[needle] / model.model.embed_tokens.weight[needle].norm()
        )
        model.model.embed_tokens.weight[needle] = direction * 32**0.5 * 0.02 * 10
        attn.q_proj.weight.zero_()
        attn.q_proj.bias.zero_()
        attn.k_proj.weight.zero_()
        attn.k_proj.bias.zero_()
        for h in range(4):
            attn.q_proj.bias[h * head_dim + head_dim // 2 - 1] = 10.0
        for h in range(2):
            attn.k_proj.weight[h * head_dim + head_dim // 2 - 1] = direction * 10.0
    return d3d.make_drafter(model, tokenizer=tok)


def test_the_chunk_the_drafter_attends_to_survives(tok):
    needle = 42
    drafter = needle_drafter(tok, needle)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 40, (1, 80), generator=g)  # no needle anywhere ...
    prompt[0, 45] = needle  # ... but in chunk 5 of 10 (positions 40-47)
    sel = d3d.select_chunks(drafter, prompt, keep_ratio=0.3, chunk_size=8)
    assert sel["kept_chunks"] == [0, 5, 9]
    prompt[0, 45], prompt[0, 21] = 7, needle  # move it to chunk 2: the choice follows
    assert d3d.select_chunks(drafter, prompt, keep_ratio=0.3, chunk_size=8)["kept_chunks"] == [
        0,
        2,
        9,
    ]


def test_selective_prefill_decodes_like_the_target_on_the_kept_chunks(tok, target):
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=5)
    prompt = torch.randint(0, TEXT_VOCAB, (1, 61), generator=torch.Generator().manual_seed(6))
    outputs = {}
    for mode in d3d.MODES:
        outputs[mode], stats = d3d.generate(
            target, drafter, prompt, max_new_tokens=17, mode=mode, keep_ratio=0.3, chunk_size=6
        )
        assert stats["chunks_kept"] == 4 and stats["prompt_tokens_prefilled"] < 61
        assert stats["time_prefill"] >= stats["time_scoring"] > 0
    assert outputs["sync"].tolist() == outputs["async"].tolist() == outputs["target"].tolist()
    # independent check, no cache: the target reading the kept chunks + the answer at their original
    # positions
    # predicts every answer token greedily
    sel = d3d.select_chunks(drafter, prompt, keep_ratio=0.3, chunk_size=6)
    answer = outputs["target"][:, 61:]
    ids = torch.cat([sel["kept_ids"], answer], 1)
    positions = torch.cat([sel["kept_positions"], torch.arange(61, 61 + answer.shape[1])[None]], 1)
    with torch.no_grad():
        logits = target(input_ids=ids, position_ids=positions).logits[0]
    k = sel["kept_ids"].shape[1]
    assert logits[k - 1 : -1].argmax(-1).tolist() == answer[0].tolist()
    full, _ = d3d.generate(target, None, prompt, max_new_tokens=17, mode="target")
    # dropping chunks does change this target's answer
    assert full.tolist() != outputs["target"].tolist()


def test_keep_ratio_one_equals_ordinary_decoding(tok, target):
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=4)
    prompt = torch.randint(0, TEXT_VOCAB, (1, 37), generator=torch.Generator().manual_seed(3))
    expected, _ = d3d.generate(target, None, prompt, max_new_tokens=15, mode="target")
    for mode in d3d.MODES:
        out, stats = d3d.generate(
            target, drafter, prompt, max_new_tokens=15, mode=mode, keep_ratio=1.0, chunk_size=8
        )
        assert out.tolist() == expected.tolist()
        assert (
            stats["chunks_kept"] == stats["num_chunks"] == 5
            and stats["prompt_tokens_prefilled"] == 37
        )


def test_long_prompts_are_prefilled_in_chunks(tok, target, monkeypatch):
    """No prefill pass reads more than PREFILL_CHUNK tokens (its mask is chunk x cache length, not
    prompt x prompt), and the chunked prefill decodes what one pass over the prompt does: every
    mode, and selective prefill."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=2)
    prompt = torch.randint(0, TEXT_VOCAB, (1, 11), generator=torch.Generator().manual_seed(5))
    expected = {
        (mode, ratio): d3d.generate(
            target, drafter, prompt, max_new_tokens=9, mode=mode, keep_ratio=ratio, chunk_size=4
        )[0].tolist()
        for mode in d3d.MODES
        for ratio in (None, 0.5)
    }
    monkeypatch.setattr(runtime, "PREFILL_CHUNK", 3)
    widths, run = [], runtime.KVCache.run

    def recording_run(
        self, ids, *rest, fixed=True
    ):  # the tokens of every prefill pass (the eager ones)
        if not fixed:
            widths.append(ids.shape[1])
        return run(self, ids, *rest, fixed=fixed)

    monkeypatch.setattr(runtime.KVCache, "run", recording_run)
    for mode in d3d.MODES:
        for ratio in (None, 0.5):
            widths.clear()
            out, _ = d3d.generate(
                target, drafter, prompt, max_new_tokens=9, mode=mode, keep_ratio=ratio, chunk_size=4
            )
            assert out.tolist() == expected[mode, ratio]
            # the target prefills 11 tokens or the 7 of 2 kept chunks; the drafter 11 (selective:
            # one scoring pass)
            assert max(widths) == 3 and sum(widths) == (11 if ratio is None else 7) + (
                11 if mode != "target" and ratio is None else 0
            )
    # select_chunks with a window shorter than the prompt: the drafter prefills the first 7
    # tokens 3 at a time, and only the last 4 are read with attention
    passes = []

    def seen(module, args, kwargs):
        passes.append((kwargs["input_ids"].shape[1], bool(kwargs.get("output_attentions"))))

    hook = drafter.model.get_decoder().register_forward_pre_hook(seen, with_kwargs=True)
    try:
        d3d.select_chunks(drafter, prompt, keep_ratio=0.5, chunk_size=4, query_window=4)
    finally:
        hook.remove()
    prefilled = [width for width, attention in passes if not attention]
    attended = [width for width, attention in passes if attention]
    assert attended == [4] and max(prefilled, default=0) <= 3 and sum(prefilled) == 7, (
        f"select_chunks' passes over 11 tokens, query_window 4: {prefilled} tokens without "
        f"attention, {attended} with it; the prompt is read in prefill chunks (at most "
        "PREFILL_CHUNK = 3 tokens here), only the last query_window tokens with attention"
    )


# --------------------------------------------------------------------------------------------------
# Bad input: clear errors, never a wrong answer


def test_keyword_settings_replace_the_configs_fields_and_unknown_names_are_refused(tok, target):
    """generate(..., config, **settings) decodes with the config's fields replaced and leaves the
    config as it was; a name DecodeConfig lacks is a TypeError naming it, never ignored."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=4)
    prompt = torch.tensor([[1, 2, 3]])
    config = d3d.DecodeConfig(max_new_tokens=12, mode="async")
    out, stats = d3d.generate(target, drafter, prompt, config, max_new_tokens=5)
    assert out.shape[1] == 3 + 5 and "hits_per_position" in stats
    assert config == d3d.DecodeConfig(max_new_tokens=12, mode="async")
    same, _ = d3d.generate(target, drafter, prompt, max_new_tokens=5, mode="async")
    assert same.tolist() == out.tolist()
    with pytest.raises(TypeError, match="'bogus'"):
        d3d.generate(target, drafter, prompt, bogus=1)
    with pytest.raises(TypeError, match="'max_tokens'"):
        d3d.generate(target, drafter, prompt, config, max_tokens=5)
    with pytest.raises(TypeError, match="DecodeConfig"):
        d3d.generate(target, drafter, prompt, d3d.PruneConfig())
    with pytest.raises(TypeError, match="'num_anchors'"):
        d3d.prune_drafter(drafter, [], [], min_layers=1, num_anchors=4)


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_new_tokens", -1),
        ("mode", "fast"),
        ("lanes", 3),
        ("trace", "yes"),
        ("cover", 1),
        ("keep_ratio", 1.5),
        ("temperature", float("nan")),
        ("eos_token_id", [2, -1]),
    ],
)
def test_a_decode_setting_outside_its_range_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"DecodeConfig.{field} must be"):
        d3d.DecodeConfig(**{field: value})


def test_every_setting_carries_its_help_and_range():
    """The drivers' flags read a field's explanation and range from its metadata."""
    decode_fields = [f.name for f in dataclasses.fields(d3d.DecodeConfig)]
    assert decode_fields == [
        "max_new_tokens", "mode", "temperature", "eos_token_id", "block_size", "coverage",
        "fanout", "cover", "lanes", "keep_ratio", "chunk_size", "trace",
    ]  # fmt: skip
    for config in (d3d.DecodeConfig, d3d.D3DConfig, d3d.PruneConfig):
        for f in dataclasses.fields(config):
            assert isinstance(f.metadata.get("help"), str) and f.metadata["help"], f.name
            if config is not d3d.D3DConfig:
                assert isinstance(f.metadata.get("range"), runtime.Range), f.name


def test_bad_inputs_raise_clear_errors(tok, target, tmp_path):
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok)
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="DecodeConfig.block_size must be int >= 1, got 0"):
        d3d.generate(target, drafter, prompt, max_new_tokens=5, block_size=0)
    with pytest.raises(ValueError, match="D3DConfig.block_size must be int >= 1, got 0"):
        d3d.make_drafter(tiny_qwen3(), tokenizer=tok, block_size=0)
    with pytest.raises(ValueError, match="D3DConfig.d1_from must be str one of 'causal', 'mask'"):
        d3d.make_drafter(tiny_qwen3(), tokenizer=tok, d1_from="ar")
    # gamma > 0 (0 would divide by zero); None: uniform weights
    with pytest.raises(ValueError, match="D3DConfig.decay_gamma must be float > 0, got 0.0"):
        d3d.make_drafter(tiny_qwen3(), tokenizer=tok, decay_gamma=0.0)
    assert d3d.D3DConfig(decay_gamma=None).decay_gamma is None
    with pytest.raises(ValueError, match="empty"):
        d3d.generate(target, drafter, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=5)
    with pytest.raises(ValueError, match="batch 1"):
        d3d.generate(target, drafter, prompt.repeat(2, 1), max_new_tokens=5)
    with pytest.raises(ValueError, match="needs a drafter"):
        d3d.generate(target, None, prompt, max_new_tokens=5, mode="sync")
    with pytest.raises(ValueError, match=r"DecodeConfig.keep_ratio must be float in \(0, 1\]"):
        d3d.generate(target, drafter, prompt, max_new_tokens=5, keep_ratio=0.0)
    with pytest.raises(ValueError, match="scores the prompt chunks"):
        d3d.generate(target, None, prompt, max_new_tokens=5, mode="target", keep_ratio=0.5)
    with pytest.raises(ValueError, match="DecodeConfig.mode must be str one of 'target'"):
        d3d.generate(target, drafter, prompt, max_new_tokens=5, mode="fast")
    with pytest.raises(
        ValueError, match="target vocabulary"
    ):  # a drafter for a target with another vocabulary
        d3d.generate(tiny_qwen3(vocab_size=120), drafter, prompt, max_new_tokens=5)
    with pytest.raises(
        ValueError, match="does not cover"
    ):  # drafter model smaller than the tokenizer
        d3d.make_drafter(tiny_qwen3(vocab_size=64), tokenizer=tok)
    with pytest.raises(
        ValueError, match="does not cover"
    ):  # drafter model smaller than the target's vocabulary
        d3d.make_drafter(tiny_qwen3(), tokenizer=tok, target_vocab_size=128)
    with pytest.raises(ValueError, match="text token"):  # MASK would collide with text
        d3d.make_drafter(tiny_qwen3(), 17, tokenizer=tok)
    with pytest.raises(ValueError, match="different tokenizer"):
        runtime.check_tokenizer(drafter, make_tokenizer(prefix="w"))
    runtime.check_tokenizer(drafter, tok)  # the right one passes
    with pytest.raises(FileNotFoundError, match="no drafter folder"):
        d3d.Drafter.from_pretrained(str(tmp_path / "missing"))
    target.save_pretrained(str(tmp_path / "plain"))
    with pytest.raises(FileNotFoundError, match="not a D3D drafter"):
        d3d.Drafter.from_pretrained(str(tmp_path / "plain"))


def test_a_prompt_or_drafter_on_another_device_than_the_target_is_refused(tok, target):
    """input_ids, or a drafter the decode uses, on another device than the target: one clear
    error before anything runs (the meta device stands in for a second device on a CPU), in
    d3d.generate and in the batched path; a drafter that target-only decoding never uses may be
    anywhere."""
    prompt = torch.tensor([[1, 2, 3]])
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok)
    with pytest.raises(ValueError, match="input_ids are on meta, the target on cpu: put them on"):
        d3d.generate(target, drafter, prompt.to("meta"), max_new_tokens=5)
    drafter.to("meta")
    for mode in ("sync", "async"):
        with pytest.raises(ValueError, match="the target is on cpu, the drafter on meta: put both"):
            d3d.generate(target, drafter, prompt, max_new_tokens=5, mode=mode)
    with pytest.raises(ValueError, match="the target is on cpu, the drafter on meta: put both"):
        batched.generate(target, drafter, [prompt[0], prompt[0, :2]], max_new_tokens=5)
    tokens, _ = d3d.generate(target, drafter, prompt, max_new_tokens=5, mode="target")
    assert tokens.shape == (1, 8), "target-only decoding never touches the drafter"


def test_a_request_the_caches_cannot_hold_is_refused_up_front(tok, target):
    """A request longer than the caches: a clear error before anything is written, and the caches
    still decode."""
    drafter = d3d.make_drafter(tiny_qwen3(seed=1), tokenizer=tok, block_size=4)
    caches = runtime.Caches.make(target, drafter, 40)
    prompt = torch.tensor([[7, 1, 9, 4, 4]])
    with pytest.raises(ValueError, match="KV caches of 75 slots"):
        d3d.generate(target, drafter, prompt, max_new_tokens=30, mode="async", caches=caches)
    with pytest.raises(ValueError, match="other models"):
        d3d.generate(tiny_qwen3(seed=2), drafter, prompt, max_new_tokens=3, caches=caches)
    out, _ = d3d.generate(target, drafter, prompt, max_new_tokens=20, mode="sync", caches=caches)
    assert (
        out.tolist()
        == d3d.generate(target, None, prompt, max_new_tokens=20, mode="target")[0].tolist()
    )
    with pytest.raises(ValueError, match="KV cache full"):
        runtime.causal_pass(caches.target, torch.zeros(1, 41, dtype=torch.long))


def dropping_cache(model: torch.nn.Module, cut_mask: bool) -> torch.nn.Module:
    """A model whose forward drops the KV cache it is given (as a transformers version that renamed
    the keyword would): each pass sees only its own tokens. cut_mask: it also cuts a mask wider than
    its keys down to them (as attention code that slices the mask does), so nothing fails on a shape
    and the tokens are silently wrong."""
    forward = model.forward

    def without_cache(*args, cache=None, past_key_values=None, attention_mask=None, **kwargs):
        if cut_mask:
            attention_mask = attention_mask[..., : kwargs["input_ids"].shape[1]]
        return forward(*args, attention_mask=attention_mask, **kwargs)

    model.forward = without_cache
    return model


@pytest.mark.parametrize("cut_mask", [False, True])
@pytest.mark.parametrize(
    "who,mode",
    [
        ("target", "target"),
        ("target", "sync"),
        ("target", "async"),
        ("drafter", "sync"),
        ("drafter", "async"),
        ("target", "batch"),
        ("drafter", "batch"),
    ],
)
def test_a_model_that_ignores_its_cache_fails_loudly(tok, who, mode, cut_mask):
    target = tiny_qwen3(seed=1)
    drafter = d3d.make_drafter(tiny_qwen3(seed=2), tokenizer=tok, block_size=4)
    dropping_cache(target if who == "target" else drafter.model.get_decoder(), cut_mask)
    prompts = batch_prompts((3, 6)) if mode == "batch" else torch.tensor([[7, 1, 9, 4]])
    with pytest.raises(RuntimeError, match="ignored the cache"):
        (batched.generate if mode == "batch" else d3d.generate)(
            target,
            None if mode == "target" else drafter,
            prompts,
            max_new_tokens=12,
            mode="sync" if mode == "batch" else mode,
        )


@pytest.mark.parametrize("mode", ["target", "sync", "async"])
def test_a_round_that_commits_no_token_is_an_error_not_a_loop(tok, target, mode, monkeypatch):
    """Plant the bug: EOS never reaches the sequence. A round whose only token is EOS then commits
    nothing; the decode must stop with an error, not repeat that round forever."""
    prompt = torch.tensor([[2, 7, 1, 8]])
    reference = reference_continuation(target, prompt, 20)
    eos = reference[prompt.shape[1] + 3]  # the target's fourth new token
    # rejected at d_1: every round commits one token
    drafter, _ = scripted(tok, target, prompt, 4, "never", 20)
    real, calls = runtime.Output.commit, []

    def loses_eos(self, new):
        calls.append(1)
        assert len(calls) < 200, "the decode looped"
        return real(self, [t for t in new if t not in self.eos])

    monkeypatch.setattr(runtime.Output, "commit", loses_eos)
    with pytest.raises(RuntimeError, match="committed no token"):
        d3d.generate(
            target,
            None if mode == "target" else drafter,
            prompt,
            max_new_tokens=20,
            mode=mode,
            eos_token_id=eos,
        )


def test_a_finished_sequence_takes_no_more_tokens():
    """Committing to a sequence that is done (a loop that confused its batch rows, or missed the
    stop) is an error."""
    out = runtime.Output([5, 6], max_new_tokens=3, eos_token_id=9)
    assert out.commit([1, 9, 2]) == [1, 9] and out.done and out.tokens == [5, 6, 1, 9]
    with pytest.raises(RuntimeError, match="finished sequence"):
        out.commit([3])


# --------------------------------------------------------------------------------------------------
# A transformers streamer


class RecordingStreamer:
    """What generate hands a streamer, in order."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", value))

    def end(self):
        self.calls.append(("end", None))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_text_streamer_prints_the_new_tokens_one_round_at_a_time(mode, capsys):
    """On the shipped toy: transformers' TextStreamer(skip_prompt=True) prints exactly the decoded
    new tokens; a streamer sees the prompt, then the prefill's token, then one put per round
    ((1, n) on the CPU, the round's committed tokens), then end()."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer

    import toy

    tok = AutoTokenizer.from_pretrained(toy.SHIPPED)
    target = AutoModelForCausalLM.from_pretrained(toy.SHIPPED).eval()
    drafter = d3d.make_drafter(AutoModelForCausalLM.from_pretrained(toy.SHIPPED), tokenizer=tok)
    chat = [{"role": "user", "content": "7 * 6 + 8 - 5"}]
    ids = tok.apply_chat_template(
        chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    config = d3d.DecodeConfig(max_new_tokens=40, mode=mode, block_size=4)
    capsys.readouterr()
    streamer = TextStreamer(tok, skip_prompt=True)
    out, _ = d3d.generate(target, drafter, ids, config, streamer=streamer)
    new = out[0, ids.shape[1] :]
    # what it printed, flushed by end(): the new tokens decoded as TextStreamer decodes them, "\n"
    printed = capsys.readouterr().out
    assert printed.strip() and printed == tok.decode(new) + "\n"
    recorder = RecordingStreamer()
    again, stats = d3d.generate(target, drafter, ids, config, streamer=recorder)
    assert again.tolist() == out.tolist()
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == ["put"] * (2 + stats["num_rounds"]) + ["end"]
    puts = [value for kind, value in recorder.calls if kind == "put"]
    assert all(p.device.type == "cpu" and p.dtype == torch.long for p in puts)
    assert all(p.dim() == 2 and p.shape[0] == 1 for p in puts)
    assert puts[0].shape == ids.shape and torch.equal(puts[0], ids)  # the prompt first
    assert puts[1].tolist() == [[new[0].item()]]  # then the prefill's token
    rounds = puts[2:]
    assert [p.shape[1] for p in rounds] == stats["accept_lengths"]
    assert torch.cat([p[0] for p in puts[1:]]).tolist() == new.tolist()
