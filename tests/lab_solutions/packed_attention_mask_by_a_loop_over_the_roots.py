"""packed_attention_mask, wrong for speed only: the mask is right, filled in by Python
loops over the roots' values (roots.tolist()). Every value read waits for the device on
CUDA: the async pass, built while the target verifies, would stall the host. The right claims
pass; the no-read claims fail, and say that the values are right.
"""

EXERCISE = "packed_attention_mask"
RULE = "no-read"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = (
    "test_the_mask_is_built_without_reading_the_device",
    "test_branch_pass_is_planned_and_built_without_reading_the_device",
)


def packed_attention_mask(num_causal, roots, block_size, *, prefix_len=0, past_len=0):
    rows = roots.tolist() if roots.dim() == 2 else [roots.tolist()]  # the bug: a read
    seg_len = prefix_len + block_size
    width = num_causal + len(rows[0]) * seg_len
    device = roots.device
    mask = torch.zeros(len(rows), 1, width, past_len + width, dtype=torch.bool, device=device)
    positions = torch.zeros(len(rows), width, dtype=torch.long, device=device)
    mask[..., :past_len] = True
    for b, row in enumerate(rows):
        for i in range(num_causal):
            mask[b, 0, i, past_len : past_len + i + 1] = True
            positions[b, i] = past_len + i
        for s, root in enumerate(row):
            start = num_causal + s * seg_len
            for t in range(seg_len):
                mask[b, 0, start + t, past_len : past_len + root + 1] = True
                seen = t + 1 if t < prefix_len else seg_len
                mask[b, 0, start + t, past_len + start : past_len + start + seen] = True
                positions[b, start + t] = past_len + root + 1 + t
    return mask, positions
