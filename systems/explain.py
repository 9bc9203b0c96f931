"""Decoding rounds told in words: what d3d.generate(on_round=...) reports, as a student reads it.

    describe_round(info, block_size=B, decode=tok.decode)  a few lines on one d3d.RoundInfo
    RoundPrinter(decode=tok.decode)       an on_round: every round described, to a file
    ColoredStream(decode=tok.decode)      an on_round: the answer as it is committed, accepted
                                          drafts green, the target's own tokens yellow

Without `decode` (a callable: token ids -> text) tokens are shown as ids. A KV cache of length 7
holds the sequence's first seven tokens, x_0 .. x_6: committed tokens, and after a round the
accepted drafts d_1 .. d_a (which are x_{n+1} .. x_{n+a})."""

from __future__ import annotations

import textwrap

import d3d

WIDTH = 98  # a described round fits a comment line of 100 columns ("# " + text)
GREEN = "\033[32m"  # ANSI colours
YELLOW = "\033[33m"
RESET = "\033[0m"
COLOURS = {"draft": GREEN, "target": YELLOW}  # as decode.py's coloured answers
NBSP = "\u00a0"  # holds a unit such as "d_1 .. d_4" together while lines are wrapped

# the symbols of describe_round, one a line
LEGEND = """\
x_j     the token at position j of the text (the prompt is x_0 onwards)
n       the round starts with x_0 .. x_n committed (the target's cache holds x_0 .. x_{n-1})
d_i     the draft d_1 .. d_B it verifies: R real tokens (B; or B - 1 and a pad)
a       how many the target accepted: d_1 .. d_a
t       the target's own token after them: its correction of d_{a+1}, or the bonus if a = R
(i, t)  an outcome the drafter prepared a block for while the target verified: d_i rejected
        and the target said t; (R + 1, g): all R accepted and the bonus token is g (its guess)
hit     the round's outcome (a + 1, t) was prepared: that block is the next draft
miss    it was not: the next round drafts anew
cache   a KV cache of length 7 holds x_0 .. x_6"""


def _show(token: int, decode) -> str:
    """A token as its id, or as its text (quoted, so that spaces show) when `decode` is given."""
    if decode is None:
        return str(token)
    return repr(decode([token]))


def _unit(text: str) -> str:
    """`text` that a wrapped line never breaks (its spaces are no-break spaces until the end)."""
    return text.replace(" ", NBSP)


def _span(first: int, last: int, name: str = "x") -> str:
    """x_first .. x_last, or x_first alone (never broken over two lines)."""
    if first == last:
        return f"{name}_{first}"
    return _unit(f"{name}_{first} .. {name}_{last}")


def _held(length: int, n: int, num_accepted: int) -> str:
    """What a cache of `length` tokens holds in a round from x_n that accepts d_1 .. d_a."""
    if length == 0:
        return "nothing"
    if length <= n + 1 or length > n + 1 + num_accepted:
        return _span(0, length - 1)
    return _span(0, n) + ", " + _span(1, length - n - 1, "d")


def _cache(name: str, lengths: tuple[int, int], n: int, num_accepted: int) -> str:
    before, after = lengths
    held_before = _held(before, n, num_accepted)
    held_after = _held(after, n, num_accepted)
    return f"  {name:<14}{before} -> {after}: {held_before} -> {held_after}"


def _wrap(label: str, text: str) -> list[str]:
    """`label` in a column of 12, then `text` wrapped under it."""
    head = f"  {label:<12}"
    return textwrap.wrap(text, WIDTH, initial_indent=head, subsequent_indent=" " * len(head))


