"""A decode's rounds, watched from outside the method: each decoding loop of d3d.py hands its
round's values to one Watch call, after the round's one host read, its commit and its rewinds.
The Watch feeds whoever watches:

    on_round    a d3d.RoundInfo per round (built only when on_round is given)
    streamer    a transformers streamer: the prompt, the prefill's token, each round's commit
    the tally   async's hits and misses per first rejected position, for the stats

This module sits below d3d.py: it imports only runtime, and d3d.generate makes the Watch,
handing it the record to build (d3d.RoundInfo)."""

from __future__ import annotations

import torch

from runtime import Output


class Watch:
    """The watchers of one decode. config: generate's DecodeConfig, every setting resolved;
    caches: its runtime.Caches (their lengths are read, never changed); record: the class of
    a round's record (d3d.RoundInfo); drafter: the d3d.Drafter (its d1_from is recorded)."""

    def __init__(self, config, caches, record, drafter, on_round=None, streamer=None):
        self.config = config
        self.caches = caches
        self.record = record
        self.on_round = on_round
        self.streamer = streamer
        # what the next round's record needs from the rounds before it
        self.index = 0
        self.size = 0
        self.lengths = (0, 0)
        self.drafted_by = ""
        self.d1_from = ""
        if config.mode != "target":
            self.drafted_by = "draft pass"
            self.d1_from = drafter.d3d_config.d1_from
        # async: hits and misses by the first rejected position (index i - 1: d_i rejected;
        # index B: full acceptance), and the padded drafts accepted whole
        positions = (config.block_size or 0) + 1
        self.hits = [0] * positions
        self.misses = [0] * positions
        self.pad_full = 0

    def start(self, out: Output) -> None:
        """After the prefill: the prompt and the prefill's token go to the streamer."""
        if self.streamer is not None:
            self.streamer.put(torch.tensor([out.tokens[: out.prompt_len]]))
            if len(out.tokens) > out.prompt_len:
                self.streamer.put(torch.tensor([out.tokens[out.prompt_len :]]))
        self.size = len(out.tokens)
        self.lengths = self._cache_lengths()

    def __call__(self, out: Output, draft, num_real, verdict, plan=None, segment=None) -> None:
        """One round, as host values: `draft` d_1 .. d_B (ints; [] in target mode) with R =
        num_real real tokens, `verdict` (a, t); async: `plan` (covered, candidates, guess), the
        outcomes the packed pass prepared (plan_branches, bonus_guess), and the selected
        `segment` (select_segment: -1 on a miss)."""
        if self.streamer is not None:
            self.streamer.put(torch.tensor([out.tokens[self.size :]]))
        if self.on_round is not None:
            self.on_round(self._record(out, draft, num_real, verdict, plan, segment))
        if segment is not None:
            self._tally(verdict[0], num_real, segment)
            self.drafted_by = _drafted_by(segment, plan)
        self.index += 1
        self.size = len(out.tokens)
        self.lengths = self._cache_lengths()

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

    def stats(self) -> dict:
        """Async's tally and branch budget (runtime.Output.stats lists the keys); {} in the
        other modes."""
        if self.config.mode != "async":
            return {}
        return {
            "hits_per_position": self.hits,
            "misses_per_position": self.misses,
            "pad_full_acceptances": self.pad_full,
            "coverage": self.config.coverage,
            "fanout": self.config.fanout,
            "cover": self.config.cover,
            "lanes": self.config.lanes,
        }

    def _tally(self, num_accepted: int, num_real: int, segment: int) -> None:
        # d_{a+1} rejected: index a
        index = num_accepted
        if num_accepted == num_real:
            index = self.config.block_size  # full acceptance
        if segment >= 0:
            self.hits[index] += 1
        else:
            self.misses[index] += 1
        if num_real < self.config.block_size and num_accepted == num_real:
            self.pad_full += 1

    def _cache_lengths(self) -> tuple[int, int]:
        drafter_length = 0
        if self.config.mode != "target":
            drafter_length = self.caches.drafter.length
        return self.caches.target.length, drafter_length

    def _record(self, out: Output, draft, num_real, verdict, plan, segment):
        end = self._cache_lengths()
        outcomes = None
        if plan is not None:
            outcomes = _outcomes(plan, num_real)
        return self.record(
            mode=self.config.mode,
            index=self.index,
            n=self.size - 1,
            x_n=out.tokens[self.size - 1],
            draft=list(draft),
            num_real=num_real,
            drafted_by=self.drafted_by,
            d1_from=self.d1_from,
            num_accepted=verdict[0],
            next_token=verdict[1],
            committed=out.tokens[self.size :],
            target_cache=(self.lengths[0], end[0]),
            drafter_cache=(self.lengths[1], end[1]),
            outcomes=outcomes,
            segment=segment,
        )


def _outcomes(plan, num_real: int) -> list[tuple[int, int]]:
    """The outcomes (i, t) the packed pass's segments were prepared for, in their order: each
    covered position i with each of its candidates t, then full acceptance (R + 1, g)."""
    covered, candidates, guess = plan
    outcomes = []
    for position, tokens in zip(covered, candidates):
        for token in tokens:
            outcomes.append((position, token))
    outcomes.append((num_real + 1, guess))
    return outcomes


def _drafted_by(segment: int, plan) -> str:
    """Which pass drafts the round after an async round whose outcome selected `segment`."""
    _, candidates, _ = plan
    num_branches = sum(len(tokens) for tokens in candidates)
    if segment < 0:
        return "draft pass"
    if segment == num_branches:
        return "full acceptance"
    return "branch"
