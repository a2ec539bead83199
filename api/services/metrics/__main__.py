"""`python -m api.services.metrics [--write]`: the catalog page, printed or written to docs/metrics.md."""

from __future__ import annotations

import sys
from pathlib import Path

from api.services.metrics.page import render_catalog

page = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
if sys.argv[1:] == ["--write"]:
    page.write_text(render_catalog(), encoding="utf-8")
else:
    sys.stdout.write(render_catalog())
