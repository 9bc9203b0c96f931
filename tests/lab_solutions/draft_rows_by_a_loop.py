"""draft_rows, wrong for speed only: the rows are right, listed by a Python loop over the
rows' values (.tolist()) and made into a tensor again. On CUDA each read waits for the device:
the async packed pass, built while the target verifies, would stall the host.
"""

EXERCISE = "draft_rows"
RULE = "no-read"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = (
    "test_draft_rows_reads_nothing_back",
    "test_branch_pass_is_planned_and_built_without_reading_the_device",
)


def draft_rows(prefix_row, first_mask_row, block_size, d1_from):
    prefix_row, first_mask_row = torch.broadcast_tensors(prefix_row, first_mask_row)
    pairs = zip(prefix_row.flatten().tolist(), first_mask_row.flatten().tolist())  # the bug
    rows = [
        [prefix if d1_from == "causal" and i == 0 else first + i for i in range(block_size)]
        for prefix, first in pairs
    ]
    rows = torch.tensor(rows, dtype=torch.long, device=first_mask_row.device)
    return rows.view(*first_mask_row.shape, block_size)
