"""plan_branches, wrong: the candidates are the drafter's F likeliest tokens at k, d_k among
them. "The target said d_k" is never an outcome (d_k would have been accepted), so a slot of
every position's budget is wasted, and the runner-up the target does say often has no
branch: fewer hits (test_async_equals_sync_and_target counts them too).
"""

EXERCISE = "plan_branches"
RIGHT = False
FAILS = ("test_plan_branches_chooses_positions_and_candidates",)  # must fail (others may too)


def plan_branches(draft_logits, draft, coverage, fanout, cover="first"):
    block_size, vocab = draft_logits.shape
    coverage, fanout = min(coverage, block_size), min(fanout, vocab - 1)
    if cover == "first":
        positions = torch.arange(1, coverage + 1, device=draft.device)
    else:
        c = torch.softmax(draft_logits, -1).gather(1, draft[:, None])[:, 0]
        reach = torch.cat([torch.ones_like(c[:1]), torch.cumprod(c, 0)[:-1]])
        positions = torch.topk(reach * (1 - c), coverage).indices.sort().values + 1
    return positions, draft_logits.topk(fanout, dim=-1).indices[positions - 1]  # the bug
