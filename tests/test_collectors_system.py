"""SystemHostCollector against this machine and against fixture files under a fake root."""

from __future__ import annotations

import asyncio
import os
import platform
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from collectors.facts import UNKNOWN, Known, TemporarilyFailed, Unavailable
from collectors.observations import HOST_METRICS, HostCollectionError, HostObservation
from collectors.system import SystemHostCollector, mount_point, parse_cpuinfo, parse_os_release

# Shaped like a real Ubuntu 22.04 /etc/os-release, with a comment and both quoting styles.
UBUNTU_OS_RELEASE = """\
# written by the distribution
PRETTY_NAME="Ubuntu 22.04.4 LTS"
NAME="Ubuntu"
VERSION_ID="22.04"
VERSION="22.04.4 LTS (Jammy Jellyfish)"
VERSION_CODENAME=jammy
ID=ubuntu
ID_LIKE=debian
HOME_URL='https://www.ubuntu.com/'
"""

# Two sockets, one core each shown (the rest trimmed), as on a dual-socket Xeon.
DUAL_SOCKET_CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 0
cpu cores\t: 56

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 1
core id\t\t: 0
cpu cores\t: 56

processor\t: 2
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
physical id\t: 0
core id\t\t: 1
cpu cores\t: 56
"""

# aarch64 (e.g. Grace): no "model name" and no "physical id".
AARCH64_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics
CPU implementer\t: 0x41
CPU part\t: 0xd4f

processor\t: 1
BogoMIPS\t: 2000.00
CPU implementer\t: 0x41
CPU part\t: 0xd4f
"""


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fixture_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    write(root, "etc/os-release", UBUNTU_OS_RELEASE)
    write(root, "proc/cpuinfo", DUAL_SOCKET_CPUINFO)
    return root


def collect(root: Path, state_dir: Path, **kwargs: Any) -> HostObservation:
    return SystemHostCollector(state_dir, root=root, **kwargs).collect()


# -- this machine -----------------------------------------------------------------------------


def test_real_machine(tmp_path: Path) -> None:
    host = SystemHostCollector(tmp_path / "state").collect()
    assert isinstance(host.memory_total_bytes, Known)
    assert isinstance(host.memory_total_bytes.value, int) and host.memory_total_bytes.value > 0
    assert set(host.telemetry) == set(HOST_METRICS)
    available = host.telemetry["memory_available_bytes"]
    assert isinstance(available, Known) and 0 < int(available.value) <= int(host.memory_total_bytes.value)
    assert host.telemetry["memory_total_bytes"] == host.memory_total_bytes
    assert host.hostname == platform.node()
    assert host.os.kernel == Known(platform.release())
    assert host.os.architecture == Known(platform.machine())
    assert isinstance(host.cpu.logical_cores, Known) and int(host.cpu.logical_cores.value) >= 1
    mounts = [s.mount for s in host.storage]
    assert "/" in mounts
    assert len(mounts) == len(set(mounts))
    root_usage = next(s for s in host.storage if s.mount == "/")
    assert isinstance(root_usage.total_bytes, Known) and int(root_usage.total_bytes.value) > 0
    assert msgspec.json.decode(msgspec.json.encode(host), type=HostObservation) == host


async def test_real_machine_async(tmp_path: Path) -> None:
    host = await SystemHostCollector(tmp_path).collect_async()
    assert isinstance(host.memory_total_bytes, Known)


# -- fixture root -----------------------------------------------------------------------------


def test_fixture_root_os_and_cpu(fixture_root: Path, tmp_path: Path) -> None:
    host = collect(fixture_root, tmp_path)
    assert host.os.name == Known("Ubuntu")
    assert host.os.version == Known("22.04")
    assert host.cpu.model == Known("Intel(R) Xeon(R) Platinum 8480+")
    assert host.cpu.sockets == Known(2)


def test_os_release_falls_back_to_usr_lib(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root, "usr/lib/os-release", 'NAME="Debian GNU/Linux"\nVERSION_ID="12"\n')
    host = collect(root, tmp_path)
    assert host.os.name == Known("Debian GNU/Linux")
    assert host.os.version == Known("12")


def test_missing_os_release_and_cpuinfo_are_unavailable_not_fatal(tmp_path: Path) -> None:
    host = collect(tmp_path / "empty-root", tmp_path)
    assert isinstance(host.os.name, Unavailable)
    assert isinstance(host.os.version, Unavailable)
    assert isinstance(host.cpu.model, Unavailable)
    assert host.cpu.sockets == UNKNOWN
    assert isinstance(host.memory_total_bytes, Known)  # the rest of the host is still observed


def test_os_release_without_version_is_unknown(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root, "etc/os-release", "NAME=Arch Linux\nID=arch\nBUILD_ID=rolling\n")
    host = collect(root, tmp_path)
    assert host.os.name == Known("Arch Linux")
    assert host.os.version == UNKNOWN


def test_aarch64_without_model_name_uses_sysfs_packages(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root, "proc/cpuinfo", AARCH64_CPUINFO)
    for cpu, package in ((0, 0), (1, 0), (2, 1), (3, 1)):
        write(root, f"sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id", f"{package}\n")
    host = collect(root, tmp_path)
    assert host.cpu.model == UNKNOWN
    assert host.cpu.sockets == Known(2)


