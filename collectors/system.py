"""SystemHostCollector: the host's OS, CPU, memory and relevant storage as a HostObservation.

Sources are psutil, `platform` and files under /etc, /proc and /sys (read below `root`, so tests
can point them at captured fixture files). No command is run and no command output is parsed.
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Callable
from pathlib import Path

import psutil

from collectors._worker import SingleFlightWorker, WorkerBusy, WorkerTimeout
from collectors.facts import UNKNOWN, Fact, Known, TemporarilyFailed, Unavailable
from collectors.observations import (
    CpuInfo,
    HostCollectionError,
    HostObservation,
    OsInfo,
    StorageObservation,
)

_ESCAPED = re.compile(r"\\(.)")
# cpuinfo keys naming the CPU model: x86 ("model name"), 32-bit ARM ("Processor"), POWER ("cpu").
_MODEL_KEYS = ("model name", "Processor", "cpu")


def parse_os_release(text: str) -> dict[str, str]:
    """The KEY=value pairs of an os-release file (os-release(5)): quotes removed, escapes undone."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, raw = line.partition("=")
        raw = raw.strip()
        if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
            quote, raw = raw[0], raw[1:-1]
            if quote == '"':
                raw = _ESCAPED.sub(r"\1", raw)
        values[key.strip()] = raw
    return values


def parse_cpuinfo(text: str) -> list[dict[str, str]]:
    """The per-processor blocks of /proc/cpuinfo as dicts (blank lines separate blocks)."""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition(":")
        if sep:
            current[key.strip()] = value.strip()
    if current:
        blocks.append(current)
    return blocks


def _os_error_fact(what: str, err: Exception) -> Fact:
    """A failed read: missing or forbidden is a standing condition, anything else may pass."""
    if isinstance(err, FileNotFoundError | NotADirectoryError):
        return Unavailable(f"{what} not found")
    if isinstance(err, PermissionError | psutil.AccessDenied):
        return Unavailable(f"no permission to read {what}")
    return TemporarilyFailed(f"{what}: {type(err).__name__}: {err}")


def _attempt(what: str, produce: Callable[[], Fact]) -> Fact:
    try:
        return produce()
    except Exception as err:  # one bad fact never fails the host
        return _os_error_fact(what, err)


