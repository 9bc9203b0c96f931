"""draft_rows, wrong: d_1 is read at prefix_row whatever d1_from says, as under the
default "causal". d1_from="mask", the ablation that drafts d_1 from MASK 1, then measures the
causal head again.
"""

EXERCISE = "draft_rows"
RULE = "d1-mask"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_draft_rows_reads_d1_where_d1_from_says_and_the_rest_at_masks_2_to_b",)


def draft_rows(
    prefix_row: torch.Tensor, first_mask_row: torch.Tensor, block_size: int, d1_from: str
) -> torch.Tensor:
    prefix_row, first_mask_row = torch.broadcast_tensors(prefix_row, first_mask_row)
    rows = first_mask_row[..., None] + torch.arange(block_size, device=first_mask_row.device)
    return torch.cat([prefix_row[..., None], rows[..., 1:]], -1)  # the bug: always
