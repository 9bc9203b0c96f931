"""select_segment, wrong: the matches are read back and searched in a Python loop
(`matches.tolist()`). The segment it picks is right, so decoding stays lossless; but the round
now waits for the device twice, once here and once in its read_round.
"""

EXERCISE = "select_segment"
RIGHT = False
FAILS = (  # tests that must fail (others may too)
    "test_select_segment_reads_nothing_back_to_the_host",
    "test_each_round_reads_the_device_once_between_two_reports",
)


def select_segment(num_accepted, next_token, num_real, covered, candidates, guess):
    at_position = covered[:, None] == num_accepted + 1
    branch = (at_position & (candidates == next_token)).flatten()
    full_match = (num_accepted == num_real) & (guess == next_token)
    matches = torch.cat([branch, full_match[None]])
    for index, match in enumerate(matches.tolist()):  # the bug: a host read
        if match:
            return torch.tensor(index, device=matches.device)
    return torch.tensor(-1, device=matches.device)
