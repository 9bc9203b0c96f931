"""The paper's pictures drawn by the code: each from what d3d.py builds or returns, as a PNG.

    picture                              data (plain lists)        PNG
    training mask (Fig. 1a)              training_mask_data        draw_training_mask
    asynchronous packed pass (Fig. 1c)   branch_pass_data          draw_branch_pass
    block accuracy by position           block_accuracy_data       draw_block_accuracy
    τ histogram, hits / misses (Fig. 3)  acceptance_data           draw_acceptance
    pruning curve (Fig. 1b)              pruning_curve_data        draw_pruning_curve

A data function returns exactly what its picture shows (the mask cells, the bar heights, the
points), so tests check the numbers, not the pixels. A draw function takes the output path
first, writes the PNG (making its folder) and returns the path. The figure functions beside
them (mask_figure, block_accuracy_figure, acceptance_figure, pruning_curve_figure) return the
unsaved matplotlib Figure, drawn by Agg, for a caller to embed or a test to read.

matplotlib is optional (requirements-plots.txt): without it every draw function raises
PicturesUnavailable. Greys, hatches and marker shapes only, so that a black-and-white print
reads the same.

The two mask pictures need no model (prints the paths it wrote):
    python -m systems.pictures masks --block-size 4 --num-anchors 3 --coverage 2 --fanout 1 \
        --out DIR
The README's two, by name (LAB.md shows the command):
    python -m systems.pictures masks --training-png pictures/training-mask.png \
        --branch-png pictures/branch-pass-mask.png
"""

from __future__ import annotations

import collections
import math
import os
import re
import sys
import types
from dataclasses import dataclass

import torch

import d3d
import runtime
from runtime import Range, setting

# by name: `cli` here is this module's own command (pictures.cli)
from systems.cli import (
    MASK_PICTURES,
    PICTURE,
    PICTURE_MARK,
    Parser,
    add_groups,
    check_flags,
    check_output,
    flag,
    settings_of,
)

try:
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator
    from PIL import Image  # matplotlib's own dependency
    from PIL.PngImagePlugin import PngInfo
except ImportError:
    matplotlib = None


MISSING = "matplotlib is not installed — pip install -r requirements-plots.txt"
MAX_CELLS = 300  # rows or columns of the largest mask picture drawn (labels at 6 pt, 39 inches)
DPI = 150  # pixels per inch of every PNG
CELL = 0.27  # inches per mask cell up to 40 rows; larger masks get smaller cells (_cell_size)
FONT = 7.5  # points, tick labels of the mask pictures
ON = "0.30"  # grey of a cell that may attend
GREYS = ("0.15", "0.55", "0.80", "1.0")  # series fills, dark to white (white has a black edge)
HATCHES = ("", "///", "...", "xx")
_TOKEN = re.compile(r"\b[xdt]_(?:n[+-]\d+|\d+(?:,\d+)?|\{[^}]*\}|[a-z]\b)")  # x_3, t_1,2, x_j


class PicturesUnavailable(runtime.UserError):
    """A picture cannot be drawn: matplotlib is missing or a value is out of range. One line,
    "<what is wrong> — <how to fix it>"."""


def _need_matplotlib() -> None:
    """Raise the one-line error when matplotlib is not importable (every figure function's
    first line, so every draw function's too)."""
    if matplotlib is None:
        raise PicturesUnavailable(MISSING)


# ---------------------------------------------------------------------------------------------
# Mask pictures: what the data functions return


@dataclass(frozen=True)
class MaskSizes:
    """The sizes of the two mask pictures, each also a flag of the masks command (MaskFlags): B,
    K and N of the training mask; B, C, F, the cached tokens and d1_from of the packed pass."""

    block_size: int = setting(4, "B: MASKs per block", Range(int, low=1))
    num_anchors: int = setting(3, "K: blocks of the training mask", Range(int, low=1))
    length: int | None = setting(
        None, "N: clean tokens of the training mask (default: B + 2 K - 1)", Range(int)
    )
    coverage: int = setting(2, "C: positions with rejection branches, 0 .. B", Range(int, low=0))
    fanout: int = setting(1, "F: candidate tokens per position, >= 1", Range(int, low=1))
    past: int = setting(2, "cached tokens before x_n in the packed pass", Range(int, low=0))
    d1_from: str = setting(
        "causal",
        "which rows draft d_1 of a branch's block",
        Range(str, choices=("causal", "mask")),
    )


@dataclass(frozen=True)
class MaskPicture:
    """A packed attention mask and what its rows and columns are.

    mask: (W, past_len + W) bools exactly as d3d returns them (row r may attend to column c);
    columns are past_len cached tokens, then the W packed tokens, rows the W packed tokens.
    tokens, positions: per packed token, its role ("x_3", "d_2", "t_1", "MASK") and position id.
    past_tokens: the cached columns' names. segments: (start, stop, name) packed-token ranges of
    each block or branch; tags: their short names ("1", "S1"). anchors: per segment, the row of
    the causal token it hangs off (the last causal token it sees). draft_rows: per segment, the
    B rows whose hidden states draft its next block, d_1 first (branch pass only)."""

    mask: list[list[bool]]
    tokens: list[str]
    positions: list[int]
    past_tokens: list[str]
    segments: list[tuple[int, int, str]]
    tags: list[str]
    anchors: list[int]
    draft_rows: list[list[int]] | None
    title: str


