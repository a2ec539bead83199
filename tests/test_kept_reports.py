"""Agent reports decided on kept copies (api/services/reports.py `_commit_folded` and
`_commit_kept`): a server that kept a node's folded state and its stream's position from its
previous report decides the next report before sending anything, and commits it in one statement
(five in a transaction where that one wrote nothing). The copies are guesses:
whatever another server (or a rolled-back transaction of its own) did in between, every report
gets the answer, and leaves the position, it would have had on what PostgreSQL holds."""

from __future__ import annotations

import asyncio
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.protocol import EnrollRequest, ReportAck
from api.config import ServerConfig
from api.services.credentials import Principal
from api.services.errors import Conflict
from api.services.reports import report_item
from api.wiring import Services, build_services
from projections.inventory import ALL_PROJECTIONS
from projections.rebuild import rebuild
from tests.agent_support import report_body


def _now() -> datetime:
    return datetime.now(UTC)


def server(pool: asyncpg.Pool, tmp_path: Path, name: str) -> Services:
    return build_services(pool, ServerConfig(state_dir=tmp_path / name, collector_timeout=5.0))


async def enrolled(server: Services, key: str) -> tuple[Principal, str]:
    """The node's principal on `server`, and its credential (for another server to authenticate)."""
    token = await server.enrollment.create_token(3600, 1)
    done = await server.enrollment.enroll(
        token.token, EnrollRequest(identity_key=key, identity_source="configured", hostname=key)
    )
    return await server.credentials.authenticate(done.credential), done.credential


async def position(pool: asyncpg.Pool, node_id: str, stream: str = "telemetry") -> tuple[int, int, int]:
    async with pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT last_sequence, reports, skipped FROM agent_stream_positions WHERE node_id = $1 AND stream = $2",
            node_id,
            stream,
        )
    assert row is not None
    return row["last_sequence"], row["reports"], row["skipped"]


async def verify(pool: asyncpg.Pool) -> None:
    report = await rebuild(pool, ALL_PROJECTIONS, verify=True)
    assert report.differences == [], report.differences


