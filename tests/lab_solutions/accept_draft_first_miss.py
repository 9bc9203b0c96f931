"""accept_draft, right, written another way: the first rejection is the argmax of "missed"
flags (a sentinel miss at B for a full block), the sampling test is u < p / q, and the
residual or the bonus law is picked with one where.
"""

EXERCISE = "accept_draft"
RIGHT = True
FAILS = ()  # tests that must fail: none


def accept_draft(p_logits, draft, q_draft, temperature, generator=None, num_real=None):
    block_size = draft.shape[0]
    limit = block_size if num_real is None else num_real
    counted = torch.arange(block_size, device=draft.device) < limit  # (B,)
    if temperature == 0:
        best = p_logits.argmax(-1)  # (B+1,)
        missed = ~((draft == best[:-1]) & counted)
        first_miss = torch.cat([missed, missed.new_ones(1)]).int().argmax()  # B if none
        return first_miss, best.gather(0, first_miss.view(1))[0]
    p = torch.softmax(p_logits.float() / temperature, dim=-1)  # (B+1, V)
    p_d = p[:-1].gather(1, draft[:, None])[:, 0]
    q_d = q_draft.gather(1, draft[:, None])[:, 0]
    device = p.device if generator is None else generator.device  # seeded: its device
    u = torch.rand(block_size, generator=generator, device=device).to(p.device)
    missed = ~((u < p_d / q_d) & counted)
    first_miss = torch.cat([missed, missed.new_ones(1)]).int().argmax()
    p_next = p.index_select(0, first_miss.view(1))[0]  # (V,)
    q_rows = torch.cat([q_draft, torch.zeros_like(q_draft[:1])])  # past the draft: q = 0
    residual = (p_next - q_rows.index_select(0, first_miss.view(1))[0]).clamp(min=0)
    all_accepted = first_miss == counted.sum()
    law = torch.where(all_accepted | (residual.sum() <= 0), p_next, residual)
    return first_miss, _sample(law / law.sum(), generator)
