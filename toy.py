"""Built-in toy setting: a tiny target LM that learns step-by-step arithmetic.

This is scaffolding, not the D3D method. It lets ``python train.py`` run end to end on a CPU in a few
minutes: :func:`build_toy` generates a small procedural task, trains a tiny ``Qwen3ForCausalLM`` target on
it from scratch, and writes

* ``out_dir/target/``            a normal Hugging Face folder (model + character-level tokenizer with a chat
                                 template), loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer``;
* ``out_dir/prompts-train.jsonl`` prompts the drafter is later trained on (the target answers them);
* ``out_dir/prompts-test.jsonl``  held-out prompts (disjoint from the train prompts).

Each prompt line is ``{"question": "7 * 6 + 8 - 5", "reference_answer": "..."}``. The reference answer is
the exact, correct solution; the drafter should learn from the *target's* answers, not from it.

The task, e.g. question ``7 * 6 + 8 - 5`` and answer::

    7 * 6 = 42
    42 + 8 = 50
    50 - 5 = 45
    #### 45

2 to 4 operations, one per line, each line starting with the previous result; at most one ``*``, and it comes first
(a times table: 2..12 by 2..9), so the usual precedence and left to right agree; otherwise the first number is 1..50;
+ and - operands 1..9; no intermediate value below 0 or above 999; answers of 30 to 80 characters (43 on average).

Command line: ``python toy.py --out runs/toy [--seed 0] [--steps 3000] [--threads N]``.

The target trains from fixed seeds until it solves its own problems (TRAIN_STEPS = 3000 steps of 16 problems; it
prints and records in target/toy.json its exact-match rate on the 200 held-out prompts). Float order differs between
CPUs and thread counts, so no two machines build bit-equal toys; trained to convergence, toys from different float
orders answer alike, but a drafter cut from their layers can reach another tau (RESULTS.md, "The toy under another
float order").

On a CPU shared with other busy processes, training with as many torch threads as cores can be many times
slower than with one thread (threads wait on each other); pass ``num_threads=1`` / ``--threads 1`` there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import time

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

# ----------------------------------------------------------------------------------------------- task

MIN_OPS, MAX_OPS = 2, 4
FIRST_RANGE = (1, 50)  # the first number, when the first operation is + or -
TIMES_RANGE = (2, 12)  # the first number, when the first operation is *: a times table
ADD_RANGE = (1, 9)  # operands of + and -
MUL_RANGE = (2, 9)  # right operand of *
P_MUL = 0.4  # chance that the first operation is * (no other may be)
MAX_VALUE = 999  # no intermediate value above this (and none below 0)
MIN_ANSWER_CHARS, MAX_ANSWER_CHARS = 30, 80


def _solve(nums: list[int], ops: list[str]) -> list[tuple[int, str, int, int]] | None:
    """Steps (a, op, b, result), left to right, or None if a value leaves [0, MAX_VALUE].

    Left to right is the usual precedence here because every * comes before every + and -."""
    steps, acc = [], nums[0]
    for op, b in zip(ops, nums[1:]):
        c = acc * b if op == "*" else acc + b if op == "+" else acc - b
        if not 0 <= c <= MAX_VALUE:
            return None
        steps.append((acc, op, b, c))
        acc = c
    return steps


def make_problem(rng: random.Random) -> tuple[str, str]:
    """One random problem: (question, reference step-by-step answer). Deterministic given the rng state.

    A multiplication only leads the expression ("7 * 3 + 5 - 4"), so the steps go left to right and each line starts
    with the previous result: easy for a tiny model to follow, and still ordinary arithmetic."""
    while True:
        ops = ["*" if rng.random() < P_MUL else rng.choice("+-")]
        ops += [rng.choice("+-") for _ in range(rng.randint(MIN_OPS, MAX_OPS) - 1)]
        nums = [rng.randint(*(TIMES_RANGE if ops[0] == "*" else FIRST_RANGE))]
        nums += [rng.randint(*(MUL_RANGE if op == "*" else ADD_RANGE)) for op in ops]
        steps = _solve(nums, ops)
        if steps is None:
            continue
        question = " ".join([str(nums[0])] + [f"{op} {n}" for op, n in zip(ops, nums[1:])])
        lines = [f"{a} {op} {b} = {c}" for a, op, b, c in steps] + [f"#### {steps[-1][3]}"]
        answer = "\n".join(lines)
        if MIN_ANSWER_CHARS <= len(answer) <= MAX_ANSWER_CHARS:
            return question, answer


# ------------------------------------------------------------------------------------------ tokenizer

PAD, EOS, UNK = "<|pad|>", "<|end|>", "<|unk|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, EOS, UNK] + ROLE_TOKENS
# Every character the task uses, plus lowercase letters and some punctuation so that ordinary short text
# (e.g. a system prompt) still round-trips. Anything else maps to <|unk|>.
CHARS = list("0123456789+-*/=#()") + [" ", "\n"] + list("abcdefghijklmnopqrstuvwxyz") + list(".,:;?!'\"")

# "<|role|>\n" + content + "<|end|>\n" per message; the generation prompt is "<|assistant|>\n", so the
# prompt ids end exactly where the answer begins, and the model ends its answer with <|end|> (eos).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
MODEL_MAX_LENGTH = 512


def make_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """The character-level tokenizer (one token per character, special tokens first)."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate characters, no separator
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    # Role markers are special (never split into characters, skipped by decode(skip_special_tokens=True)).
    tok.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) == len(vocab), "special tokens must already be in the vocabulary"
    return tok