def spread_anchors(length: int, num_anchors: int, block_size: int) -> list[int]:
    """K distinct anchors j_k spread evenly over the causal rows 0 .. N-1-B, so that every
    block's labels x_{j_k+1} .. x_{j_k+B} lie in the stream; over 0 .. N-2 where N < B + K
    leaves no room (the last blocks then reach past the stream, where training gives them no
    label)."""
    if not 1 <= num_anchors <= length - 1:
        raise PicturesUnavailable(
            f"K = {num_anchors} anchors need 1 <= K <= N - 1 = {length - 1}"
            " — give fewer anchors or a longer stream"
        )
    last = length - 1 - block_size if length - block_size >= num_anchors else length - 2
    if num_anchors == 1:
        return [last // 2]
    step = last / (num_anchors - 1)
    return [math.floor(k * step + 0.5) for k in range(num_anchors)]


def default_length(block_size: int, num_anchors: int) -> int:
    """N of the training-mask picture: B + 2 K - 1, room for K blocks inside the stream."""
    return block_size + 2 * num_anchors - 1


def training_mask_data(
    sizes: MaskSizes = MaskSizes(), anchors: list[int] | None = None
) -> MaskPicture:
    """The training mask (Fig. 1a) as d3d.packed_attention_mask builds it: a causal stream of N
    clean tokens x_0 .. x_{N-1}, then K blocks of B MASKs, block k hanging off anchor j_k.

    sizes: B, K and N (sizes.length, default B + 2 K - 1); anchors: rows of the causal stream
    (default spread_anchors(N, K, B)). Returns a MaskPicture whose mask is
    packed_attention_mask's (1, 1, W, W) mask[0, 0]."""
    block_size, num_anchors, length = sizes.block_size, sizes.num_anchors, sizes.length
    if block_size < 1:
        raise PicturesUnavailable(f"B = {block_size} — give a block size >= 1")
    length = default_length(block_size, num_anchors) if length is None else length
    if anchors is None:
        anchors = spread_anchors(length, num_anchors, block_size)
    anchors = sorted(anchors)
    mask, positions = d3d.packed_attention_mask(length, torch.tensor(anchors), block_size)
    tokens = [f"x_{j}" for j in range(length)] + ["MASK"] * (len(anchors) * block_size)
    segments = []
    for k, j in enumerate(anchors):
        start = length + k * block_size
        name = f"block {k + 1}: anchor x_{j}, predicts x_{j + 1} .. x_{j + block_size}"
        if j + block_size >= length:
            name += f" (x_{length} on: past the stream, no label)"
        segments.append((start, start + block_size, name))
    return MaskPicture(
        mask=mask[0, 0].tolist(),
        tokens=tokens,
        positions=positions[0].tolist(),
        past_tokens=[],
        segments=segments,
        tags=[str(k + 1) for k in range(len(anchors))],
        anchors=anchors,
        draft_rows=None,
        title=f"Training mask (Fig. 1a): N = {length}, K = {len(anchors)}, B = {block_size}",
    )


def _candidate_name(i: int, f: int, fanout: int) -> str:
    """The name of candidate f (0-based) at block position i: t_i, or t_{i,f} when F > 1."""
    return f"t_{i}" if fanout == 1 else f"t_{i},{f + 1}"


def branch_pass_data(sizes: MaskSizes = MaskSizes()) -> MaskPicture:
    """The asynchronous packed pass (Fig. 1c) as d3d.build_branch_pass builds it, for a plan from
    d3d.plan_branches (cover="first": positions i = 1 .. C) over made-up draft logits whose F
    likeliest other tokens at each k are distinct ids, so every token's role reads off its id.

    sizes: B, C, F, the cached tokens and d1_from. No model: build_branch_pass only reads the
    drafter's config (MASK id, d1_from). The cache holds past_len = sizes.past tokens
    x_{n-past_len} .. x_{n-1}. Returns a MaskPicture whose mask is build_branch_pass's
    (1, 1, W, past_len + W) mask[0, 0], with its draft rows."""
    block_size, coverage, fanout = sizes.block_size, sizes.coverage, sizes.fanout
    past_len = sizes.past
    if block_size < 1 or not 0 <= coverage <= block_size or fanout < 1 or past_len < 0:
        raise PicturesUnavailable(
            f"B = {block_size}, C = {coverage}, F = {fanout}, past = "
            f"{past_len} — need B >= 1, 0 <= C <= B, F >= 1, past >= 0"
        )
    x_n, draft = 0, torch.arange(1, block_size + 1)  # ids: x_n = 0, d_i = i
    vocab = 1 + block_size + block_size * fanout
    logits = torch.zeros(block_size, vocab)
    logits[torch.arange(block_size), draft] = 10.0
    names = {x_n: "x_n", vocab: "MASK"}
    for i in range(1, block_size + 1):  # the F runners-up at d_i: ids of their own, in order
        names[i] = f"d_{i}"
        first = 1 + block_size + (i - 1) * fanout
        logits[i - 1, first : first + fanout] = 5.0 - torch.arange(fanout, dtype=torch.float)
        for f in range(fanout):
            names[first + f] = _candidate_name(i, f, fanout)
    budget = d3d.DecodeConfig(coverage=coverage, fanout=fanout, cover="first")
    covered, candidates = d3d.plan_branches(logits, draft, block_size, budget)
    config = d3d.D3DConfig(block_size=block_size, mask_token_id=vocab, d1_from=sizes.d1_from)
    drafter = types.SimpleNamespace(d3d_config=config)  # all build_branch_pass reads of a drafter
    ids, position_ids, mask, rows = d3d.build_branch_pass(
        drafter, torch.tensor([x_n]), draft, covered, candidates, past_len=past_len
    )
    tokens = [names[token] for token in ids[0].tolist()]
    num_causal = 1 + block_size  # x_n, d_1 .. d_B
    seg_len = 1 + block_size  # a candidate t (or d_B), then B MASKs
    segments, anchors = [], []
    branches = [(i, f) for i in covered.tolist() for f in range(fanout)]
    for s, (i, f) in enumerate(branches):
        start = num_causal + s * seg_len
        t = _candidate_name(i, f, fanout)
        accepted = {1: "none accepted", 2: "d_1 accepted"}.get(i, f"d_1 .. d_{i - 1} accepted")
        name = f"S{s + 1}: {accepted}, d_{i} rejected, the target said {t}"
        segments.append((start, start + seg_len, name))
        anchors.append(i - 1)
    start = num_causal + len(segments) * seg_len
    name = f"S{len(segments) + 1}: full acceptance, d_1 .. d_{block_size} accepted"
    segments.append((start, start + seg_len, name))
    anchors.append(block_size - 1)
    return MaskPicture(
        mask=mask[0, 0].tolist(),
        tokens=tokens,
        positions=position_ids[0].tolist(),
        past_tokens=[f"x_n-{past_len - j}" for j in range(past_len)],
        segments=segments,
        tags=[f"S{s + 1}" for s in range(len(segments))],
        anchors=anchors,
        draft_rows=rows.tolist(),
        title=f"Asynchronous packed pass (Fig. 1c): B = {block_size}, "
        f"C = {coverage}, F = {fanout}, d_1 from {sizes.d1_from!r}",
    )


# ---------------------------------------------------------------------------------------------
# Mask pictures: drawing


def _math(name: str) -> str:
    """A token name as mathtext: x_3 -> $x_{3}$, t_1,2 -> $t_{1,2}$, x_n-1 -> $x_{n-1}$."""
    if "_" not in name:
        return name
    base, sub = name.split("_", 1)
    return f"${base}_{{{sub.strip('{}')}}}$"


def _position(p: int, past_len: int, relative: bool) -> str:
    """A position id as the picture prints it: absolute, or relative to x_n (n, n+1, ...)."""
    if not relative:
        return str(p)
    offset = p - past_len
    return "n" if offset == 0 else f"n{offset:+d}"


def _new_figure(width: float, height: float):
    """A figure drawn by the Agg backend (no window, no global pyplot state), its size a whole
    number of pixels."""
    figure = Figure(figsize=(round(width * DPI) / DPI, round(height * DPI) / DPI), dpi=DPI)
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str) -> str:
    """Write the figure as a greyscale PNG at path (its folder made) and return the path.

    Every picture is drawn in greys, so one grey channel loses nothing: the file is a third of
    an RGBA one, and what is saved is what a black-and-white print shows. Its text names this
    module (cli.PICTURE_MARK): a command writes over a picture it drew, and over no other file
    without --force (cli.check_output)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    figure.set_facecolor("white")
    figure.canvas.draw()
    rgba = Image.frombuffer(
        "RGBA", figure.canvas.get_width_height(), figure.canvas.buffer_rgba(), "raw", "RGBA", 0, 1
    )
    text = PngInfo()
    text.add_text(*PICTURE_MARK)
    rgba.convert("L").save(path, format="png", optimize=True, pnginfo=text)
    return path


def _math_names(text: str) -> str:
    """Every token name inside a sentence as mathtext (x_0 .. x_4, d_2, t_1,2)."""
    return _TOKEN.sub(lambda m: _math(m.group(0)), text)


def _cell_size(count: int) -> tuple[float, float]:
    """Inches per cell and points of tick labels for a mask of `count` rows or columns: larger
    masks get smaller cells, never below what a 6 pt label needs."""
    cell = CELL if count <= 40 else max(0.13, CELL * 40 / count)
    return cell, min(FONT, 0.8 * 72 * cell)


def _right_of_cells(ax, text: str, height: float, gap: float, fontsize: float) -> None:
    """A line of text right of the mask's cells, centred at `height` (a fraction of the axes,
    0 at the bottom), `gap` points from them."""
    ax.annotate(
        text,
        (1.0, height),
        xycoords="axes fraction",
        xytext=(gap, 0),
        textcoords="offset points",
        va="center",
        fontsize=fontsize,
    )


def _notes(picture: MaskPicture) -> list[str]:
    """The lines under a mask picture's title: how its rows, columns, dots, tags and arrows
    read."""
    unit = "block" if picture.draft_rows is None else "segment"
    notes = ["rows and columns: token (position id); the columns are the same tokens"]
    if picture.past_tokens:
        notes[0] += ", after the cached ones (left of the dashed line; the cache is seen by all)"
    notes.append(
        f"white dot, and the {unit}'s tag below its column: its anchor, the last causal "
        f"token the {unit} sees"
    )
    if picture.draft_rows is not None:
        notes.append(
            "◀ i right of a row: its hidden state drafts token i of the segment's "
            "block; on a hit that block is the next draft"
        )
        notes.append(
            "    (full acceptance: token 1 guesses the bonus token, 2 .. B are the next draft)"
        )
    else:
        notes.append(
            "a causal row x_j predicts x_{j+1} (L_AR); a MASK at position j predicts x_j (L_block)"
        )
    return notes


def _draw_cells(ax, cells, picture: MaskPicture, relative: bool, font: float) -> None:
    """The mask as one image cell per entry, dark where the row may attend, each column and row
    named by its token and position id, thin grey lines between the cells."""
    rows, cols = cells.shape
    past = len(picture.past_tokens)
    # the position id of every column: the cached tokens 0 .. past_len-1, then the packed
    # tokens' own positions
    column_positions = list(range(past)) + list(picture.positions)
    names = [
        f"{_math(t)} ({_position(p, past, relative)})"
        for t, p in zip(picture.past_tokens + picture.tokens, column_positions)
    ]
    colours = ListedColormap(["white", ON])  # 0: masked, 1: may attend
    ax.imshow(cells, cmap=colours, vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    # the rows are the packed tokens: the columns after the cached ones
    ax.set_yticks(range(rows), names[past:], fontsize=font)
    ax.set_xticks(range(cols), names, fontsize=font, rotation=90)
    ax.xaxis.tick_top()
    ax.tick_params(length=0, pad=2)
    ax.set_xticks([c - 0.5 for c in range(1, cols)], minor=True)
    ax.set_yticks([r - 0.5 for r in range(1, rows)], minor=True)
    ax.grid(which="minor", color="0.75", linewidth=0.4)
    ax.tick_params(which="minor", length=0)


def _draw_segments(ax, picture: MaskPicture) -> None:
    """On the cells: a black line around the causal stream and each block or segment, a dashed
    one right of the cache, and a white dot in each segment row at its anchor's column."""
    past = len(picture.past_tokens)
    num_causal = picture.segments[0][0]
    for b in [num_causal] + [stop for _, stop, _ in picture.segments[:-1]]:
        ax.axhline(b - 0.5, color="black", linewidth=1.6)  # between stream and segments
        ax.axvline(past + b - 0.5, color="black", linewidth=1.6)
    if past:
        ax.axvline(past - 0.5, color="black", linewidth=1.0, linestyle=(0, (3, 2)))
    for (start, stop, _), anchor in zip(picture.segments, picture.anchors):
        column = [past + anchor] * (stop - start)
        ax.plot(column, range(start, stop), "o", color="white", markersize=2.6, markeredgewidth=0)


