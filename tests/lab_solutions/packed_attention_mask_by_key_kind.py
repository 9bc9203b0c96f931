"""packed_attention_mask, right, written another way: one (q, q) comparison over all packed
tokens at once. Each token gets the last causal index it may see (its own in the stream, its
root in a segment), its segment (-1 in the stream) and its index there; the mask follows
from two rules: causal keys up to that index, and the token's own segment in order (a MASK
sees all of it).
"""

EXERCISE = "packed_attention_mask"
RIGHT = True
FAILS = ()  # tests that must fail: none


def packed_attention_mask(num_causal, roots, block_size, *, prefix_len=0, past_len=0):
    roots = roots if roots.dim() == 2 else roots[None]
    b, num_segments = roots.shape
    seg_len = prefix_len + block_size
    token = torch.arange(num_causal + num_segments * seg_len, device=roots.device)  # (q,)
    causal = token < num_causal
    segment = torch.where(causal, -1, (token - num_causal) // seg_len)  # (q,) -1: the stream
    inner = torch.where(causal, token, (token - num_causal) % seg_len)  # (q,) index in it
    sees_up_to = torch.where(causal, token, roots[:, segment.clamp(min=0)])  # (b, q)
    causal_key = causal[None, None, :] & (token[None, None, :] <= sees_up_to[:, :, None])
    own_segment = (segment[:, None] == segment[None, :]) & ~causal[:, None]  # (q, q)
    in_order = (inner[None, :] <= inner[:, None]) | (inner[:, None] >= prefix_len)
    mask = causal_key | (own_segment & in_order)[None]  # (b, q, q)
    cached = torch.ones(b, len(token), past_len, dtype=torch.bool, device=roots.device)
    positions = torch.where(causal[None], token[None], sees_up_to + 1 + inner[None])
    return torch.cat([cached, mask], 2)[:, None], positions + past_len
