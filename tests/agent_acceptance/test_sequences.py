"""A report's sequence: a replay is idempotent, other content or an older sequence is a conflict,
and a gap is accepted and recorded."""

from __future__ import annotations

import asyncpg
import httpx

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
    post_report,
    report_body,
)
from tests.sample_reads import logged


async def test_replay_is_idempotent_other_content_or_older_sequence_is_409_and_gaps_are_recorded(
    server: ServerProcess, db: asyncpg.Pool, http: httpx.AsyncClient
) -> None:
    key = f"replay-{tag()}"
    node_id = node_id_for(key)
    token = (await create_token(http, server.url))["token"]
    r = await enroll_direct(http, server.url, token, key)
    assert r.status_code == 201, r.text
    credential = r.json()["credential"]

    captured = report_body(key, 1, mem_avail=100)
    r = await post_report(http, server.url, credential, captured)
    assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
    assert r.json()["previous_sequence"] is None and r.json()["gap"] == 0
    appended = await event_count(db, node_id)

    # The captured report again, unchanged: an idempotent retry.
    r = await post_report(http, server.url, credential, captured)
    assert r.status_code == 200 and r.json()["status"] == "duplicate" and r.json()["events"] == 0, r.text
    assert await event_count(db, node_id) == appended

    # The same sequence with any other content.
    p = assert_problem(
        await post_report(http, server.url, credential, report_body(key, 1, mem_avail=101)),
        409,
        "sequence-conflict",
    )
    assert p["last_sequence"] == 1 and p["stream"] == "telemetry"
    assert await event_count(db, node_id) == appended

    # A newer one, then an older one (other content) and the old one unchanged.
    r = await post_report(http, server.url, credential, report_body(key, 2, mem_avail=102))
    assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
    appended = await event_count(db, node_id)
    p = assert_problem(
        await post_report(http, server.url, credential, report_body(key, 1, mem_avail=99)),
        409,
        "sequence-conflict",
    )
    assert "older" in p["detail"] and p["last_sequence"] == 2
    r = await post_report(http, server.url, credential, captured)
    assert r.status_code == 200 and r.json()["status"] == "duplicate"
    assert await event_count(db, node_id) == appended

    # Streams have their own sequences.
    r = await post_report(http, server.url, credential, report_body(key, 1, stream="inventory"))
    assert r.status_code == 200 and r.json()["status"] == "accepted"

    # A gap is accepted and recorded: in the answer, the events' metadata and the stream position.
    r = await post_report(http, server.url, credential, report_body(key, 5, mem_avail=105))
    assert r.status_code == 200 and r.json()["gap"] == 2 and r.json()["previous_sequence"] == 2, r.text
    async with db.acquire() as conn:
        gaps = [
            {"gap": gap}
            for gap in {
                e.metadata.agent_sequence_gap
                for e in await logged(conn, "stream_id = $1", node_id)
                if e.metadata.agent_sequence == 5
            }
        ]
        position = await conn.fetchrow(
            "SELECT last_sequence, skipped, reports FROM agent_stream_positions "
            "WHERE node_id = $1 AND stream = 'telemetry'",
            node_id,
        )
    assert [g["gap"] for g in gaps] == [2]
    assert dict(position) == {"last_sequence": 5, "skipped": 2, "reports": 3}
    streams = (
        await http.get(server.url + "/api/v1/agent-streams", params={"node_id": node_id}, headers=OPERATOR)
    ).json()
    assert {s["stream"]: s["last_sequence"] for s in streams["items"]} == {"inventory": 1, "telemetry": 5}
