"""Tests for systems/pictures.py: every picture shows what d3d.py builds or returns. The data
functions run without matplotlib; the drawing tests skip without it. Tiny models from
test_d3d.py's configs, CPU, a few seconds in all.

Run: python -m pytest -q tests/test_pictures.py
"""

import collections

import pytest
import torch

import d3d
from systems import pictures
from test_d3d import make_tokenizer, prune_data, tiny_qwen3


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture
def mpl():
    return pytest.importorskip("matplotlib")


def drawn_mask(picture: pictures.MaskPicture, relative: bool = False) -> list[list[bool]]:
    """The cells the mask picture draws, as bools."""
    image = pictures.mask_figure(picture, relative).axes[0].images[0]
    return (torch.tensor(image.get_array().tolist()) > 0.5).tolist()


def heights(container) -> list[float]:
    """The heights of a bar container's bars."""
    return [bar.get_height() for bar in container]


def line(figure, label: str):
    """The figure's line whose legend label starts with `label`."""
    return next(ln for ln in figure.axes[0].lines if ln.get_label().startswith(label))


# the sizes of the README's two mask pictures
README_SIZES = pictures.MaskSizes(block_size=4, num_anchors=3, coverage=2, fanout=1)


# ---------------------------------------------------------------------------------------------
# The mask pictures


@pytest.mark.parametrize(
    "block_size,num_anchors,length", [(4, 3, None), (8, 3, None), (1, 1, 2), (5, 2, 4)]
)
def test_training_mask_picture_is_packed_attention_mask(block_size, num_anchors, length):
    sizes = pictures.MaskSizes(block_size=block_size, num_anchors=num_anchors, length=length)
    picture = pictures.training_mask_data(sizes)
    length = length or pictures.default_length(block_size, num_anchors)
    anchors = torch.tensor(picture.anchors)
    mask, positions = d3d.packed_attention_mask(length, anchors, block_size)
    assert picture.mask == mask[0, 0].tolist()
    assert picture.positions == positions[0].tolist()
    assert picture.tokens == [f"x_{j}" for j in range(length)] + ["MASK"] * (
        num_anchors * block_size
    )
    assert len(set(picture.anchors)) == num_anchors
    for (start, stop, _), anchor in zip(picture.segments, picture.anchors):
        assert stop - start == block_size
        assert all(picture.mask[r][anchor] for r in range(start, stop))  # sees its anchor
        assert not any(picture.mask[r][anchor + 1] for r in range(start, stop))  # and no further


@pytest.mark.parametrize("block_size,num_anchors", [(4, 3), (8, 2)])
def test_training_mask_cells_drawn_are_the_mask(mpl, block_size, num_anchors):
    sizes = pictures.MaskSizes(block_size=block_size, num_anchors=num_anchors)
    picture = pictures.training_mask_data(sizes)
    assert drawn_mask(picture) == picture.mask


@pytest.mark.parametrize(
    "block_size,coverage,fanout,past_len", [(4, 2, 1, 2), (5, 3, 2, 0), (6, 0, 1, 3), (1, 1, 1, 1)]
)
def test_branch_pass_picture_is_build_branch_pass_mask(tok, block_size, coverage, fanout, past_len):
    """Against a real drafter and random draft logits: the mask depends on B, C, F only."""
    sizes = pictures.MaskSizes(
        block_size=block_size, coverage=coverage, fanout=fanout, past=past_len
    )
    picture = pictures.branch_pass_data(sizes)
    drafter = d3d.make_drafter(tiny_qwen3(seed=3), tokenizer=tok, block_size=block_size)
    logits = torch.randn(block_size, 99, generator=torch.Generator().manual_seed(block_size))
    draft = logits.argmax(-1)
    budget = d3d.DecodeConfig(coverage=coverage, fanout=fanout)
    covered, candidates = d3d.plan_branches(logits, draft, block_size, budget)
    ids, position_ids, mask, rows = d3d.build_branch_pass(
        drafter,
        torch.tensor([5]),
        draft,
        covered,
        candidates,
        past_len=past_len,
    )
    assert picture.mask == mask[0, 0].tolist()
    assert picture.positions == position_ids[0].tolist()
    assert picture.draft_rows == rows.tolist()
    mask_id = drafter.d3d_config.mask_token_id
    assert [t == "MASK" for t in picture.tokens] == (ids[0] == mask_id).tolist()
    firsts = [picture.tokens[start] for start, _, _ in picture.segments]
    assert len(firsts) == coverage * fanout + 1
    assert all(t.startswith("t_") for t in firsts[:-1]) and firsts[-1] == f"d_{block_size}"
    for (start, stop, _), anchor in zip(picture.segments, picture.anchors):
        assert stop - start == 1 + block_size
        seen = picture.mask[start][past_len : past_len + 1 + block_size]  # the causal columns
        assert seen == [j <= anchor for j in range(1 + block_size)]


