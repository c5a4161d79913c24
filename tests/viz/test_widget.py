"""attnkit.viz.widget (anywidget) and attnkit.viz.relevance: what they send is the model's attention
(float64 formulas from the captured weights and statistics), within the notebook budgets, and the
widget's front end, run in headless Chromium against a stand-in for the notebook's model, draws the
grid, answers a click and draws the picked head."""

from __future__ import annotations

import base64
import json
import math
import sys

import numpy as np
import pytest
import torch

import attnkit
from attnkit.inspect import AttentionStats
from attnkit.viz import notebook, relevance, widget
from attnkit.viz.html import asset

pytest.importorskip("anywidget")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(attnkit.MultiHeadAttention(16, 4), attnkit.MultiHeadAttention(16, 4)).eval()


def _run(model, x):
    return model[1](model[0](x, mask=attnkit.masks.causal())[0], mask=attnkit.masks.causal())[0]


def _decode(d) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(d["bytes"]), dtype=np.uint8).astype(np.float64)
    values = np.where(raw > 0, 10 ** (d["hi"] - d["decades"] + (raw - 1) / 254 * d["decades"]), 0.0)
    return values.reshape(d["rows"], d["cols"])


def test_weights_widget_sends_the_captured_heads():
    model = _model()
    tokens = ["the", "猫", "sat", "on", "a", "mat", "."]
    with attnkit.capture(model) as cap, torch.no_grad():
        _run(model, torch.randn(1, 7, 16))
    w = widget(cap, tokens)
    assert w.data["layers"] == 2 and w.data["heads"] == 4 and w.data["layerNames"] == cap.names
    for layer, weights in enumerate(cap.weights):
        p = weights[0].double()
        entropy = (-(p * p.clamp_min(1e-300).log()).sum(-1) / math.log(2)).mean(-1)
        np.testing.assert_allclose(w.data["summary"]["entropy"][layer], entropy.numpy(), rtol=1e-9)
        np.testing.assert_allclose(w.data["summary"]["max_weight"][layer], p.amax(-1).mean(-1).numpy(), rtol=1e-9)
    assert w.detail == {}
    w.select(1, 2)
    d = w.detail
    assert (d["layer"], d["head"], d["keyTokens"]) == (1, 2, tokens)
    want = cap.weights[1][0, 2].double().numpy()
    seen = want >= want.max() * 1e-6  # the byte scale keeps six decades below the largest weight
    np.testing.assert_allclose(_decode(d)[seen], want[seen], rtol=10 ** (6 / 254 / 2) - 1 + 1e-9)
    assert (_decode(d)[~seen] <= want.max() * 1e-6).all()
    assert "attnkit-glyphs" in w._css  # the CJK token's glyph travels with the widget
    w.selected = [-1, -1]
    assert w.detail == {}


def test_stats_widget_sends_binned_profiles_and_top_keys():
    model = _model()
    with attnkit.capture(model, mode="stats", rows=[-1, 100]) as cap, torch.no_grad():
        _run(model, torch.randn(1, 3000, 16))
    w = widget(cap, bins=500)
    w.select(1, 3)
    d = w.detail
    received = cap.stats[1].received[0, 3].double()
    assert d["binSize"] == 6 and len(d["received"]) == 500
    np.testing.assert_allclose(d["received"], received.view(500, 6).amax(-1).numpy(), rtol=1e-3)
    np.testing.assert_allclose(d["entropy"], cap.stats[1].entropy_bits[0, 3].double().view(500, 6).mean(-1), rtol=1e-3)
    assert d["topReceived"][0]["position"] == int(received.argmax())
    row = cap.weights[1][0, 3, 0].double()  # the weights of row -1
    np.testing.assert_allclose(d["rowWeights"][0], row.view(500, 6).amax(-1).numpy(), rtol=1e-3)
    assert d["rowTop"][1][0]["position"] == int(cap.weights[1][0, 3, 1].argmax()) and d["rows"] == [2999, 100]
    summary = cap.stats[0].head_summary()
    np.testing.assert_allclose(w.data["summary"]["sink_mass"][0], summary["sink_mass"].numpy(), rtol=1e-6)


