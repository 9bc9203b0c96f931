"""select_chunks, wrong: keep_ratio = 0 is accepted (0 <= keep_ratio), where (0, 1] is
the range: a request to keep nothing silently keeps the first and the last chunk.
"""

EXERCISE = "select_chunks"
RULE = "refuse"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_select_chunks_refuses_a_keep_ratio_outside_0_1_and_a_chunk_size_under_1",)


def select_chunks(
    drafter: Drafter, input_ids, *, keep_ratio, chunk_size=64, query_window=32, cache=None
):
    if not 0 <= keep_ratio <= 1 or chunk_size < 1:  # the bug: 0 accepted
        raise ValueError(
            f"need keep_ratio in (0, 1] and chunk_size >= 1, got {keep_ratio}, {chunk_size}"
        )
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    window = min(query_window, prompt_len)
    if cache is None:
        cache = KVCache(drafter, prompt_len)
    cache.rewind(0)
    if prompt_len > window:
        prefill(cache, input_ids[:, : prompt_len - window])
    attentions = attention_pass(cache, input_ids[:, prompt_len - window :])
    attention = torch.stack(attentions).mean((0, 1, 2))[:prompt_len]
    num_chunks = math.ceil(prompt_len / chunk_size)
    scores = torch.zeros(num_chunks, device=device).index_add_(
        0, torch.arange(prompt_len, device=device) // chunk_size, attention
    )
    num_keep = min(num_chunks, max(2, math.ceil(keep_ratio * num_chunks)))
    ranked = scores.clone()
    ranked[0] = float("inf")
    ranked[-1] = float("inf")
    kept = sorted(torch.topk(ranked, num_keep).indices.tolist())
    spans = []
    for chunk in kept:
        end = min((chunk + 1) * chunk_size, prompt_len)
        spans.append(torch.arange(chunk * chunk_size, end, device=device))
    positions = torch.cat(spans)
    return {
        "kept_ids": input_ids[:, positions],
        "kept_positions": positions[None],
        "drafter_cache": cache,
        "chunk_scores": scores.tolist(),
        "kept_chunks": kept,
        "num_chunks": num_chunks,
        "chunks_kept": len(kept),
    }