def test_branch_pass_cells_drawn_are_build_branch_pass_mask(mpl):
    picture = pictures.branch_pass_data(pictures.MaskSizes(block_size=4, coverage=2, fanout=2))
    assert drawn_mask(picture, relative=True) == picture.mask


def tick_texts(labels) -> list[str]:
    """Tick labels as plain text: mathtext's $, braces and backslashes dropped."""
    return [label.get_text().translate(str.maketrans("", "", "${}")) for label in labels]


def test_mask_pictures_label_rows_and_columns_by_token_and_position(mpl):
    """Every column names its token and position, as the rows do: the blocks' MASK columns
    would otherwise all read "MASK"."""
    training = pictures.mask_figure(pictures.training_mask_data(README_SIZES)).axes[0]
    rows = tick_texts(training.get_yticklabels())
    assert rows[:2] == ["x_0 (0)", "x_1 (1)"] and rows[9:11] == ["MASK (1)", "MASK (2)"]
    assert tick_texts(training.get_xticklabels()) == rows  # the same tokens, in the same order
    branch = pictures.mask_figure(pictures.branch_pass_data(README_SIZES), relative=True).axes[0]
    columns = tick_texts(branch.get_xticklabels())
    assert columns[:4] == ["x_n-2 (n-2)", "x_n-1 (n-1)", "x_n (n)", "d_1 (n+1)"]
    assert columns[2:] == tick_texts(branch.get_yticklabels())


def test_pngs_are_greyscale_and_small(mpl, tmp_path):
    """One grey channel (what a black-and-white print shows), under 150 KB for the pictures a
    README shows."""
    from PIL import Image

    paths = [
        pictures.draw_training_mask(str(tmp_path / "mask.png"), README_SIZES),
        pictures.draw_branch_pass(str(tmp_path / "branch.png"), README_SIZES),
    ]
    for path in paths:
        with Image.open(path) as image:
            assert image.mode == "L", path
        assert (tmp_path / path).stat().st_size < 150_000, path


# ---------------------------------------------------------------------------------------------
# Bars and curves from real runs


@pytest.fixture(scope="module")
def async_stats(tok):
    """A tiny async decode: the drafter has the target's weights, so some drafts are accepted."""
    target, model = tiny_qwen3(seed=1), tiny_qwen3(seed=1)
    drafter = d3d.make_drafter(model, tokenizer=tok, block_size=4)
    _, stats = d3d.generate(
        target, drafter, torch.tensor([[7, 1, 9]]), max_new_tokens=24, mode="async"
    )
    return stats


def test_acceptance_bars_are_the_stats_counts(async_stats):
    data = pictures.acceptance_data(async_stats)
    counts = collections.Counter(async_stats["accept_lengths"])
    assert data["tau"] == [1, 2, 3, 4, 5]
    assert data["counts"] == [counts[t] for t in data["tau"]]
    assert sum(data["counts"]) == async_stats["num_rounds"]
    assert data["hits"] == async_stats["hits_per_position"]
    assert data["misses"] == async_stats["misses_per_position"]
    assert data["mean_tau"] == pytest.approx(async_stats["tau"])


