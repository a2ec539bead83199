"""Bad report, enrollment and token bodies: 400 or 413 problem+json, nothing appended, the stream
where it was."""

from __future__ import annotations

import json
from typing import Any

import asyncpg
import httpx

from collectors.facts import Known
from domain.node import node_id_for
from tests.agent_acceptance.plane import (
    event_count,
    tag,
)
from tests.agent_support import (
    OPERATOR,
    ServerProcess,
    assert_problem,
    create_token,
    enroll_direct,
    observation,
    post_report,
    report_body,
)


async def test_bad_input_is_400_or_413_problem_json_and_nothing_is_appended(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient
) -> None:
    key = f"bad-{tag()}"
    node_id = node_id_for(key)
    token = (await create_token(http, server.url))["token"]
    credential = (await enroll_direct(http, server.url, token, key)).json()["credential"]
    r = await post_report(http, server.url, credential, report_body(key, 1))
    assert r.status_code == 200
    before = await event_count(db, node_id)

    def mutated(**changes: Any) -> bytes:
        doc = json.loads(report_body(key, 2))
        doc.update(changes)
        return json.dumps(doc).encode()

    marker = 987_654_321
    template = report_body(key, 2, mem_avail=marker)
    negative_obs = observation()
    negative_obs = type(negative_obs)(
        observed_at=negative_obs.observed_at,
        host=type(negative_obs.host)(
            **{
                **{f: getattr(negative_obs.host, f) for f in negative_obs.host.__struct_fields__},
                "telemetry": {"memory_available_bytes": Known(-5)},
            }
        ),
        nvml=negative_obs.nvml,
    )
    cases: list[tuple[str, bytes, int, str]] = [
        ("malformed JSON", b'{"protocol": 1, "node_id": ', 400, "malformed-json"),
        ("not an object", b"[1, 2, 3]", 400, "validation-failed"),
        ("wrong type", mutated(sequence="two"), 400, "validation-failed"),
        ("sequence 0", mutated(sequence=0), 400, "validation-failed"),
        ("unknown field", mutated(extra=True), 400, "validation-failed"),
        ("naive time", mutated(observed_at="2026-11-30T12:00:00"), 400, "validation-failed"),
        ("unknown stream", mutated(stream="gossip"), 400, "unknown-stream"),
        ("protocol", mutated(protocol=2), 400, "unsupported-protocol"),
        ("negative metric", report_body(key, 2, obs=negative_obs), 400, "validation-failed"),
        ("NaN metric", template.replace(str(marker).encode(), b"NaN"), 400, "malformed-json"),
        ("infinite metric", template.replace(str(marker).encode(), b"1e999"), 400, "validation-failed"),
        ("negative literal", template.replace(str(marker).encode(), b"-1.5"), 400, "validation-failed"),
        ("over the size limit", b'{"pad": "' + b"x" * (1024 * 1024) + b'"}', 413, "payload-too-large"),
    ]
    # What PostgreSQL would refuse (never a 500) and garbage that would become history.
    host_ = ("observation", "host")
    gpu0 = ("observation", "nvml", "accelerators", 0)
    outside_the_contract: list[tuple[str, tuple[Any, ...], Any]] = [
        ("NUL in hostname", (*host_, "hostname"), "gpu\u0000host"),
        ("NUL in os.name", (*host_, "os", "name"), {"state": "known", "value": "Ubuntu\u0000"}),
        ("NUL in a GPU uuid", (*gpu0, "uuid"), "GPU-\u0000"),
        ("NUL in a mount path", (*host_, "storage", 0, "mount"), "/\u0000"),
        ("NUL in a reason", (*gpu0, "name"), {"state": "unavailable", "reason": "\u0000"}),
        ("year 9999, offset -23:59", ("observed_at",), "9999-12-31T23:59:59-23:59"),
        ("year 1, offset +23:59", ("observation", "observed_at"), "0001-01-01T00:00:00+23:59"),
        (
            "a string for bytes",
            (*host_, "telemetry", "memory_available_bytes"),
            {"state": "known", "value": "abc"},
        ),
        (
            "a bool for bytes",
            (*host_, "telemetry", "memory_available_bytes"),
            {"state": "known", "value": True},
        ),
        ("bytes 2^64+1", (*host_, "memory_total_bytes"), {"state": "known", "value": 2**64 + 1}),
        ("GPU index 2^63", (*gpu0, "index"), {"state": "known", "value": 2**63}),
        (
            "a metric of 10^100",
            (*gpu0, "telemetry", "temperature_celsius"),
            {"state": "known", "value": 10**100},
        ),
        (
            "a percentage of 101",
            (*gpu0, "telemetry", "utilization_gpu_percent"),
            {"state": "known", "value": 101},
        ),
        ("an unknown metric", (*gpu0, "telemetry", "joy_percent"), {"state": "known", "value": 1}),
        ("sequence 2^63-1", ("sequence",), 2**63 - 1),
    ]
    for name, path, value in outside_the_contract:
        doc = json.loads(report_body(key, 2))
        target = doc
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
        # A NUL is refused before the body is decoded (api/http/guards.py), the rest by the contract.
        refusal = "nul-character" if name.startswith("NUL") else "validation-failed"
        cases.append((name, json.dumps(doc).encode(), 400, refusal))
    duplicated = report_body(key, 2).replace(b'{"protocol":1,', b'{"protocol":1,"sequence":3,', 1)
    assert duplicated != report_body(key, 2)
    cases.append(("a duplicate key", duplicated, 400, "validation-failed"))
    twice = json.loads(report_body(key, 2))
    twice["observation"]["nvml"]["accelerators"].append(twice["observation"]["nvml"]["accelerators"][0])
    cases.append(("the same GPU twice", json.dumps(twice).encode(), 400, "invalid-observation"))
    for name, body, status, type_ in cases:
        r = await post_report(http, server.url, credential, body)
        assert r.status_code == status, (name, r.status_code, r.text)
        problem = assert_problem(r, status, type_)
        assert problem["detail"], name
    # Enrollment and token bodies are validated too.
    assert_problem(
        await http.post(
            server.url + "/api/v1/agent/enroll",
            content=b"{oops",
            headers={"Authorization": f"Bearer {token}"},
        ),
        400,
    )
    assert_problem(
        await http.post(server.url + "/api/v1/enrollment-tokens", json={"uses": "many"}, headers=OPERATOR),
        400,
    )
    assert_problem(
        await http.post(server.url + "/api/v1/enrollment-tokens", json={"uses": 0}, headers=OPERATOR), 400
    )
    assert await event_count(db, node_id) == before
    assert "Traceback" not in server.log_text()
    # The stream is where it was: sequence 2 is still free.
    r = await post_report(http, server.url, credential, report_body(key, 2))
    assert r.status_code == 200 and r.json()["previous_sequence"] == 1