async def test_reports_on_kept_copies_take_the_short_way_and_count_right(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    a = server(pool, tmp_path, "a")
    principal, _ = await enrolled(a, "kept-agent")
    for seq in (1, 2, 3, 5):
        ack = await a.reports.accept_report(principal, report_body("kept-agent", seq, mem_avail=seq), None)
        assert ack.status == "accepted" and ack.sequence == seq
    assert ack.previous_sequence == 3 and ack.gap == 1
    # Reports 2, 3 and 5 were decided on kept copies; 1 had no position yet.
    assert a.reports.store.states.kept_appends == 3
    assert await position(pool, principal.node_id) == (5, 4, 1)
    # A replay of a kept sequence is refused or recognized as the usual way decides it.
    again = await a.reports.accept_report(principal, report_body("kept-agent", 3, mem_avail=3), None)
    assert again.status == "duplicate"
    await verify(pool)


async def test_a_report_after_another_server_took_the_node_is_decided_on_what_is_stored(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    a, b = server(pool, tmp_path, "a"), server(pool, tmp_path, "b")
    principal, credential = await enrolled(a, "moved-agent")
    on_b = await b.credentials.authenticate(credential)
    await a.reports.accept_report(principal, report_body("moved-agent", 1, mem_avail=1), None)
    await a.reports.accept_report(principal, report_body("moved-agent", 2, mem_avail=2), None)
    # The agent fails over to server b for a report, then comes back to a.
    ack_b = await b.reports.accept_report(on_b, report_body("moved-agent", 3, mem_avail=3), None)
    assert ack_b.status == "accepted" and ack_b.previous_sequence == 2
    ack_a = await a.reports.accept_report(principal, report_body("moved-agent", 4, mem_avail=4), None)
    # a's copies say 2: the node's checkpoint told it otherwise, and it read the stored position.
    assert ack_a.status == "accepted" and ack_a.previous_sequence == 3 and ack_a.gap == 0
    assert a.reports.store.states.stale == 1
    # b's copy of sequence 3 is behind too; its replay of 4 is what a stored.
    replay = await b.reports.accept_report(on_b, report_body("moved-agent", 4, mem_avail=4), None)
    assert replay.status == "duplicate"
    assert await position(pool, principal.node_id) == (4, 4, 0)
    await verify(pool)


async def test_a_kept_position_is_used_only_with_the_node_state_it_was_kept_with(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # Server a makes its copy of the node state current (a lease acquired through a, after b's
    # report) while its copy of the stream position is from before b's report: the two copies are
    # of different moments, so the report is decided on what a reads.
    a, b = server(pool, tmp_path, "a"), server(pool, tmp_path, "b")
    principal, credential = await enrolled(a, "lease-agent")
    await a.reports.accept_report(principal, report_body("lease-agent", 1, mem_avail=1), None)
    ack_b = await b.reports.accept_report(
        await b.credentials.authenticate(credential), report_body("lease-agent", 2, mem_avail=2), None
    )
    assert ack_b.status == "accepted"
    await a.decommission.acquire_lease(principal.node_id, "scheduler", "job 1")
    ack = await a.reports.accept_report(principal, report_body("lease-agent", 3, mem_avail=3), None)
    assert ack.status == "accepted" and ack.previous_sequence == 2 and ack.gap == 0
    # Known before anything was written: no batch rolled back (and no dead rows left) for it.
    assert a.reports.positions.stale == 0
    assert await position(pool, principal.node_id) == (3, 3, 0)
    await verify(pool)


async def test_a_position_row_written_behind_the_servers_back_is_what_the_report_is_decided_on(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # A write of the row that moves no node stream (an operator's repair, a tool of a later
    # release): only the row's xmin tells the kept copy from it. The report runs again on the row.
    a = server(pool, tmp_path, "a")
    principal, _ = await enrolled(a, "repaired-agent")
    for seq in (1, 2):
        await a.reports.accept_report(principal, report_body("repaired-agent", seq, mem_avail=seq), None)
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE agent_stream_positions SET last_sequence = 10 WHERE node_id = $1", principal.node_id
        )
    with pytest.raises(Conflict) as refused:
        await a.reports.accept_report(principal, report_body("repaired-agent", 3, mem_avail=3), None)
    assert "older than the last accepted (10)" in refused.value.detail
    assert a.reports.positions.stale == 1
    assert await position(pool, principal.node_id) == (10, 2, 0)


async def test_one_row_written_behind_the_servers_back_sends_its_whole_batch_round_again(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # Two reports in one batch on kept copies, one of whose rows was written since: the batch's
    # folded statement must not stand, its append and the other row's advance included; the batch
    # is decided again in a transaction, on the rows it reads there.
    a = server(pool, tmp_path, "a")
    repaired, _ = await enrolled(a, "repaired-in-batch")
    steady, _ = await enrolled(a, "steady-in-batch")
    for seq in (1, 2):
        for p, key in ((repaired, "repaired-in-batch"), (steady, "steady-in-batch")):
            await a.reports.accept_report(p, report_body(key, seq, mem_avail=seq), None)
    async with pool.acquire() as conn:
        await conn.execute(
            "UPDATE agent_stream_positions SET last_sequence = 10 WHERE node_id = $1", repaired.node_id
        )
    batches_before = a.reports.group_commit.batches
    folded_before = a.reports.store.states.folded_appends
    outcomes = await asyncio.gather(
        a.reports.accept_report(repaired, report_body("repaired-in-batch", 3, mem_avail=3), None),
        a.reports.accept_report(steady, report_body("steady-in-batch", 3, mem_avail=3), None),
        return_exceptions=True,
    )
    refused, accepted = outcomes
    assert isinstance(refused, Conflict) and "older than the last accepted (10)" in refused.detail
    assert isinstance(accepted, ReportAck) and accepted.status == "accepted"
    assert a.reports.positions.stale == 1
    assert a.reports.group_commit.batches - batches_before == 1
    assert a.reports.store.states.folded_appends == folded_before
    assert await position(pool, repaired.node_id) == (10, 2, 0)
    assert await position(pool, steady.node_id) == (3, 3, 0)
    await verify(pool)


async def test_a_server_that_keeps_no_state_decides_every_report_on_what_it_reads(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    a = build_services(
        pool, ServerConfig(state_dir=tmp_path / "a", collector_timeout=5.0, state_cache_streams=0)
    )
    principal, _ = await enrolled(a, "uncached-agent")
    for seq in (1, 2, 3):
        ack = await a.reports.accept_report(
            principal, report_body("uncached-agent", seq, mem_avail=seq), None
        )
        assert ack.status == "accepted"
    assert a.reports.store.states.kept_appends == 0
    assert await position(pool, principal.node_id) == (3, 3, 0)


# --- any interleaving of two servers ----------------------------------------------------------

# (server 0 or 1, node, agent stream, what happens): the node's next report on that stream (after
# skipping 0-2 sequences), an unchanged retry of its newest accepted report, a report whose
# transaction rolls back after it wrote (a failed COMMIT, say), or a work lease through that server
# (its node state made current, its copy of the position not). A report on one stream moves the
# node on under the other stream's kept position (which the server carries along).
histories = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.integers(0, 1),
        st.sampled_from(["telemetry", "telemetry", "inventory"]),
        st.sampled_from(["next", "next", "next", "skip", "retry", "rolled_back", "lease"]),
    ),
    min_size=1,
    max_size=16,
)


async def test_any_interleaving_of_two_servers_answers_and_counts_as_one_would(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    loop = asyncio.get_running_loop()
    servers = [server(pool, tmp_path, "a"), server(pool, tmp_path, "b")]

    @settings(
        max_examples=int(os.environ.get("MF_PROPERTY_EXAMPLES", "30")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(history=histories)
    # Both ways, whatever else is drawn: server 0 decides its node's second and third reports on
    # its copies, and its fourth on copies server 1's report made stale.
    @example(
        history=[
            (0, 0, "telemetry", "next"),
            (0, 0, "telemetry", "next"),
            (0, 0, "telemetry", "next"),
            (1, 0, "telemetry", "next"),
            (0, 0, "telemetry", "next"),
        ]
    )
    def prop(history: list[tuple[int, int, str, str]]) -> None:
        prefix = uuid.uuid4().hex[:8]

        async def example() -> None:
            keys = [f"{prefix}-{n}" for n in range(2)]
            principals = []
            for key in keys:
                principal, credential = await enrolled(servers[0], key)
                principals.append([principal, await servers[1].credentials.authenticate(credential)])
            # The model: per node and stream, the last accepted sequence, accepted reports, skipped
            # sequences.
            model = {
                (n, stream): [0, 0, 0] for n in range(len(keys)) for stream in ("telemetry", "inventory")
            }
            for s, n, stream, action in history:
                service, principal, key = servers[s].reports, principals[n][s], keys[n]
                last, reports, skipped = model[n, stream]
                if action == "lease":
                    if not model[n, "telemetry"][1] and not model[n, "inventory"][1]:
                        continue  # not discovered yet: no node to lease
                    await servers[s].decommission.acquire_lease(principal.node_id, "scheduler", "job")
                    continue
                if action == "retry":
                    if last == 0:
                        continue
                    retried = report_body(key, last, stream=stream, mem_avail=last)
                    ack = await service.accept_report(principal, retried, None)
                    assert ack.status == "duplicate", ack
                    continue
                seq = last + (3 if action == "skip" else 1)
                body = report_body(key, seq, stream=stream, mem_avail=seq)
                if action == "rolled_back":
                    item = report_item(principal, body, _now(), None)
                    async with pool.acquire() as conn:
                        transaction = conn.transaction()
                        await transaction.start()
                        try:
                            (ack,) = await service._commit_reports(conn, [item])
                            assert isinstance(ack, ReportAck) and ack.status == "accepted", ack
                        finally:
                            await transaction.rollback()
                    continue
                ack = await service.accept_report(principal, body, None)
                assert (ack.status, ack.previous_sequence, ack.gap) == (
                    "accepted",
                    last or None,
                    seq - last - 1,
                ), (ack, model[n, stream])
                model[n, stream] = [seq, reports + 1, skipped + seq - last - 1]
            for (n, stream), expected in model.items():
                if expected[1]:
                    assert list(await position(pool, principals[n][0].node_id, stream)) == expected, (
                        n,
                        stream,
                    )
            await verify(pool)

        asyncio.run_coroutine_threadsafe(example(), loop).result()

    await asyncio.to_thread(prop)
    # Both ways were taken: on kept copies, and refused for what was stored.
    stores = [s.reports.store.states for s in servers]
    assert sum(x.kept_appends for x in stores) > 0 and sum(x.stale for x in stores) > 0


async def test_a_nodes_two_streams_reporting_at_once_to_two_servers_are_each_counted_once(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    # Both of a node's agent streams in flight at once, on one server and across two: the two
    # reports of a node take turns on its lock, and whichever comes second finds the first one's
    # writes, whatever its copies said.
    a, b = server(pool, tmp_path, "a"), server(pool, tmp_path, "b")
    principal, credential = await enrolled(a, "two-streams")
    on_b = await b.credentials.authenticate(credential)
    for seq in range(1, 13):
        telemetry_plane, inventory_plane = (a, b) if seq % 3 else (a, a)
        acks = await asyncio.gather(
            telemetry_plane.reports.accept_report(
                principal, report_body("two-streams", seq, mem_avail=seq), None
            ),
            inventory_plane.reports.accept_report(
                on_b if inventory_plane is b else principal,
                report_body("two-streams", seq, stream="inventory", mem_avail=seq),
                None,
            ),
        )
        assert [(x.status, x.previous_sequence, x.gap) for x in acks] == [
            ("accepted", seq - 1 or None, 0)
        ] * 2
    async with pool.acquire() as conn:
        rows = await conn.fetch(
            "SELECT stream, last_sequence, reports, skipped FROM agent_stream_positions WHERE node_id = $1 "
            "ORDER BY stream",
            principal.node_id,
        )
    assert [tuple(r) for r in rows] == [("inventory", 12, 12, 0), ("telemetry", 12, 12, 0)]
    await verify(pool)
