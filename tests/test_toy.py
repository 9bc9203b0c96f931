"""Tests of the built-in toy setting (toy.py). Fast: a few seconds on 2 CPU cores."""

import json
import os
import random
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import runtime
import toy

LINE = re.compile(r"^(\d+) ([+\-*]) (\d+) = (\d+)$")
QUESTION = re.compile(r"^\d+( [+\-*] \d+)+$")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: on a small CPU shared with other work, more threads are often much
    slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _problems(n, seed=0):
    rng = random.Random(seed)
    return [toy.make_problem(rng) for _ in range(n)]


def _check(question, answer):
    """Asserts that the answer is a right step-by-step solution of the question."""
    assert QUESTION.match(question), question
    tokens = question.split(" ")
    nums = [int(t) for t in tokens[::2]]
    ops = tokens[1::2]
    assert 2 <= len(ops) <= 4
    *lines, last = answer.split("\n")
    assert len(lines) == len(ops)
    acc = nums[0]
    for line, op, b in zip(lines, ops, nums[1:]):
        m = LINE.match(line)
        assert m, line
        x = int(m[1])
        line_op = m[2]
        y = int(m[3])
        z = int(m[4])
        assert (x, line_op, y) == (acc, op, b), (question, line)
        assert z == {"+": x + y, "-": x - y, "*": x * y}[line_op], line
        acc = z
    assert last == f"#### {acc}"
    # usual precedence (the string is checked above to be digits and + - * only)
    assert acc == eval(question)


def _prompt_ids(tok, question):
    out = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


# ----------------------------------------------------------------------------------------- problems


def test_problems_are_right():
    for q, a in _problems(500):
        _check(q, a)


def test_problems_shape_and_determinism():
    probs = _problems(300)
    assert probs == _problems(300)
    assert probs != _problems(300, seed=1)
    lengths = [len(a) for _, a in probs]
    assert min(lengths) >= 30 and max(lengths) <= 80
    assert {q.count(" ") // 2 for q, _ in probs} == {2, 3, 4}
    assert any("*" in q for q, _ in probs) and any("-" in q for q, _ in probs)
    # at most one multiplication, first, from a times table
    for q, _ in probs:
        tokens = q.split(" ")
        assert "*" not in tokens[3:], q
        if tokens[1] == "*":
            assert 2 <= int(tokens[0]) <= 12, q


# ---------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_is_character_level():
    tok = toy.make_tokenizer()
    for q, a in _problems(50):
        for text in (q, a):
            ids = tok.encode(text, add_special_tokens=False)
            assert len(ids) == len(text)  # one token per character
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text
    one = tok.encode("1", add_special_tokens=False)
    two = tok.encode("2", add_special_tokens=False)
    assert tok.encode("12", add_special_tokens=False) == one + two
    # no bos
    with_specials = tok.encode("1 + 2", add_special_tokens=True)
    assert with_specials == tok.encode("1 + 2", add_special_tokens=False)


def test_special_tokens_and_vocab():
    tok = toy.make_tokenizer()
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|end|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert "<|MASK|>" not in tok.get_vocab()
    assert len(set(tok.get_vocab().values())) == len(tok)
    padded = toy._padded_vocab_size(len(tok))
    assert padded > len(tok) and padded % 16 == 0
    # strictly larger even when len is already a multiple of 16
    assert toy._padded_vocab_size(64) == 80


def test_chat_template_prompt_ends_where_answer_begins():
    tok = toy.make_tokenizer()
    q, a = _problems(1)[0]
    prompt = _prompt_ids(tok, q)
    assert prompt == toy._prompt_ids(tok, q)
    assert tok.decode(prompt) == f"<|user|>\n{q}<|end|>\n<|assistant|>\n"
    chat = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    full = tok.apply_chat_template(chat, tokenize=False)
    full_ids = tok.encode(full, add_special_tokens=False)
    answer_ids = tok.encode(a, add_special_tokens=False)
    n = len(prompt) + len(answer_ids)
    assert full_ids[:n] == prompt + answer_ids
    assert full_ids[n] == tok.eos_token_id
    # The role markers are single special tokens that decode(skip_special_tokens=True) drops.
    assert tok.convert_ids_to_tokens(prompt[:1]) == ["<|user|>"]
    assert "<|" not in tok.decode(full_ids, skip_special_tokens=True)


def test_tokenizer_save_load_same_ids(tmp_path):
    tok = toy.make_tokenizer()
    tok.save_pretrained(tmp_path)
    tok2 = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok2) == len(tok) and tok2.get_vocab() == tok.get_vocab()
    assert (tok2.pad_token_id, tok2.eos_token_id) == (tok.pad_token_id, tok.eos_token_id)
    for q, a in _problems(20):
        assert tok2.encode(a) == tok.encode(a)
        assert _prompt_ids(tok2, q) == _prompt_ids(tok, q)
        assert tok2.decode(tok2.encode(a)) == a
    assert tok2.decode(_prompt_ids(tok2, "1 + 2"), skip_special_tokens=True) == "\n1 + 2\n\n"


