"""The target's own answers to the training prompts, cached as token ids, and the batches made
of them.

Each prompt of a JSON Lines file goes through the target's chat template (thinking off unless
asked). The target answers greedily, and prompt and response token ids are appended to a JSON
Lines cache (a header naming the target and its tokenizer, then one line per prompt), so a
rerun or an interrupted run only answers what is missing. The toy ships its target's answers
(toy-target/, see toy.py), read as they are. collate makes training and evaluation batches of
(prompt, response) pairs.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import GenerationConfig

import runtime
from systems import batched, cli


def read_prompts(path: str, field: str) -> list[list[dict]]:
    """One chat (list of messages) per JSON line. `field` holds a string, a list of turns
    (the first is used: later turns follow the target's own reply, not written yet) or a
    list of {"role", "content"} messages."""
    chats = []
    expected = f'a JSON object with the prompt in "{field}"'
    rows = cli.read_jsonl("prompts file", path, expected)
    for n, row in enumerate(rows, 1):
        if field not in row:
            raise runtime.UserError(
                f"{path} row {n} has no field {field!r} (its fields: "
                f"{sorted(row)}) — name the prompt field with --prompt-field"
            )
        value = row[field]
        if isinstance(value, list) and value and isinstance(value[0], dict):
            # a chat that ends with the assistant's turn: the target writes that turn
            if value[-1].get("role") == "assistant":
                value = value[:-1]
            chats.append(value)
        elif isinstance(value, list) and value:
            chats.append([{"role": "user", "content": str(value[0])}])
        else:
            chats.append([{"role": "user", "content": str(value)}])
    return chats


def load_target(path: str, device, dtype=None):
    """The frozen target, in eval mode, loaded straight to the device in `dtype` (a
    function of its own so tests can count the calls)."""
    return runtime.load_causal_lm(path, dtype, device).eval()


def answers_header(target: str, tokenizer, max_new_tokens: int) -> dict:
    """The first line of an answers file: whose answers, in which tokenizer's ids, cut at how
    many tokens."""
    return {
        "answers_of": target,
        "tokenizer": runtime.tokenizer_fingerprint(tokenizer),
        "max_new_tokens": max_new_tokens,
    }


def _read_cache(paths: list[str], tokenizer) -> dict[int, tuple[list[int], list[int]]]:
    """{prompt index: (prompt ids, response ids)} from answers files; a file written in
    another tokenizer's ids is an error (its ids would mean other text)."""
    done = {}
    mine = runtime.tokenizer_fingerprint(tokenizer)
    for path in filter(os.path.exists, paths):
        with open(path) as f:
            for line in f:
                # a line cut by a kill is answered again
                if not line.endswith("\n"):
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise runtime.UserError(
                        f"{path}: a line is not JSON ({e.msg}) — delete the file to answer again"
                    ) from None
                if "answers_of" not in row:
                    done[row["i"]] = (row["prompt"], row["response"])
                elif row["tokenizer"] != mine:
                    raise runtime.UserError(
                        f"{path} holds the answers of {row['answers_of']} in the ids of a "
                        f"tokenizer with fingerprint {row['tokenizer']}, but this tokenizer's "
                        f"is {mine}: its ids would decode to other text. Use the target that "
                        "wrote it, or delete the file to answer again"
                    )
    return done


def cache_files(cache: str) -> list[str]:
    """An answers cache and its ranks' shares on disk (cache.rankR, written under DDP)."""
    return [cache] + sorted(glob.glob(glob.escape(cache) + ".rank*"))


class _Throughput:
    """A transformers streamer that shows the new tokens per second of the unfinished rows, at
    every step."""

    def __init__(self, bar, eos: set[int]):
        self.bar = bar
        self.eos = torch.tensor(sorted(eos))
        self.num_tokens = 0
        self.start = time.perf_counter()

    def put(self, tokens: torch.Tensor):
        # generate hands over the prompts first
        if tokens.dim() == 2:
            self.alive = torch.ones(tokens.shape[0], dtype=torch.bool)
            return
        self.num_tokens += int(self.alive.sum())
        self.alive &= ~torch.isin(tokens, self.eos)
        per_second = self.num_tokens / (time.perf_counter() - self.start)
        self.bar.set_postfix(tok_per_s=f"{per_second:.0f}", refresh=False)
        self.bar.update(0)  # redraws at most every bar.mininterval seconds

    def end(self):
        pass


@dataclass
class Answering:
    """How the target answers the prompts, and where: train.py's flags that shape its answers
    (train_args.json records them, so `train.py eval` and `prune` read the same cache), the
    folder of the answer caches, and the device and the process that run the target."""

    # the JSON field that holds the prompt (read_prompts)
    prompt_field: str = "question"
    # Qwen3's chat template: answer with thinking on
    thinking: bool = False
    # cap on an answer, tokens (part of the cache's name: another cap, another cache)
    max_new_tokens: int = 256
    # prompts answered together, in one generate call
    gen_batch_size: int = 64
    # the folder of the answer caches
    cache_dir: str = "."
    # where the target runs, and in which dtype (None: from_pretrained's default)
    device: str | torch.device = "cpu"
    dtype: torch.dtype | None = None
    # this process and the number of processes under DDP: each answers its share of the prompts
    rank: int = 0
    world: int = 1


@torch.no_grad()
def answer_prompts(
    target_path: str, tokenizer, prompt_ids: list[list[int]], cache: str, answering: Answering
) -> list[list[int]]:
    """The target's greedy response (token ids, ending with EOS when it stopped) to each
    prompt. Every finished batch is appended to `cache` (under DDP each rank answers its
    share into cache.rankR), so a rerun resumes."""
    done = _read_cache(cache_files(cache), tokenizer)
    missing = [i for i, p in enumerate(prompt_ids) if i not in done or done[i][0] != p]
    todo = missing[answering.rank :: answering.world]
    if todo:
        target = load_target(target_path, answering.device, answering.dtype)
        eos = target.generation_config.eos_token_id or tokenizer.eos_token_id
        if not isinstance(eos, (list, tuple)):
            eos = [eos]
        eos = set(eos)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(eos)
        # fresh: the checkpoint's sampling defaults do not apply
        gen_config = GenerationConfig(
            max_new_tokens=answering.max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
        )
        # similar lengths in a batch: little left padding
        todo.sort(key=lambda i: len(prompt_ids[i]))
        bar = tqdm(
            total=len(todo), desc="target answers", unit="prompt", disable=answering.rank > 0
        )
        throughput = _Throughput(bar, eos)
        mine = cache
        if answering.world != 1:
            mine = f"{cache}.rank{answering.rank}"
        # drop a line cut by a kill, or the next one would be glued to it
        if os.path.exists(mine):
            with open(mine, "rb+") as f:
                f.truncate(f.read().rfind(b"\n") + 1)
        with open(mine, "a") as f:
            if f.tell() == 0:
                header = answers_header(target_path, tokenizer, answering.max_new_tokens)
                f.write(json.dumps(header) + "\n")
            for s in range(0, len(todo), answering.gen_batch_size):
                idx = todo[s : s + answering.gen_batch_size]
                # left padding: every prompt ends where its answer begins
                ids, real = batched.left_pad([prompt_ids[i] for i in idx], answering.device)
                out = target.generate(
                    input_ids=ids,
                    attention_mask=real.long(),
                    generation_config=gen_config,
                    streamer=throughput,
                )[:, ids.shape[1] :].tolist()
                for i, response in zip(idx, out):
                    stop = next((k for k, t in enumerate(response) if t in eos), None)
                    # keep EOS, drop padding
                    if stop is not None:
                        response = response[: stop + 1]
                    row = {"i": i, "prompt": prompt_ids[i], "response": response}
                    f.write(json.dumps(row) + "\n")
                f.flush()
                bar.update(len(idx))
        bar.close()
        del target
    if answering.world > 1:
        dist.barrier()  # every rank's share is on disk
    done = _read_cache(cache_files(cache), tokenizer)
    return [done[i][1] for i in range(len(prompt_ids))]


def load_data(
    target: str, tokenizer, prompts: str, answering: Answering, num_prompts=None, answers=None
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) for the first `num_prompts` prompts (None: all) of a JSON
    Lines file, answered by the target; `answers`: a file of the target's answers to these
    prompts (the toy's), read as it is, never written."""
    chats = read_prompts(prompts, answering.prompt_field)[:num_prompts]
    texts = [
        tokenizer.apply_chat_template(
            c, tokenize=False, add_generation_prompt=True, enable_thinking=answering.thinking
        )
        for c in chats
    ]
    # the template has the special tokens
    prompt_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    if answers is not None:
        done = _read_cache([answers], tokenizer)
        for i, p in enumerate(prompt_ids):
            if i not in done or done[i][0] != p:
                why = "its prompt ids differ"
                if i not in done:
                    why = "no answer"
                raise runtime.UserError(
                    f"{answers} does not answer line {i + 1} of {prompts} ({why}): the answers "
                    "belong to other prompts, another chat template or another tokenizer"
                )
        return [(p, done[i][1]) for i, p in enumerate(prompt_ids)]
    # the cache belongs to one target and one generation setting; the prompts are checked
    # line by line
    target_name = target
    if os.path.exists(target):
        target_name = os.path.abspath(target)
    fingerprint = runtime.tokenizer_fingerprint(tokenizer)
    key = json.dumps([target_name, fingerprint, answering.max_new_tokens])
    name = os.path.splitext(os.path.basename(prompts))[0]
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    cache = os.path.join(answering.cache_dir, f"answers-{name}-{digest}.jsonl")
    os.makedirs(answering.cache_dir, exist_ok=True)
    responses = answer_prompts(target, tokenizer, prompt_ids, cache, answering)
    if answering.rank == 0:
        print(f"[data] {len(chats)} answers of the target to {prompts} in {cache}")
    return list(zip(prompt_ids, responses))


def collate(examples, pad_id: int, max_len: int):
    """Right-padded input_ids (b, L) and loss_mask (b, L): True on response tokens only (not
    prompt, not padding)."""
    seqs = [(p + r)[:max_len] for p, r in examples]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for row, ((prompt, _), seq) in enumerate(zip(examples, seqs)):
        input_ids[row, : len(seq)] = torch.tensor(seq)
        loss_mask[row, len(prompt) : len(seq)] = True
    return input_ids, loss_mask