def _stats(length, heads, g):
    received = torch.rand(1, heads, length, generator=g) * length
    rows = torch.rand(1, heads, length, generator=g)
    return AttentionStats(
        lse=rows, entropy=rows * 5, max_weight=rows, argmax=torch.zeros(1, heads, length, dtype=torch.long),
        sink_mass=rows, mean_distance=rows * length, received=received,
    )  # fmt: skip


def test_rows_combine_into_one_profile_their_mean_or_sum():
    """select_rows: the chosen query rows' weights combined over the keys (mean or sum) as the float64
    formula from the captured weights; negative rows count from the end; the keys it favours."""
    model = _model()
    with attnkit.capture(model) as cap, torch.no_grad():
        _run(model, torch.randn(1, 9, 16))
    w = widget(cap)
    w.select(0, 1)
    assert "selection" not in w.detail
    w.select_rows([2, -1, 4])
    p = cap.weights[0][0, 1].double()
    d = w.detail["selection"]
    assert d["rows"] == [2, 4, 8] and d["how"] == "mean" and d["binSize"] == 1
    np.testing.assert_allclose(d["weights"], p[[2, 4, 8]].mean(0).numpy(), rtol=1e-3)
    assert d["top"][0]["position"] == int(p[[2, 4, 8]].mean(0).argmax())
    w.select_rows([2, 4, 8], how="sum")
    np.testing.assert_allclose(w.detail["selection"]["weights"], p[[2, 4, 8]].sum(0).numpy(), rtol=1e-3)
    w.select(1, 3)  # another head keeps the rows
    np.testing.assert_allclose(
        w.detail["selection"]["weights"], cap.weights[1][0, 3].double()[[2, 4, 8]].sum(0).numpy(), rtol=1e-3
    )
    w.select_rows([])
    assert "selection" not in w.detail
    with pytest.raises(ValueError, match=r"rows \[9\] are out of range for 9 query rows"):
        w.select_rows([9])
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        w.select_rows([1], how="max")
    with pytest.raises(TypeError, match="sequence of ints"):
        w.select_rows([1.5])


def test_captured_rows_combine_at_long_context_and_others_are_refused():
    model = _model()
    with attnkit.capture(model, mode="stats", rows=[-1, 100, 7]) as cap, torch.no_grad():
        _run(model, torch.randn(1, 3000, 16))
    w = widget(cap, bins=500)
    w.select(1, 0)
    w.select_rows([100, -1])
    d = w.detail["selection"]
    rows = cap.weights[1][0, 0].double()  # the captured rows, in the order rows= gave them: -1, 100, 7
    want = rows[[0, 1]].mean(0)
    assert d["rows"] == [100, 2999] and d["binSize"] == 6
    np.testing.assert_allclose(d["weights"], want.view(500, 6).amax(-1).numpy(), rtol=1e-3)
    assert d["top"][0]["position"] == int(want.argmax())
    with pytest.raises(ValueError, match=r"rows \[5\] were not captured.*\[7, 100, 2999\]"):
        w.select_rows([5, 7])


def test_widget_state_fits_the_notebook_budgets():
    g = torch.Generator().manual_seed(0)
    weights = torch.softmax(torch.randn(6, 12, 512, 512, generator=g), -1)
    w = widget(weights, [f"tok{i}" for i in range(512)])
    w.select(5, 11)
    assert len(json.dumps(w.data)) + len(json.dumps(w.detail)) <= notebook.INLINE_BUDGET
    stats = [_stats(32768, 12, g) for _ in range(6)]
    w = widget(stats, [f"w{i}" for i in range(32768)])
    w.select(3, 4)
    assert len(json.dumps(w.data)) + len(json.dumps(w.detail)) <= notebook.LONG_BUDGET
    assert len(w.detail["received"]) <= 1024


