"""plan_branches, wrong: positions counted from 0 (i = 0 .. C-1) where the method counts from
1, so the first branch plans "d_0 rejected" and takes its candidates from draft_logits[i - 1] =
draft_logits[-1], the last of the block.
"""

EXERCISE = "plan_branches"
RULE = "positions"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = ("test_plan_branches_chooses_positions_and_candidates",)  # must fail (others may too)


def plan_branches(draft_logits, draft, num_real, config):
    block_size, vocab = draft_logits.shape
    coverage, fanout = branch_budget(config, block_size)
    coverage, fanout = min(coverage, block_size), min(fanout, vocab - 1)
    if config.cover == "first":
        covered = torch.arange(coverage, device=draft.device)  # the bug: from 0
    else:
        rho = first_rejection_chance(draft_logits, draft, num_real, config.temperature)
        covered = torch.topk(rho, coverage).indices.sort().values  # from 0
    others = draft_logits.scatter(-1, draft[:, None], float("-inf"))
    return covered, others.topk(fanout, dim=-1).indices[covered - 1]
