"""draft_rows, wrong: under d1_from="causal" the causal row is put in front of the MASK rows
and the block's last MASK dropped, but MASK 1 is kept: d_2 is read at MASK 1, d_i at MASK
i - 1, every later token of the block one row early (the off-by-one of "d_1 moved, the rest
shifted").
"""

EXERCISE = "draft_rows"
RULE = "masks"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = (  # tests that must fail (others may too)
    "test_draft_rows_reads_d1_where_d1_from_says_and_the_rest_at_masks_2_to_b",
    "test_packed_blocks_equal_separate_passes",
    "test_sync_equals_target_greedy",
)


def draft_rows(prefix_row, first_mask_row, block_size, d1_from):
    prefix_row, first_mask_row = torch.broadcast_tensors(prefix_row, first_mask_row)
    masks = first_mask_row[..., None] + torch.arange(block_size, device=first_mask_row.device)
    if d1_from == "causal":  # the bug: MASK 1 .. B - 1 where MASK 2 .. B belong
        return torch.cat([prefix_row[..., None], masks[..., :-1]], -1)
    return masks