# ---------------------------------------------------------------------------------------- build_toy


@pytest.fixture(scope="module")
def built(tmp_path_factory, _one_thread):
    out = tmp_path_factory.mktemp("toy")
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    paths = toy.build_toy(
        str(out), seed=0, num_train_prompts=40, num_test_prompts=8, train_steps=3, num_threads=1
    )
    assert torch.equal(state, torch.random.get_rng_state())  # caller's RNG left alone
    return out, paths


def test_build_toy_writes_files(built):
    out, paths = built
    assert set(paths) == {"target", "train", "test", "train_answers", "test_answers"}
    assert paths["target"] == str(out)
    for key in ("train", "test", "train_answers", "test_answers"):
        assert os.path.isfile(paths[key])
    train = [json.loads(line) for line in open(paths["train"])]
    test = [json.loads(line) for line in open(paths["test"])]
    assert len(train) == 40 and len(test) == 8
    for row in train + test:
        _check(row["question"], row["reference_answer"])
    train_q = {r["question"] for r in train}
    test_q = {r["question"] for r in test}
    assert len(train_q) == 40 and len(test_q) == 8 and not train_q & test_q
    assert os.path.isfile(os.path.join(paths["target"], "config.json"))
    # how it was built, and how well it answers
    recipe = json.load(open(os.path.join(paths["target"], toy.RECIPE)))
    assert recipe["train_steps"] == 3 and recipe["threads"] == 1
    assert 0 <= recipe["test_exact_match"] <= 1
    assert recipe["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    # the answers: a header, then one line per prompt, its ids as the chat template makes
    # them, ending with EOS
    tok = AutoTokenizer.from_pretrained(paths["target"])
    header, *rows = [json.loads(line) for line in open(paths["test_answers"])]
    assert header["tokenizer"] == recipe["fingerprint"]["tokenizer"]
    assert header["max_new_tokens"] == toy.MAX_NEW_TOKENS
    assert [r["i"] for r in rows] == list(range(8))
    assert [r["prompt"] for r in rows] == [toy._prompt_ids(tok, q["question"]) for q in test]
    for r in rows:
        response = r["response"]
        assert response
        assert response[-1] == tok.eos_token_id or len(response) == toy.MAX_NEW_TOKENS
    assert toy.open_toy(str(out)) == paths  # its own toy.json vouches for every file


def test_prompt_sets_deterministic_and_disjoint():
    a_train, a_test = toy._make_prompt_sets(5, 300, 100)
    b_train, b_test = toy._make_prompt_sets(5, 300, 100)
    assert (a_train, a_test) == (b_train, b_test)
    assert not {r["question"] for r in a_train} & {r["question"] for r in a_test}
    assert toy._make_prompt_sets(6, 300, 100) != (a_train, a_test)


def test_built_target_loads_and_generates(built):
    _, paths = built
    tok = AutoTokenizer.from_pretrained(paths["target"])
    model = AutoModelForCausalLM.from_pretrained(paths["target"])
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    cfg = model.config
    assert cfg.vocab_size > len(tok) and cfg.vocab_size % 16 == 0
    assert model.get_input_embeddings().weight.shape[0] == cfg.vocab_size
    assert cfg.tie_word_embeddings
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert cfg.bos_token_id is not None
    gc = model.generation_config
    assert (gc.eos_token_id, gc.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "3 * 4 + 5 - 1"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    prompt_len = enc["input_ids"].shape[1]
    assert out.shape[0] == 1 and prompt_len < out.shape[1] <= prompt_len + 8
    assert int(out.max()) < cfg.vocab_size


def test_build_toy_second_call_skips(built, capsys):
    out, paths = built
    stamp = os.path.getmtime(os.path.join(paths["target"], "model.safetensors"))
    train_text = open(paths["train"]).read()
    again = toy.build_toy(str(out), seed=0, num_train_prompts=40, num_test_prompts=8, train_steps=3)
    assert again == paths
    assert os.path.getmtime(os.path.join(paths["target"], "model.safetensors")) == stamp
    assert open(paths["train"]).read() == train_text
    printed = capsys.readouterr().out
    assert "already there" in printed and "training" not in printed


def test_answers_are_the_targets_greedy_answers():
    """Batched, left-padded answering gives each prompt what the target alone answers greedily
    (on the shipped target, whose answers have clear margins: a barely trained one would flip
    near-ties between batch shapes)."""
    tok = AutoTokenizer.from_pretrained(toy.SHIPPED)
    model = AutoModelForCausalLM.from_pretrained(toy.SHIPPED).eval()
    lines = open(os.path.join(toy.SHIPPED, "prompts-test.jsonl"))
    questions = [json.loads(line)["question"] for line in lines][:6]
    prompts = [toy._prompt_ids(tok, q) for q in questions]
    assert len({len(p) for p in prompts}) > 1  # some left padding in the batch
    batched = toy.answer_ids(model, tok, prompts, batch_size=6)
    for prompt, response in zip(prompts, batched):
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=toy.MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        assert out[0, len(prompt) :].tolist() == response and response[-1] == tok.eos_token_id


def test_build_toy_never_writes_over_the_shipped_toy(tmp_path):
    with pytest.raises(ValueError, match="repository's toy"):
        toy.build_toy(toy.SHIPPED, train_steps=1)
    with pytest.raises(ValueError, match="repository's toy"):
        toy.main(["--out", os.path.relpath(toy.SHIPPED), "--steps", "1"])


def test_a_built_toy_says_how_it_compares_with_the_shipped_one(built, capsys):
    out, _ = built
    result = toy.compare_with_shipped(str(out))
    printed = capsys.readouterr().out
    assert result["same_weights"] is False and "weights differ" in printed
    assert "test prompts differ from the repository's" in printed  # 8 prompts, not its 200
    # the shipped toy against a copy of itself: the same weights and every answer the same
    copy = out.parent / "shipped-copy"
    shutil.copytree(toy.SHIPPED, copy)
    result = toy.compare_with_shipped(str(copy))
    assert result["same_weights"] is True and result["test_same_answers"] == (200, 200)
    assert result["train_same_answers"] == (2000, 2000)


# ---------------------------------------------------------------------------------- the shipped toy


def test_the_shipped_toy_matches_its_fingerprint_and_solves_its_problems():
    """toy-target/ loads, every file matches toy.json, and greedy batched answers solve >= 90 %
    of the 200 held-out problems on this machine's float order (it was built and measured
    under the one toy.json names)."""
    paths = toy.open_toy()
    recipe = toy.read_recipe(toy.SHIPPED)
    # the build's own measure
    assert recipe["test_exact_match"] >= 0.94 and recipe["cpu_capability"]
    tok = AutoTokenizer.from_pretrained(paths["target"])
    model = AutoModelForCausalLM.from_pretrained(paths["target"]).eval()
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    assert model.dtype == torch.float32
    rows = [json.loads(line) for line in open(paths["test"])]
    train_rows = [json.loads(line) for line in open(paths["train"])]
    assert len(rows) == 200 and len(train_rows) == 2000
    result = toy.evaluate(model, tok, rows)
    assert result["exact_match"] >= 0.90, result["exact_match"]


@pytest.mark.parametrize(
    "victim", ["prompts-train.jsonl", "answers-test.jsonl", "model.safetensors"]
)
def test_open_toy_refuses_a_file_that_does_not_match_toy_json(tmp_path, victim):
    folder = tmp_path / "toy"
    shutil.copytree(toy.SHIPPED, folder)
    path = folder / victim
    # one line changed: another problem, or another answer
    if victim.endswith(".jsonl"):
        lines = path.read_text().splitlines(keepends=True)
        lines[3] = lines[1]
        path.write_text("".join(lines))
    else:
        data = bytearray(path.read_bytes())
        data[-1] ^= 1
        path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match|do not match"):
        toy.open_toy(str(folder))
    with pytest.raises(runtime.UserError, match="python toy.py"):
        toy.open_toy(str(tmp_path / "nowhere"))


def test_open_toy_refuses_a_changed_tokenizer(tmp_path):
    """Weights and data files untouched, two tokens' ids swapped in tokenizer.json: the toy's
    tokenizer fingerprint differs from toy.json's, so open_toy refuses the folder."""
    folder = tmp_path / "toy"
    shutil.copytree(toy.SHIPPED, folder)
    path = folder / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    zero = vocab["0"]
    vocab["0"] = vocab["1"]
    vocab["1"] = zero
    path.write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="tokenizer in .* do not match"):
        toy.open_toy(str(folder))


def test_build_toy_with_other_settings_reuses_the_target_and_says_so(built, capsys):
    out, paths = built
    stamp = os.path.getmtime(os.path.join(paths["target"], "model.safetensors"))
    assert json.load(open(os.path.join(paths["target"], toy.RECIPE)))["train_steps"] == 3
    toy.build_toy(str(out), seed=0, num_train_prompts=40, num_test_prompts=8, train_steps=5)
    assert os.path.getmtime(os.path.join(paths["target"], "model.safetensors")) == stamp
    printed = capsys.readouterr().out
    assert "WARNING" in printed and "'train_steps': 3" in printed and "Delete" in printed


def test_training_is_deterministic_with_seed():
    tok = toy.make_tokenizer()
    weights = []
    for _ in range(2):
        torch.manual_seed(0)
        model = toy._make_model(tok)
        toy._train(
            model,
            tok,
            seed=0,
            exclude=set(),
            train_steps=2,
            batch_size=4,
            lr=1e-3,
            warmup=1,
            device="cpu",
        )
        weights.append(model.model.embed_tokens.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_training_batches_are_fresh_problems_of_like_length():
    """Batches come in pools sorted by length (little padding), none of them a held-out
    question, in shuffled order."""
    tok = toy.make_tokenizer()
    rng = random.Random(0)
    held_out = {toy.make_problem(random.Random(1))[0]}
    batches = toy._batches(tok, rng, held_out, 16, "cpu")
    pool = [next(batches) for _ in range(2 * toy.POOL_BATCHES)]
    pads = sum(int((b["attention_mask"] == 0).sum()) for b in pool)
    padding = pads / sum(b["attention_mask"].numel() for b in pool)
    assert padding < 0.05  # random batches of 16 pad about a fifth of their tokens
    widths = [b["input_ids"].shape[1] for b in pool[: toy.POOL_BATCHES]]
    assert widths != sorted(widths)  # the batches of a pool come shuffled, not shortest first
    rows = [row for b in pool for row in b["input_ids"].tolist()]
    texts = {tok.decode(row, skip_special_tokens=True) for row in rows}
    assert not any(text.startswith(next(iter(held_out)) + "\n") for text in texts)


def test_lab_runs_gives_one_range_per_outcome_over_every_run(monkeypatch):
    """tests/lab_runs.py, the sweep behind LAB's ranges: each outcome's range covers all its
    runs, and AVX2 counts as a float order of its own only where the CPU has AVX-512."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import lab_runs

    runs = [
        {"run": "base", "order": o, "seed": s, "tau": t, "tau_d1_head": t, "tau_d1_mask": m}
        for o, s, t, m in [
            ("native", 0, 4.1, 3.7),
            ("sse", 0, 4.2, 3.8),
            ("native", 1, 3.9, 3.5),
            ("sse", 1, 3.95, 3.6),
        ]
    ]
    runs.append(
        {
            "run": "lam0",
            "order": "native",
            "seed": 0,
            "tau": 3.2,
            "tau_d1_head": 1.9,
            "tau_d1_mask": 3.2,
        }
    )
    assert lab_runs.ranges(runs) == [
        ("base tau", 3.9, 4.2, 4),
        ("base tau_d1_mask", 3.5, 3.8, 4),
        ("lam0 tau", 3.2, 3.2, 1),
        ("lam0 tau_d1_head", 1.9, 1.9, 1),
    ]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert lab_runs.available_orders() == ["native", "avx2", "sse"]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert lab_runs.available_orders() == ["native", "sse"]
