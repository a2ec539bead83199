"""The OpenAPI document is the contract: schemathesis generates requests from
/schema/openapi.json against a real `modelforge-hw serve` on a real PostgreSQL, with the operator
token, an enrollment token for enrolment and a node credential for reports, runs every check and
must find nothing. Bounded: a fixed seed and few examples per operation, so it stays a test."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from tests.agent_support import (
    OPERATOR_TOKEN,
    ServerProcess,
    clean_env,
    create_token,
    enroll_direct,
    post_report,
    report_body,
)

SEED = 20261201
MAX_EXAMPLES = 8
NODE_KEY = "schemathesis-node"


def _config(path: Path, enrollment_token: str, credential: str) -> None:
    # TOML by hand: three headers; each operation's own bearer replaces the operator's.
    path.write_text(
        f"""seed = {SEED}
workers = 1
max-failures = 200

[generation]
max-examples = {MAX_EXAMPLES}
database = "none"
# NUL is refused everywhere by design (tests/test_hostile_input.py covers it case by case).
allow-x00 = false

[checks]
enabled = true

[headers]
Authorization = "Bearer {OPERATOR_TOKEN}"

# A cursor is opaque: only one the server issued is valid, which no schema can say. The lists
# are fuzzed from their first page; tests/test_api_conventions.py pages them with real cursors.
[parameters]
cursor = ""

# Two routes judge identities beyond what JSON Schema can say: a report's node_id must be the
# UUIDv5 of its identity_key (refused 400 before any credential question), and an identity key
# must be printable in Unicode's sense and at most 128 characters once trimmed. There a
# schema-valid body may get 400; every other check still holds for them.
[[operations]]
include-operation-id = "publishReport"
headers = {{ Authorization = "Bearer {credential}" }}
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409"]
# The coverage phase's negative reports (every field of the body given every wrong type: over half
# of all cases, and half the run's time) all meet the one typed decode of the report body and its
# one 400; negative fuzzing still sends malformed reports, tests/test_hostile_input.py the hostile
# values the database cannot store, and the positive coverage cases stay.
phases.coverage.generation.mode = "positive"

[[operations]]
include-operation-id = "enrollAgent"
headers = {{ Authorization = "Bearer {enrollment_token}" }}
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404", "409"]

# A telemetry history's window is bounded across its parameters: `since` before `until`, and at
# most 2,000 points of `step` seconds between them, which JSON Schema cannot say. There a
# schema-valid query may get 400; every other check still holds for them.
[[operations]]
include-operation-id = "getAcceleratorTelemetry"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404"]

[[operations]]
include-operation-id = "getNodeTelemetry"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404"]

# The lemons' window must start before now and at most ten years back, which JSON Schema cannot
# say either (docs/lemons.md).
[[operations]]
include-operation-id = "listLemons"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403"]

# A health policy is a TOML document inside a JSON string, validated by its own rules (known
# signals, positive windows, XIDs in range), which JSON Schema cannot say: a schema-valid body may
# get 400 naming the line and key; every other check still holds for them.
[[operations]]
include-operation-id = "applyHealthPolicy"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "409"]

[[operations]]
include-operation-id = "backtestHealthPolicy"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403"]

# A webhook's URL must be http(s), resolve to an address the server may send to and accept a
# connection, and its secret must give 16 bytes or more, which JSON Schema cannot say. There a
# schema-valid body may get 400; every other check still holds for it.
[[operations]]
include-operation-id = "createWebhook"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "401", "403", "404"]

# The change feed holds an empty page up to `wait` seconds by design; a fuzzer's long waits
# would only burn the run's time.
[[operations]]
include-operation-id = "listEvents"
parameters = {{ wait = 0 }}
"""
    )


async def test_schemathesis_finds_nothing(database_dsn: str, tmp_path: Path) -> None:
    server = ServerProcess(database_dsn, tmp_path).start()
    try:
        await server.wait_healthy()
        async with httpx.AsyncClient() as client:
            token = (await create_token(client, server.url, uses=1000))["token"]
            r = await enroll_direct(client, server.url, token, NODE_KEY)
            assert r.status_code == 201, r.text
            credential = r.json()["credential"]
            # The credential works: schemathesis's reports start from an accepted one.
            ok = await post_report(client, server.url, credential, report_body(NODE_KEY, 1))
            assert ok.status_code == 200, ok.text
        config = tmp_path / "schemathesis.toml"
        _config(config, token, credential)
        report = tmp_path / "report.json"
        cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
        run = subprocess.run(  # noqa: ASYNC221  # the server is another process; nothing here waits on this loop
            [
                cli,
                "--config-file",
                str(config),
                "run",
                f"{server.url}/schema/openapi.json",
                "--checks",
                "all",
                "--no-color",
                "--report",
                "json",
                "--report-json-path",
                str(report),
            ],
            env=clean_env(),
            cwd=tmp_path,  # schemathesis keeps a cache in its working directory
            capture_output=True,
            text=True,
            timeout=900,
        )
        out = run.stdout + run.stderr
        print(out[-6000:])
        assert run.returncode == 0, out[-20000:]
        counts = re.search(r"(\d+) generated, (\d+) passed", out)
        assert counts is not None, out[-3000:]
        generated, passed = int(counts[1]), int(counts[2])
        print(f"schemathesis: {generated} test cases generated, {passed} passed")
        assert generated == passed > 1000
        assert "http.unexpected_error" not in server.log_text()
        async with httpx.AsyncClient() as client:
            after = await post_report(client, server.url, credential, report_body(NODE_KEY, 10**6))
            print("a report after the run:", after.status_code, after.text[:200])
    finally:
        server.stop()
