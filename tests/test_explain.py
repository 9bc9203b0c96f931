"""systems/explain.py on rounds made by hand: what describe_round shows of a hit, a miss and a pad,
and that ColoredStream writes exactly the committed tokens' text, coloured by origin.

Run: python -m pytest -q tests/test_explain.py
"""

import io
import re

import d3d
from systems import explain

WORDS = ["the", " cat", " sat", " on", " a", " mat", ".", " It", " was", " warm"]


def decode(ids: list[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def async_round(**fields) -> d3d.RoundInfo:
    """An async round at B = 4, C = 2, F = 1 from x_5: d_1 accepted, d_2 rejected, t = 3."""
    values = dict(
        mode="async",
        index=0,
        n=5,
        x_n=0,
        draft=[1, 7, 8, 9],
        num_real=4,
        drafted_by="draft pass",
        d1_from="causal",
        num_accepted=1,
        next_token=3,
        committed=[1, 3],
        target_cache=(5, 7),
        drafter_cache=(5, 7),
        outcomes=[(1, 2), (2, 3), (5, 4)],
        segment=1,
    )
    values.update(fields)
    return d3d.RoundInfo(**values)


def test_a_branch_hit_is_starred_and_named():
    text = explain.describe_round(async_round(), block_size=4)
    assert "(i, t) = (1, 2)  (2, 3)*  (5, 4)" in text
    assert "hit         (2, 3) was prepared; that branch's block is the next draft" in text
    assert "a = 1 (d_1); t = 3, its correction of d_2" in text
    assert "drafter cache 5 -> 7: x_0 .. x_4 -> x_0 .. x_5, d_1" in text


def test_a_miss_says_the_next_round_drafts_anew():
    info = async_round(num_accepted=2, next_token=6, committed=[1, 7, 6], segment=-1)
    text = explain.describe_round(info, block_size=4, decode=decode)
    assert "miss        nothing prepared for (3, '.'): the next round drafts anew" in text
    assert "*" not in text
    assert "committed   ' cat' ' It' '.' (= x_6 .. x_8)" in text


def test_the_last_round_says_what_it_prepared_is_never_used():
    """In the round that ends the decode a hit's block is never a draft, nor does a miss draft
    anew: describe_round(over=True) says so, and not that a next draft follows."""
    hit = explain.describe_round(async_round(), block_size=4, over=True)
    assert "hit         (2, 3) was prepared; the decode is over: never used" in hit
    miss = async_round(num_accepted=2, next_token=6, committed=[1, 7, 6], segment=-1)
    miss = explain.describe_round(miss, block_size=4, over=True)
    assert "miss        nothing prepared for (3, 6); the decode is over" in miss
    for text in (hit, miss):
        assert "next draft" not in text and "drafts anew" not in text


def test_a_padded_draft_shows_its_pad():
    info = async_round(
        index=3,
        draft=[1, 7, 8, 0],
        num_real=3,
        drafted_by="full acceptance",
        num_accepted=3,
        next_token=2,
        committed=[1, 7, 8, 2],
        target_cache=(5, 9),
        drafter_cache=(5, 9),
        outcomes=[(1, 2), (2, 3), (4, 2)],
        segment=2,
    )
    text = explain.describe_round(info, block_size=4)
    assert "d_1 .. d_4 = 1 7 8 pad (d_4 is a pad: never accepted)" in text
    words = " ".join(text.split())  # as one line, wherever it was wrapped
    assert "full-acceptance block: d_1 .. d_3 from its MASK 2 .. 4" in words
    assert "a = 3 (d_1 .. d_3, all real tokens); t = 2, its bonus token" in text
    assert "(4, 2)*" in text


def test_target_and_sync_rounds_are_described_too():
    target = async_round(
        mode="target",
        draft=[],
        num_real=0,
        drafted_by="",
        d1_from="",
        num_accepted=0,
        committed=[3],
        target_cache=(5, 6),
        drafter_cache=(0, 0),
        outcomes=None,
        segment=None,
    )
    text = explain.describe_round(target, block_size=1)
    assert "t = 3, the target alone" in text
    assert "drafter cache" not in text
    sync = async_round(mode="sync", outcomes=None, segment=None, drafter_cache=(3, 6))
    text = explain.describe_round(sync, block_size=4)
    assert "prepared" not in text
    assert "drafter cache 3 -> 6: x_0 .. x_2 -> x_0 .. x_5" in text


def test_round_printer_prints_a_header_once_then_every_round():
    file = io.StringIO()
    printer = explain.RoundPrinter(decode, file=file)
    printer(async_round())
    printer(async_round(index=1, n=7))
    text = file.getvalue()
    assert text.count("async decoding, round by round (B = 4)") == 1
    assert "round 0: n = 5" in text
    assert "round 1: n = 7" in text


def test_colored_stream_writes_exactly_the_committed_text():
    rounds = [
        async_round(committed=[1, 3]),
        async_round(index=1, num_accepted=3, committed=[4, 5, 6, 7]),
        # cut by the budget: drafts only
        async_round(index=2, num_accepted=2, committed=[8, 9]),
    ]
    plain = io.StringIO()
    coloured = io.StringIO()
    streams = [
        explain.ColoredStream(decode, file=plain, colour=False),
        explain.ColoredStream(decode, file=coloured),
    ]
    for info in rounds:
        for stream in streams:
            stream(info)
    # round 0 writes the prefill's token x_n (here 0, "the") before its own tokens
    committed = [0] + [t for info in rounds for t in info.committed]
    assert plain.getvalue() == decode(committed)
    assert re.sub(r"\033\[\d+m", "", coloured.getvalue()) == decode(committed)
    green = explain.GREEN
    yellow = explain.YELLOW
    reset = explain.RESET
    assert coloured.getvalue() == (
        f"{yellow}the{reset}"
        f"{green} cat{reset}{yellow} on{reset}"
        f"{green} a mat.{reset}{yellow} It{reset}"
        f"{green} was warm{reset}"
    )
    assert streams[0].tokens == committed


def test_colored_stream_without_decode_writes_ids():
    file = io.StringIO()
    stream = explain.ColoredStream(file=file, colour=False)
    stream(async_round(committed=[1, 3]))
    stream(async_round(index=1, num_accepted=0, committed=[5]))
    assert file.getvalue() == "0 1 3 5"
