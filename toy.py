"""Built-in toy setting: a tiny target LM that learns step-by-step arithmetic.

This is scaffolding, not the D3D method. The repository ships one toy, built once, in
``toy-target/``, so that ``python train.py`` starts at the drafter, and every machine trains
it on the same target and the same answers:

* the target: a normal Hugging Face folder (a 0.8M-parameter ``Qwen3ForCausalLM``,
  safetensors, and a character-level tokenizer with a chat template), loadable with
  ``AutoModelForCausalLM`` / ``AutoTokenizer``;
* ``prompts-train.jsonl`` / ``prompts-test.jsonl``: 2,000 training and 200 held-out prompts,
  disjoint;
* ``answers-train.jsonl`` / ``answers-test.jsonl``: the target's own greedy answers to them,
  as token ids (the answers file train.py reads: a header line, then
  ``{"i", "prompt", "response"}`` per prompt);
* ``toy.json``: the recipe, the CPU capability and float-order settings it was built under,
  its held-out accuracy, its fingerprint (sha256 of the weights, the tokenizer's
  fingerprint) and the sha256 of the four data files. :func:`open_toy` checks every file
  against it.

Each prompt line is ``{"question": "7 * 6 + 8 - 5", "reference_answer": "..."}``. The
reference answer is the exact, correct solution; the drafter learns from the *target's*
answers, not from it.

The task, e.g. question ``7 * 6 + 8 - 5`` and answer::

    7 * 6 = 42
    42 + 8 = 50
    50 - 5 = 45
    #### 45

2 to 4 operations, one per line, each line starting with the previous result. At most one
``*``, and it comes first (a times table: 2..12 by 2..9), so the usual precedence and left to
right agree; otherwise the first number is 1..50. + and - operands are 1..9; no intermediate
value is below 0 or above 999; answers have 30 to 80 characters (43 on average).

Command line: ``python toy.py [--out runs/toy-target] [--seed 0] [--steps 3000]
[--threads 1]`` builds a toy of the same layout into ``runs/`` (never over ``toy-target/``)
and says how its target compares with the repository's.

The target trains from fixed seeds until it solves its own problems (TRAIN_STEPS = 3000
steps of 16 problems). Float order differs between CPUs and thread counts, so no two
machines build bit-equal targets from the same seeds: a rebuilt target may solve another
share of its problems and answer near-ties otherwise, and a drafter cut from it reaches
another tau. That is why the toy is shipped rather than rebuilt.

On a CPU shared with other busy processes, training with as many torch threads as cores can
be many times slower than with one thread (threads wait on each other); hence one thread by
default.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tqdm.auto import tqdm

import runtime
from systems import batched, cli

# --------------------------------------------------------------------------------------------- task

MIN_OPS = 2  # operations per problem
MAX_OPS = 4
FIRST_RANGE = (1, 50)  # the first number, when the first operation is + or -
TIMES_RANGE = (2, 12)  # the first number, when the first operation is *: a times table
ADD_RANGE = (1, 9)  # operands of + and -
MUL_RANGE = (2, 9)  # right operand of *
P_MUL = 0.4  # chance that the first operation is * (no other may be)
MAX_VALUE = 999  # no intermediate value above this (and none below 0)
MIN_ANSWER_CHARS = 30  # the length of an answer, in characters
MAX_ANSWER_CHARS = 80


def _solve(nums: list[int], ops: list[str]) -> list[tuple[int, str, int, int]] | None:
    """Steps (a, op, b, result), left to right, or None if a value leaves [0, MAX_VALUE].

    Left to right is the usual precedence here because every * comes before every + and -."""
    steps = []
    acc = nums[0]
    for op, b in zip(ops, nums[1:]):
        if op == "*":
            c = acc * b
        elif op == "+":
            c = acc + b
        else:
            c = acc - b
        if not 0 <= c <= MAX_VALUE:
            return None
        steps.append((acc, op, b, c))
        acc = c
    return steps


def make_problem(rng: random.Random) -> tuple[str, str]:
    """One random problem: (question, reference step-by-step answer). Deterministic given
    the rng state.

    A multiplication only leads the expression ("7 * 3 + 5 - 4"), so the steps go left to
    right and each line starts with the previous result: easy for a tiny model to follow,
    and still ordinary arithmetic."""
    while True:
        # the first operation: * with chance P_MUL, else + or -; then + or - only
        if rng.random() < P_MUL:
            ops = ["*"]
        else:
            ops = [rng.choice("+-")]
        num_ops = rng.randint(MIN_OPS, MAX_OPS)
        ops += [rng.choice("+-") for _ in range(num_ops - 1)]
        first_range = TIMES_RANGE if ops[0] == "*" else FIRST_RANGE
        nums = [rng.randint(*first_range)]
        # each operation's right operand
        nums += [rng.randint(*(MUL_RANGE if op == "*" else ADD_RANGE)) for op in ops]
        steps = _solve(nums, ops)
        if steps is None:
            continue
        question = " ".join([str(nums[0])] + [f"{op} {n}" for op, n in zip(ops, nums[1:])])
        lines = [f"{a} {op} {b} = {c}" for a, op, b, c in steps] + [f"#### {steps[-1][3]}"]
        answer = "\n".join(lines)
        if MIN_ANSWER_CHARS <= len(answer) <= MAX_ANSWER_CHARS:
            return question, answer


# ---------------------------------------------------------------------------------------- tokenizer

PAD = "<|pad|>"
EOS = "<|end|>"
UNK = "<|unk|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, EOS, UNK] + ROLE_TOKENS
# Every character the task uses, plus lowercase letters and some punctuation so that
# ordinary short text (e.g. a system prompt) still round-trips. Anything else maps to <|unk|>.
CHARS = (
    list("0123456789+-*/=#()")
    + [" ", "\n"]
    + list("abcdefghijklmnopqrstuvwxyz")
    + list(".,:;?!'\"")
)

# "<|role|>\n" + content + "<|end|>\n" per message; the generation prompt is
# "<|assistant|>\n", so the prompt ids end exactly where the answer begins, and the model ends
# its answer with <|end|> (eos).
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
    # Role markers are special (never split into characters, skipped by
    # decode(skip_special_tokens=True)).
    tok.add_special_tokens({"additional_special_tokens": ROLE_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    assert len(tok) == len(vocab), "special tokens must already be in the vocabulary"
    return tok


def _prompt_text(tok, question: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def _prompt_ids(tok, question: str) -> list[int]:
    return tok.encode(_prompt_text(tok, question), add_special_tokens=False)


# -------------------------------------------------------------------------------------------- model


def _padded_vocab_size(n: int) -> int:
    """Strictly more than n and a multiple of 16 (free embedding slots, as in Qwen3's padded
    vocabulary)."""
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
        # as in Qwen3, "bos" is the pad/end-of-text token; no bos is prepended
        bos_token_id=tok.pad_token_id,
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


# ------------------------------------------------------------------------------------------ prompts


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


# ----------------------------------------------------------------------------------------- training


def _batch(tok, problems: list[tuple[str, str]], device) -> dict[str, torch.Tensor]:
    """Right-padded (prompt + answer + eos); labels only on answer + eos."""
    seqs = []
    labels = []
    for q, a in problems:
        p = _prompt_ids(tok, q)
        ans = tok.encode(a, add_special_tokens=False) + [tok.eos_token_id]
        seqs.append(p + ans)
        labels.append([-100] * len(p) + ans)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (seq, seq_labels) in enumerate(zip(seqs, labels)):
        ids[i, : len(seq)] = torch.tensor(seq)
        lab[i, : len(seq_labels)] = torch.tensor(seq_labels)
        mask[i, : len(seq)] = 1
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "labels": lab.to(device),
    }


def _problem_length(problem: tuple[str, str]) -> int:
    """Characters in a problem's question and answer together."""
    question, answer = problem
    return len(question) + len(answer)


