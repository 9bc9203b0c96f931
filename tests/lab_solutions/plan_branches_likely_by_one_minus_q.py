"""plan_branches, wrong: cover "likely" ranks the positions by 1 - q(d_i), the chance that
d_i is rejected, forgetting that it is compared only if d_1 .. d_{i-1} all pass. A doubtful
position late in the block then outranks a likelier first rejection early in it.
"""

EXERCISE = "plan_branches"
RULE = "likely"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_likely_cover_ranks_positions_by_the_chance_the_first_rejection_is_there",)


def plan_branches(draft_logits, draft, num_real: int, config):
    block_size, vocab = draft_logits.shape
    coverage, fanout = branch_budget(config, block_size)
    coverage = min(coverage, block_size)
    fanout = min(fanout, vocab - 1)
    if config.cover == "first":
        covered = torch.arange(1, coverage + 1, device=draft.device)
    else:
        scale = config.temperature if config.temperature > 0 else 1.0
        q_d = torch.softmax(draft_logits.float() / scale, -1).gather(1, draft[:, None])[:, 0]
        is_pad = torch.arange(block_size, device=draft.device) >= num_real
        rejected = (1 - q_d).masked_fill(is_pad, float("-inf"))  # the bug: no reach
        covered = torch.topk(rejected, coverage).indices.sort().values + 1
    others = draft_logits.scatter(-1, draft[:, None], float("-inf"))
    candidates = others.topk(fanout, dim=-1).indices[covered - 1]
    return covered, candidates
