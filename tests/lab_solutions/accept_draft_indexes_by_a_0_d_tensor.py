"""accept_draft, wrong: the row after the accepted prefix is taken with plain indexing by
the 0-d tensor a (p_logits[a]), which reads a back to the host: on CUDA the round waits
for the device here, before its one read.
"""

EXERCISE = "accept_draft"
RULE = "no-read"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_accept_draft_reads_nothing_back",)


def accept_draft(p_logits, draft, q_draft, sampler, num_real=None):
    block_size = draft.shape[0]
    if num_real is None:
        num_real = block_size
    real = torch.arange(block_size, device=draft.device) < num_real
    if sampler.temperature == 0:
        target_tokens = p_logits.argmax(-1)
        agrees = (draft == target_tokens[:block_size]) & real
        num_accepted = agrees.long().cumprod(0).sum()
        return num_accepted, target_tokens[num_accepted]  # the bug: a read
    p_target = sampler.probs(p_logits)
    block_index = torch.arange(block_size, device=draft.device)
    p_d = p_target[block_index, draft]
    q_d = q_draft[block_index, draft]
    u = sampler.uniform((block_size,), p_d.device)
    accepts = (u * q_d <= p_d) & real
    num_accepted = accepts.long().cumprod(0).sum()
    p_next = p_target[num_accepted]  # the bug: a read
    q_next = _at(nn.functional.pad(q_draft, (0, 0, 0, 1)), num_accepted)
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p_next)
    next_dist = torch.where(real.sum() == num_accepted, p_next, residual)
    return num_accepted, sampler.draw(next_dist / next_dist.sum())