def _batches(tok, rng: random.Random, exclude: set[str], batch_size: int, device):
    """Endless training batches of fresh problems (none of them a test question). Problems
    come in pools of POOL_BATCHES batches sorted by length, so a batch pads little; the
    batches of a pool are shuffled."""
    while True:
        pool = []
        while len(pool) < POOL_BATCHES * batch_size:
            q, a = make_problem(rng)
            if q not in exclude:
                pool.append((q, a))
        pool.sort(key=_problem_length)
        batches = [pool[i : i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(batches)
        for problems in batches:
            yield _batch(tok, problems, device)


def _lr_scale(step: int, train_steps: int, warmup: int) -> float:
    """The learning rate at `step`, as a share of the peak: (1) a linear warmup over `warmup`
    steps; (2) the peak; (3) over the last DECAY_SHARE of the steps, a linear decay to 10 %."""
    scale = min(1.0, (step + 1) / warmup)
    decay_from = int((1 - DECAY_SHARE) * train_steps)
    if step >= decay_from:
        scale *= 0.1 + 0.9 * (train_steps - step) / (train_steps - decay_from)
    return scale


def _train(
    model,
    tok,
    *,
    seed: int,
    exclude: set[str],
    train_steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    device,
) -> tuple[int, float]:
    """AdamW with warmup, a constant rate, then a linear decay to 10 % over the last
    DECAY_SHARE of the steps (_lr_scale). Returns (steps, last smoothed loss)."""
    rng = random.Random(f"toy-train-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    model.train()
    ema = float("nan")
    bar = tqdm(total=train_steps, desc="toy target", unit="step", dynamic_ncols=True)
    batches = _batches(tok, rng, exclude, batch_size, device)
    for step, batch in zip(range(train_steps), batches):
        scale = _lr_scale(step, train_steps, warmup)
        for g in opt.param_groups:
            g["lr"] = lr * scale
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        val = loss.item()
        if math.isnan(ema):
            ema = val
        else:
            ema = 0.9 * ema + 0.1 * val
        bar.update(1)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr * scale:.1e}")
    bar.close()
    model.eval()
    return train_steps, ema


# ------------------------------------------------------------------------------------------ answers

MAX_NEW_TOKENS = 128  # every toy answer ends well before this (at most 80 characters and EOS)


@torch.no_grad()
def answer_ids(
    model,
    tok,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = 64,
    desc: str = "target answers",
) -> list[list[int]]:
    """The target's greedy response to each prompt, as token ids ending with EOS where it
    stopped. Batches of similar lengths, left-padded, so that every prompt ends where its
    answer begins."""
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    out: list[list[int]] = [[] for _ in prompt_ids]
    starts = range(0, len(order), batch_size)
    for s in tqdm(starts, desc=desc, unit="batch", dynamic_ncols=True):
        idx = order[s : s + batch_size]
        ids, real = batched.left_pad([prompt_ids[i] for i in idx], model.device)
        gen = model.generate(
            input_ids=ids,
            attention_mask=real.long(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        for i, row in zip(idx, gen[:, ids.shape[1] :].tolist()):
            if tok.eos_token_id in row:
                row = row[: row.index(tok.eos_token_id) + 1]
            out[i] = row
    return out


def _final_number(answer: str) -> str | None:
    """The number after "#### " on an answer's last line; None if there is none."""
    last = answer.strip().split("\n")[-1]
    if not last.startswith("#### "):
        return None
    return last[5:].strip()


def score(tok, rows: list[dict], responses: list[list[int]]) -> dict:
    """Exact match of the answers against the references, final-number match, and the share
    ending with EOS."""
    texts = []
    for response in responses:
        without_eos = [t for t in response if t != tok.eos_token_id]
        texts.append(tok.decode(without_eos, skip_special_tokens=True))
    references = [r["reference_answer"] for r in rows]
    n = max(len(rows), 1)
    exact = sum(a == ref for a, ref in zip(texts, references))
    final = sum(_final_number(a) == _final_number(ref) for a, ref in zip(texts, references))
    ended = sum(tok.eos_token_id in r for r in responses)
    return {
        "n": len(rows),
        "exact_match": exact / n,
        "final_answer": final / n,
        "ends_with_eos": ended / n,
        "answers": texts,
    }


def evaluate(model, tok, rows: list[dict]) -> dict:
    """Greedy answers to the rows' questions, scored against their reference answers (see
    `score`)."""
    prompt_ids = [_prompt_ids(tok, r["question"]) for r in rows]
    return score(tok, rows, answer_ids(model, tok, prompt_ids))


def write_answers(
    path: str, header: dict, prompt_ids: list[list[int]], responses: list[list[int]]
) -> None:
    """An answers file, the format train.py reads and caches: a header line naming the
    target, the tokenizer's fingerprint and the generation limit, then one line per prompt:
    {"i", "prompt", "response"} as token ids."""
    rows = [header]
    for i, (p, r) in enumerate(zip(prompt_ids, responses)):
        rows.append({"i": i, "prompt": p, "response": r})
    _write_jsonl(path, rows)


# ---------------------------------------------------------------------------------------------- API

# the toy target's optimizer steps: enough to solve its own problems (>= 90 % of held-out
# prompts)
TRAIN_STEPS = 3000
BATCH_SIZE = 16  # problems per step
LR = 5e-3  # the peak learning rate
WARMUP = 30  # steps of linear warmup
DECAY_SHARE = 0.3  # the last share of the steps, a linear decay to 10 % of LR
POOL_BATCHES = 8  # batches drawn at once and sorted by length (little padding)
# in every toy folder: how it was built, how well it answers, and the fingerprints of its
# files; systems/cli.py checks every folder that holds one against it (cli.check_toy)
RECIPE = cli.TOY_RECIPE
# the toy in the repository
SHIPPED = cli.TOY_TARGET
DEFAULT_OUT = "runs/toy-target"  # where `python toy.py` builds one
DATA_FILES = cli.TOY_FILES
FLOAT_ORDER_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def toy_paths(folder: str) -> dict:
    """{"target": the HF folder, "train"/"test": the prompt files,
    "train_answers"/"test_answers": the target's answers to them}: all in one folder."""
    folder = os.path.abspath(folder)
    paths = {"target": folder}
    for key, name in DATA_FILES.items():
        paths[key] = os.path.join(folder, name)
    return paths


def read_recipe(folder: str) -> dict:
    """The toy folder's toy.json; a UserError if it is missing or not JSON."""
    path = os.path.join(folder, RECIPE)
    if not os.path.isfile(path):
        raise runtime.UserError(
            f"no toy at {folder} ({RECIPE} is missing): `python toy.py --out {folder}` builds "
            f"one; the repository's toy is {SHIPPED}"
        )
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise runtime.UserError(
            f"{path} is not valid JSON ({e.msg}) — restore it, or rebuild the "
            "toy with `python toy.py --out FOLDER`"
        ) from None


def open_toy(folder: str = SHIPPED) -> dict:
    """The paths of a finished toy folder (see `toy_paths`), after checking every file
    against its toy.json (cli.check_toy): the weights and tokenizer against the recorded
    fingerprint, the prompt and answer files against their sha256. A file that does not
    match is an error, never a silently different toy."""
    folder = os.path.abspath(folder)
    recipe = read_recipe(folder)
    cli.check_toy("--toy", folder, recipe)
    return toy_paths(folder)


def build_toy(
    out_dir: str = DEFAULT_OUT,
    *,
    seed: int = 0,
    num_train_prompts: int = 2000,
    num_test_prompts: int = 200,
    train_steps: int = TRAIN_STEPS,
    device: str = "cpu",
    num_threads: int | None = None,
) -> dict:
    """Builds a toy folder (see `toy_paths`): a normal HF folder (AutoModelForCausalLM and
    AutoTokenizer both load it, with a chat template) holding also the prompt files, the
    target's greedy answers to them and toy.json. Skips what is already there (rerun =
    instant; an interrupted build resumes after the training). Returns the paths; prints
    where it wrote what and how the target compares with the repository's.

    The prompt files depend only on ``seed`` and the two counts; the target on ``seed``,
    ``train_steps`` and the float order of the CPU (recorded in toy.json). A finished toy
    built with other settings is reused with a warning: delete the folder to rebuild.
    ``num_threads``, if given, is torch's CPU thread count meanwhile (restored afterwards).
    Never writes over the repository's toy."""
    out_dir = os.path.abspath(out_dir)
    if os.path.realpath(out_dir) == os.path.realpath(SHIPPED):
        raise ValueError(
            f"{out_dir} is the repository's toy, built once and kept as it is; build into "
            f"another folder (default {DEFAULT_OUT})"
        )
    paths = toy_paths(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    recipe = {}
    if os.path.isfile(os.path.join(out_dir, RECIPE)):
        recipe = read_recipe(out_dir)
    if "files" in recipe:
        wanted = {"seed": seed, "train_steps": train_steps}
        built = {k: recipe.get(k) for k in wanted}
        if built != wanted:
            print(
                f"[toy] WARNING: reusing {out_dir}, built with {built}, not {wanted}. "
                "Delete it to rebuild."
            )
        else:
            print(f"[toy] already there: {out_dir}")
        return paths

    if os.path.exists(paths["train"]) and os.path.exists(paths["test"]):
        print(f"[toy] prompts already there: {paths['train']}, {paths['test']}")
    else:
        train_rows, test_rows = _make_prompt_sets(seed, num_train_prompts, num_test_prompts)
        _write_jsonl(paths["test"], test_rows)
        _write_jsonl(paths["train"], train_rows)
        print(
            f"[toy] wrote {len(train_rows)} train prompts to {paths['train']}\n"
            f"[toy] wrote {len(test_rows)} test prompts to {paths['test']}"
        )
    old_threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        if not recipe:
            recipe = _build_target(paths, seed=seed, train_steps=train_steps, device=device)
        finish_toy(out_dir, recipe, device=device)
    finally:
        torch.set_num_threads(old_threads)
    compare_with_shipped(out_dir)
    return paths


def _build_target(paths: dict, *, seed: int, train_steps: int, device: str) -> dict:
    """Trains the target and saves it with its tokenizer and a first toy.json (the
    training's record)."""
    test_rows = _read_jsonl(paths["test"])
    tok = make_tokenizer()
    # leave the caller's RNG state alone
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _make_model(tok).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"[toy] training a {n_params / 1e6:.2f}M-parameter Qwen3 target from scratch "
            f"({train_steps} steps, seed {seed}) on {device}"
        )
        t0 = time.monotonic()
        steps, loss = _train(
            model,
            tok,
            seed=seed,
            exclude={r["question"] for r in test_rows},
            train_steps=train_steps,
            batch_size=BATCH_SIZE,
            lr=LR,
            warmup=WARMUP,
            device=device,
        )
    print(f"[toy] trained {steps} steps in {time.monotonic() - t0:.0f} s, final loss {loss:.4f}")
    recipe = {
        "seed": seed,
        "train_steps": train_steps,
        "final_loss": round(loss, 4),
        "train_seconds": round(time.monotonic() - t0),
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "float_order_env": {k: os.environ[k] for k in FLOAT_ORDER_ENV if k in os.environ},
        "torch": torch.__version__.split("+")[0],
    }
    model.to("cpu").to(torch.float32).save_pretrained(paths["target"])
    tok.save_pretrained(paths["target"])
    _write_json(os.path.join(paths["target"], RECIPE), recipe)
    print(f"[toy] wrote the target model and tokenizer to {paths['target']}")
    return recipe


def finish_toy(folder: str, recipe: dict, device: str = "cpu") -> dict:
    """The target in `folder` answers its prompt files (greedy, batched); its held-out
    accuracy, the fingerprints and the files' sha256 go into toy.json, which then marks the
    toy finished. Returns the recipe."""
    paths = toy_paths(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = model.to(device).eval()
    recipe = dict(recipe)
    recipe["fingerprint"] = cli.fingerprint(folder, tok)
    recipe["max_new_tokens"] = MAX_NEW_TOKENS
    weights = recipe["fingerprint"]["weights_sha256"]
    header = {
        "answers_of": f"toy target {weights[:16]}",
        "tokenizer": recipe["fingerprint"]["tokenizer"],
        "max_new_tokens": MAX_NEW_TOKENS,
    }
    t0 = time.monotonic()
    for split in ("test", "train"):
        rows = _read_jsonl(paths[split])
        prompt_ids = [_prompt_ids(tok, r["question"]) for r in rows]
        responses = answer_ids(model, tok, prompt_ids, desc=f"target answers ({split})")
        write_answers(paths[f"{split}_answers"], header, prompt_ids, responses)
        res = score(tok, rows, responses)
        recipe[f"{split}_exact_match"] = res["exact_match"]
        recipe[f"{split}_final_answer"] = res["final_answer"]
        print(
            f"[toy] greedy answers to {res['n']} {split} prompts: exact match "
            f"{res['exact_match']:.1%}, final answer {res['final_answer']:.1%}, ended with EOS "
            f"{res['ends_with_eos']:.0%} -> {paths[f'{split}_answers']}"
        )
        if split == "test" and rows:
            print(
                f"[toy] sample question: {rows[0]['question']}\n"
                f"[toy] target answer:\n{res['answers'][0]}\n"
                f"[toy] reference answer:\n{rows[0]['reference_answer']}"
            )
    recipe["answer_seconds"] = round(time.monotonic() - t0)
    recipe["files"] = {}
    for name in DATA_FILES.values():
        recipe["files"][name] = cli.sha256_file(os.path.join(folder, name))
    _write_json(os.path.join(folder, RECIPE), recipe)
    print(f"[toy] finished {folder} ({RECIPE}: recipe, accuracy, fingerprints)")
    return recipe


def compare_with_shipped(folder: str) -> dict | None:
    """How a built toy compares with the repository's: held-out accuracy, fingerprints, and
    the share of prompts the two targets answer alike (where their prompt files agree).
    Printed; None if the repository's toy is absent."""
    if not os.path.isfile(os.path.join(SHIPPED, RECIPE)):
        return None
    if os.path.realpath(folder) == os.path.realpath(SHIPPED):
        return None
    mine = read_recipe(folder)
    shipped = read_recipe(SHIPPED)
    result = {
        "exact_match": (mine.get("test_exact_match"), shipped.get("test_exact_match")),
        "same_weights": mine["fingerprint"] == shipped["fingerprint"],
    }
    if result["same_weights"]:
        weights = "identical"
    else:
        weights = "differ"
    print(
        f"[toy] against the repository's toy ({SHIPPED}, built under "
        f"{shipped.get('cpu_capability')}): held-out problems solved "
        f"{mine.get('test_exact_match', 0):.1%} here, "
        f"{shipped.get('test_exact_match', 0):.1%} there; weights {weights}"
    )
    for split in ("test", "train"):
        rows_a = _read_jsonl(toy_paths(folder)[f"{split}_answers"])[1:]
        rows_b = _read_jsonl(toy_paths(SHIPPED)[f"{split}_answers"])[1:]
        if [r["prompt"] for r in rows_a] != [r["prompt"] for r in rows_b]:
            print(f"[toy] {split} prompts differ from the repository's: answers not compared")
            continue
        same = sum(x["response"] == y["response"] for x, y in zip(rows_a, rows_b))
        result[f"{split}_same_answers"] = (same, len(rows_a))
        print(
            f"[toy] {split}: {same} of {len(rows_a)} answers identical to the repository's target's"
        )
    return result


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description="Build a toy target (the repository ships one, toy-target/): prompts, a "
        "target trained from scratch, its answers, toy.json."
    )
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--steps", type=int, default=TRAIN_STEPS, help=f"training steps (default: {TRAIN_STEPS})"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default: 1, as the repository's toy was built)",
    )
    args = ap.parse_args(argv)
    return build_toy(args.out, seed=args.seed, train_steps=args.steps, num_threads=args.threads)


if __name__ == "__main__":
    main()