def _draw_labels(ax, picture: MaskPicture, tags_at: dict, font: float, rotation: int) -> None:
    """Around the cells: each segment's name right of it, the tags below each anchor column
    (tags_at: column -> tags), and ◀ i right of each draft row."""
    rows = len(picture.tokens)
    for start, stop, name in picture.segments:
        middle = 1 - ((start + stop) / 2) / rows
        _right_of_cells(ax, _math_names(name), middle, 24, FONT)
    for column, tags in tags_at.items():  # below each anchor column, read downwards
        ax.annotate(
            ", ".join(tags),
            (column, rows - 0.5),
            xytext=(0, -3),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=font,
            rotation=rotation,
        )
    for segment_rows in picture.draft_rows or []:
        for i, r in enumerate(segment_rows):
            _right_of_cells(ax, f"◀ {i + 1}", 1 - (r + 0.5) / rows, 2, font)


def _draw_key(figure, title: str, notes: list[str], width: float, height: float) -> None:
    """Above the cells, the title and the notes; at the bottom left, what the two greys mean."""
    key = [
        Patch(facecolor=ON, edgecolor="0.5", label="row may attend to column"),
        Patch(facecolor="white", edgecolor="0.5", label="masked"),
    ]
    figure.legend(handles=key, loc="lower left", fontsize=FONT, frameon=False, ncols=2)
    corner = 0.1 / width  # 0.1 inch from the left edge, as a fraction of the width
    title = _math_names(title)
    figure.text(
        corner, 1 - 0.1 / height, title, ha="left", va="top", fontsize=FONT + 2.5, weight="bold"
    )
    text = "\n".join(_math_names(n) for n in notes)
    figure.text(
        corner, 1 - 0.38 / height, text, ha="left", va="top", fontsize=FONT, linespacing=1.5
    )


