"""draft_rows, right, written another way: the B MASK rows, then one torch.where that puts
prefix_row at block position 1 under d1_from="causal" (no in-place write).
"""

EXERCISE = "draft_rows"
RIGHT = True
FAILS = ()  # tests that must fail: none


def draft_rows(prefix_row, first_mask_row, block_size, d1_from):
    first = torch.as_tensor(first_mask_row)[..., None]
    prefix = torch.as_tensor(prefix_row)[..., None]
    i = torch.arange(1, block_size + 1, device=first.device)  # block positions 1 .. B
    mask_rows = first + i - 1
    from_prefix = (i == 1) & (d1_from == "causal")
    return torch.where(from_prefix, prefix, mask_rows)
