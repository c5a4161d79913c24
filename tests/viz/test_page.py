"""TODO"""

from __future__ import annotations

import pytest
import torch


# regression: a finding of the adversarial review of the inputs (hardening)
@pytest.mark.parametrize("placeholder", ["{{data}}", "{{title}}", "{{style}}", "{{script}}"])
def test_page_fills_its_template_once(placeholder):
    from attnkit.viz import attention_html

    page = attention_html(torch.full((1, 1, 2, 2), 0.5), [placeholder, "b"], title=placeholder)
    head = page.split("</title>", 1)[0]
    assert head.endswith(f"<title>{placeholder}")  # the user's text, not a second substitution
    assert page.count('id="attnkit-data"') == 1 and len(head) < 300


# regression: a finding of the adversarial review of the inputs (hardening)
def test_page_title_drops_bidi_and_control_characters():
    from attnkit.viz import attention_html

    page = attention_html(torch.full((1, 1, 1, 1), 1.0), ["x"], title="abc\u202edef\x07")
    assert "<title>abcdef</title>" in page


# regression: finding F21 of the review of the seams between features
def test_attention_page_is_bounded_whatever_the_token_text():
    from attnkit.viz.html import MAX_LABEL, attention_html

    page = attention_html(torch.rand(1, 1, 300, 300), ["x" * 1_000_000] * 300, title="t" * 10_000)
    assert len(page) < 1_000_000  # was 600 MB
    assert f"300 token labels longer than {MAX_LABEL} characters are cut" in page
