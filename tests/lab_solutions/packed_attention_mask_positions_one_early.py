"""packed_attention_mask, wrong: a segment's positions start one early, at its root's own
position p instead of p + 1, so MASK i sits where x_{a+i-1} is, not where the token it
predicts goes. The visibility is right: the test against the docstring's rules fails on the
positions alone, and shows both lists.
"""

EXERCISE = "packed_attention_mask"
RULE = "positions"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = (
    "test_mask_matches_slow_reference",  # tests that must fail (others may too)
    "test_mask_is_per_row_for_batched_roots",
)


def packed_attention_mask(num_causal, roots, block_size, *, prefix_len=0, past_len=0):
    roots = roots if roots.dim() == 2 else roots[None]
    device = roots.device
    b, num_segments = roots.shape
    seg_len = prefix_len + block_size
    token = torch.arange(num_segments * seg_len, device=device)
    seg_of, idx_in_seg = token // seg_len, token % seg_len
    is_prefix = idx_in_seg < prefix_len
    causal_idx = torch.arange(num_causal, device=device)
    seg_root = roots[:, seg_of]
    cc = (causal_idx[None, :] <= causal_idx[:, None]).expand(b, -1, -1)
    cs = torch.zeros(b, num_causal, len(seg_of), dtype=torch.bool, device=device)
    sc = causal_idx[None, None, :] <= seg_root[:, :, None]
    same = seg_of[:, None] == seg_of[None, :]
    ss = same & ((idx_in_seg[None, :] <= idx_in_seg[:, None]) | ~is_prefix[:, None])
    mask = torch.cat([torch.cat([cc, cs], 2), torch.cat([sc, ss.expand(b, -1, -1)], 2)], 1)
    cached = torch.ones(b, mask.shape[1], past_len, dtype=torch.bool, device=device)
    positions = torch.cat([causal_idx.expand(b, -1), seg_root + idx_in_seg], 1)  # the bug
    return torch.cat([cached, mask], 2)[:, None], positions + past_len