def mask_figure(picture: MaskPicture, relative: bool = False):
    """The figure of a mask picture: one image cell per mask entry (figure.axes[0].images[0]
    holds the mask as drawn), dark where the row may attend; positions relative to x_n
    (n, n+1, ...) if `relative`."""
    _need_matplotlib()
    cells = torch.tensor(picture.mask, dtype=torch.float).numpy()
    rows, cols = cells.shape
    if max(rows, cols) > MAX_CELLS:
        raise PicturesUnavailable(
            f"a {rows} x {cols} mask is too large to read as a picture "
            f"(at most {MAX_CELLS} rows and columns) — give a smaller B, "
            "K, N, C or F"
        )
    past = len(picture.past_tokens)
    cell, font = _cell_size(max(rows, cols))
    longest = max(len(name) for _, _, name in picture.segments)
    tags_at = collections.defaultdict(list)  # column -> tags of the segments anchored there
    for tag, anchor in zip(picture.tags, picture.anchors):
        tags_at[past + anchor].append(tag)
    tag_length = max(len(", ".join(tags)) for tags in tags_at.values())
    notes = _notes(picture)
    label_height = max(len(n) for n in picture.past_tokens + picture.tokens) + 5
    left = 1.3  # inches around the cells
    top = 0.55 + 0.17 * len(notes) + label_height * font * 0.6 / 72
    bottom = 0.45 + tag_length * font * 0.6 / 72
    right = 0.75 + longest * FONT * 0.55 / 72
    width = max(left + cols * cell + right, 0.3 + max(len(n) for n in notes) * FONT * 0.52 / 72)
    height = top + rows * cell + bottom
    figure = _new_figure(width, height)
    box = (left / width, bottom / height, cols * cell / width, rows * cell / height)
    ax = figure.add_axes(box)
    _draw_cells(ax, cells, picture, relative, font)
    _draw_segments(ax, picture)
    _draw_labels(ax, picture, tags_at, font, -90 if tag_length > 2 else 0)
    ax.set_xlim(-0.5, cols - 0.5)
    ax.set_ylim(rows - 0.5, -0.5)
    _draw_key(figure, picture.title, notes, width, height)
    return figure


