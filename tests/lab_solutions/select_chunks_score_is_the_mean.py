"""select_chunks, wrong: a chunk's score is the mean of its tokens' attention, not the
sum. The last chunk, often short, is scored on fewer tokens and every chunk's score moves with
chunk_size.
"""

EXERCISE = "select_chunks"
RULE = "score"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_a_chunks_score_is_the_attention_its_tokens_get_from_the_last_query_window",)


def select_chunks(
    drafter: Drafter, input_ids, *, keep_ratio, chunk_size=64, query_window=32, cache=None
):
    if not 0 < keep_ratio <= 1 or chunk_size < 1:
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
    chunk_of = torch.arange(prompt_len, device=device) // chunk_size
    sizes = torch.bincount(chunk_of, minlength=num_chunks)
    scores = torch.zeros(num_chunks, device=device).index_add_(0, chunk_of, attention)
    scores = scores / sizes  # the bug: the mean, not the sum
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