def test_sysfs_package_minus_one_is_not_a_socket(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root, "proc/cpuinfo", AARCH64_CPUINFO)
    write(root, "sys/devices/system/cpu/cpu0/topology/physical_package_id", "-1\n")
    assert collect(root, tmp_path).cpu.sockets == UNKNOWN


def test_parse_os_release_quoting() -> None:
    parsed = parse_os_release(
        'NAME="Fancy \\"OS\\""\nVERSION_ID=\'1.0\'\nID=fancy\n# COMMENT=x\n\nBAD LINE\nEMPTY=\n'
    )
    assert parsed == {"NAME": 'Fancy "OS"', "VERSION_ID": "1.0", "ID": "fancy", "EMPTY": ""}


def test_parse_cpuinfo_blocks() -> None:
    blocks = parse_cpuinfo(DUAL_SOCKET_CPUINFO)
    assert len(blocks) == 3
    assert [b["physical id"] for b in blocks] == ["0", "1", "0"]


# -- failures ---------------------------------------------------------------------------------


def test_memory_failure_is_a_host_collection_error(
    fixture_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> None:
        raise OSError("no /proc/meminfo")

    monkeypatch.setattr(psutil, "virtual_memory", broken)
    with pytest.raises(HostCollectionError, match="memory"):
        collect(fixture_root, tmp_path)


def test_one_failed_fact_is_data(fixture_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_permission(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    def flaky(logical: bool = True) -> int:
        raise RuntimeError("transient")

    monkeypatch.setattr(psutil, "disk_usage", no_permission)
    monkeypatch.setattr(psutil, "cpu_count", flaky)
    host = collect(fixture_root, tmp_path)
    assert host.storage
    for storage in host.storage:
        assert isinstance(storage.used_bytes, Unavailable)
        assert isinstance(storage.total_bytes, Unavailable)
    assert isinstance(host.cpu.physical_cores, TemporarilyFailed)
    assert isinstance(host.cpu.logical_cores, TemporarilyFailed)
    assert host.cpu.sockets == Known(2)
    assert isinstance(host.memory_total_bytes, Known)


def test_unknown_physical_core_count(
    fixture_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = psutil.cpu_count

    def cpu_count(logical: bool = True) -> int | None:
        return real(logical=True) if logical else None  # psutil's answer when it cannot tell

    monkeypatch.setattr(psutil, "cpu_count", cpu_count)
    host = collect(fixture_root, tmp_path)
    assert host.cpu.physical_cores == UNKNOWN
    assert isinstance(host.cpu.logical_cores, Known)


# -- storage ----------------------------------------------------------------------------------


def test_state_dir_on_the_root_filesystem_is_reported_once(
    fixture_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / "state" / "not" / "created" / "yet"
    expected_mounts = {str(mount_point(Path("/"))), str(mount_point(state_dir))}
    host = collect(fixture_root, state_dir)
    assert {s.mount for s in host.storage} == expected_mounts
    assert len(host.storage) == len(expected_mounts)
    if os.stat("/").st_dev == os.stat(tmp_path).st_dev:
        assert [s.mount for s in host.storage] == ["/"]


def test_state_dir_on_another_filesystem_is_reported_by_its_mount_point(
    fixture_root: Path, tmp_path: Path
) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == os.stat("/").st_dev:
        pytest.fail(
            "needs /dev/shm as a filesystem of its own (tmpfs, as Linux hosts and containers mount it)"
        )
    host = collect(fixture_root, shm / "modelforge-test-state")
    assert [s.mount for s in host.storage] == ["/", "/dev/shm"]
    shm_usage = host.storage[1]
    assert shm_usage.total_bytes == Known(psutil.disk_usage("/dev/shm").total)


def test_mount_point_walks_up_to_the_filesystem_root(tmp_path: Path) -> None:
    assert mount_point(Path("/")) == Path("/")
    top = mount_point(tmp_path)
    assert top.stat().st_dev == tmp_path.stat().st_dev
    assert top == Path("/") or top.parent.stat().st_dev != top.stat().st_dev
    assert mount_point(tmp_path / "missing" / "deeper") == top


# -- timeouts ---------------------------------------------------------------------------------


@pytest.fixture
def hung_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """psutil.disk_usage blocks like statvfs on a dead NFS mount, until released."""
    release = threading.Event()

    def hang(path: str) -> None:
        release.wait(30)
        raise OSError("gave up")

    monkeypatch.setattr(psutil, "disk_usage", hang)
    yield release
    release.set()


def test_hung_collection_times_out(fixture_root: Path, tmp_path: Path, hung_disk: threading.Event) -> None:
    collector = SystemHostCollector(tmp_path, root=fixture_root, timeout_seconds=0.3)
    started = time.monotonic()
    with pytest.raises(HostCollectionError, match=r"timed out after 0\.3s"):
        collector.collect()
    assert time.monotonic() - started < 1.5
    # The hung call is not joined by a second one.
    started = time.monotonic()
    with pytest.raises(HostCollectionError, match="still running"):
        collector.collect()
    assert time.monotonic() - started < 0.2


async def test_hung_collection_times_out_async(
    fixture_root: Path, tmp_path: Path, hung_disk: threading.Event
) -> None:
    collector = SystemHostCollector(tmp_path, root=fixture_root, timeout_seconds=0.3)
    started = time.monotonic()
    with pytest.raises(HostCollectionError, match="timed out"):
        await collector.collect_async()
    assert time.monotonic() - started < 1.5
    await asyncio.sleep(0)
