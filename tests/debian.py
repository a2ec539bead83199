"""Debian packages a test needs, installed with apt-get when missing.

A test that needs a real tool (chromium, promtool, docker-compose, a second PostgreSQL...) installs
it here on a fresh machine and FAILS, saying why, when it cannot: a check that did not run is not
a check that passed."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

APT_TIMEOUT = 900


def install(*packages: str) -> str:
    """Install Debian packages; '' on success, else why not (for the failure message). The package
    lists are updated only when the first attempt fails, as a stale list is the usual cause."""
    if shutil.which("apt-get") is None:
        return "apt-get is not available"
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "not root, cannot apt-get install"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    output = ""
    for step in (command, ["apt-get", "update", "-q"], command):
        try:
            done = subprocess.run(
                step, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired:
            return f"`{' '.join(step)}` timed out after {APT_TIMEOUT}s"
        output = (done.stdout + done.stderr).strip()
        if step is command and done.returncode == 0:
            return ""
    return f"apt-get install {' '.join(packages)} failed: {output[-500:]}"


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
