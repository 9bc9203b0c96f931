"""select_chunks, wrong: the kept tokens get positions 0, 1, 2, ... as if they were the whole
prompt, not their original positions. The target then reads the kept chunks closed up, at
positions they never had.
"""

EXERCISE = "select_chunks"
RULE = "order"  # the rule it breaks (lab.RULES)
RIGHT = False
FAILS = ("test_kept_chunks_are_in_order_with_original_positions",)  # must fail (others may too)


def select_chunks(drafter, input_ids, *, keep_ratio, chunk_size=64, query_window=32, cache=None):
    if not 0 < keep_ratio <= 1 or chunk_size < 1:
        raise ValueError(f"need keep_ratio in (0, 1] and chunk_size >= 1, got {keep_ratio}")
    device, prompt_len = input_ids.device, input_ids.shape[1]
    window = min(query_window, prompt_len)
    cache = KVCache(drafter, prompt_len) if cache is None else cache
    cache.rewind(0)
    if prompt_len > window:
        prefill(cache, input_ids[:, : prompt_len - window])
    attentions = attention_pass(cache, input_ids[:, prompt_len - window :])
    attention = torch.stack(attentions).mean((0, 1, 2))[:prompt_len]
    num_chunks = math.ceil(prompt_len / chunk_size)
    chunk_of = torch.arange(prompt_len, device=device) // chunk_size
    scores = torch.zeros(num_chunks, device=device).index_add_(0, chunk_of, attention)
    num_keep = min(num_chunks, max(2, math.ceil(keep_ratio * num_chunks)))
    ranked = scores.clone()
    ranked[0] = ranked[-1] = float("inf")
    kept = sorted(torch.topk(ranked, num_keep).indices.tolist())
    positions = torch.cat(
        [
            torch.arange(c * chunk_size, min((c + 1) * chunk_size, prompt_len), device=device)
            for c in kept
        ]
    )
    return {
        "kept_ids": input_ids[:, positions],
        "kept_positions": torch.arange(len(positions), device=device)[None],  # the bug
        "drafter_cache": cache,
        "chunk_scores": scores.tolist(),
        "kept_chunks": kept,
        "num_chunks": num_chunks,
        "chunks_kept": len(kept),
    }
