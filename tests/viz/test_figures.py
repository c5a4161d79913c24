"""The figures users look at: nothing cut off, every axis labelled, one unit for entropy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("matplotlib")


def _inside(fig, artist):
    """Whether a drawn text lies wholly inside the figure (a cut title fails)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # as savefig draws it (layout included)
    canvas.draw()
    renderer = canvas.get_renderer()
    box, page = artist.get_window_extent(renderer), fig.bbox
    return box.x0 >= page.x0 - 1 and box.y0 >= page.y0 - 1 and box.x1 <= page.x1 + 1 and box.y1 <= page.y1 + 1


def test_heatmap_with_long_key_labels_keeps_title_labels_and_ticks_inside(tmp_path):
    from attnkit.viz import visualize_attention

    titles = [f"A Rather Long Movie Title Number {i} (1997)" for i in range(30)]
    weights = torch.softmax(torch.randn(2, 30), -1)
    fig = visualize_attention(
        weights,
        ["layer 0", "layer 1"],
        None,  # measured as drawn (savefig draws the same layout)
        key_tokens=titles,
        xlabel="history (oldest to newest)",
        ylabel="",
        title="user 1: the next-item query's attention (mean of heads)",
    )
    ax = fig.axes[0]
    assert ax.get_title().startswith("user 1") and _inside(fig, ax.title)
    assert ax.get_xlabel() == "history (oldest to newest)" and _inside(fig, ax.xaxis.label)
    assert all(_inside(fig, t) for t in ax.get_xticklabels())


def test_a_title_wider_than_the_figure_wraps_instead_of_being_cut(tmp_path):
    from attnkit.viz import visualize_attention

    title = "a very long title " * 8
    fig = visualize_attention(torch.softmax(torch.randn(3, 3), -1), list("abc"), None, title=title)
    assert "\n" in fig.axes[0].get_title()
    fig.savefig(tmp_path / "t.png")
    assert _inside(fig, fig.axes[0].title)


def test_recommend_figure_cuts_long_titles_with_an_ellipsis(tmp_path):
    pytest.importorskip("sklearn")
    from attnkit.models import movielens

    try:
        movielens.data_folder()
    except ModuleNotFoundError:
        pytest.skip("MovieLens-100K needs: pip install --no-deps recbole==1.2.1")
    from matplotlib.image import imread

    from attnkit.cli import main

    assert main(["recommend", "--user", "1", "--out", str(tmp_path)]) == 0
    assert imread(tmp_path / "recommend.png").shape[0] > 500  # tall enough for its rotated titles
    page = (tmp_path / "recommend.html").read_text(encoding="utf-8")
    assert "\u2026" in page  # a cut title says so


def test_cross_attention_grid_labels_both_axes():
    from attnkit.viz import attention_grid

    weights = torch.softmax(torch.randn(2, 4, 11, 18), -1)
    rows, cols = list("2019-03-25") + ["</s>"], list("25th of March 2019")
    fig = attention_grid(weights, None, tokens=rows, key_tokens=cols, title="cross-attention")
    bottom_left = fig.axes[4]  # layer 1, head 0
    assert [t.get_text() for t in bottom_left.get_xticklabels()] == cols
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == rows
    assert fig.axes[1].get_yticklabels() == [] or not any(t.get_text() for t in fig.axes[1].get_yticklabels())


def test_long_view_entropy_is_in_bits(tmp_path):
    from attnkit.inspect import AttentionStats
    from attnkit.viz.long import asset, long_data, long_figures

    heads, length = 2, 64
    uniform = torch.full((1, heads, length), float(torch.log(torch.tensor(16.0))))  # 16 equal keys: 4 bits
    stats = AttentionStats(
        lse=torch.zeros(1, heads, length),
        entropy=uniform,
        max_weight=torch.full((1, heads, length), 1 / 16),
        argmax=torch.zeros(1, heads, length, dtype=torch.long),
        sink_mass=torch.zeros(1, heads, length),
        mean_distance=torch.ones(1, heads, length),
        received=torch.ones(1, heads, length),
    )
    torch.testing.assert_close(stats.entropy_bits, torch.full_like(uniform, 4.0))
    data = long_data([stats], [f"t{i}" for i in range(length)], [], [], title="t")
    assert data["summary"]["entropy"] == [[pytest.approx(4.0), pytest.approx(4.0)]]
    long_figures(tmp_path, [stats], [f"t{i}" for i in range(length)], [], [], title="t")
    assert "mean entropy (bits)" in asset("long.html") and "nats" not in asset("long.html")


def test_caption_overlay_keeps_the_digit_visible(tmp_path):
    import numpy as np

    from attnkit.viz.regions import region_figure

    image = np.random.default_rng(0).uniform(0, 16, (8, 24))
    attention = torch.softmax(4 * torch.randn(3, 12), -1)
    fig = region_figure(image, ["seven", "three", "one"], attention, (2, 6), tmp_path / "c.png")
    for ax in fig.axes:
        tint = ax.get_images()[1].get_array()
        assert float(np.asarray(tint)[..., 3].max()) <= 0.36  # light: the strokes stay readable
        assert ax.collections, "an outline of where the word looked"


