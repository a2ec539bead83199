#!/usr/bin/env bash
# The seed's Real GPU validation, on a host with NVIDIA GPUs:
#   start the server on a throwaway state directory (embedded PostgreSQL), POST /refresh twice,
#   compare the /nodes and /accelerators identities of both, print the typed metrics, and compare
#   every GPU with `nvidia-smi --query-gpu=...` (the optional direct diagnostic; NVML remains the
#   implementation's only source). Then compares the GPU health signals the NVML collector reads
#   (collectors/gpu_health.py: ECC mode and counts, row remapping, page retirement, PCIe replays,
#   hardware clock event reasons) with `nvidia-smi -q -x`. Exits non-zero on any mismatch.
#
# Usage: deploy/validate-gpu.sh            (from the repository root, after the README's run setup)
#        PYTHON=/path/to/python deploy/validate-gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
PORT=${PORT:-18080}
STATE=$(mktemp -d /tmp/mf-gpu-validate.XXXXXX)
TOKEN="validate-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
LOG="$STATE/server.log"

cleanup() {
  if [[ -n "${SERVER_PID:-}" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" || true
  fi
}
trap cleanup EXIT

command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: is this a GPU host?" >&2; exit 2; }

env -u MODELFORGE_DATABASE_URL MODELFORGE_STATE_DIR="$STATE" MODELFORGE_ADMIN_TOKEN="$TOKEN" \
  MODELFORGE_NODE_ID="${MODELFORGE_NODE_ID:-gpu-validation-$(hostname)}" \
  "$PYTHON" -m api.cli serve --port "$PORT" --no-startup-refresh >"$LOG" 2>&1 &
SERVER_PID=$!

for _ in $(seq 1 150); do
  if "$PYTHON" - "$PORT" <<'PY' 2>/dev/null; then break; fi
import sys, httpx
sys.exit(0 if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/api/v1/health", timeout=1).status_code == 200 else 1)
PY
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$LOG" >&2; echo "server exited" >&2; exit 1; }
  sleep 0.2
done

nvidia-smi --query-gpu=uuid,name,pci.bus_id,memory.total,driver_version --format=csv,noheader,nounits \
  >"$STATE/nvidia-smi.csv"
echo "== nvidia-smi --query-gpu=uuid,name,pci.bus_id,memory.total,driver_version"
cat "$STATE/nvidia-smi.csv"

"$PYTHON" - "$PORT" "$TOKEN" "$STATE/nvidia-smi.csv" <<'PY'
import csv, json, sys
import httpx

port, token, smi_csv = sys.argv[1], sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}/api/v1"
auth = {"Authorization": f"Bearer {token}"}
failures: list[str] = []

def get(path: str) -> dict:
    r = httpx.get(base + path, headers=auth, timeout=60)
    r.raise_for_status()
    return r.json()

def identities() -> tuple[list, list]:
    nodes = get("/hardware/nodes")["items"]
    accs = get("/hardware/accelerators?limit=1000")["items"]
    return (sorted((n["id"], n["identity_key"]) for n in nodes),
            sorted((a["id"], a["uuid"], a["node_id"]) for a in accs))

runs = []
for i in (1, 2):
    r = httpx.post(base + "/hardware/refresh", headers=auth, timeout=120)
    print(f"== refresh {i}: HTTP {r.status_code}")
    print(json.dumps({k: v for k, v in r.json().items() if k != "events"}, indent=2))
    if r.status_code != 200:
        failures.append(f"refresh {i} answered {r.status_code}")
        break
    runs.append((r.json(), identities()))

if len(runs) == 2:
    (first, ids1), (second, ids2) = runs
    if ids1 != ids2:
        failures.append(f"identities changed between refreshes: {ids1} != {ids2}")
    lifecycle = [e["event_type"] for e in second["events"] if e["event_class"] == "lifecycle"]
    if lifecycle:
        failures.append(f"second refresh appended lifecycle events: {lifecycle}")

accs = {a["uuid"]: a for a in get("/hardware/accelerators?limit=1000")["items"]}
node = get("/hardware/nodes")["items"][0]
print(f"== node {node['id']} inventory={node['inventory_status']} reasons={node['inventory_reasons']}")
print(f"   driver={node['driver_version']} cuda_driver={node['cuda_driver_version']} fingerprint={node['fingerprint']}")
for a in sorted(accs.values(), key=lambda a: (a["index"] is None, a["index"])):
    print(f"== GPU {a['index']} {a['uuid']} {a['name']} pci={a['pci_bus_id']} cc={a['compute_capability']}"
          f" mig={a['mig_mode']} vram={a['memory_total_bytes']}")
    for metric, fact in sorted(a["telemetry"].items()):
        print(f"     {metric:28} {json.dumps(fact)}")

with open(smi_csv) as f:
    rows = [[c.strip() for c in row] for row in csv.reader(f) if row]
if len(rows) != len(accs):
    failures.append(f"nvidia-smi lists {len(rows)} GPUs, the API {len(accs)}")
for uuid, name, pci, mem_mib, driver in rows:
    a = accs.get(uuid)
    if a is None:
        failures.append(f"{uuid} from nvidia-smi is not in /accelerators")
        continue
    if a["status"] != "active":
        failures.append(f"{uuid} status {a['status']}")
    if a["name"] != name:
        failures.append(f"{uuid} name {a['name']!r} != {name!r}")
    if (a["pci_bus_id"] or "").upper() != pci.upper():
        failures.append(f"{uuid} pci {a['pci_bus_id']!r} != {pci!r}")
    if a["memory_total_bytes"] is None or a["memory_total_bytes"] // (1024 * 1024) != int(mem_mib):
        failures.append(f"{uuid} memory {a['memory_total_bytes']} bytes != {mem_mib} MiB")
    if a["driver_version"] != driver:
        failures.append(f"{uuid} driver {a['driver_version']!r} != {driver!r}")

if failures:
    print("== VALIDATION FAILED")
    for f in failures:
        print("   - " + f)
    sys.exit(1)
print(f"== VALIDATION PASSED: {len(accs)} GPU(s), identities stable across two refreshes, facts match nvidia-smi")
PY

# -- GPU health signals: the collector (NVML) against `nvidia-smi -q -x` ------------------------
"$PYTHON" - "$STATE/nvidia-smi-q.xml" <<'PY'
import subprocess, sys
import xml.etree.ElementTree as ET

from collectors.facts import Known
from collectors.nvml import NvidiaNvmlCollector

collector = NvidiaNvmlCollector(timeout_seconds=30)
scan = collector.collect()
collector.close()
# Counters only grow: read NVML first, nvidia-smi second, and accept NVML <= nvidia-smi.
xml_text = subprocess.run(["nvidia-smi", "-q", "-x"], capture_output=True, text=True, check=True).stdout
open(sys.argv[1], "w").write(xml_text)
gpus = ET.fromstring(xml_text).findall("gpu") if xml_text.strip() else []
by_uuid = {a.uuid: a for a in scan.accelerators}
failures: list[str] = []
print(f"== health signals: NVML scan {scan.status}, nvidia-smi -q lists {len(gpus)} GPU(s)")


def text(node, path):
    found = node.find(path)
    return None if found is None or found.text is None else found.text.strip()


def number(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def check(uuid, what, fact, smi):
    """smi: None (absent), "N/A", or a value; `fact` must be not-known exactly where smi is N/A."""
    print(f"     {what:40} nvml={fact!r:55} nvidia-smi={smi!r}")
    if smi is None:
        return
    if smi == "N/A":
        if isinstance(fact, Known):
            failures.append(f"{uuid} {what}: NVML says {fact.value!r}, nvidia-smi N/A")
        return
    if not isinstance(fact, Known):
        failures.append(f"{uuid} {what}: NVML says {fact!r}, nvidia-smi {smi!r}")
        return
    expected = {"Enabled": "enabled", "Disabled": "disabled", "Yes": True, "No": False,
                "Active": True, "Not Active": False}.get(smi, smi)
    if isinstance(fact.value, int) and not isinstance(fact.value, bool) and number(smi) is not None:
        if fact.value > number(smi):
            failures.append(f"{uuid} {what}: NVML {fact.value} > nvidia-smi {smi}")
    elif fact.value != expected:
        failures.append(f"{uuid} {what}: NVML {fact.value!r} != nvidia-smi {smi!r}")


def ecc_total(node, corrected):
    """The total corrected/uncorrected count of one ECC block in any of nvidia-smi's layouts."""
    if node is None:
        return None
    legacy = text(node, "single_bit/total" if corrected else "double_bit/total")
    if legacy is not None:
        return legacy
    names = ("sram_correctable", "dram_correctable") if corrected else ("sram_uncorrectable", "dram_uncorrectable")
    values = [text(node, n) for n in names]
    if all(v is None for v in values):
        return None
    if all(v in (None, "N/A") for v in values):
        return "N/A"
    return str(sum(number(v) or 0 for v in values))


if len(gpus) != len(scan.accelerators):
    failures.append(f"nvidia-smi -q lists {len(gpus)} GPUs, NVML {len(scan.accelerators)}")
for g in gpus:
    uuid = text(g, "uuid")
    acc = by_uuid.get(uuid)
    if acc is None or acc.health is None:
        failures.append(f"{uuid} from nvidia-smi -q has no NVML health signals")
        continue
    h = acc.health
    print(f"== GPU {uuid}")
    check(uuid, "ecc_mode", h.ecc_mode, text(g, "ecc_mode/current_ecc"))
    for counter in ("volatile", "aggregate"):
        block = g.find(f"ecc_errors/{counter}")
        check(uuid, f"ecc corrected {counter}", h.ecc_errors[f"corrected_{counter}"], ecc_total(block, True))
        check(uuid, f"ecc uncorrected {counter}", h.ecc_errors[f"uncorrected_{counter}"], ecc_total(block, False))
    rows = g.find("remapped_rows")
    if rows is not None and (rows.text or "").strip() == "N/A":
        for name in ("correctable", "uncorrectable", "pending", "failure"):
            check(uuid, f"remapped rows {name}", h.remapped_rows[name], "N/A")
    elif rows is not None:
        for name, tag in (("correctable", "remapped_row_corr"), ("uncorrectable", "remapped_row_unc"),
                          ("pending", "remapped_row_pending"), ("failure", "remapped_row_failure")):
            check(uuid, f"remapped rows {name}", h.remapped_rows[name], text(rows, tag))
    check(uuid, "retired pages single_bit", h.retired_pages["single_bit"],
          text(g, "retired_pages/multiple_single_bit_retirement/retired_count"))
    check(uuid, "retired pages double_bit", h.retired_pages["double_bit"],
          text(g, "retired_pages/double_bit_retirement/retired_count"))
    check(uuid, "retired pages pending", h.retired_pages["pending"], text(g, "retired_pages/pending_retirement"))
    check(uuid, "pcie replay count", h.pcie_replay_count, text(g, "pci/replay_counter"))
    # Hardware reasons only: software ones (idle, power cap) change with the load from one read
    # to the next.
    for name in ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"):
        smi = text(g, f"clocks_event_reasons/clocks_event_reason_{name}")
        if smi is None:
            smi = text(g, f"clocks_throttle_reasons/clocks_throttle_reason_{name}")
        check(uuid, f"clock event {name}", h.clock_event_reasons[name], smi)
    print(f"     {'xid event set':40} {h.xid_events!r}")

if failures:
    print("== HEALTH VALIDATION FAILED")
    for f in failures:
        print("   - " + f)
    sys.exit(1)
print(f"== HEALTH VALIDATION PASSED: {len(gpus)} GPU(s), NVML health signals match nvidia-smi -q")
PY