def _draft_origin(info: d3d.RoundInfo, block_size: int) -> str:
    """Which pass drafted d_1 .. d_B, and which row of it each was read at (draft_rows)."""
    real = info.num_real
    if info.drafted_by == "full acceptance":
        return (
            f"the previous round's full-acceptance block: {_span(1, real, 'd')} from its "
            + _unit(f"MASK 2 .. {block_size}")
            + " (its first row guessed x_n, the bonus token)"
        )
    if info.drafted_by == "branch":
        source = "a rejection branch of the previous round's packed pass (its t is x_n)"
    elif info.mode == "async":
        source = f"a draft pass (x_n and {block_size} MASKs, its KV dropped again)"
    else:
        source = "a draft pass"
    if info.d1_from == "mask":
        rows = f"{_span(1, real, 'd')} from " + _unit(f"MASK 1 .. {real}")
    else:
        rows = f"d_1 from the LM head at x_n, {_span(2, real, 'd')} from "
        rows += _unit(f"MASK 2 .. {real}")
    return f"{source}; {rows}"


def _verdict(info: d3d.RoundInfo, decode) -> str:
    """What the target said: the accepted prefix and its own token."""
    a = info.num_accepted
    t = _show(info.next_token, decode)
    if a == 0:
        return f"a = 0 (d_1 rejected); t = {t}, its correction of d_1"
    accepted = _span(1, a, "d")
    if a == info.num_real:
        return f"a = {a} ({accepted}, all real tokens); t = {t}, its bonus token"
    return f"a = {a} ({accepted}); t = {t}, its correction of d_{a + 1}"


def _pass_lines(info: d3d.RoundInfo, block_size: int) -> list[str]:
    """async: what the round's two passes wrote into the caches before the rewinds."""
    verify = block_size + 1
    segments = len(info.outcomes)
    packed = 1 + block_size + segments * (1 + block_size)
    target_end = info.target_cache[0] + verify
    drafter_end = info.drafter_cache[0] + packed
    draft = f"x_n, {_span(1, block_size, 'd')}"
    branches = _unit(f"{segments - 1} x [t, {block_size} MASKs]")
    full = _unit(f"[d_{info.num_real}, {block_size} MASKs]")
    text = (
        f"verify {draft}: target cache -> {target_end}; packed pass {draft}, {branches}, "
        f"{full}: drafter cache -> {drafter_end}; then both rewind"
    )
    return _wrap("passes", text)


def _outcome_lines(info: d3d.RoundInfo, decode, over: bool) -> list[str]:
    """async: the prepared outcomes, the selected one starred; then the hit or the miss (over:
    the decode ended in this round, so nothing is drafted after it)."""
    shown = [_unit(f"({i}, {_show(t, decode)})") for i, t in info.outcomes]
    hit = info.segment is not None and info.segment >= 0
    if hit:
        shown[info.segment] += "*"
    outcome = f"({info.num_accepted + 1}, {_show(info.next_token, decode)})"
    lines = _wrap("prepared", "(i, t) = " + "  ".join(shown))
    if over and not hit:
        return lines + _wrap("miss", f"nothing prepared for {outcome}; the decode is over")
    if over:
        return lines + _wrap("hit", f"{outcome} was prepared; the decode is over: never used")
    if not hit:
        return lines + _wrap("miss", f"nothing prepared for {outcome}: the next round drafts anew")
    if info.segment == len(info.outcomes) - 1:
        used = "the full-acceptance block: its other B - 1 rows and a pad are the next draft"
    else:
        used = "that branch's block is the next draft"
    return lines + _wrap("hit", f"{outcome} was prepared; {used}")


