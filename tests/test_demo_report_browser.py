"""The demo's report in a real browser: headless Chromium renders report.html, whose first element after the title
is the speedup figure, and the figure decodes to a picture that is not blank. Built from a fixture, not by running
the demo: a quick demo's summary.json (the figures the report draws; 2026-11-29) with its prompt-lookup block
(`specheads.demo.lookup.lookup_line`) and an EAGLE-3 block in the shape `specheads.demo.eagle3.eagle3_line` writes,
holding docs/results.md's wall-clock figures (no drafter here). Skips,
saying so, where no Chromium is installed (`.ci/run` installs Debian's `chromium`)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from specheads.demo.figure import FIGURE, panels
from specheads.demo.report import write_demo_report
from specheads.demo.stages import Layout

SUMMARY = Path(__file__).parent / "fixtures" / "demo_summary.json"
CHROMIUM = next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--allow-file-access-from-files", "--virtual-time-budget=10000"]
PROBE = """<script>
window.addEventListener('load', () => {
  const figure = document.querySelector('img[src="__FIGURE__"]');
  const probe = {present: !!figure, first: false, width: 0, height: 0, inked: 0};
  if (figure) {
    const body = document.body.children;
    probe.first = body.length > 1 && body[0].tagName === 'H1' && body[1].contains(figure);
    probe.width = figure.naturalWidth;
    probe.height = figure.naturalHeight;
    if (figure.naturalWidth > 0) {
      const canvas = document.createElement('canvas');
      canvas.width = figure.naturalWidth;
      canvas.height = figure.naturalHeight;
      const context = canvas.getContext('2d');
      context.drawImage(figure, 0, 0);
      const pixels = context.getImageData(0, 0, canvas.width, canvas.height).data;
      let inked = 0;
      for (let i = 0; i < pixels.length; i += 4) {
        if (pixels[i + 3] > 0 && Math.min(pixels[i], pixels[i + 1], pixels[i + 2]) < 200) inked++;
      }
      probe.inked = inked / (canvas.width * canvas.height);
    }
  }
  document.body.setAttribute('data-probe', JSON.stringify(probe));
});
</script>""".replace("__FIGURE__", FIGURE)
"""Appended to a copy of the report: after the page and its images load, it records whether the figure is there and
first, its decoded size, and the share of its pixels that are drawn (darker than a light grey)."""


def summary() -> dict:
    return json.loads(SUMMARY.read_text())


def rendered(folder: Path, tmp_path: Path) -> dict:
    """What the probe saw once Chromium loaded a copy of folder/report.html (the figure beside it)."""
    page = folder / "probe.html"
    page.write_text((folder / "report.html").read_text().replace("</body>", PROBE + "</body>"))
    result = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    found = re.search(r'data-probe="([^"]*)"', result.stdout)
    assert found, f"Chromium rendered no page (exit {result.returncode}): {result.stderr[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def report_folder(tmp_path: Path, content: dict) -> Path:
    folder = tmp_path / "demo"
    folder.mkdir()
    write_demo_report(content, {}, Layout(folder))
    return folder


def test_the_figure_draws_each_rule_and_the_heads_interval_paired_against_it():
    """The prompt-lookup pair's panel first; then per evaluated head a panel of every rule it was decoded beside, the
    head's whisker on each rule's row being its own speedup's paired interval against that rule; the EAGLE-3 pair's
    panel in wall clock last, each rule's interval its own."""
    content = summary()
    found = panels(content)
    assert len(found) == len([f for f in content["heads"].values() if "modelled_speedup" in f["decoding"]]) + 2
    assert found[0].title.startswith("prompt-lookup pair")
    ontime = content["heads"]["ontime"]["decoding"]
    first = found[1]
    assert first.rows[0].head and first.rows[0].value == ontime["modelled_speedup"]
    confidence = next(row for row in first.rows if row.label.startswith("draft confidence"))
    ci = ontime["gain_vs_confidence_ci"]
    assert confidence.value == ontime["confidence_speedup"] and confidence.around == ontime["modelled_speedup"]
    assert confidence.interval == pytest.approx((ontime["confidence_speedup"] * (1 + ci[0]),
                                                 ontime["confidence_speedup"] * (1 + ci[1])))
    eagle3 = found[-1]
    row = content["eagle3"]["rules"]["constant_k:1"]
    assert eagle3.title.startswith("EAGLE-3 pair: wall clock") and eagle3.rows[0].value == row["speedup"]
    assert eagle3.rows[0].interval == pytest.approx((1 + row["speedup_interval"][0], 1 + row["speedup_interval"][1]))


def test_without_decoding_the_report_says_why_there_is_no_figure(tmp_path):
    content = summary()
    for figures in content["heads"].values():
        figures["decoding"] = {"note": "no decoding runs"}
    content["eagle3"] = content["lookup"] = None
    folder = report_folder(tmp_path, content)
    assert not (folder / FIGURE).exists()
    assert "there is no speedup figure" in (folder / "report.md").read_text()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install -y chromium): the demo report's "
                                             "browser test skipped")
def test_the_demo_report_opens_on_its_speedup_figure_in_chromium(tmp_path):
    folder = report_folder(tmp_path, summary())
    text = (folder / "report.md").read_text()
    assert text.index(f"]({FIGURE})") < text.index("| AUC on held-out tokens")  # the picture, then the table
    probe = rendered(folder, tmp_path)
    assert probe["present"] and probe["first"], probe
    assert probe["width"] > 300 and probe["height"] > 300, probe  # decoded: a broken or missing file has no size
    assert probe["inked"] > 0.01, probe  # drawn: not a blank picture
