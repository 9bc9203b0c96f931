"""The greedy check's forensics: where a greedy output leaves target-only decoding's
(first_difference, divergence), and whether the target's own logits call that rounding at a
near-tie or an error (tie_tolerance, classify_divergence); greedy_check's summary line, and
tally's counts for the JSON."""

from __future__ import annotations

import collections

import torch

# the greedy check's rounding allowance: see tie_tolerance
TIE_EPS_MULTIPLE = 8
TIE_EPS_FLOOR = 2.0**-16


# ---------------------------------------------------------------------------------------------
# Greedy check: rounding at near-ties or an error


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """Index of the first differing token (None if equal; the shorter length if one output is a
    prefix of the other)."""
    if reference == other:
        return None
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return min(len(reference), len(other))


def tie_tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest logit margin that rounding can flip at one position: 8 x eps x the largest
    |logit| there, with eps = max(the dtype's machine epsilon, 2^-16).

    Why: passes that share a prefix but not a shape (1 row in target-only decoding, B+1 in
    verification, the whole sequence in the check's pass) round differently, and each logit
    carries an error relative to the logits' scale. In bf16/fp16 the final rounding of the
    logits dominates; in fp32 the error accumulated over the layers does, about 1e-6 relative,
    far above fp32's epsilon (hence the 2^-16 floor). Measured on SmolLM2-135M-Instruct (3
    prompts x 96 tokens, 1-row vs 9-row vs whole-sequence passes), the top-two margin moved by
    at most 2.4 (bf16) and 1.7 (fp16) times the dtype's epsilon x max|logit|, and by 1.1e-6 x
    max|logit| (9.4 fp32 epsilons) in fp32: the tolerance leaves 3x headroom in bf16 and 100x in
    fp32. A margin beyond it is a difference in what was computed (a wrong cache, position or
    token), not rounding. At max|logit| 20: bf16 1.25 logits, fp32 2.4e-3."""
    eps = max(torch.finfo(dtype).eps, TIE_EPS_FLOOR)
    return TIE_EPS_MULTIPLE * eps * logits.abs().max().item()


@torch.no_grad()
def classify_divergence(
    target, ids: torch.Tensor, reference: list[int], other: list[int], tolerance=None
) -> dict:
    """Class of a greedy output that leaves target-only's (at new token `position`,
    first_difference): one teacher-forced target pass over prompt + the shared tokens gives the
    target's margin there, logit(target-only token) - logit(other token). "near-tie" if |margin|
    <= tolerance (tie_tolerance unless given), else "error"; an output that is a strict prefix of
    the other (no token to compare) is an error."""
    position = first_difference(reference, other)
    if position >= min(len(reference), len(other)):
        return {
            "class": "error",
            "margin": None,
            "tolerance": tolerance,
            "reason": "outputs differ in length only",
        }
    prefix = torch.tensor([reference[:position]], dtype=ids.dtype, device=ids.device)
    logits = target(input_ids=torch.cat([ids, prefix], 1), logits_to_keep=1).logits[0, -1]
    if tolerance is None:
        # the weights' precision
        tolerance = tie_tolerance(logits, target.dtype)
    logits = logits.float()
    margin = (logits[reference[position]] - logits[other[position]]).item()
    found = "error"
    if abs(margin) <= tolerance:
        found = "near-tie"
    return {
        "class": found,
        "margin": margin,
        "tolerance": tolerance,
        "max_abs_logit": logits.abs().max().item(),
    }


def divergence(models, ids: torch.Tensor, reference: list[int], other: list[int], run, **where):
    """None if a greedy output equals target-only's, else where it leaves it (tokens shown) and
    its class. models: the run's decoding.Models (its target and tokenizer); run: the run's
    decoding.Run (its temperature, and tie_tolerance if given)."""
    pos = first_difference(reference, other)
    if run.config.temperature or pos is None:
        return None
    show = []
    for tokens in (reference, other):
        if pos < len(tokens):
            show.append({"id": tokens[pos], "text": models.tokenizer.decode(tokens[pos : pos + 1])})
        else:
            show.append("end of output")
    return {
        **where,
        "position": pos,
        "target_token": show[0],
        "mode_token": show[1],
        **classify_divergence(models.target, ids, reference, other, run.tie_tolerance),
    }


def greedy_check(divergences: list[dict], checked: int, against: str = "target-only") -> str:
    """The summary line of the greedy check, then the first error if any."""
    ties = [d for d in divergences if d["class"] == "near-tie"]
    errors = [d for d in divergences if d["class"] == "error"]
    largest = ""
    if ties:
        largest = f" (largest margin {max(abs(d['margin']) for d in ties):.3g})"
    text = (
        f"greedy check: identical {checked - len(divergences)}, near-tie divergences "
        f"{len(ties)}{largest}, errors {len(errors)} (of {checked} outputs against {against})"
    )
    if errors:
        x = errors[0]
        if x["margin"] is None:
            margin = x["reason"]
        else:
            margin = f"margin {x['margin']:.3g} > tolerance {x['tolerance']:.3g}"
        text += (
            f"\n  first error: {x['dataset']} prompt {x['prompt_index']}, {x['mode']}, "
            f"new token {x['position']}: target {x['target_token']} vs {x['mode']} "
            f"{x['mode_token']}, {margin}"
        )
    return text


def tally(divergences: list[dict], checked: int) -> dict:
    """The greedy check's counts as the benchmark JSON keeps them, with every divergence."""
    counts = collections.Counter(d["class"] for d in divergences)
    return {
        "count": len(divergences),
        "checked": checked,
        "identical": checked - len(divergences),
        "near_ties": counts["near-tie"],
        "errors": counts["error"],
        "list": divergences,
    }