def test_acceptance_bars_drawn_are_the_stats_counts(mpl, async_stats):
    counts = collections.Counter(async_stats["accept_lengths"])
    histogram, outcomes = pictures.acceptance_figure(async_stats).axes
    assert heights(histogram.containers[0]) == [counts[t] for t in range(1, 6)]
    assert heights(outcomes.containers[0]) == async_stats["hits_per_position"]
    assert heights(outcomes.containers[1]) == async_stats["misses_per_position"]
    mean = histogram.lines[0].get_label()  # pooled over rounds: not a mean of per-prompt means
    rounds = async_stats["num_rounds"]
    assert mean == f"mean τ = {async_stats['tau']:.2f}\nover all {rounds} rounds"
    assert histogram.lines[0].get_xdata()[0] == pytest.approx(async_stats["tau"])
    sync = {"accept_lengths": async_stats["accept_lengths"]}  # a sync run's stats: B given
    assert len(pictures.acceptance_figure(sync, block_size=4).axes) == 1
    with pytest.raises(pictures.PicturesUnavailable, match="pass block_size"):
        pictures.acceptance_data(sync)


def test_block_accuracy_bars_are_the_accuracies_in_percent(mpl):
    block_acc = torch.tensor([0.9, 0.5, 0.25, 0.0])
    data = pictures.block_accuracy_data(block_acc)
    assert data["positions"] == [1, 2, 3, 4]
    assert data["percent"]["block accuracy"] == [100 * a for a in block_acc.tolist()]
    ax = pictures.block_accuracy_figure({"a": block_acc, "b": [1.0, 1.0, 0.5, 0.5]}).axes[0]
    assert heights(ax.containers[0]) == data["percent"]["block accuracy"]
    assert heights(ax.containers[1]) == [100.0, 100.0, 50.0, 50.0]
    assert ax.get_ylim() == (0.0, 100.0)
    assert ax.get_ylabel() == "share of blocks (%)"  # not "accuracy": eval draws shares of 1 .. i
    titled = pictures.block_accuracy_figure(block_acc, title="d_1 .. d_i all accepted").axes[0]
    assert titled.get_title() == "$d_{1}$ .. $d_{i}$ all accepted"  # names as subscripts
    with pytest.raises(pictures.PicturesUnavailable, match="fractions"):
        pictures.block_accuracy_data([90.0, 50.0])


@pytest.fixture(scope="module")
def prune_rows(tok):
    """Every row d3d.prune_drafter yields on a tiny 3-layer drafter, one recovery step each."""
    drafter = d3d.make_drafter(
        tiny_qwen3(seed=6, layers=3), tokenizer=tok, block_size=3, num_anchors=4
    )
    return list(
        d3d.prune_drafter(
            drafter, prune_data(), prune_data(seed=10), min_layers=1, recovery_steps=1
        )
    )


def test_pruning_curve_points_are_the_rows(mpl, prune_rows):
    data = pictures.pruning_curve_data(iter(prune_rows))  # a generator's rows do too
    assert data["layers"] == [3, 2, 1]
    assert data["tau_before"] == [r["tau_before_recovery"] for r in prune_rows]
    assert data["tau_after"] == [r["tau_after_recovery"] for r in prune_rows]
    assert data["tau_before"][0] == data["tau_after"][0] == data["tau0"]  # the starting point
    figure = pictures.pruning_curve_figure(prune_rows)
    for label, key in (
        ("before recovery", "tau_before_recovery"),
        ("after recovery", "tau_after_recovery"),
    ):
        points = line(figure, label)
        assert list(points.get_xdata()) == [r["layers"] for r in prune_rows]
        assert list(points.get_ydata()) == [r[key] for r in prune_rows]
    with pytest.raises(pictures.PicturesUnavailable, match="unpruned"):
        pictures.pruning_curve_data(prune_rows[1:])


# ---------------------------------------------------------------------------------------------
# The PNGs, the command, and the error without matplotlib


