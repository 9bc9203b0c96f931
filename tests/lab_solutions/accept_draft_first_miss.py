"""accept_draft, right, written another way: the first rejection is the argmax of "missed"
flags (a sentinel miss at B for a full block), the sampling test is u < p / q, and the
residual or the bonus law is picked with one where.
"""

EXERCISE = "accept_draft"
RIGHT = True
FAILS = ()  # tests that must fail: none


def accept_draft(p_logits, draft, q_draft, sampler, num_real=None):
    block_size = draft.shape[0]
    limit = block_size if num_real is None else num_real
    counted = torch.arange(block_size, device=draft.device) < limit  # (B,)
    if sampler.temperature == 0:
        best = p_logits.argmax(-1)  # (B+1,)
        missed = ~((draft == best[:-1]) & counted)
        first_miss = torch.cat([missed, missed.new_ones(1)]).int().argmax()  # B if none
        return first_miss, best.gather(0, first_miss.view(1))[0]
    p = sampler.probs(p_logits)  # (B+1, V)
    p_d = p[:-1].gather(1, draft[:, None])[:, 0]
    q_d = q_draft.gather(1, draft[:, None])[:, 0]
    u = sampler.uniform((block_size,), p.device)  # seeded: drawn on the generator's device
    missed = ~((u < p_d / q_d) & counted)
    first_miss = torch.cat([missed, missed.new_ones(1)]).int().argmax()
    p_next = p.index_select(0, first_miss.view(1))[0]  # (V,)
    q_rows = torch.cat([q_draft, torch.zeros_like(q_draft[:1])])  # past the draft: q = 0
    residual = (p_next - q_rows.index_select(0, first_miss.view(1))[0]).clamp(min=0)
    all_accepted = first_miss == counted.sum()
    law = torch.where(all_accepted | (residual.sum() <= 0), p_next, residual)
    return first_miss, sampler.draw(law / law.sum())
