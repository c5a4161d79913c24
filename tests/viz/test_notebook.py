"""examples/attention_in_a_notebook.ipynb on a real Jupyter kernel (nbclient), its saved outputs
opened in headless Chromium: each inline view renders and shows what it is for (the long view's
tables and profile, the weights page's heads, the head-effects table), within its size budget."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from attnkit.viz import notebook

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "attention_in_a_notebook.ipynb"
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("attnkit.models")

import test_browser  # noqa: E402
from test_browser import CANVAS_SPREAD, open_widget, severe_logs  # noqa: E402

browser = test_browser.browser  # the module's headless Chromium fixture


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook run top to bottom in a fresh kernel; (outputs per cell, the saved file)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    folder = tmp_path_factory.mktemp("notebook")
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    )
    client.execute()
    saved = folder / "executed.ipynb"
    nbformat.write(nb, saved)
    return [cell.get("outputs", []) for cell in nb.cells if cell.cell_type == "code"], saved


def _html(outputs) -> list[str]:
    return [
        o["data"]["text/html"]
        for o in outputs
        if o.get("output_type") == "execute_result" and "text/html" in o.get("data", {})
    ]


def test_every_cell_runs_and_the_views_fit_their_budgets(executed):
    cells, saved = executed
    errors = [o for outs in cells for o in outs if o.get("output_type") == "error"]
    assert not errors, errors
    (long_view,) = _html(cells[1])
    (weights_view,) = _html(cells[3])
    assert 'class="attnkit-view"' in long_view and 'class="attnkit-view"' in weights_view
    assert len(long_view.encode()) <= notebook.INLINE_BUDGET  # 512 tokens x 6 layers x 12 heads
    assert len(weights_view.encode()) <= notebook.INLINE_BUDGET
    assert "512" in "".join(o.get("text", "") for o in cells[0])  # the whole passage was read
    assert saved.stat().st_size < 4 * notebook.INLINE_BUDGET


def _page(tmp_path, fragment: str) -> Path:
    path = tmp_path / "cell.html"
    path.write_text(f"<!doctype html><meta charset='utf-8'><body>{fragment}</body>", encoding="utf-8")
    return path


def _enter(browser, path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")
    browser.get(path.as_uri())
    frame = browser.find_element(By.CSS_SELECTOR, "iframe.attnkit-view")
    browser.switch_to.frame(frame)
    WebDriverWait(browser, 30).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def test_the_long_view_draws_its_tables_and_profile(executed, browser, tmp_path):
    from selenium.webdriver.common.by import By

    cells, _ = executed
    _enter(browser, _page(tmp_path, _html(cells[1])[0]))
    try:
        tables = browser.find_element(By.ID, "tables")
        numbers = re.findall(r"\d+\.\d+", tables.text)
        assert len(numbers) >= 6 * 12  # a value for every layer and head
        assert browser.execute_script(CANVAS_SPREAD, browser.find_element(By.ID, "profile"))[0] > 50
        assert browser.execute_script(CANVAS_SPREAD, browser.find_element(By.ID, "rowprofile"))[0] > 50
        assert len(browser.find_elements(By.CSS_SELECTOR, "#top li")) >= 5  # the last token's top keys
        assert not severe_logs(browser)
    finally:
        browser.switch_to.default_content()


def test_the_weights_view_draws_every_head(executed, browser, tmp_path):
    from selenium.webdriver.common.by import By

    cells, _ = executed
    _enter(browser, _page(tmp_path, _html(cells[3])[0]))
    try:
        thumbs = browser.find_elements(By.CSS_SELECTOR, "canvas.thumb")
        assert len(thumbs) == 6 * 12
        assert browser.execute_script(CANVAS_SPREAD, thumbs[0])[0] > 50
        assert "animal" in browser.find_element(By.TAG_NAME, "body").text or browser.execute_script(
            "return JSON.stringify(JSON.parse(document.getElementById('attnkit-data').textContent)).includes('animal')"
        )
        assert not severe_logs(browser)
    finally:
        browser.switch_to.default_content()


def test_the_tables_answer_their_question(executed, browser, tmp_path):
    from selenium.webdriver.common.by import By

    cells, _ = executed
    stats_table = _html(cells[2])[0]
    assert stats_table.count("<tr>") == 1 + 12  # a row per head of layer 0
    effects = _html(cells[4])[0]
    browser.get(_page(tmp_path, effects).as_uri())
    values = [float(td.text) for td in browser.find_elements(By.CSS_SELECTOR, ".attnkit-head-effects td")]
    assert len(values) == 6 * 12
    clean, corrupt = (float(x) for x in re.findall(r"clean ([\d.e-]+), corrupt ([\d.e-]+)", html.unescape(effects))[0])
    assert clean > corrupt and max(values) > corrupt  # some head moves the corrupt run toward the clean one
    printed = "".join(o.get("text", "") for o in cells[5])
    assert "[CLS]" in printed and "changes [CLS] by" in printed


def test_the_relevance_view_shades_the_most_relevant_token_darkest(executed, browser, tmp_path):
    from selenium.webdriver.common.by import By

    cells, _ = executed
    printed = "".join(o.get("text", "") for o in cells[5])
    first = re.findall(r"\[\('([^']+)', ([\d.]+)\)", printed)[0][0]  # rollout's most relevant token, printed
    _enter(browser, _page(tmp_path, _html(cells[6])[0]))
    try:
        spans = browser.find_elements(By.CSS_SELECTOR, "p.text span")
        shades = [re.search(r"rgba?\(214, 80, 40(?:, ([\d.]+))?\)", s.get_attribute("style")) for s in spans]
        alphas = [float(m.group(1) or 1.0) for m in shades]  # the browser writes alpha 1 as rgb(...)
        assert len(spans) >= 10  # every token of the sentence
        assert spans[alphas.index(max(alphas))].text == first
        assert not severe_logs(browser)
    finally:
        browser.switch_to.default_content()


def test_the_widget_cell_holds_a_live_view_that_renders_from_the_saved_state(executed, browser, tmp_path):
    """The saved notebook keeps the widget's state (nbclient stores it, as Jupyter does); its front
    end, rendered from that state, draws every head and the picked head's profiles over 512 tokens."""
    from selenium.webdriver.common.by import By

    pytest.importorskip("anywidget")
    cells, saved = executed
    views = [o["data"] for o in cells[8] if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1
    model_id = views[0]["application/vnd.jupyter.widget-view+json"]["model_id"]
    stored = nbformat.read(saved, as_version=4).metadata["widgets"]["application/vnd.jupyter.widget-state+json"]
    state = stored["state"][model_id]["state"]
    assert state["selected"] == [0, 3] and state["detail"]["layer"] == 0 and state["detail"]["head"] == 3
    assert len(state["detail"]["received"]) == 512 and state["detail"]["binSize"] == 1
    assert len(json.dumps(state)) <= notebook.INLINE_BUDGET
    open_widget(browser, tmp_path / "widget.html", state, state["_esm"], state["_css"])
    assert len(browser.find_elements(By.CSS_SELECTOR, "td.ak-cell")) == 6 * 12
    assert browser.find_element(By.CSS_SELECTOR, ".ak-title").text.endswith("head 3")
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg.ak-profile polyline")) == 3
    assert not severe_logs(browser)


def test_no_cell_prints_a_warning(executed):
    """A reader sees no red text: the example read a tensor that required grad with float() (torch warned)."""
    cells, _ = executed
    warned = [o.get("text", "") for outs in cells for o in outs if o.get("name") == "stderr"]
    assert not [t for t in warned if "Warning" in t], warned


def test_the_exported_notebook_shows_the_widgets_grid_offline(executed, browser, tmp_path):
    """nbconvert's HTML keeps the widget's saved state and loads its front end from a CDN: offline the
    widget cell was blank. The widget's output carries a static picture of its grid beside the live view."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    nbconvert = pytest.importorskip("nbconvert")
    _, saved = executed
    body, _ = nbconvert.HTMLExporter().from_filename(str(saved))
    page = tmp_path / "exported.html"
    page.write_text(body, encoding="utf-8")
    assert "application/vnd.jupyter.widget-view+json" in body  # the live view is exported too
    browser.get(page.as_uri())

    def shown(driver):
        return [i for i in driver.find_elements(By.CSS_SELECTOR, ".attnkit-static img") if i.is_displayed()]

    try:  # the page's scripts (a CDN's, unreachable offline) may still be failing when get() returns
        WebDriverWait(browser, 20).until(shown)
    except TimeoutException:
        pass
    images = shown(browser)
    assert len(images) == 1
    image = images[0]
    assert "6 layers x 12 heads" in image.get_attribute("alt")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) > 400
    assert image.size["width"] > 400 and image.size["height"] > 200  # the grid, drawn, not a blank cell
