"""The worked async trace in d3d.py, made by the code itself: asynchronous decoding at B = 4,
C = 2, F = 1 (cover="first"), greedy, a tiny target and a drafter whose logits follow a script,
so that its rounds show (i) a rejection branch used, (ii) a miss and (iii) a full-acceptance hit
with its pad.

    python tests/worked_trace.py            # print the trace
    python tests/worked_trace.py --write    # write it into d3d.py, between its marker lines

tests/test_trace.py checks that d3d.py holds this text, and what each round must do.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import d3d  # noqa: E402  (d3d.py lives one folder up)
import runtime  # noqa: E402
from systems import explain  # noqa: E402

# the spec's tiny models and tokenizer (odd sizes; 99 rows, 90 known tokens)
from test_d3d import TEXT_VOCAB, make_tokenizer, tiny_qwen3  # noqa: E402

D3D_PY = os.path.join(ROOT, "d3d.py")
BEGIN = "# >>> worked async trace"
END = "# <<< worked async trace"

BLOCK_SIZE = 4  # B
COVERAGE = 2  # C: rejection branches at i = 1, 2
FANOUT = 1  # F: one candidate token t per covered position
PROMPT = [18, 87, 71, 54, 8]  # x_0 .. x_4; the target's first token x_5 ends the prefill
MAX_NEW_TOKENS = 15  # x_5 .. x_19: the prefill's token, then rounds of 2, 3, 5 and 4 tokens

# The drafter's script, by the position it predicts, as an offset j from x_5 (j = 1: x_6). Every
# position is right (the target's token first, a wrong one second) except these two:
RUNNER_UP = {2}  # x_7: wrong, the target's token second (a rejection branch at i = 2 can hit)
WRONG = {5}  # x_10: wrong, and wrong second too (no branch could hit)

# What each round shows, in the order they run (the hand-written checks: tests/test_trace.py)
CASES = [
    "First, a rejection branch used: d_2 is rejected and the branch prepared for (i, t) = (2, t) "
    "becomes the next draft, with no drafting on the critical path.",
    "Second, a miss: d_3 is rejected, but C = 2 covers only i = 1, 2, so nothing was prepared "
    "for (3, t): the next round's draft is a fallback draft pass.",
    "Third, a full-acceptance hit: all four tokens are accepted and the full-acceptance block "
    "guessed the bonus token t; its other B - 1 rows and a pad are the next draft.",
    "The padded draft of the full-acceptance hit: three real tokens and a pad that is never "
    "accepted; the target's token for the pad's position (predicted at d_3's row) is the bonus. "
    "The budget is reached: "
    "decoding stops.",
]


class ScriptedDrafter(d3d.Drafter):
    """A real drafter (its passes run and its KV cache moves as usual) whose logits follow a script.

    Each row of a pass predicts one position q: a MASK at position p predicts q = p, any other token
    (x_n, a draft token, a branch's t) predicts the next one, q = p + 1. The row's logits are
    integers, 10 for its first choice and 5 for its second, so there are no near-ties:
    right:     first reference[q], second reference[q] + 1 (mod 90)
    RUNNER_UP: first reference[q] + 1, second reference[q]
    WRONG:     first reference[q] + 1, second reference[q] + 2"""

    def __init__(self, drafter: d3d.Drafter, reference: list[int]):
        super().__init__(drafter.model, drafter.d3d_config)
        self.reference = reference

    def choices(self, q: int) -> tuple[int, int]:
        """(first, second) choice for position q."""
        right = self.reference[q]
        wrong = (right + 1) % TEXT_VOCAB
        offset = q - len(PROMPT)
        if offset in RUNNER_UP:
            return wrong, right
        if offset in WRONG:
            return wrong, (right + 2) % TEXT_VOCAB
        return right, wrong

    def hidden_states(self, ids, positions, mask, cache=None):
        super().hidden_states(ids, positions, mask, cache)
        logits = torch.zeros(*ids.shape, self.d3d_config.target_vocab_size)
        is_mask = ids == self.d3d_config.mask_token_id
        for j in range(ids.shape[1]):
            q = int(positions[0, j]) + 1
            if is_mask[0, j]:
                q -= 1
            first, second = self.choices(min(q, len(self.reference) - 1))
            logits[0, j, second] = 5.0
            logits[0, j, first] = 10.0
        return logits  # "hidden states" that are already the scripted logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def models_for_trace():
    """(target, scripted drafter, prompt ids (1, 5), the target's greedy tokens x_0 .. x_24)."""
    target = tiny_qwen3(seed=4, init=2.0)
    prompt = torch.tensor([PROMPT])
    reference, _ = d3d.generate(
        target, None, prompt, max_new_tokens=MAX_NEW_TOKENS + 5, mode="target"
    )
    reference = reference[0].tolist()
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=9, init=0.02), tokenizer=make_tokenizer(), block_size=BLOCK_SIZE
    )
    return target, ScriptedDrafter(drafter, reference), prompt, reference


