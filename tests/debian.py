"""Debian packages a test needs, installed with apt-get when missing.

A test that needs a real tool (chromium, promtool, docker-compose, a second PostgreSQL...) installs
it here on a fresh machine and FAILS, saying why, when it cannot: a check that did not run is not
a check that passed."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

APT_TIMEOUT = 900.0  # seconds for a whole install, waits for another apt-get's lock included
LOCK_HELD = "Could not get lock"  # apt's message (LC_ALL=C) while another process holds a lock
LOCK_RETRY_SECONDS = 2.0


def install(*packages: str) -> str:
    """Install Debian packages; '' on success, else why not (for the failure message). The package
    lists are updated only when the first attempt fails, as a stale list is the usual cause.

    Another process (another test session, an operator) may be running apt-get or dpkg at the same
    moment, and apt-get refuses at once while it holds their lock: each step waits for the lock
    instead, dpkg's through `DPkg::Lock::Timeout`, any other (`apt-get update`'s lists lock, which
    that option does not cover) by running the step again."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "not root, cannot apt-get install"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
    deadline = time.monotonic() + APT_TIMEOUT
    command = ["install", "-y", "-q", "--no-install-recommends", *packages]
    output = ""
    for step in (command, ["update", "-q"], command):
        done = _apt_get(step, env, deadline)
        if isinstance(done, str):
            return done
        output = (done.stdout + done.stderr).strip()
        if step is command and done.returncode == 0:
            return ""
    return f"apt-get install {' '.join(packages)} failed: {output[-500:]}"


def _apt_get(step: list[str], env: dict[str, str], deadline: float) -> subprocess.CompletedProcess[str] | str:
    """One apt-get step, run again while another process holds a lock it needs; why not (a str)
    when `deadline` passes first."""
    while True:
        left = deadline - time.monotonic()
        try:
            done = subprocess.run(
                ["apt-get", "-o", f"DPkg::Lock::Timeout={max(int(left), 1)}", *step],
                env=env,
                capture_output=True,
                text=True,
                timeout=left,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"`apt-get {' '.join(step)}` did not finish within {APT_TIMEOUT:.0f}s"
        output = (done.stdout + done.stderr).strip()
        if done.returncode == 0 or LOCK_HELD not in output:
            return done
        if deadline - time.monotonic() <= LOCK_RETRY_SECONDS:
            return f"another process held apt's lock for {APT_TIMEOUT:.0f}s: {output[-500:]}"
        time.sleep(LOCK_RETRY_SECONDS)


def require(program: str, package: str) -> str:
    """The path of `program`, installing `package` when it is missing; fails the calling test
    when it cannot be had."""
    path = shutil.which(program)
    if path is None:
        why = install(package)
        path = shutil.which(program)
        if path is None:
            pytest.fail(
                f"{program} (Debian package {package}) cannot be installed: {why or 'not on PATH after install'}"
            )
    return path
