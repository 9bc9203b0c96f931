"""plan_branches, right, written another way: "likely" ranks positions by log r_k (a
cumulative sum of log c_j, plus log(1 - c_k)), and the candidates come from a full sort with
d_k masked out by a one-hot.
"""

EXERCISE = "plan_branches"
RIGHT = True
FAILS = ()  # tests that must fail: none


def plan_branches(draft_logits, draft, coverage, fanout, cover="first"):
    block_size, vocab = draft_logits.shape
    coverage, fanout = min(coverage, block_size), min(fanout, vocab - 1)
    if cover == "first":
        positions = torch.arange(coverage, device=draft.device) + 1
    else:
        log_c = torch.log_softmax(draft_logits.float(), -1).gather(1, draft[:, None])[:, 0]
        log_reach = torch.cumsum(log_c, 0) - log_c  # sum over j < k of log c_j
        log_r = log_reach + torch.log1p(-log_c.exp().clamp(max=1.0))
        positions = torch.sort(torch.topk(log_r, coverage).indices).values + 1
    is_draft = F.one_hot(draft, vocab).bool()  # (B, V)
    others = draft_logits.masked_fill(is_draft, float("-inf"))
    ranked = torch.sort(others, -1, descending=True).indices  # (B, V)
    return positions, ranked[positions - 1, :fanout]
