"""plan_branches, wrong: positions counted from 0 (k = 0 .. C-1) where the method counts from
1, so the first branch plans "d_0 rejected" and takes its candidates from row k - 1 = -1, the
last of the block.
"""

EXERCISE = "plan_branches"
RIGHT = False
FAILS = ("test_plan_branches_chooses_positions_and_candidates",)  # must fail (others may too)


def plan_branches(draft_logits, draft, coverage, fanout, cover="first"):
    block_size, vocab = draft_logits.shape
    coverage, fanout = min(coverage, block_size), min(fanout, vocab - 1)
    if cover == "first":
        positions = torch.arange(coverage, device=draft.device)  # the bug: from 0
    else:
        c = torch.softmax(draft_logits, -1).gather(1, draft[:, None])[:, 0]
        reach = torch.cat([torch.ones_like(c[:1]), torch.cumprod(c, 0)[:-1]])
        positions = torch.topk(reach * (1 - c), coverage).indices.sort().values  # from 0
    others = draft_logits.scatter(-1, draft[:, None], float("-inf"))
    return positions, others.topk(fanout, dim=-1).indices[positions - 1]
