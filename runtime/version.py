"""The release this process runs: read once from the installed package's metadata (pyproject.toml's
`version`), so the server, the CLI, the agent and `/metrics` can never name different releases."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "modelforge-hardware"

try:
    VERSION = version(DISTRIBUTION)
except PackageNotFoundError:  # a source tree run without `pip install -e .`
    VERSION = "0+unknown"
