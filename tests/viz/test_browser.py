"""The HTML view in headless Chromium (Debian's chromium and chromium-driver), from file://."""

import os
import shutil

import numpy as np
import pytest
import torch

from attnkit.viz import attention_html, save_html

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    "--window-size=1300,1000",
]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        if os.environ.get("ATTNKIT_REQUIRE_BROWSER"):
            pytest.fail("ATTNKIT_REQUIRE_BROWSER is set but chromium/chromedriver are not on PATH")
        pytest.skip(
            "browser test skipped: no chromium/chromedriver on PATH "
            "(apt-get install chromium chromium-driver; .ci/run installs them)"
        )
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


def fake_weights(layers, heads, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(layers, heads, length, length, generator=g), dim=-1)


def open_page(browser, path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(path.as_uri())
    WebDriverWait(browser, 20).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def severe_logs(browser):
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


CANVAS_SPREAD = """
const c = arguments[0], d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let lo = 255, hi = 0, sum = 0;
for (let i = 0; i < d.length; i += 4) {
  const v = d[i] + d[i+1] + d[i+2]; lo = Math.min(lo, v); hi = Math.max(hi, v); sum += v;
}
return [hi - lo, sum];
"""

STAND_IN = """<!doctype html><meta charset="utf-8"><style>{css}</style><body>{before}<div id="w"></div>
<script type="module">
const state = {state};
const listeners = {{}};
window.sets = [];
const model = {{
  get: (k) => state[k],
  set: (k, v) => {{ state[k] = v; window.sets.push([k, v]); (listeners["change:" + k] || []).forEach((f) => f()); }},
  save_changes() {{}},
  on: (e, f) => {{ (listeners[e] = listeners[e] || []).push(f); }},
  off: (e, f) => {{ listeners[e] = (listeners[e] || []).filter((g) => g !== f); }},
}};
window.push = (k, v) => {{ state[k] = v; (listeners["change:" + k] || []).forEach((f) => f()); }};
const url = URL.createObjectURL(new Blob([{esm}], {{ type: "text/javascript" }}));
import(url).then((m) => {{
  m.default.render({{ model, el: document.getElementById("w") }});
  document.body.dataset.ready = "1";
}});
</script>"""


def open_widget(browser, path, state: dict, esm: str, css: str, before: str = "") -> None:
    """The widget's front end (its ``_esm``) rendered in a page with a stand-in for the notebook's
    model holding ``state`` (``data``, ``selected``, ``detail``); ``window.sets`` records what the
    view sets, ``window.push(name, value)`` changes a value as the kernel would. ``before``: HTML of
    the outputs above the widget's (its static view, as the notebook shows it)."""
    import json

    from selenium.webdriver.support.ui import WebDriverWait

    page = STAND_IN.format(css=css, state=json.dumps(state), esm=json.dumps(esm), before=before)
    path.write_text(page, encoding="utf-8")
    browser.get_log("browser")
    browser.get(path.as_uri())
    WebDriverWait(browser, 20).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def test_model_view_renders_and_a_click_opens_the_head(browser, tmp_path):
    from selenium.webdriver.common.by import By

    tokens = ["[CLS]", "the", "cat", "sat", "今天", "[SEP]"]
    path = save_html(tmp_path / "a.html", fake_weights(3, 4, 6), tokens, title="a test")
    open_page(browser, path)
    thumbs = browser.find_elements(By.CSS_SELECTOR, "canvas.thumb")
    assert len(thumbs) == 12
    assert browser.execute_script(CANVAS_SPREAD, thumbs[0])[0] > 50  # not blank
    target = browser.find_element(By.CSS_SELECTOR, "canvas.thumb[data-layer='2'][data-head='3']")
    target.click()
    assert browser.find_element(By.ID, "heatmap-view").is_displayed()
    assert not browser.find_element(By.ID, "model-view").is_displayed()
    assert browser.find_element(By.ID, "hm-title").text == "layer 2 · head 3"
    heatmap = browser.find_element(By.ID, "hm-canvas")
    assert browser.execute_script(CANVAS_SPREAD, heatmap)[0] > 50
    assert severe_logs(browser) == []


def test_head_view_draws_lines_and_hover_keeps_one_tokens_lines(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    path = save_html(tmp_path / "b.html", fake_weights(2, 3, 8), [f"tok{i}" for i in range(8)])
    open_page(browser, path)
    browser.find_element(By.CSS_SELECTOR, "nav button[data-view='head']").click()
    canvas = browser.find_element(By.ID, "head-canvas")
    spread, everything = browser.execute_script(CANVAS_SPREAD, canvas)
    assert spread > 50
    # hover the first query token (left column, first row; the column is as wide as its
    # widest label): only its lines stay
    ActionChains(browser).move_to_element_with_offset(
        canvas, -canvas.size["width"] // 2 + 8, -canvas.size["height"] // 2 + 20
    ).perform()
    _, hovered = browser.execute_script(CANVAS_SPREAD, canvas)
    assert hovered != everything
    # toggle every head off: only the tokens remain
    for square in browser.find_elements(By.CSS_SELECTOR, "#head-toggles .swatch"):
        square.click()
    ActionChains(browser).move_to_element(browser.find_element(By.ID, "title")).perform()
    _, none = browser.execute_script(CANVAS_SPREAD, canvas)
    assert none != everything
    assert severe_logs(browser) == []


def test_user_text_is_escaped_everywhere(browser, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    evil = ['<img src=x onerror="window.__pwned=1;alert(1)">', "</script><script>window.__pwned=2</script>", "&amp;"]
    title = "</title><script>window.__pwned=3</script>"
    path = save_html(tmp_path / "c.html", fake_weights(1, 2, 3), evil, title=title, layer_names=["<b>x</b>"])
    open_page(browser, path)
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018
    assert browser.execute_script("return window.__pwned === undefined")
    assert browser.find_element(By.ID, "title").text == title
    assert browser.title == title
    assert browser.execute_script("return document.querySelectorAll('img, b').length") == 0
    assert browser.find_elements(By.CSS_SELECTOR, "canvas.thumb")[0].get_attribute("title") == "<b>x</b>, head 0"
    assert severe_logs(browser) == []


def test_too_many_tokens_for_lines_shows_a_message(browser, tmp_path):
    from selenium.webdriver.common.by import By

    path = save_html(tmp_path / "d.html", fake_weights(1, 1, 300), [str(i) for i in range(300)])
    open_page(browser, path)
    browser.find_element(By.CSS_SELECTOR, "nav button[data-view='head']").click()
    message = browser.find_element(By.ID, "head-message")
    assert message.is_displayed() and "at most 256 tokens" in message.text
    browser.find_element(By.CSS_SELECTOR, "nav button[data-view='heatmap']").click()
    assert browser.execute_script(CANVAS_SPREAD, browser.find_element(By.ID, "hm-canvas"))[0] > 50
    assert severe_logs(browser) == []


# --- the file itself (no browser needed) -----------------------------------------------------


def test_page_is_self_contained_and_compact():
    page = attention_html(fake_weights(6, 12, 128), [f"t{i}" for i in range(128)])
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and "src=" not in page
    assert len(page.encode()) < 5 * 2**20


def test_page_escapes_script_breakers_in_the_data():
    page = attention_html(fake_weights(1, 1, 2), ["</script>", "<!--"], title="<x>")
    assert page.count("</script>") == 2  # the data block's and the code's own
    assert "<!--" not in page and "<x>" not in page


def test_page_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match=r"more than one page holds"):
        attention_html(torch.zeros(64, 64, 512, 512), ["t"] * 512)
    with pytest.raises(ValueError, match=r"need 3 query tokens and 3 key tokens, but got 2 and 2"):
        attention_html(torch.zeros(1, 1, 3, 3), ["a", "b"])


GLYPHS = """
const family = arguments[0], chars = arguments[1], out = [];
const c = document.createElement('canvas'); c.width = 48; c.height = 48;
const ctx = c.getContext('2d');
for (const ch of chars) {
  ctx.clearRect(0, 0, 48, 48); ctx.font = '36px ' + family; ctx.fillStyle = '#000'; ctx.textBaseline = 'top';
  ctx.fillText(ch, 4, 4);
  const d = ctx.getImageData(0, 0, 48, 48).data; let bits = '';
  for (let i = 3; i < d.length; i += 4) bits += d[i] > 127 ? '1' : '0';
  out.push(bits);
}
return [document.fonts.check('36px "attnkit-glyphs"', chars), out];
"""


def test_cjk_tokens_render_without_system_cjk_fonts(browser, tmp_path):
    """The page carries the glyphs it shows: distinct CJK characters draw as distinct shapes,
    not as a row of identical empty boxes (a fresh machine has no CJK fonts)."""
    tokens = ["[CLS]", "她", "说", "今天", "天气", "很", "好", "[SEP]"]
    path = save_html(tmp_path / "cjk.html", fake_weights(1, 2, len(tokens)), tokens, title="她说今天天气很好")
    assert "@font-face" in path.read_text(encoding="utf-8")
    open_page(browser, path)
    chars = "她说今天气很好"
    loaded, bitmaps = browser.execute_script(GLYPHS, '"attnkit-glyphs", monospace', chars)
    assert loaded
    assert all("1" in b for b in bitmaps)  # something is drawn
    assert len(set(bitmaps)) == len(chars)  # and each character differently (boxes would be identical)
    family = browser.execute_script("return getComputedStyle(document.getElementById('title')).fontFamily")
    assert "attnkit-glyphs" in family
    assert severe_logs(browser) == []


def test_ascii_pages_embed_no_font(tmp_path):
    path = save_html(tmp_path / "ascii.html", fake_weights(1, 1, 3), ["a", "b", "c"], title="plain")
    assert "@font-face" not in path.read_text(encoding="utf-8")


def test_region_page_shows_a_words_region_on_hover(browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    from attnkit.viz.regions import save_region_html

    image = torch.rand(8, 24) * 16
    attention = torch.softmax(torch.randn(2, 4, 3, 12), dim=-1)
    path = save_region_html(tmp_path / "regions.html", image, ["seven", "three", "one"], attention, (2, 6))
    open_page(browser, path)
    canvas = browser.find_element(By.ID, "image")
    first = browser.execute_script(CANVAS_HASH, canvas)
    buttons = browser.find_elements(By.CSS_SELECTOR, ".words button")
    assert [b.text for b in buttons] == ["seven", "three", "one"]
    ActionChains(browser).move_to_element(buttons[2]).perform()
    assert browser.execute_script(CANVAS_HASH, canvas) != first  # another word, another region
    assert "active" in buttons[2].get_attribute("class")
    assert severe_logs(browser) == []


CANVAS_HASH = """
const d = arguments[0].getContext('2d').getImageData(0, 0, arguments[0].width, arguments[0].height).data;
let h = 0; for (let i = 0; i < d.length; i += 7) h = (h * 31 + d[i]) % 1000000007; return h;
"""


def _long_inputs(length=32768, layers=6, heads=12, rows=(0, -1)):
    """Statistics and chosen rows of a 32k-token input, shaped like capture(mode="stats")'s."""
    from attnkit.inspect import AttentionStats

    g = torch.Generator().manual_seed(0)
    stats = []
    for _ in range(layers):
        lse = torch.randn(1, heads, length, generator=g)
        stats.append(
            AttentionStats(
                lse=lse,
                entropy=torch.rand(1, heads, length, generator=g) * 5,
                max_weight=torch.rand(1, heads, length, generator=g),
                argmax=torch.zeros(1, heads, length, dtype=torch.long),
                sink_mass=torch.rand(1, heads, length, generator=g),
                mean_distance=torch.rand(1, heads, length, generator=g) * 1e4,
                received=torch.rand(1, heads, length, generator=g) ** 8 * 50,
            )
        )
    weights = [torch.softmax(4 * torch.randn(1, heads, len(rows), length, generator=g), -1) for _ in range(layers)]
    tokens = [f"w{i}" for i in range(length)]
    tokens[5] = "<script>alert(1)</script>"
    tokens[6] = "今天"
    return stats, tokens, [r % length for r in rows], weights


def test_long_page_fits_its_budget_opens_and_zooms_to_tokens(browser, tmp_path):
    from selenium.webdriver.common.by import By

    from attnkit.viz.long import save_long_html

    stats, tokens, rows, weights = _long_inputs()
    path = save_long_html(tmp_path / "long.html", stats, tokens, rows, weights, title="<b>32k</b> tokens")
    assert path.stat().st_size <= 10 * 2**20  # 32k tokens, 6 layers x 12 heads, two rows
    open_page(browser, path)
    assert severe_logs(browser) == []
    assert len(browser.find_elements(By.CSS_SELECTOR, "table.grid")) == 3
    assert browser.execute_script(CANVAS_SPREAD, browser.find_element(By.ID, "profile"))[0] > 50
    assert browser.execute_script(CANVAS_SPREAD, browser.find_element(By.ID, "rowprofile"))[0] > 50
    assert browser.find_element(By.ID, "title").text == "<b>32k</b> tokens"  # text, not markup
    browser.execute_script("window.attnkitZoom(0, 40)")
    spans = browser.find_elements(By.CSS_SELECTOR, "#zoomed span")
    assert len(spans) == 40 and spans[5].text == "<script>alert(1)</script>" and spans[6].text == "今天"
    assert len(browser.find_elements(By.CSS_SELECTOR, "#top li")) == 10
    sink = browser.find_elements(By.CSS_SELECTOR, "table.grid")[1].find_elements(By.CSS_SELECTOR, "td")
    assert all(td.text.endswith("%") for td in sink) and any(td.text not in ("0.00%", "<0.01%") for td in sink)
    cell = browser.find_elements(By.CSS_SELECTOR, "table.grid td")[13]  # layer 1, head 1 of the first table
    cell.click()
    assert browser.find_element(By.ID, "which").get_attribute("value") == "1:1"
    assert severe_logs(browser) == []


# --- the applications' pages: the first view answers the page's question without a click ------------


def _visible(browser, element_id):
    return browser.execute_script(f"return !document.getElementById('{element_id}').closest('[hidden]')")


EDGE_INK = """
const c = arguments[0], ctx = c.getContext('2d');
const ink = (d) => {
  let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] + d[i+1] + d[i+2] < 600) n++; return n;
};
return [ink(ctx.getImageData(c.width - 2, 0, 2, c.height).data), ink(ctx.getImageData(0, 0, c.width, 2).data)];
"""


def test_recommendation_page_opens_on_the_titles_and_what_each_drew_on(browser, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from selenium.webdriver.common.by import By

    from attnkit.cli import main

    assert main(["recommend", "--user", "1", "-k", "5", "--out", str(tmp_path)]) == 0
    import re

    printed = capsys.readouterr().out
    top = re.findall(r"^ +\d+\. (.+)$", printed.split("top 5:")[1], flags=re.M)
    assert len(top) == 5
    open_page(browser, tmp_path / "recommend.html")
    assert _visible(browser, "overview-view") and not _visible(browser, "model-grid")
    items = browser.find_elements(By.CSS_SELECTOR, "#ov-list > li")
    assert [li.find_element(By.CSS_SELECTOR, ".item").text for li in items] == top
    for li in items:
        rows = li.find_elements(By.CSS_SELECTOR, ".bar-row")
        assert 1 <= len(rows) <= 3
        names = [r.find_element(By.CSS_SELECTOR, ".name").text for r in rows]
        assert all(n and n not in top for n in names)  # past movies, never the recommendation itself
        widths = [r.find_element(By.CSS_SELECTOR, ".bar").size["width"] for r in rows]
        assert widths == sorted(widths, reverse=True) and widths[0] > 0  # bars, largest first
    # one scale for all titles: a bar's width is its value times the same factor everywhere
    bars = [
        (float(r.find_element(By.CSS_SELECTOR, ".value").text), r.find_element(By.CSS_SELECTOR, ".bar").size["width"])
        for r in browser.find_elements(By.CSS_SELECTOR, "#ov-list .bar-row")
    ]
    top_value, top_width = max(bars)
    assert top_width > 100
    for value, width in bars:  # the values are printed with 2 digits: their rounding, and a pixel
        assert abs(width - top_width * value / top_value) <= 1.5 + top_width * 0.006 / top_value, (value, width, bars)
    assert "Top 5 for user 1" in browser.find_element(By.ID, "ov-heading").text
    # the other views make room for whole movie titles (they were clipped)
    fits = """
    const data = JSON.parse(document.getElementById("attnkit-data").textContent);
    const ctx = document.createElement("canvas").getContext("2d");
    ctx.font = arguments[1] + " " + getComputedStyle(document.body).fontFamily;
    const widest = (list) => Math.max(...list.map((t) => ctx.measureText(t).width));
    return document.getElementById(arguments[0]).width >= 340 + widest(data.keyTokens) + widest(data.tokens);
    """
    browser.find_element(By.CSS_SELECTOR, 'nav button[data-view="head"]').click()
    assert browser.execute_script(fits, "head-canvas", "14px")
    browser.find_element(By.CSS_SELECTOR, 'nav button[data-view="heatmap"]').click()
    assert browser.execute_script("return document.getElementById('hm-canvas').height") > 200  # rotated titles
    # the rotated titles of the last (most recent, most attended) columns run past the matrix's right
    # edge: the canvas holds them whole, so its right and top edges carry no ink
    assert browser.execute_script(EDGE_INK, browser.find_element(By.ID, "hm-canvas")) == [0, 0]
    assert severe_logs(browser) == []


def test_listen_page_opens_on_the_transcript_over_the_waveform(browser, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from selenium.webdriver.common.by import By

    from attnkit.cli import main

    assert main(["listen", "--example", "1", "--out", str(tmp_path)]) == 0
    heard = capsys.readouterr().out.strip().splitlines()[-1]
    open_page(browser, tmp_path / "listen.html")
    assert _visible(browser, "ov-wave")
    spans = browser.find_elements(By.CSS_SELECTOR, "#ov-list li")
    chars = [s.find_element(By.CSS_SELECTOR, ".char").text for s in spans]
    assert "".join(c for c in chars if c.isdigit()) == heard
    saved = np.load(tmp_path / "listen.npz")
    assert chars == [c for c in saved["chars"] if c != "</s>"]  # the transcript's characters, not the end token
    times = [s.find_element(By.CSS_SELECTOR, ".time").text for s in spans]  # "0.08\u20130.24 s"
    starts = [float(t.split("\u2013")[0]) for t in times]
    ends = [float(t.split("\u2013")[1].removesuffix(" s")) for t in times]
    assert all(a < b for a, b in zip(starts, ends))
    assert starts == sorted(starts)  # the characters were read left to right
    spread, _ = browser.execute_script(CANVAS_SPREAD, browser.find_element(By.ID, "ov-wave"))
    assert spread > 200  # the waveform and the shaded spans are drawn
    assert (
        "rows: " in browser.find_element(By.ID, "summary").text
        and "audio frame" in browser.find_element(By.ID, "summary").text
    )  # frames are not called tokens
    assert severe_logs(browser) == []


def test_alignment_page_opens_on_the_labelled_alignment(browser, tmp_path):
    pytest.importorskip("matplotlib")
    from selenium.webdriver.common.by import By

    from attnkit.cli import main

    assert main(["translate", "25th of March 2019", "--out", str(tmp_path)]) == 0
    open_page(browser, tmp_path / "alignment.html")
    assert _visible(browser, "hm-canvas") and not _visible(browser, "model-grid")
    assert "input character" in browser.find_element(By.ID, "hm-xlabel").text
    assert "output character" in browser.find_element(By.ID, "hm-ylabel").text
    assert "mean of heads" in browser.find_element(By.ID, "hm-title").text
    assert "decoder layer 1" in browser.find_element(By.ID, "hm-title").text  # the last layer
    spread, _ = browser.execute_script(CANVAS_SPREAD, browser.find_element(By.ID, "hm-canvas"))
    assert spread > 200
    # 18 x 11 characters fill the window (a 340 px heatmap on a 1,400 px page before): cells of 40 px or more
    matrix = browser.find_element(By.ID, "hm-canvas")
    assert matrix.size["width"] >= 18 * 40 * 0.9, matrix.size
    assert severe_logs(browser) == []


def test_a_page_without_an_overview_opens_on_the_model_view(browser, tmp_path):
    path = save_html(tmp_path / "plain.html", fake_weights(2, 2, 5), list("abcde"))
    open_page(browser, path)
    assert _visible(browser, "model-grid") and not _visible(browser, "overview-view")
    assert not browser.execute_script("return document.querySelector('nav button[data-view=overview]').offsetParent")


def test_demo_index_has_a_section_per_application_and_captions(browser, tmp_path):
    pytest.importorskip("matplotlib")
    from selenium.webdriver.common.by import By

    from attnkit.viz import attention_grid
    from attnkit.viz.gallery import SECTIONS, write_gallery

    big = attention_grid(fake_weights(6, 12, 9), None)  # the 72-panel grid of attnkit show
    from attnkit.viz.heatmap import heads_figure

    tokens = [f"tok{i}" for i in range(9)]
    heads_figure(
        fake_weights(6, 12, 9), [(0, 1, "a"), (2, 3, "b"), (4, 5, "c")], tokens, tmp_path / "attention_heads.png"
    )
    for folder, name in [(".", "attention.png"), ("translation", "alignment.png"), ("caption", "caption.png")]:
        (tmp_path / folder).mkdir(exist_ok=True)
        big.savefig(tmp_path / folder / name, dpi=110)
    save_html(tmp_path / "translation" / "alignment.html", fake_weights(1, 1, 4), list("abcd"))
    (tmp_path / "notes.png").write_bytes((tmp_path / "attention.png").read_bytes())
    open_page_plain = browser.get
    open_page_plain((write_gallery(tmp_path)).as_uri())
    headings = [h.text for h in browser.find_elements(By.CSS_SELECTOR, "h2")]
    assert headings == [SECTIONS[0][0], SECTIONS[1][0], SECTIONS[2][0], "Other files"]
    for figure in browser.find_elements(By.CSS_SELECTOR, "figure"):
        caption = figure.find_element(By.CSS_SELECTOR, "figcaption").text
        assert len(caption) > 40  # says what to look at, not only the file name
        link = figure.find_element(By.CSS_SELECTOR, "a").get_attribute("href")
        assert link.endswith(".png")  # a click opens the figure at full size
        assert figure.find_element(By.CSS_SELECTOR, "img").size["width"] > 640  # wider than a thumbnail
    assert "open the alignment" in browser.find_element(By.CSS_SELECTOR, "p.view a").text
    first = browser.find_elements(By.CSS_SELECTOR, "section")[0].find_elements(By.CSS_SELECTOR, "figure img")
    assert [i.get_attribute("src").rsplit("/", 1)[-1] for i in first] == ["attention_heads.png", "attention.png"]
    # the figure the section opens on: three heads, its 12 pt labels drawn at least 0.45 of their size
    shown, natural = first[0].size["width"], browser.execute_script("return arguments[0].naturalWidth", first[0])
    assert shown / natural >= 0.45, (shown, natural)


def test_page_options_are_checked_and_overview_text_is_data():
    from attnkit.viz.html import attention_html, bars_overview, waveform_overview

    w, tokens = fake_weights(2, 3, 4), list("abcd")
    with pytest.raises(ValueError, match="start must be"):
        attention_html(w, tokens, start="overview")  # no overview given
    with pytest.raises(ValueError, match="start must be"):
        attention_html(w, tokens, start="sideways")
    with pytest.raises(ValueError, match=r"focus must be \(layer, head\) with layer in 0..1 and head in 0..2"):
        attention_html(w, tokens, focus=(2, 0))
    with pytest.raises(ValueError, match="axes must be two strings"):
        attention_html(w, tokens, axes=("rows",))
    with pytest.raises(ValueError, match="bar values must be finite"):
        bars_overview("h", [("t", [("x", float("nan"))])])
    with pytest.raises(ValueError, match="captions must have one entry per item"):
        bars_overview("h", [("t", [("x", 1.0)])], captions=[])
    with pytest.raises(ValueError, match="NaN or Inf"):
        waveform_overview("h", [0.0, float("inf")], 16000, [])
    with pytest.raises(ValueError, match="finite start <= end"):
        waveform_overview("h", [0.0, 0.5], 16000, [("1", 0.3, 0.1)])
    evil = "</script><script>alert(1)</script>"
    page = attention_html(w, tokens, overview=bars_overview(evil, [(evil, [(evil, 1.0)])], captions=[evil]))
    assert "<script>alert" not in page and page.count("</script>") == 2  # the data block and the script
    wave = waveform_overview("heard 12", np.sin(np.arange(32000) / 20.0), 16000, [("1", 0.1, 0.4), ("2", 1.2, 1.6)])
    assert wave["seconds"] == 2.0 and len(wave["envelope"]) == 2 * 900 and max(wave["envelope"]) <= 1.0