def draw_training_mask(path: str, *args, **settings) -> str:
    """Draw training_mask_data(*args, **settings) (sizes, anchors) as a PNG at path. Returns the
    path."""
    _need_matplotlib()
    return _save(mask_figure(training_mask_data(*args, **settings)), path)


def draw_branch_pass(path: str, sizes: MaskSizes = MaskSizes()) -> str:
    """Draw branch_pass_data(sizes) as a PNG at path, positions relative to x_n. Returns the
    path."""
    _need_matplotlib()
    picture = branch_pass_data(sizes)
    return _save(mask_figure(picture, relative=True), path)


# ---------------------------------------------------------------------------------------------
# Block accuracy by position


def block_accuracy_data(block_acc) -> dict:
    """Bars of block accuracy by position: block_acc is d3d_loss's metrics["block_acc"] (B,), the
    share of position-i predictions that were right, or {name: such values} to compare drafters.
    Returns {"positions": [1 .. B], "percent": {name: [100 * acc_i]}} (one series is named
    "block accuracy")."""
    series = block_acc if isinstance(block_acc, dict) else {"block accuracy": block_acc}
    percent = {}
    for name, values in series.items():
        # a tensor, an array or a sequence of numbers
        if hasattr(values, "tolist"):
            values = values.tolist()
        values = [float(v) for v in values]
        if not values or not all(0.0 <= v <= 1.0 for v in values):
            raise PicturesUnavailable(
                f"{name}: {values} — give per-position accuracies as "
                "fractions in [0, 1], one per block position"
            )
        percent[name] = [100.0 * v for v in values]
    series_lengths = {len(v) for v in percent.values()}
    if len(series_lengths) != 1:
        lengths = sorted(series_lengths)
        raise PicturesUnavailable(f"series of lengths {lengths} — give every series B values")
    return {"positions": list(range(1, series_lengths.pop() + 1)), "percent": percent}


