"""plan_branches, wrong: the likely cover scores the block as if all B tokens were real
(R = B): after a full-acceptance hit the pad's zero logits look like a likely rejection, and a
branch is spent on a position that is never compared.
"""

EXERCISE = "plan_branches"
RULE = "pad-covered"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_the_pad_is_covered_only_where_coverage_exceeds_the_real_positions",)


def plan_branches(draft_logits, draft, num_real: int, config):
    block_size, vocab = draft_logits.shape
    coverage, fanout = branch_budget(config, block_size)
    coverage = min(coverage, block_size)
    fanout = min(fanout, vocab - 1)
    if config.cover == "first":
        covered = torch.arange(1, coverage + 1, device=draft.device)
    else:
        rho = first_rejection_chance(draft_logits, draft, block_size, config.temperature)
        covered = torch.topk(rho, coverage).indices.sort().values + 1
    others = draft_logits.scatter(-1, draft[:, None], float("-inf"))
    candidates = others.topk(fanout, dim=-1).indices[covered - 1]
    return covered, candidates