def test_widget_bad_input():
    weights = torch.softmax(torch.randn(2, 3, 5, 5), -1)
    with pytest.raises(TypeError, match="widget takes a Capture"):
        widget("attention")
    with pytest.raises(ValueError, match="one token per key"):
        widget(weights, ["a", "b"])
    with pytest.raises(ValueError, match="bins must be an int >= 8"):
        widget(weights, bins=2)
    with pytest.raises(ValueError, match="batch=3"):
        widget(weights, batch=3)
    with pytest.raises(ValueError, match="too many for the widget"):
        widget(torch.rand(1, 1, 1025, 1025))
    with pytest.raises(ValueError, match=r"no head \(2, 0\)"):
        widget(weights).select(2, 0)
    model = _model()
    with attnkit.capture(model, mode="heads") as cap, torch.no_grad():
        _run(model, torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="holds nothing the widget draws"):
        widget(cap)


def test_widget_without_anywidget_says_how_to_install_it(monkeypatch):
    import attnkit.viz.widgets as module

    monkeypatch.setattr(module, "_CLASS", None)
    monkeypatch.setitem(sys.modules, "anywidget", None)
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[widget\]'"):
        widget(torch.softmax(torch.randn(1, 1, 3, 3), -1))


def test_relevance_view_shades_each_token_by_its_relevance():
    values = torch.tensor([[[0.05, 0.6, 0.1, 0.25]]])
    view = relevance(values, ["the", "猫", "<b>", "mat"], rows=["row -1"])
    page = view.html()
    assert "rgba(214,80,40,1.00)" in page and "rgba(214,80,40,0.17)" in page  # 0.1 / 0.6 of the darkest
    assert "&lt;b&gt;" in page and "<b>猫</b>" in page and "attnkit-glyphs" in page
    assert 'class="attnkit-view"' in view._repr_html_()
    long_view = relevance(torch.rand(1, 1, 40000), rows=["last"])
    assert "<svg" in long_view.html() and len(long_view._repr_html_().encode()) <= notebook.LONG_BUDGET
    with pytest.raises(ValueError, match="one token per position"):
        relevance(values, ["a"])
    with pytest.raises(ValueError, match="NaN"):
        relevance(torch.tensor([[float("nan")]]))
    with pytest.raises(TypeError, match="float tensor"):
        relevance([0.1, 0.2])


# --- the front end in headless Chromium -------------------------------------------------------------

import test_browser  # noqa: E402
from test_browser import CANVAS_SPREAD, open_widget, severe_logs  # noqa: E402

browser = test_browser.browser


def _open(browser, tmp_path, w):
    state = {"data": w.data, "selected": w.selected, "detail": w.detail}
    open_widget(browser, tmp_path / "widget.html", state, asset("widget.js"), w._css)


def test_widget_front_end_draws_the_grid_and_the_picked_heads_weights(browser, tmp_path):
    from selenium.webdriver.common.by import By

    weights = torch.full((2, 3, 6, 6), 1 / 6)  # every head spread evenly...
    weights[1, 2] = torch.eye(6) * 0.88 + 0.02  # ...but layer 1, head 2, which looks at itself
    w = widget(weights, ["a", "b", "c", "d", "e", "f"])
    _open(browser, tmp_path, w)
    cells = browser.find_elements(By.CSS_SELECTOR, "td.ak-cell")
    assert len(cells) == 6
    focused = browser.find_element(By.CSS_SELECTOR, "td.ak-cell[data-layer='1'][data-head='2']")
    assert float(focused.text) == pytest.approx(w.data["summary"]["entropy"][1][2], abs=0.01)
    assert float(focused.text) < min(float(c.text) for c in cells if c != focused)  # the focused head stands out
    focused.click()
    assert browser.execute_script("return window.sets") == [["selected", [1, 2]]]
    w.selected = [1, 2]  # what the notebook's kernel does on that change
    browser.execute_script("window.push('detail', arguments[0])", w.detail)
    assert browser.find_element(By.CSS_SELECTOR, ".ak-title").text == "layer 1 · head 2"
    canvas = browser.find_element(By.CSS_SELECTOR, "canvas.ak-heatmap")
    assert browser.execute_script(CANVAS_SPREAD, canvas)[0] > 50
    diagonal, off = browser.execute_script(
        "const c = arguments[0], s = c.width / 6, x = c.getContext('2d');"
        "const at = (i, j) => x.getImageData(j * s + 1, i * s + 1, 1, 1).data;"
        "return [at(3, 3)[0], at(3, 1)[0]];",
        canvas,
    )
    assert diagonal < off  # the weight on the diagonal is drawn darker
    assert not severe_logs(browser)


