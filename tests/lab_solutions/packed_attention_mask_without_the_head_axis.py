"""packed_attention_mask, wrong: the mask comes back (b, W, past_len + W), without the
axis of one that broadcasts it over the attention heads. The model then reads W, the rows, as
the heads' axis; the test against the docstring's rules stops at the shape and says it.
"""

EXERCISE = "packed_attention_mask"
RULE = "shape"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_mask_matches_slow_reference",)


def packed_attention_mask(num_causal: int, roots, block_size: int, *, prefix_len=0, past_len=0):
    if roots.dim() == 1:
        roots = roots[None]
    device = roots.device
    b, num_segments = roots.shape
    seg_len = prefix_len + block_size
    token = torch.arange(num_segments * seg_len, device=device)
    seg_of = token // seg_len
    place_in_seg = token % seg_len
    is_prefix = place_in_seg < prefix_len
    causal_row = torch.arange(num_causal, device=device)
    seg_root = roots[:, seg_of]
    cc = (causal_row[None, :] <= causal_row[:, None]).expand(b, -1, -1)
    cs = torch.zeros(b, num_causal, len(seg_of), dtype=torch.bool, device=device)
    sc = causal_row[None, None, :] <= seg_root[:, :, None]
    same = seg_of[:, None] == seg_of[None, :]
    ss = same & ((place_in_seg[None, :] <= place_in_seg[:, None]) | ~is_prefix[:, None])
    causal_part = torch.cat([cc, cs], 2)
    segment_part = torch.cat([sc, ss.expand(b, -1, -1)], 2)
    mask = torch.cat([causal_part, segment_part], 1)
    past = torch.ones(b, mask.shape[1], past_len, dtype=torch.bool, device=device)
    mask = torch.cat([past, mask], 2)
    causal_positions = causal_row.expand(b, -1)
    segment_positions = seg_root + 1 + place_in_seg
    positions = torch.cat([causal_positions, segment_positions], 1) + past_len
    return mask, positions  # the bug: no heads' axis