def _bars(ax, x, heights, width: float, index: int, label: str = "", texts=None) -> None:
    """Bars of series `index`, filled with a grey of the ramp and a hatch, both black-and-white
    safe; each bar's value (or its text of `texts`) above it, on white so that a line behind it
    cannot hide it."""
    fill = {"color": GREYS[index % len(GREYS)], "hatch": HATCHES[index % len(HATCHES)]}
    bars = ax.bar(x, heights, width, label=label, edgecolor="black", linewidth=0.6, **fill)
    box = {"facecolor": "white", "edgecolor": "none", "pad": 0.4}
    ax.bar_label(bars, texts, fontsize=7, padding=1.5, bbox=box)


def draw_block_accuracy(path: str, block_acc, *, title: str | None = None) -> str:
    """Draw block_accuracy_data(block_acc) as bars, 0-100 %, with each bar's value on it.
    Returns the path."""
    return _save(block_accuracy_figure(block_acc, title=title), path)


def block_accuracy_figure(block_acc, *, title: str | None = None):
    """The figure draw_block_accuracy writes: figure.axes[0].containers[s] holds series s's
    bars."""
    _need_matplotlib()
    data = block_accuracy_data(block_acc)
    positions, series = data["positions"], data["percent"]
    figure = _new_figure(max(4.5, 1.2 + 0.55 * len(positions) * len(series)), 3.4)
    ax = figure.add_subplot()
    width = 0.8 / len(series)
    for s, (name, values) in enumerate(series.items()):
        x = [p - 0.4 + width * (s + 0.5) for p in positions]
        _bars(ax, x, values, width, s, _math_names(name), [f"{v:.0f}" for v in values])
    ax.set_xticks(positions)
    ax.set_ylim(0, 100)
    ax.set_xlabel("position i in the block ($d_i$, the guess at $x_{j_k+i}$)")
    ax.set_ylabel("share of blocks (%)")  # right at i, or right at 1 .. i: the title says which
    if title is None:
        title = f"Block accuracy by position (B = {len(positions)})"
    ax.set_title(_math_names(title), fontsize=10, pad=10)
    ax.grid(axis="y", color="0.85", linewidth=0.6)
    ax.set_axisbelow(True)
    if len(series) > 1:
        ax.legend(fontsize=8, frameon=False)
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------------------------------------
# Acceptance lengths and hits / misses per first rejection (Fig. 3)


def acceptance_data(stats: dict, block_size: int | None = None) -> dict:
    """The bars of the acceptance picture, from the stats d3d.generate returns.

    tau: 1 .. B+1; counts: rounds whose accept length (stats["accept_lengths"]: tokens committed,
    accepted + 1) is tau. outcomes: accepted drafts a = 0 .. B; hits, misses: the async run's
    hits_per_position and misses_per_position (index a: d_{a+1} rejected; B: all accepted),
    None for a sync run. B comes from the async counts, else from block_size (needed then)."""
    lengths = list(stats["accept_lengths"])
    hits, misses = stats.get("hits_per_position"), stats.get("misses_per_position")
    if hits is not None:
        block_size = len(hits) - 1
    if block_size is None:
        raise PicturesUnavailable("a sync run's stats do not say B — pass block_size")
    too_long = [n for n in lengths if not 1 <= n <= block_size + 1]
    if too_long:
        raise PicturesUnavailable(
            f"accept lengths {too_long[:5]} outside 1 .. B+1 = "
            f"{block_size + 1} — pass the B the run decoded with"
        )
    count = collections.Counter(lengths)
    tau = list(range(1, block_size + 2))
    return {
        "block_size": block_size,
        "tau": tau,
        "counts": [count[t] for t in tau],
        "mean_tau": sum(lengths) / len(lengths) if lengths else math.nan,
        "outcomes": list(range(block_size + 1)),
        "hits": None if hits is None else list(hits),
        "misses": None if misses is None else list(misses),
    }


def draw_acceptance(
    path: str, stats: dict, block_size: int | None = None, *, title: str | None = None
) -> str:
    """Draw acceptance_data(stats, block_size): the τ histogram and, for an async run, hits and
    misses per first rejection beside it. Returns the path."""
    return _save(acceptance_figure(stats, block_size, title=title), path)


def _tau_bars(ax, data: dict) -> None:
    """The τ histogram of acceptance_data's `data`: rounds per accept length, and the mean τ
    over all rounds as a dashed line."""
    rounds = sum(data["counts"])
    _bars(ax, data["tau"], data["counts"], 0.7, 1)
    mean = f"mean τ = {data['mean_tau']:.2f}\nover all {rounds} rounds"
    ax.axvline(data["mean_tau"], color="black", linestyle=(0, (4, 2)), linewidth=1.0, label=mean)
    ax.set_xticks(data["tau"])
    ax.set_xlabel("τ: tokens committed in a round (accepted + 1)")
    ax.set_title(f"Acceptance lengths ({rounds} rounds, B = {data['block_size']})", fontsize=10)