def test_widget_front_end_draws_long_context_profiles(browser, tmp_path):
    from selenium.webdriver.common.by import By

    model = _model()
    with attnkit.capture(model, mode="stats", rows=[-1]) as cap, torch.no_grad():
        _run(model, torch.randn(1, 2000, 16))
    w = widget(cap, bins=400)
    _open(browser, tmp_path, w)
    w.select(0, 1)
    browser.execute_script("window.push('detail', arguments[0])", w.detail)
    lines = browser.find_elements(By.CSS_SELECTOR, "svg.ak-profile polyline")
    assert len(lines) == 3  # key mass, entropy, the chosen row's weights
    assert len(lines[0].get_attribute("points").split()) == 400
    for svg in browser.find_elements(By.CSS_SELECTOR, "svg.ak-profile"):  # axes, ticks and what they measure
        ticks = [t.text for t in svg.find_elements(By.CSS_SELECTOR, "text.ak-tick")]
        assert len(svg.find_elements(By.CSS_SELECTOR, "line.ak-axis")) >= 4 and len(ticks) >= 4, ticks
        assert "0" in ticks and svg.find_element(By.CSS_SELECTOR, "text.ak-axis-title").text.endswith("position")
    mass = browser.find_elements(By.CSS_SELECTOR, "svg.ak-profile")[0]
    assert any(t.text.startswith("1e-") for t in mass.find_elements(By.CSS_SELECTOR, "text.ak-tick"))  # log scale
    keys = [t.text for t in mass.find_elements(By.CSS_SELECTOR, "text.ak-tick") if not t.text.startswith("1e")]
    assert max(int(t) for t in keys) >= 1500  # positions over the 2,000 tokens, not over the 400 bins
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.ak-profile line.ak-mark")) == 1  # where the row sits
    tops = browser.find_elements(By.CSS_SELECTOR, "ol.ak-top li")
    assert f"(position {w.detail['topReceived'][0]['position']})" in tops[0].text
    browser.find_element(By.CSS_SELECTOR, "button.ak-back").click()
    assert browser.execute_script("return window.sets")[-1] == ["selected", [-1, -1]]
    assert not severe_logs(browser)


