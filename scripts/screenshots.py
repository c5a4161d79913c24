"""Screenshots of the HTML view for the README, taken in headless Chromium.

attnkit show "The animal didn't cross the street because it was too tired." --out attention
python scripts/screenshots.py attention/attention.html docs/
"""

import sys
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait


def main(page: str, out: str) -> None:
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in [
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--window-size=1320,980",
        f"--user-data-dir={tempfile.mkdtemp()}",
    ]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        driver.get(Path(page).resolve().as_uri())
        WebDriverWait(driver, 20).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
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
    main(*sys.argv[1:3])
