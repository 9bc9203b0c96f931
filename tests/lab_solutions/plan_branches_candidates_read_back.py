"""plan_branches, wrong for speed only: the candidates are right, gathered by a Python loop
over covered.tolist(). Each read waits for the device on CUDA, and the async round plans its
branches while the target verifies: the host would stall there every round.
"""

EXERCISE = "plan_branches"
RULE = "no-read"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = (
    "test_branches_are_planned_on_the_device_in_ops_that_do_not_grow_with_c_and_f",
    "test_branch_pass_is_planned_and_built_without_reading_the_device",
)


def plan_branches(draft_logits, draft, num_real: int, config):
    block_size, vocab = draft_logits.shape
    coverage, fanout = branch_budget(config, block_size)
    coverage = min(coverage, block_size)
    fanout = min(fanout, vocab - 1)
    if config.cover == "first":
        covered = torch.arange(1, coverage + 1, device=draft.device)
    else:
        rho = first_rejection_chance(draft_logits, draft, num_real, config.temperature)
        covered = torch.topk(rho, coverage).indices.sort().values + 1
    others = draft_logits.scatter(-1, draft[:, None], float("-inf"))
    ranked = others.topk(fanout, dim=-1).indices
    candidates = ranked[:0]
    if coverage > 0:  # the bug: covered read back to the host
        candidates = torch.stack([ranked[i - 1] for i in covered.tolist()])
    return covered, candidates