def _outcome_bars(ax, data: dict) -> None:
    """Hits and misses of acceptance_data's `data` side by side, per drafts accepted a = 0 ..
    B, the hit rate in the title."""
    x = data["outcomes"]
    # hits left of each outcome, misses right of it
    sides = [
        (-0.19, "hits", "hit: prepared block", 0),
        (0.19, "misses", "miss: fallback draft", 3),
    ]
    for shift, key, label, style in sides:
        _bars(ax, [a + shift for a in x], data[key], 0.38, style, label)
    ax.set_xticks(x)
    ax.set_xlabel(
        "drafts accepted a, by where the first rejection was\n"
        "(a < B: $d_{a+1}$ rejected; B: every real token accepted)"
    )
    hits = sum(data["hits"])
    total = hits + sum(data["misses"])
    rate = hits / total if total else math.nan
    ax.set_title(f"Hits and misses per first rejection (hit rate {rate:.0%})", fontsize=10)


def acceptance_figure(stats: dict, block_size: int | None = None, *, title: str | None = None):
    """The figure draw_acceptance writes: figure.axes[0].containers[0] holds the τ bars; for an
    async run figure.axes[1].containers[0] and [1] hold the hits and the misses."""
    _need_matplotlib()
    data = acceptance_data(stats, block_size)
    panels = 1 if data["hits"] is None else 2
    size = data["block_size"] + 1
    figure = _new_figure(max(4.2, 1.4 + 0.42 * size) * panels, 3.6)
    axes = figure.subplots(1, panels, squeeze=False)[0]
    _tau_bars(axes[0], data)
    if panels == 2:
        _outcome_bars(axes[1], data)
    for ax in axes:
        ax.set_ylabel("rounds")
        ax.legend(fontsize=8, frameon=False, loc="best")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        top = ax.get_ylim()[1]
        ax.set_ylim(0, top * 1.25 if top > 0 else 1)  # room for the legend above the bars
        ax.grid(axis="y", color="0.85", linewidth=0.6)
        ax.set_axisbelow(True)
    if title:
        figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------------------------------------
# The pruning curve (Fig. 1b)


def pruning_curve_data(rows) -> dict:
    """The points of the pruning curve, from the rows d3d.prune_drafter yields (or the "table"
    of prune_table.json): the unpruned row first, then one per removal.

    Returns {"layers": [...], "tau_before": [...], "tau_after": [...], "removed": [None, layer,
    ...], "kept": [...], "tau0": unpruned τ}; index 0 is the unpruned drafter, whose τ starts both
    curves."""
    rows = list(rows)
    if not rows or rows[0]["removed_layer"] is not None:
        raise PicturesUnavailable(
            "the rows do not start with the unpruned drafter's — give every"
            " row prune_drafter yields, the first included"
        )
    return {
        "layers": [r["layers"] for r in rows],
        "tau_before": [r["tau_before_recovery"] for r in rows],
        "tau_after": [r["tau_after_recovery"] for r in rows],
        "removed": [r["removed_layer"] for r in rows],
        "kept": [r["kept"] for r in rows],
        "tau0": rows[0]["tau_after_recovery"],
    }


def draw_pruning_curve(
    path: str, rows, *, tau_floor: float | None = None, title: str | None = None
) -> str:
    """Draw pruning_curve_data(rows): τ before and after recovery against the drafter's depth,
    pruning going left to right, the unpruned τ as a reference line (and tau_floor x it, the
    stopping rule, if given). Returns the path."""
    return _save(pruning_curve_figure(rows, tau_floor=tau_floor, title=title), path)