def test_every_png_has_its_size_and_is_not_blank(mpl, tmp_path, async_stats, prune_rows):
    from matplotlib.image import imread

    drawn = {
        pictures.draw_training_mask(
            str(tmp_path / "a" / "mask.png"), README_SIZES
        ): pictures.mask_figure(pictures.training_mask_data(README_SIZES)),
        pictures.draw_branch_pass(str(tmp_path / "branch.png"), README_SIZES): pictures.mask_figure(
            pictures.branch_pass_data(README_SIZES), relative=True
        ),
        pictures.draw_block_accuracy(
            str(tmp_path / "acc.png"), [0.9, 0.6, 0.3, 0.1]
        ): pictures.block_accuracy_figure([0.9, 0.6, 0.3, 0.1]),
        pictures.draw_acceptance(
            str(tmp_path / "tau.png"), async_stats
        ): pictures.acceptance_figure(async_stats),
        pictures.draw_pruning_curve(
            str(tmp_path / "prune.png"), prune_rows
        ): pictures.pruning_curve_figure(prune_rows),
    }
    for path, figure in drawn.items():
        pixels = imread(path)
        width, height = figure.get_size_inches() * figure.dpi
        assert pixels.shape == (round(height), round(width)), path  # one grey channel
        grey = pixels
        assert (grey < 0.5).mean() > 0.005 and (grey > 0.9).mean() > 0.3, path  # ink on white


def test_masks_command_writes_both_pictures_and_prints_their_paths(mpl, tmp_path, capsys):
    argv = [
        "masks",
        "--block-size",
        "5",
        "--num-anchors",
        "2",
        "--coverage",
        "3",
        "--fanout",
        "2",
        "--out",
        str(tmp_path / "pics"),
    ]
    assert pictures.cli(argv) == 0
    paths = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[1] for p in paths] == [
        "training_mask_B5_K2.png",
        "branch_pass_B5_C3_F2.png",
    ]
    assert all((tmp_path / "pics" / p.rsplit("/", 1)[1]).stat().st_size > 0 for p in paths)


def test_masks_command_writes_each_picture_where_its_flag_says(mpl, tmp_path, capsys):
    training = tmp_path / "pictures" / "training-mask.png"
    branch = tmp_path / "branch-pass-mask.png"
    argv = ["masks", "--training-png", str(training), "--branch-png", str(branch)]
    assert pictures.cli([*argv, "--out", str(tmp_path / "unused")]) == 0
    assert capsys.readouterr().out.split() == [str(training), str(branch)]
    assert training.stat().st_size > 0 and branch.stat().st_size > 0
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--block-size", "0"], "--block-size"),
        (["--coverage", "5"], "--coverage"),
        (["--fanout", "0"], "--fanout"),
        (["--num-anchors", "6", "--length", "4"], "--length"),
        (["--block-size", "four"], "--block-size"),
    ],
)
def test_masks_command_names_a_bad_value_in_one_line(tmp_path, capsys, argv, flag):
    assert pictures.cli(["masks", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and " — " in err and flag in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv",
    [["--coverage", "4"], ["--num-anchors", "6", "--length", "7"], ["--coverage", "0"]],
)
def test_masks_command_takes_a_range_that_depends_on_b_or_k_at_its_edge(
    mpl, tmp_path, capsys, argv
):
    # B = 4: --coverage in 0 .. B; --length >= K + 1
    assert pictures.cli(["masks", *argv, "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    assert len(list(tmp_path.iterdir())) == 2


def test_without_matplotlib_every_picture_says_how_to_install_it(
    monkeypatch, tmp_path, capsys, async_stats
):
    monkeypatch.setattr(pictures, "matplotlib", None)
    calls = [
        lambda p: pictures.draw_training_mask(p),
        lambda p: pictures.draw_branch_pass(p),
        lambda p: pictures.draw_block_accuracy(p, [0.5]),
        lambda p: pictures.draw_acceptance(p, async_stats),
        lambda p: pictures.draw_pruning_curve(p, [{"removed_layer": None}]),
    ]
    for draw in calls:
        with pytest.raises(ValueError) as error:
            draw(str(tmp_path / "x.png"))
        assert str(error.value) == pictures.MISSING
        assert str(error.value) == (
            "matplotlib is not installed — pip install -r requirements-plots.txt"
        )
    assert not list(tmp_path.iterdir())
    assert pictures.cli(["masks", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {pictures.MISSING}\n"
    assert pictures.training_mask_data(README_SIZES).mask  # the data functions need no matplotlib