def test_widget_front_end_combines_clicked_rows(browser, tmp_path):
    """Clicks on the heatmap's rows (shift: a range) set the rows to combine; the view draws the
    combined profile with its mean/sum choice, and a click on "clear rows" empties the selection."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    w = widget(torch.softmax(torch.randn(1, 2, 8, 8), -1), list("abcdefgh"))
    w.select(0, 1)
    _open(browser, tmp_path, w)
    browser.execute_script("window.push('detail', arguments[0])", w.detail)
    canvas = browser.find_element(By.CSS_SELECTOR, "canvas.ak-heatmap")
    cell = int(canvas.get_attribute("height")) // 8
    top = -int(canvas.get_attribute("height")) // 2  # offsets are from the canvas's centre

    def row(i):
        return top + i * cell + cell // 2

    ActionChains(browser).move_to_element_with_offset(canvas, 0, row(2)).click().perform()
    assert browser.execute_script("return window.sets")[-1] == ["rows", [2]]
    ActionChains(browser).move_to_element_with_offset(canvas, 0, row(5)).key_down(Keys.SHIFT).click().key_up(
        Keys.SHIFT
    ).perform()
    assert browser.execute_script("return window.sets")[-1] == ["rows", [2, 3, 4, 5]]
    w.select_rows([2, 3, 4, 5])  # what the kernel does on that change
    browser.execute_script("window.push('detail', arguments[0])", w.detail)
    titles = [h.text for h in browser.find_elements(By.CSS_SELECTOR, ".ak-detail h4")]
    assert any(t.startswith("mean of the weights of 4 rows (2 (c), 3 (d)") for t in titles), titles
    line = browser.find_element(By.CSS_SELECTOR, "svg.ak-profile polyline")
    assert len(line.get_attribute("points").split()) == 8  # one point per key
    tops = browser.find_elements(By.CSS_SELECTOR, "ol.ak-top li")
    assert f"(position {w.detail['selection']['top'][0]['position']})" in tops[0].text
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element(By.CSS_SELECTOR, "select.ak-combine")).select_by_value("sum")
    assert browser.execute_script("return window.sets")[-1] == ["combine", "sum"]
    browser.find_element(By.CSS_SELECTOR, "button.ak-clear").click()
    assert browser.execute_script("return window.sets")[-1] == ["rows", []]
    assert not severe_logs(browser)


def test_widget_front_end_ticks_captured_rows_to_combine(browser, tmp_path):
    from selenium.webdriver.common.by import By

    model = _model()
    with attnkit.capture(model, mode="stats", rows=[-1, 10]) as cap, torch.no_grad():
        _run(model, torch.randn(1, 600, 16))
    w = widget(cap, bins=200)
    w.select(0, 0)
    _open(browser, tmp_path, w)
    browser.execute_script("window.push('detail', arguments[0])", w.detail)
    boxes = browser.find_elements(By.CSS_SELECTOR, "input.ak-row-pick")
    assert [b.get_attribute("data-row") for b in boxes] == ["599", "10"]
    boxes[1].click()
    assert browser.execute_script("return window.sets")[-1] == ["rows", [10]]
    boxes[0].click()
    assert browser.execute_script("return window.sets")[-1] == ["rows", [10, 599]]
    assert not severe_logs(browser)


def test_the_widgets_output_carries_a_static_grid_the_live_view_hides(browser, tmp_path):
    """An export without a widget manager shows the static picture of the grid; in Jupyter the live
    widget hides it once it renders (so the grid is not shown twice)."""
    from selenium.webdriver.common.by import By

    from attnkit.viz.widgets import static_view

    w = widget(torch.softmax(torch.randn(2, 3, 6, 6), -1), ["a", "b", "c", "d", "e", "f"], title="a test")
    picture = static_view(w.data)
    assert f"attnkit-static-{w.data['staticId']}" in picture and "data:image/png;base64," in picture
    assert len(picture.encode()) < 100_000
    page = tmp_path / "static.html"
    page.write_text(f"<!doctype html><meta charset='utf-8'><body>{picture}</body>", encoding="utf-8")
    browser.get(page.as_uri())
    image = browser.find_element(By.CSS_SELECTOR, ".attnkit-static img")
    assert image.is_displayed() and "2 layers x 3 heads" in image.get_attribute("alt")
    state = {"data": w.data, "selected": w.selected, "detail": w.detail}
    open_widget(browser, tmp_path / "widget.html", state, asset("widget.js"), w._css, before=picture)
    assert len(browser.find_elements(By.CSS_SELECTOR, "td.ak-cell")) == 6
    assert not browser.find_element(By.CSS_SELECTOR, ".attnkit-static").is_displayed()


def test_counts_of_one_are_singular(browser, tmp_path):
    """One layer of one head over one token reads "1 layer × 1 head, 1 token", in the live header and
    in the static picture an export shows."""
    from selenium.webdriver.common.by import By

    from attnkit.viz.widgets import static_view

    w = widget(torch.ones(1, 1, 1, 1), ["x"])
    assert "1 layer &times; 1 head, 1 token," in static_view(w.data)
    _open(browser, tmp_path, w)
    assert browser.find_element(By.CSS_SELECTOR, ".ak-head").text.endswith("— 1 layer × 1 head, 1 token")
    assert not severe_logs(browser)
