"""Screenshots of the HTML views for the README and the docs, taken in headless Chromium.

attnkit show "The animal didn't cross the street because it was too tired." --out attention
python scripts/screenshots.py attention/attention.html docs/
python scripts/screenshots.py attention/recommend/recommend.html docs/view_recommend.png --first-view

The first form takes the model, head and heatmap views; ``--first-view`` takes what a page
shows when it opens (an application's overview), ``--height`` pixels tall (default 760).
"""

import argparse
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait


def _driver(height: int = 980):
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        f"--window-size=1320,{height}",
        f"--user-data-dir={tempfile.mkdtemp()}",
    ]:
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def _open(driver, page: str) -> None:
    driver.get(Path(page).resolve().as_uri())
    WebDriverWait(driver, 20).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def first_view(page: str, out: str, height: int = 760) -> None:
    driver = _driver(height)
    try:
        _open(driver, page)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(out)
    finally:
        driver.quit()
    print(f"wrote {out}")


def main(page: str, out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    driver = _driver()
    try:
        _open(driver, page)
        driver.save_screenshot(str(out_dir / "view_model.png"))
        driver.find_element(By.CSS_SELECTOR, "nav button[data-view='head']").click()
        driver.execute_script(
            "document.getElementById('head-layer').value = 2; "
            "document.getElementById('head-layer').dispatchEvent(new Event('change'))"
        )
        driver.save_screenshot(str(out_dir / "view_head.png"))
        driver.find_element(By.CSS_SELECTOR, "nav button[data-view='model']").click()
        driver.find_element(By.CSS_SELECTOR, "canvas.thumb[data-layer='2'][data-head='0']").click()
        driver.save_screenshot(str(out_dir / "view_heatmap.png"))
    finally:
        driver.quit()
    print(f"wrote {out_dir}/view_model.png, view_head.png, view_heatmap.png")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", help="an HTML view written by attnkit")
    parser.add_argument("out", help="a folder (the three views) or, with --first-view, a PNG file")
    parser.add_argument("--first-view", action="store_true", help="take what the page shows when it opens")
    parser.add_argument("--height", type=int, default=760, help="window height for --first-view (pixels)")
    args = parser.parse_args()
    if args.first_view:
        first_view(args.page, args.out, args.height)
    else:
        main(args.page, args.out)