def test_caption_outline_is_a_closed_box_along_pixel_edges(tmp_path):
    """The patches above half the peak get a box (it was two vertical lines: a contour through pixel
    centres, open at the image's top and bottom edges)."""
    import numpy as np

    from attnkit.viz.regions import region_figure

    image = np.zeros((8, 24))
    attention = torch.zeros(1, 12)
    attention[0, 0] = attention[0, 1] = 0.5  # the first column of patches (2 x 6 grid: column by column)
    fig = region_figure(image, ["seven"], attention, (2, 6), tmp_path / "c.png")
    (lines,) = fig.axes[0].collections
    ends = {}
    for (x0, y0), (x1, y1) in lines.get_segments():
        for point in ((x0, y0), (x1, y1)):
            ends[point] = ends.get(point, 0) + 1
    assert all(n == 2 for n in ends.values()), ends  # every end meets another segment: a closed loop
    xs, ys = {x for x, _ in ends}, {y for _, y in ends}
    assert (min(xs), max(xs), min(ys), max(ys)) == (-0.5, 3.5, -0.5, 7.5)  # the 4-pixel-wide, full-height patch column


def test_long_figures_draw_the_needle_they_describe(tmp_path, monkeypatch):
    """The marked needle is a labelled line on the key-mass figure and on every row panel."""
    from matplotlib.figure import Figure

    from attnkit.inspect import AttentionStats
    from attnkit.viz.long import long_figures

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: drawn.append(self))
    heads, length, needle = 2, 300, 123
    one = torch.ones(1, heads, length)
    stats = AttentionStats(
        lse=0 * one, entropy=one, max_weight=one / 2, argmax=torch.zeros(1, heads, length, dtype=torch.long),
        sink_mass=one / 4, mean_distance=one, received=one,
    )  # fmt: skip
    rows = [torch.softmax(torch.randn(1, heads, 1, length), -1)]
    long_figures(tmp_path, [stats, stats], [f"t{i}" for i in range(length)], [length - 1], rows * 2,
                 title="t", marks={"needle": needle})  # fmt: skip
    heads_fig, keymass, row_fig = drawn
    for fig in (keymass, row_fig):
        for ax in fig.axes:
            assert any(list(line.get_xdata()) == [needle, needle] for line in ax.get_lines()), ax.get_title()
        assert any("needle" in t.get_text() for ax in fig.axes for t in ax.texts)


def test_the_demo_index_names_the_page_to_open(tmp_path):
    import subprocess
    import sys

    (tmp_path / "listen").mkdir()
    (tmp_path / "listen" / "listen.html").write_text("<!doctype html>", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "attnkit.viz.gallery", str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert f"open it in a browser: {(tmp_path / 'index.html').resolve().as_uri()}" in done.stdout
    page = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert "Hearing spoken digits" in page and "open the transcript" in page


def test_each_row_panel_is_scaled_to_what_it_holds_and_distances_read_as_tokens(tmp_path, monkeypatch):
    """RecallLM's layer-1 row panel shared the 0-1 axis with layer 0 and looked empty (its largest weight
    0.025); the mean-distance colour bar read 4.07e3 ... 4.11e3 (offset notation). Each panel now spans
    what it holds, and distances read as whole numbers of tokens."""
    from matplotlib.figure import Figure

    from attnkit.inspect import AttentionStats
    from attnkit.viz.long import long_figures

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: drawn.append(self))
    heads, length = 2, 400
    one = torch.ones(1, heads, length)
    stats = AttentionStats(
        lse=0 * one, entropy=one, max_weight=one / 2, argmax=torch.zeros(1, heads, length, dtype=torch.long),
        sink_mass=one / 4, mean_distance=4070 + 40 * torch.rand(1, heads, length), received=one,
    )  # fmt: skip
    sharp = torch.zeros(1, heads, 1, length)
    sharp[..., 7] = 1.0
    flat = torch.full((1, heads, 1, length), 0.025 / 2) + 0.0125 * torch.rand(1, heads, 1, length)
    long_figures(tmp_path, [stats, stats], [f"t{i}" for i in range(length)], [length - 1], [sharp, flat], title="t")
    heads_fig, _, row_fig = drawn
    top0, top1 = row_fig.axes[0].get_ylim()[1], row_fig.axes[1].get_ylim()[1]
    assert top0 >= 1.0 and top1 < 0.05  # the flat layer fills its own panel
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(heads_fig).draw()
    bar = heads_fig.axes[-1]  # the mean distance's colour bar
    labels = [t.get_text() for t in bar.get_yticklabels() if t.get_text()]
    assert labels and all(label.replace(",", "").isdigit() for label in labels), labels
    assert not bar.yaxis.get_offset_text().get_visible() or not bar.yaxis.get_offset_text().get_text()


def test_notable_heads_are_the_ones_that_do_what_they_are_named_for():
    from attnkit.inspect.summary import notable_heads

    length = 8
    weights = torch.full((2, 3, length, length), 1.0 / length)  # every head spread evenly ...
    weights[1, 2] = torch.diag(torch.ones(length - 1), -1)  # ... but one reads the previous token
    weights[1, 2, 0, 0] = 1.0
    weights[0, 1] = 0.0
    weights[0, 1, :, 0] = 1.0  # and one rests on [CLS]
    tokens = ["[CLS]", *"abcdef", "[SEP]"]
    picks = notable_heads(weights, tokens, ("[CLS]", "[SEP]"))
    assert picks[0][:2] == (1, 2) and "previous" in picks[0][2]
    assert picks[1][:2] == (0, 1) and "[CLS]" in picks[1][2]
    assert len({p[:2] for p in picks}) == 3
