"""select_chunks, wrong for memory only: the scores are right, from one eager attention
pass over the whole prompt whose last query_window rows are kept. That pass holds every
layer's prompt x prompt attention (for a 32k prompt, gigabytes), where the prefill reads the
prompt in chunks and only the last window pays for attention.
"""

EXERCISE = "select_chunks"
RULE = "prefill"  # the rule it breaks (lab.RULES)
RIGHT = False
# the tests that must fail (others may too)
FAILS = ("test_long_prompts_are_prefilled_in_chunks",)


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
    attentions = attention_pass(cache, input_ids)  # the bug: the whole prompt
    attention = torch.stack(attentions)[:, :, -window:].mean((0, 1, 2))[:prompt_len]
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
