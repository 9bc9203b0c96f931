"""draft_rows, wrong: d_1 is read at MASK 1 whatever d1_from says (the rows first_mask_row ..
first_mask_row + B - 1). Decoding stays lossless, but under the default d1_from="causal" the
drafter's d_1 comes from a row that training's L_AR never made a next-token predictor.
"""

EXERCISE = "draft_rows"
RULE = "d1-causal"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = (  # tests that must fail (others may too)
    "test_draft_rows_reads_d1_where_d1_from_says_and_the_rest_at_masks_2_to_b",
    "test_packed_blocks_equal_separate_passes",
    "test_offline_tau_drafts_the_d1_from_where_decoding_does",
)


def draft_rows(prefix_row, first_mask_row, block_size, d1_from):
    prefix_row, first_mask_row = torch.broadcast_tensors(prefix_row, first_mask_row)
    return first_mask_row[..., None] + torch.arange(block_size, device=first_mask_row.device)
