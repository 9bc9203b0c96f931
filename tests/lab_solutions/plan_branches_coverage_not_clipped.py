"""plan_branches, wrong: F is clipped to V - 1 but C is taken as given. A budget like
async:6,2 at B = 4 asks for positions 5 and 6, which the block does not have.
"""

EXERCISE = "plan_branches"
RULE = "clipped"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_plan_branches_takes_c_and_f_from_the_budget_clipped_to_b_and_v_minus_1",)


def plan_branches(draft_logits, draft, num_real: int, config):
    block_size, vocab = draft_logits.shape
    coverage, fanout = branch_budget(config, block_size)
    fanout = min(fanout, vocab - 1)
    if config.cover == "first":
        covered = torch.arange(1, coverage + 1, device=draft.device)
    else:
        rho = first_rejection_chance(draft_logits, draft, num_real, config.temperature)
        covered = torch.topk(rho, coverage).indices.sort().values + 1
    others = draft_logits.scatter(-1, draft[:, None], float("-inf"))
    candidates = others.topk(fanout, dim=-1).indices[covered - 1]
    return covered, candidates