def describe_round(info: d3d.RoundInfo, *, block_size: int, decode=None, over=False) -> str:
    """A few lines on one round (a d3d.RoundInfo): the draft and where it came from, what the target
    accepted and said, what was committed, in async the prepared outcomes and the one used, and what
    each KV cache held before and after. `decode`: token ids -> text (default: ids shown); `over`:
    the decode ended in this round (async: what its hit selects is never used)."""
    n = info.n
    a = info.num_accepted
    first = n + 1
    last = n + len(info.committed)
    lines = [f"round {info.index}: n = {n}, x_0 .. x_{n} committed"]
    if info.mode == "target":
        lines += _wrap("target", f"t = {_show(info.next_token, decode)}, the target alone")
    else:
        tokens = [_show(t, decode) for t in info.draft[: info.num_real]]
        tokens += ["pad"] * (len(info.draft) - info.num_real)
        draft = f"{_span(1, len(info.draft), 'd')} = {' '.join(tokens)}"
        if info.num_real < len(info.draft):
            draft += f" (d_{len(info.draft)} is a pad: never accepted)"
        lines += _wrap("draft", draft)
        lines += _wrap("", "drafted by " + _draft_origin(info, block_size))
        lines += _wrap("target", _verdict(info, decode))
    committed = " ".join(_show(t, decode) for t in info.committed)
    committed += f" (= {_span(first, last)})"
    if len(info.committed) < a + 1:
        committed += ", cut at EOS or the budget"
    lines += _wrap("committed", committed)
    if info.outcomes is not None:
        lines += _pass_lines(info, block_size)
        lines += _outcome_lines(info, decode, over)
    lines.append(_cache("target cache", info.target_cache, n, a))
    if info.mode != "target":
        lines.append(_cache("drafter cache", info.drafter_cache, n, a))
    return "\n".join(lines).replace(NBSP, " ")


class RoundPrinter:
    """An on_round that prints every round (describe_round) to `file` (default stdout), after a
    header and the legend. `block_size`: default the length of the round's draft."""

    def __init__(self, decode=None, *, file=None, block_size: int | None = None):
        self.decode = decode
        self.file = file  # None: sys.stdout, print's default
        self.block_size = block_size
        self.rounds = 0

    def __call__(self, info: d3d.RoundInfo) -> None:
        block_size = self.block_size
        if block_size is None:
            block_size = len(info.draft)
        if self.rounds == 0:
            header = f"{info.mode} decoding, round by round"
            if info.mode != "target":
                header += f" (B = {block_size})"
            print(header, file=self.file)
            print(LEGEND, file=self.file)
        self.rounds += 1
        print("", file=self.file)
        text = describe_round(info, block_size=block_size, decode=self.decode)
        print(text, file=self.file, flush=True)


class ColoredStream:
    """An on_round that writes the answer to `file` (default stdout) as each round commits it:
    accepted draft tokens in COLOURS["draft"] (green), the target's own token in COLOURS["target"]
    (yellow); colour=False: plain text. The prefill's token, x_n of round 0, is the target's own:
    round 0 writes it first. .tokens: every token written so far."""

    def __init__(self, decode=None, *, file=None, colour: bool = True):
        self.decode = decode
        self.file = file  # None: sys.stdout, print's default
        self.colour = colour
        self.tokens: list[int] = []
        self.shown = ""  # the text of self.tokens, as written

    def __call__(self, info: d3d.RoundInfo) -> None:
        if info.index == 0:
            # the target's prefill committed x_n before the first round
            self._write([info.x_n], "target")
        drafts = info.committed[: info.num_accepted]
        own = info.committed[info.num_accepted :]  # c, unless EOS or the budget cut it off
        self._write(drafts, "draft")
        self._write(own, "target")

    def _write(self, tokens: list[int], origin: str) -> None:
        if not tokens:
            return
        piece = self._piece(tokens)
        if self.colour:
            piece = COLOURS[origin] + piece + RESET
        print(piece, end="", file=self.file, flush=True)

    def _piece(self, tokens: list[int]) -> str:
        """The text `tokens` add. The whole answer is decoded again, so that a character split
        over two tokens (multi-byte text) comes out whole."""
        self.tokens += tokens
        if self.decode is None:
            text = " ".join(str(t) for t in self.tokens)
        else:
            text = self.decode(self.tokens)
        piece = text[len(self.shown) :]
        if not text.startswith(self.shown):
            piece = self.decode(tokens)
        self.shown = text
        return piece