def run_trace():
    """The rounds (d3d.RoundInfo) of the scenario's async decode, its output and the reference."""
    target, drafter, prompt, reference = models_for_trace()
    rounds = []
    out, _ = d3d.generate(
        target,
        drafter,
        prompt,
        max_new_tokens=MAX_NEW_TOKENS,
        mode="async",
        block_size=BLOCK_SIZE,
        coverage=COVERAGE,
        fanout=FANOUT,
        cover="first",
        lanes=1,
        on_round=rounds.append,
    )
    return rounds, out[0].tolist(), reference


def trace_text() -> str:
    """The worked trace: setting, legend, then one paragraph per round."""
    rounds, output, reference = run_trace()
    n = len(PROMPT)
    tokens = " ".join(str(t) for t in reference[n : n + MAX_NEW_TOKENS])
    right_first = [n + j for j in sorted(RUNNER_UP)]
    wrong = [n + j for j in sorted(WRONG)]
    lines = [
        f"Asynchronous decoding at B = {BLOCK_SIZE}, C = {COVERAGE}, F = {FANOUT} "
        '(cover="first": i = 1, 2), greedy,',
        "made by tests/worked_trace.py (a tiny target, a drafter whose logits follow a script).",
        f"Prompt x_0 .. x_{n - 1} = {' '.join(str(t) for t in PROMPT)}; the target's prefill "
        f"says x_{n} = {reference[n]}.",
        f"The target's greedy x_{n} .. x_{n + MAX_NEW_TOKENS - 1} = {tokens}.",
        "The drafter is right at every position except "
        + ", ".join(f"x_{q} (runner-up right)" for q in right_first)
        + " and "
        + ", ".join(f"x_{q} (both choices wrong)" for q in wrong)
        + ".",
        "",
    ]
    # the symbols are d3d.py's (the module docstring's and the async section's); the words a
    # round's lines add:
    lines += [
        "hit: the round's outcome (a + 1, t) was prepared, and that block is the next draft;",
        "miss: it was not, and the next round drafts anew. A cache of length 7 holds x_0 .. x_6.",
    ]
    for info, case in zip(rounds, CASES):
        lines.append("")
        lines += textwrap.wrap(case, explain.WIDTH)
        over = info is rounds[-1]
        text = explain.describe_round(info, block_size=BLOCK_SIZE, over=over)
        lines += text.splitlines()
    if len(rounds) != len(CASES) or output != reference[: len(output)]:
        raise RuntimeError(
            f"the scenario ran {len(rounds)} rounds (want {len(CASES)}) or its output is not the "
            "target's greedy tokens: the async loop in d3d.py changed what a round does, or the "
            "script in tests/worked_trace.py no longer fits it"
        )
    return "\n".join(lines)


def as_comments(text: str) -> list[str]:
    """Each line of `text` as a comment line of d3d.py."""
    return [f"# {line}".rstrip() + "\n" for line in text.splitlines()]


def marked_span(lines: list[str]) -> tuple[int, int]:
    """Indices of d3d.py's two marker lines; a clear error if either is missing."""
    begin = [i for i, line in enumerate(lines) if line.startswith(BEGIN)]
    end = [i for i, line in enumerate(lines) if line.startswith(END)]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        raise runtime.UserError(
            f"d3d.py needs one line starting {BEGIN!r} and, after it, one starting {END!r}: "
            "put them where the worked trace belongs"
        )
    return begin[0], end[0]


def written_trace(path: str = D3D_PY) -> list[str]:
    """The comment lines between d3d.py's markers."""
    with open(path) as f:
        lines = f.readlines()
    begin, end = marked_span(lines)
    return lines[begin + 1 : end]


def write(path: str = D3D_PY) -> None:
    with open(path) as f:
        lines = f.readlines()
    begin, end = marked_span(lines)
    lines[begin + 1 : end] = as_comments(trace_text())
    with open(path, "w") as f:
        f.writelines(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write",
        action="store_true",
        help="write the trace into d3d.py between its marker lines (default: print it)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.write:
        write()
        print(f"wrote the worked trace into {D3D_PY}")
    else:
        print(trace_text())


if __name__ == "__main__":
    try:
        main()
    except runtime.UserError as error:
        sys.exit(f"error: {error}")
