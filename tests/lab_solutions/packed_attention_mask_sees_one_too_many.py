"""packed_attention_mask, wrong: each block also sees the causal token right after its
root, the very token its first MASK must predict (`<=` against root + 1, not the root).

A drafter trained on this mask learns to copy the label (LAB.md, exercise 8). The test
against the docstring's rules names the mask as wrong, and a block in the packed pass no
longer equals drafting it alone.
"""

EXERCISE = "packed_attention_mask"
RULE = "root"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = (
    "test_mask_matches_slow_reference",  # tests that must fail (others may too)
    "test_packed_blocks_equal_separate_passes",
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
    sc = causal_idx[None, None, :] <= seg_root[:, :, None] + 1  # the bug: one token too many
    same = seg_of[:, None] == seg_of[None, :]
    ss = same & ((idx_in_seg[None, :] <= idx_in_seg[:, None]) | ~is_prefix[:, None])
    mask = torch.cat([torch.cat([cc, cs], 2), torch.cat([sc, ss.expand(b, -1, -1)], 2)], 1)
    cached = torch.ones(b, mask.shape[1], past_len, dtype=torch.bool, device=device)
    positions = torch.cat([causal_idx.expand(b, -1), seg_root + 1 + idx_in_seg], 1)
    return torch.cat([cached, mask], 2)[:, None], positions + past_len