def pruning_curve_figure(rows, *, tau_floor: float | None = None, title: str | None = None):
    """The figure draw_pruning_curve writes: its lines labelled "before recovery ..." and
    "after recovery" hold the points."""
    _need_matplotlib()
    data = pruning_curve_data(rows)
    layers = data["layers"]
    figure = _new_figure(max(4.8, 1.6 + 0.7 * len(layers)), 3.8)
    ax = figure.add_subplot()
    unpruned = f"unpruned τ = {data['tau0']:.3f}"
    ax.axhline(data["tau0"], color="0.5", linewidth=0.8, linestyle=(0, (1, 2)), label=unpruned)
    if tau_floor is not None:
        floor = tau_floor * data["tau0"]  # the stopping rule
        label = f"floor: {tau_floor} × unpruned τ"
        ax.axhline(floor, color="0.3", linewidth=0.8, linestyle=(0, (6, 3)), label=label)
    ax.plot(
        layers,
        data["tau_before"],
        color="0.45",
        linestyle=(0, (4, 2)),
        marker="s",
        markerfacecolor="white",
        markeredgecolor="0.25",
        markersize=6,
        label="before recovery (right after the removal)",
    )
    ax.plot(
        layers, data["tau_after"], color="black", marker="o", markersize=5, label="after recovery"
    )
    undone = "undone: below the floor"
    for i in range(1, len(layers)):
        if not data["kept"][i]:
            ax.plot(
                layers[i], data["tau_after"][i], "x", color="black", markersize=11, label=undone
            )
    ticks = [f"{layers[0]}\nunpruned"]
    ticks += [f"{n}\n−layer {r}" for n, r in zip(layers[1:], data["removed"][1:])]
    ax.set_xticks(layers, ticks, fontsize=8)
    ax.set_xlim(max(layers) + 0.5, min(layers) - 0.5)
    taus = data["tau_before"] + data["tau_after"] + [data["tau0"]]  # the points, the unpruned τ
    low = min(taus)
    high = max(taus)
    span = max(high - low, 0.5)  # a flat curve still gets a readable axis
    ax.set_ylim(max(0.9, low - 0.15 * span), high + 0.25 * span)  # τ >= 1: never far below 1
    ax.set_xlabel(
        "decoder layers left, and the layer that step removed\n"
        "(its index in the unpruned drafter; pruning goes left to right)",
        fontsize=9,
    )
    ax.set_ylabel("offline τ (accepted + 1)")
    ax.set_title(title or "Progressive layer pruning with recovery (Fig. 1b)", fontsize=10)
    ax.grid(color="0.88", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.legend(fontsize=7.5, frameon=False, loc="best")
    figure.tight_layout()
    return figure


# ---------------------------------------------------------------------------------------------
# python -m systems.pictures masks ...


@dataclass(frozen=True)
class MaskFlags(MaskSizes):
    """The flags of `python -m systems.pictures masks` (cli.add_settings): the sizes of the two
    mask pictures (MaskSizes) and where they go. --length must also be >= K + 1 and --coverage <= B
    (parse_args narrows their ranges once it has read K and B)."""

    out: str = flag("runs/pictures", "folder for the PNGs")
    training_png: str | None = flag(
        None,
        "where the training mask goes (default: OUT/training_mask_B<B>_K<K>.png)",
        metavar="PATH.png",
    )
    branch_png: str | None = flag(
        None,
        "where the packed pass's mask goes (default: OUT/branch_pass_B<B>_C<C>_F<F>.png)",
        metavar="PATH.png",
    )
    force: bool = flag(
        False,
        "write over a folder or file that holds what this command did not draw (default: "
        "refuse); never into the repository's toy-target/",
        Range(bool),
    )


def parse_args(argv=None) -> MaskFlags:
    """The command line of `python -m systems.pictures`, every flag in its range."""
    prog = "python -m systems.pictures"
    description = "Draw the paper's pictures that need no model."
    ap = Parser(prog=prog, usage="%(prog)s masks [flags]", description=description)
    commands = ap.add_subparsers(dest="command", required=True, parser_class=Parser, prog=prog)
    masks = commands.add_parser(
        "masks",
        help="the training mask (Fig. 1a) and the asynchronous "
        "packed pass's mask (Fig. 1c), as PNGs",
        description="Draw the training mask and the asynchronous packed "
        "pass's mask as d3d.py builds them.",
    )
    groups = {"the mask pictures": MaskFlags}
    add_groups(masks, groups)
    values = vars(ap.parse_args(argv))
    # the ranges of --length (its default, B + 2 K - 1, is always in it) and --coverage depend
    # on K and B, whose own ranges check_flags checks first
    K, B = values["num_anchors"], values["block_size"]
    narrower = {"length": Range(int, low=K + 1), "coverage": Range(int, low=0, high=B)}
    check_flags(values, groups, narrower)
    return settings_of(MaskFlags, values)


def main(argv=None) -> list[str]:
    """`python -m systems.pictures masks ...`: write both mask pictures (into --out, or where
    --training-png and --branch-png say), printing each path as it is written. Returns the
    paths. Every path is checked before the first is drawn (cli.check_output): --out must be
    absent, empty or hold only pictures this project drew, each PNG flag absent or such a
    picture, unless --force."""
    args = parse_args(argv)
    training = args.training_png
    branch = args.branch_png
    if training is None or branch is None:
        check_output("--out", args.out, MASK_PICTURES, args.force)
    check_output("--training-png", training, PICTURE, args.force)
    check_output("--branch-png", branch, PICTURE, args.force)
    if training is None:
        name = f"training_mask_B{args.block_size}_K{args.num_anchors}.png"
        training = os.path.join(args.out, name)
    draw_training_mask(training, args)
    print(training)
    if branch is None:
        name = f"branch_pass_B{args.block_size}_C{args.coverage}_F{args.fanout}.png"
        branch = os.path.join(args.out, name)
    draw_branch_pass(branch, args)
    print(branch)
    return [training, branch]


def cli(argv=None) -> int:
    """main(argv) as a command: a bad flag or a PicturesUnavailable (a runtime.UserError)
    becomes `error: ...` on stderr and exit status 2. Returns the exit status."""
    try:
        main(argv)
    except runtime.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
