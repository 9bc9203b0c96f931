"""draft_rows, wrong: the rows are built from first_mask_row alone, not broadcast with
prefix_row. offline_tau gives anchors (b, K) and first MASK rows (K,): the rows come out (K, B)
under "mask", and the two shapes do not meet under "causal".
"""

EXERCISE = "draft_rows"
RULE = "broadcast"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_draft_rows_reads_d1_where_d1_from_says_and_the_rest_at_masks_2_to_b",)


def draft_rows(
    prefix_row: torch.Tensor, first_mask_row: torch.Tensor, block_size: int, d1_from: str
) -> torch.Tensor:
    rows = first_mask_row[..., None] + torch.arange(block_size, device=first_mask_row.device)
    if d1_from == "causal":
        rows = torch.cat([prefix_row[..., None], rows[..., 1:]], -1)  # the bug
    return rows
