"""plan_branches, right, written another way: rho_i is computed in log space (a cumulative sum
of log q(d_i), plus log(1 - q(d_i))) and exponentiated, and the candidates come from a full
sort with d_i masked out by a one-hot.
"""

EXERCISE = "plan_branches"
RIGHT = True
FAILS = ()  # tests that must fail: none


def first_rejection_chance(draft_logits, draft, num_real, temperature):
    scale = 1.0 if temperature == 0 else temperature
    log_q = torch.log_softmax(draft_logits.float() / scale, -1).gather(1, draft[:, None])[:, 0]
    log_reach = torch.cumsum(log_q, 0) - log_q  # the sum over the positions before i
    log_rho = log_reach + torch.log1p(-log_q.exp().clamp(max=1.0))
    is_pad = torch.arange(len(draft), device=draft.device) >= num_real
    return log_rho.exp().masked_fill(is_pad, float("-inf"))


def plan_branches(draft_logits, draft, num_real, config):
    block_size, vocab = draft_logits.shape
    coverage, fanout = branch_budget(config, block_size)
    coverage, fanout = min(coverage, block_size), min(fanout, vocab - 1)
    if config.cover == "first":
        covered = torch.arange(coverage, device=draft.device) + 1
    else:
        rho = first_rejection_chance(draft_logits, draft, num_real, config.temperature)
        covered = torch.sort(torch.topk(rho, coverage).indices).values + 1
    is_draft = nn.functional.one_hot(draft, vocab).bool()  # (B, V)
    others = draft_logits.masked_fill(is_draft, float("-inf"))
    ranked = torch.sort(others, -1, descending=True).indices  # (B, V)
    return covered, ranked[covered - 1, :fanout]
