"""tests/debian.py installs a tool while another process holds apt's lock: it waits for the lock
instead of failing the test that needed the tool. A stand-in `apt-get` first on PATH answers as the
real one does while another apt-get or dpkg runs (exit 100, "Could not get lock"), so nothing is
installed and no lock on this machine is taken."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from tests import debian

# Refuses as apt-get does while another process holds the lock, until the lock file is removed.
FAKE_APT_GET = """#!/bin/sh
echo "$@" >> "{calls}"
if [ -e "{held}" ]; then
    echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (apt-get)" >&2
    echo "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process using it?" >&2
    exit 100
fi
echo "zsh is already the newest version."
"""


@pytest.fixture
def fake_apt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls, held = tmp_path / "calls", tmp_path / "held"
    program = bin_dir / "apt-get"
    program.write_text(FAKE_APT_GET.format(calls=calls, held=held))
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(debian, "LOCK_RETRY_SECONDS", 0.05)
    return calls, held


def test_an_install_waits_while_another_apt_get_holds_the_lock(fake_apt: tuple[Path, Path]) -> None:
    calls, held = fake_apt
    held.touch()
    release = threading.Timer(0.5, held.unlink)  # the other apt-get finishes
    release.start()
    try:
        assert debian.install("zsh") == ""
    finally:
        release.cancel()
    made = calls.read_text().splitlines()
    assert len(made) > 1, "refused at least once, then run again"
    assert all(line.startswith("-o DPkg::Lock::Timeout=") and " install " in line for line in made), made


def test_a_lock_held_past_the_deadline_says_so(
    fake_apt: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, held = fake_apt
    held.touch()
    monkeypatch.setattr(debian, "APT_TIMEOUT", 0.5)
    why = debian.install("zsh")
    assert "held apt's lock" in why and "Could not get lock" in why, why
