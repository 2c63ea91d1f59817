"""The HTML report in real headless Chromium: no console error, every plot decoded (naturalWidth > 0).

Needs Debian's `chromium` (.ci/run installs it); without it the tests skip saying how to get it.
Negative control: a page with a console.error, an uncaught exception and a broken image is
caught by the same checks."""

from __future__ import annotations

import pytest
from headless_chromium import Chromium

from titan_audit.report import write_report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def browser():
    with Chromium() as chromium:
        yield chromium


def _check(page, min_images: int) -> None:
    assert page.errors == [], page.errors
    assert len(page.images) >= min_images, page.images
    assert all(i["complete"] and i["naturalWidth"] > 0 and i["naturalHeight"] > 0 for i in page.images), page.images
    assert page.tables >= 1 and page.title.startswith("titan-audit")


def test_train_report_with_against_renders_without_errors(runs, browser):
    page = browser.load(write_report(runs["base"], against=runs["seed1"])["html"])
    _check(page, min_images=3)  # loss curves, coverage, divergence map
    assert "Audit coverage" in page.text and "divergence map" in page.text


def test_rl_report_renders_without_errors(runs, browser):
    page = browser.load(write_report(runs["rl"])["html"])
    _check(page, min_images=3)  # reward/loss, zero gap, coverage
    assert "ZERO GAP" in page.text


def test_the_checks_catch_console_errors_and_broken_images(browser, tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<!DOCTYPE html><html><head><title>titan-audit bad</title></head><body><table></table>"
        "<img alt='broken' src='data:image/png;base64,AAAA'>"
        "<script>console.error('boom'); notDefined();</script></body></html>"
    )
    page = browser.load(bad)
    assert any("boom" in e for e in page.errors) and any("notDefined" in e for e in page.errors)
    assert page.images and page.images[0]["naturalWidth"] == 0
    with pytest.raises(AssertionError):
        _check(page, min_images=1)