def _count(value: object) -> Fact:
    return Known(value) if isinstance(value, int) and value > 0 else UNKNOWN


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding `path` (or its nearest existing ancestor).

    Walks up while the device id stays the same; the last directory before it changes (or `/`)
    is the mount point. Works for paths that do not exist yet, such as a fresh state directory.
    """
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    device = path.stat().st_dev
    while path != path.parent:
        parent = path.parent
        if parent.stat().st_dev != device:
            break
        path = parent
    return path


class SystemHostCollector:
    """Observes the local host. `collect()` never takes longer than `timeout_seconds`."""

    name = "system"

    def __init__(self, state_dir: Path, root: Path = Path("/"), *, timeout_seconds: float = 5.0) -> None:
        self.state_dir = Path(state_dir)
        self.root = Path(root)
        self.timeout_seconds = timeout_seconds
        self._worker: SingleFlightWorker[HostObservation] = SingleFlightWorker("host-collector")

    def collect(self) -> HostObservation:
        """Observe the host; HostCollectionError when it cannot be observed at all."""
        try:
            return self._worker.call(self.observe, self.timeout_seconds)
        except (WorkerTimeout, WorkerBusy) as err:
            raise self._timed_out(err) from None

    async def collect_async(self) -> HostObservation:
        try:
            return await self._worker.call_async(self.observe, self.timeout_seconds)
        except (WorkerTimeout, WorkerBusy) as err:
            raise self._timed_out(err) from None

    def _timed_out(self, err: WorkerTimeout | WorkerBusy) -> HostCollectionError:
        if isinstance(err, WorkerBusy):
            return HostCollectionError(
                "host collection timed out: a previous collection is still running "
                f"after {self.timeout_seconds}s"
            )
        return HostCollectionError(f"host collection timed out after {self.timeout_seconds}s")

    def observe(self) -> HostObservation:
        """The observation itself, in the calling thread and without a deadline."""
        try:
            return self._observe()
        except HostCollectionError:
            raise
        except Exception as err:
            raise HostCollectionError(f"host collection failed: {type(err).__name__}: {err}") from err

    def _observe(self) -> HostObservation:
        try:
            memory = psutil.virtual_memory()
            total, available = int(memory.total), int(memory.available)
        except Exception as err:
            # Without memory the host is not observable at all: the refresh fails (seed's 503).
            raise HostCollectionError(f"cannot read host memory: {type(err).__name__}: {err}") from err
        return HostObservation(
            hostname=platform.node(),
            os=self._os(),
            cpu=self._cpu(),
            memory_total_bytes=Known(total),
            telemetry={
                "memory_available_bytes": Known(available),
                "memory_total_bytes": Known(total),
            },
            storage=self._storage(),
        )

    def _under_root(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def _os(self) -> OsInfo:
        release: dict[str, str] | None = None
        failure: Fact = Unavailable("/etc/os-release not found")
        # os-release(5): /etc/os-release, falling back to /usr/lib/os-release.
        for candidate in ("/etc/os-release", "/usr/lib/os-release"):
            try:
                release = parse_os_release(self._under_root(candidate).read_text(errors="replace"))
                break
            except Exception as err:
                if not isinstance(err, FileNotFoundError):
                    failure = _os_error_fact(candidate, err)
        if release is None:
            name: Fact = failure
            version: Fact = failure
        else:
            name = Known(release["NAME"]) if release.get("NAME") else UNKNOWN
            # VERSION_ID ("22.04") rather than VERSION: point-release wording is not a version change.
            version_id = release.get("VERSION_ID") or release.get("VERSION")
            version = Known(version_id) if version_id else UNKNOWN
        return OsInfo(
            name=name,
            version=version,
            kernel=_attempt(
                "kernel release", lambda: Known(platform.release()) if platform.release() else UNKNOWN
            ),
            architecture=_attempt(
                "architecture", lambda: Known(platform.machine()) if platform.machine() else UNKNOWN
            ),
        )

    def _cpu(self) -> CpuInfo:
        blocks: list[dict[str, str]] | None = None
        try:
            blocks = parse_cpuinfo(self._under_root("/proc/cpuinfo").read_text(errors="replace"))
            model = self._cpu_model(blocks)
        except Exception as err:
            model = _os_error_fact("/proc/cpuinfo", err)
        return CpuInfo(
            model=model,
            sockets=_attempt("CPU sockets", lambda: self._sockets(blocks or [])),
            physical_cores=_attempt("physical cores", lambda: _count(psutil.cpu_count(logical=False))),
            logical_cores=_attempt("logical cores", lambda: _count(psutil.cpu_count(logical=True))),
        )

    @staticmethod
    def _cpu_model(blocks: list[dict[str, str]]) -> Fact:
        for block in blocks:
            for key in _MODEL_KEYS:
                if block.get(key):
                    return Known(block[key])
        return UNKNOWN

    def _sockets(self, blocks: list[dict[str, str]]) -> Fact:
        packages = {block["physical id"] for block in blocks if block.get("physical id")}
        if not packages:
            # aarch64 and some hypervisors omit "physical id"; sysfs topology still has packages.
            cpu_dir = self._under_root("/sys/devices/system/cpu")
            for id_file in cpu_dir.glob("cpu[0-9]*/topology/physical_package_id"):
                try:
                    package = id_file.read_text().strip()
                except OSError:
                    continue
                if package and package != "-1":
                    packages.add(package)
        return Known(len(packages)) if packages else UNKNOWN

    def _storage(self) -> list[StorageObservation]:
        seen: dict[int, Path] = {}
        mounts: list[Path] = []
        for path in (Path("/"), self.state_dir):
            try:
                mount = mount_point(path)
                device = mount.stat().st_dev
            except OSError:
                mount, device = Path(os.path.abspath(path)), -1
            # One filesystem is reported once, whichever of its paths we reached it through.
            if device != -1 and device in seen:
                continue
            seen[device] = mount
            mounts.append(mount)
        return [self._usage(mount) for mount in mounts]

    @staticmethod
    def _usage(mount: Path) -> StorageObservation:
        try:
            usage = psutil.disk_usage(str(mount))
        except Exception as err:
            failed = _os_error_fact(f"usage of {mount}", err)
            return StorageObservation(mount=str(mount), used_bytes=failed, total_bytes=failed)
        return StorageObservation(
            mount=str(mount), used_bytes=Known(usage.used), total_bytes=Known(usage.total)
        )
