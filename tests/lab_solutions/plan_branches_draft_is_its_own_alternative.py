"""plan_branches, wrong: the candidates are the drafter's F likeliest tokens at i, d_i among
them. "The target said d_i" is never an outcome (d_i would have been accepted), so a slot of
every position's budget is wasted, and the runner-up the target does say often has no
branch: fewer hits (test_async_equals_sync_and_target counts them too).
"""

EXERCISE = "plan_branches"
RULE = "candidates"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = ("test_plan_branches_chooses_positions_and_candidates",)  # must fail (others may too)


def plan_branches(draft_logits, draft, num_real, config):
    block_size, vocab = draft_logits.shape
    coverage, fanout = branch_budget(config, block_size)
    coverage, fanout = min(coverage, block_size), min(fanout, vocab - 1)
    if config.cover == "first":
        covered = torch.arange(1, coverage + 1, device=draft.device)
    else:
        rho = first_rejection_chance(draft_logits, draft, num_real, config.temperature)
        covered = torch.topk(rho, coverage).indices.sort().values + 1
    return covered, draft_logits.topk(fanout, dim=-1).indices[covered - 1]  # the bug