def _prompt_text(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def _prompt_ids(tok, question: str) -> list[int]:
    return tok.encode(_prompt_text(tok, question), add_special_tokens=False)


# ------------------------------------------------------------------------------------------- model

def _padded_vocab_size(n: int) -> int:
    """Strictly more than n and a multiple of 16 (free embedding slots, as in Qwen3's padded vocabulary)."""
    return (n // 16 + 1) * 16


def _make_model(tok) -> transformers.Qwen3ForCausalLM:
    config = transformers.Qwen3Config(
        vocab_size=_padded_vocab_size(len(tok)),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        initializer_range=0.02,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.pad_token_id,  # as in Qwen3, "bos" is the pad/end-of-text token; no bos is prepended
        eos_token_id=tok.eos_token_id,
    )
    model = transformers.Qwen3ForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=128,
    )
    return model


# ----------------------------------------------------------------------------------------- prompts

def _make_prompt_sets(seed: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Unique questions, test first, train disjoint from test. Deterministic given the seed."""
    rng = random.Random(f"toy-prompts-{seed}")
    seen: set[str] = set()
    sets: list[list[dict]] = []
    for n in (n_test, n_train):
        rows: list[dict] = []
        tries = 0
        while len(rows) < n:
            tries += 1
            if tries > 100 * (n + 10):
                raise RuntimeError(f"could not draw {n} distinct toy problems")
            q, a = make_problem(rng)
            if q not in seen:
                seen.add(q)
                rows.append({"question": q, "reference_answer": a})
        sets.append(rows)
    test, train = sets
    return train, test


def _write_jsonl(path: str, rows: list[dict]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------------- training

def _batch(tok, problems: list[tuple[str, str]], device) -> dict[str, torch.Tensor]:
    """Right-padded (prompt + answer + eos); labels only on answer + eos."""
    seqs, labels = [], []
    for q, a in problems:
        p = _prompt_ids(tok, q)
        ans = tok.encode(a, add_special_tokens=False) + [tok.eos_token_id]
        seqs.append(p + ans)
        labels.append([-100] * len(p) + ans)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
        mask[i, : len(s)] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": lab.to(device)}


def _batches(tok, rng: random.Random, exclude: set[str], batch_size: int, device):
    """Endless training batches of fresh problems (none of them a test question). Problems come in pools of
    POOL_BATCHES batches sorted by length, so a batch pads little; the batches of a pool are shuffled."""
    while True:
        pool = []
        while len(pool) < POOL_BATCHES * batch_size:
            q, a = make_problem(rng)
            if q not in exclude:
                pool.append((q, a))
        pool.sort(key=lambda qa: len(qa[0]) + len(qa[1]))
        batches = [pool[i: i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(batches)
        for problems in batches:
            yield _batch(tok, problems, device)


def _train(model, tok, *, seed: int, exclude: set[str], train_steps: int, batch_size: int, lr: float, warmup: int,
           device) -> tuple[int, float]:
    """AdamW with warmup, a constant rate, then a linear decay to 10 % over the last DECAY_SHARE of the steps. Returns
    (steps, last smoothed loss)."""
    from tqdm.auto import tqdm

    rng = random.Random(f"toy-train-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    ema = float("nan")
    decay_from = int((1 - DECAY_SHARE) * train_steps)
    bar = tqdm(total=train_steps, desc="toy target", unit="step", dynamic_ncols=True)
    for step, batch in zip(range(train_steps), _batches(tok, rng, exclude, batch_size, device)):
        scale = min(1.0, (step + 1) / warmup)
        if step >= decay_from:
            scale *= 0.1 + 0.9 * (train_steps - step) / (train_steps - decay_from)
        for g in opt.param_groups:
            g["lr"] = lr * scale
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        val = loss.item()
        ema = val if math.isnan(ema) else 0.9 * ema + 0.1 * val
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr * scale:.1e}")
    bar.close()
    model.eval()
    return train_steps, ema


@torch.no_grad()
def _generate_answers(model, tok, questions: list[str], *, max_new_tokens: int = 128,
                      batch_size: int = 64) -> list[tuple[str, bool]]:
    """Greedy answers (text, ended with eos), batched with left padding."""
    out = []
    old_side = tok.padding_side
    tok.padding_side = "left"
    try:
        for i in range(0, len(questions), batch_size):
            texts = [_prompt_text(tok, q) for q in questions[i : i + batch_size]]
            enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            for row in gen[:, enc["input_ids"].shape[1]:].tolist():
                ended = tok.eos_token_id in row
                if ended:
                    row = row[: row.index(tok.eos_token_id)]
                out.append((tok.decode(row, skip_special_tokens=True), ended))
    finally:
        tok.padding_side = old_side
    return out


def _final_number(answer: str) -> str | None:
    last = answer.strip().split("\n")[-1]
    return last[5:].strip() if last.startswith("#### ") else None


def evaluate(model, tok, rows: list[dict]) -> dict:
    """Exact match of greedy answers against the reference, final-number match, and share ending with eos."""
    answers = _generate_answers(model, tok, [r["question"] for r in rows])
    n = max(len(rows), 1)
    exact = sum(a == r["reference_answer"] for (a, _), r in zip(answers, rows))
    final = sum(_final_number(a) == _final_number(r["reference_answer"]) for (a, _), r in zip(answers, rows))
    ended = sum(e for _, e in answers)
    return {"n": len(rows), "exact_match": exact / n, "final_answer": final / n, "ends_with_eos": ended / n,
            "answers": [a for a, _ in answers]}


# -------------------------------------------------------------------------------------------- API

TRAIN_STEPS = 3000  # the toy target's optimizer steps: enough to solve its own problems (>= 90 % of held-out prompts)
BATCH_SIZE, LR, WARMUP, DECAY_SHARE = 16, 5e-3, 30, 0.3
POOL_BATCHES = 8  # batches drawn at once and sorted by length (little padding)
RECIPE = "toy.json"  # written into the target folder: how it was built


def _target_done(path: str) -> bool:
    return all(os.path.exists(os.path.join(path, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


def build_toy(out_dir: str, *, seed: int = 0, num_train_prompts: int = 2000, num_test_prompts: int = 200,
              train_steps: int = TRAIN_STEPS, device: str = "cpu", num_threads: int | None = None) -> dict:
    """Writes out_dir/target/ (a normal HF folder: AutoModelForCausalLM.from_pretrained and
    AutoTokenizer.from_pretrained both load it, with a chat template), out_dir/prompts-train.jsonl and
    out_dir/prompts-test.jsonl (one JSON object per line with a "question" field). Skips the work that is
    already there (rerun = instant). Returns {"target": path, "train": path, "test": path}. Prints where it
    wrote what.

    The prompt files depend only on ``seed`` and the two counts; the target on ``seed`` and ``train_steps``
    (recorded in target/toy.json). What exists is reused as is, and a target built with other settings is reused
    with a warning: delete the folder to rebuild. ``num_threads``, if given, is torch's CPU thread count while
    training and evaluating (restored afterwards).
    """
    out_dir = os.path.abspath(out_dir)
    paths = {"target": os.path.join(out_dir, "target"),
             "train": os.path.join(out_dir, "prompts-train.jsonl"),
             "test": os.path.join(out_dir, "prompts-test.jsonl")}
    os.makedirs(out_dir, exist_ok=True)

    if os.path.exists(paths["train"]) and os.path.exists(paths["test"]):
        print(f"[toy] prompts already there: {paths['train']}, {paths['test']}")
    else:
        train_rows, test_rows = _make_prompt_sets(seed, num_train_prompts, num_test_prompts)
        _write_jsonl(paths["test"], test_rows)
        _write_jsonl(paths["train"], train_rows)
        print(f"[toy] wrote {len(train_rows)} train prompts to {paths['train']}")
        print(f"[toy] wrote {len(test_rows)} test prompts to {paths['test']}")

    if _target_done(paths["target"]):
        recipe_path = os.path.join(paths["target"], RECIPE)
        recipe = json.load(open(recipe_path)) if os.path.exists(recipe_path) else {}
        wanted = {"seed": seed, "train_steps": train_steps}
        if {k: recipe.get(k) for k in wanted} != wanted:
            print(f"[toy] WARNING: reusing {paths['target']}, built with {recipe or 'unknown settings'}, not "
                  f"{wanted}: its numbers differ from RESULTS.md's. Delete {out_dir} to rebuild it.")
        else:
            print(f"[toy] target already there: {paths['target']}")
        return paths

    old_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        _build_target(paths, seed=seed, train_steps=train_steps, device=device)
    finally:
        torch.set_num_threads(old_threads)
    return paths


def _build_target(paths: dict, *, seed: int, train_steps: int, device: str) -> None:
    test_rows = _read_jsonl(paths["test"])
    tok = make_tokenizer()
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(seed)
        model = _make_model(tok).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[toy] training a {n_params / 1e6:.2f}M-parameter Qwen3 target from scratch ({train_steps} steps, "
              f"seed {seed}) on {device}")
        t0 = time.monotonic()
        steps, loss = _train(model, tok, seed=seed, exclude={r["question"] for r in test_rows},
                             train_steps=train_steps, batch_size=BATCH_SIZE, lr=LR, warmup=WARMUP, device=device)
    print(f"[toy] trained {steps} steps in {time.monotonic() - t0:.0f} s, final loss {loss:.4f}")

    recipe = {"seed": seed, "train_steps": train_steps, "final_loss": round(loss, 4),
              "train_seconds": round(time.monotonic() - t0), "threads": torch.get_num_threads(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if test_rows:  # every held-out prompt: the toy should solve its own problems (>= 90 % exact)
        t0 = time.monotonic()
        res = evaluate(model, tok, test_rows)
        recipe.update(test_exact_match=res["exact_match"], test_final_answer=res["final_answer"])
        print(f"[toy] greedy answers on {res['n']} held-out prompts: exact match {res['exact_match']:.1%}, "
              f"final answer {res['final_answer']:.1%}, ended with eos {res['ends_with_eos']:.0%} "
              f"({time.monotonic() - t0:.0f} s)")
        print(f"[toy] sample question: {test_rows[0]['question']}\n[toy] target answer:\n"
              f"{res['answers'][0]}\n[toy] reference answer:\n{test_rows[0]['reference_answer']}")

    tmp = paths["target"] + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.to("cpu").to(torch.float32).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, RECIPE), "w") as f:
        json.dump(recipe, f, indent=2)
    shutil.rmtree(paths["target"], ignore_errors=True)
    os.replace(tmp, paths["target"])
    print(f"[toy] wrote target model and tokenizer to {paths['target']}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description="Build the toy target model and prompt files.")
    ap.add_argument("--out", default="runs/toy", help="output folder (default: runs/toy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=TRAIN_STEPS, help=f"training steps (default: {TRAIN_STEPS})")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    return build_toy(args.out, seed=args.seed, train_steps=args.steps, num_threads=args.threads)


if __name__ == "__main__":
    main()
