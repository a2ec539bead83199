"""How many SQL statements one steady-state agent report and one steady-state local refresh send
(asyncpg's query logger sees every statement a connection sends, BEGIN and COMMIT included;
docs/performance.md has the figures). A report sends 7 statements where its node is opened (the
lock and the state load are one call, `mf_open_streams`; a projection writes all its changed rows
and its state in one statement), and 1 where the server kept the node's state and stream position
from its previous report: the lock, the check of the kept checkpoint, the append, the read
models' rows and the position's advance are one statement outside a transaction block
(`mf_append_folded`, ledger/folded_append.py), besides which the server reserves the log's
positions it folds at, one statement per 128 (counted apart); a refresh sends 5. Reports that
arrive together (group commit) send the same statements for the whole batch. A snapshot whose GPU set the store does not know stored adds one statement (storing it, or
finding it stored: docs/storage.md), so the counts are taken once a report of these GPUs has
found their set committed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import msgspec
import pytest

from agent.protocol import EnrollRequest
from api.config import ServerConfig
from api.wiring import Services, build_services
from ledger.db import _keep_session, init_connection
from projections.inventory import INVENTORY
from tests.agent_support import report_body
from tests.fakes.fake_pynvml import FakeNvml
from tests.fixtures_nvml import multi_gpu_scenario
from tests.sample_reads import latest_samples

REPORT_STATEMENTS = 1  # locks + kept checkpoint checked + append + rows + advance, one transaction
OPENING_STATEMENTS = 7  # BEGIN, lock and state, position, append, one write, advance, COMMIT
REFRESH_STATEMENTS = 5  # BEGIN, lock and state, append, one write, COMMIT
# Reports that arrive together (group commit): the same one for the whole batch.
BATCH_STATEMENTS = 1
RESERVATION = "nextval('events_global_position_seq'"


class Counter:
    def __init__(self) -> None:
        self.queries: list[str] = []

    def __call__(self, record: object) -> None:
        query = str(getattr(record, "query", ""))
        if RESERVATION in query:
            self.reservations += 1
        else:
            self.queries.append(query)

    reservations = 0


@pytest.fixture
async def counted(database_dsn: str, tmp_path: Path) -> AsyncIterator[tuple[Services, Counter]]:
    counter = Counter()

    async def init(conn: asyncpg.Connection) -> None:
        await init_connection(conn)  # the product's codecs, as `serve` sets them up
        conn.add_query_logger(counter)

    # One connection: every statement of the path goes through it, and nothing else does.
    pool = await asyncpg.create_pool(database_dsn, min_size=1, max_size=1, init=init, reset=_keep_session)
    try:
        config = ServerConfig(state_dir=tmp_path / "state", node_id="counted-host", collector_timeout=5.0)
        yield build_services(pool, config, nvml=FakeNvml(multi_gpu_scenario(2))), counter
    finally:
        await pool.close()


async def test_a_steady_state_agent_report_sends_one_statement_and_a_first_one_seven(
    counted: tuple[Services, Counter],
) -> None:
    services, counter = counted
    token = await services.enrollment.create_token(3600, 2)
    principals = []
    for key in ("warm-up-agent", "counted-agent"):
        enrolled = await services.enrollment.enroll(
            token.token, EnrollRequest(identity_key=key, identity_source="configured", hostname=key)
        )
        principals.append(await services.credentials.authenticate(enrolled.credential))
    # The connection's first report prepares its statements (and asyncpg reads their types); it
    # stores the GPUs' set, which the counted agent's first report finds committed.
    await services.reports.accept_report(principals[0], report_body("warm-up-agent", 1, mem_avail=1), None)
    await services.reports.accept_report(principals[0], report_body("warm-up-agent", 2, mem_avail=2), None)
    principal = principals[1]
    counter.queries.clear()
    first = await services.reports.accept_report(
        principal, report_body("counted-agent", 1, mem_avail=1), None
    )
    assert first.status == "accepted" and first.lifecycle_events
    # The stream's first report: no position to keep yet, so the node is opened and read.
    assert len(counter.queries) == OPENING_STATEMENTS, counter.queries
    # One lock with its state load per report (the unit of work), never two, never apart.
    assert sum("mf_open_streams" in q for q in counter.queries) == 1
    counter.queries.clear()
    second = await services.reports.accept_report(
        principal, report_body("counted-agent", 2, mem_avail=2), None
    )
    assert second.status == "accepted" and second.lifecycle_events == [] and second.events > 0
    assert len(counter.queries) == REPORT_STATEMENTS, counter.queries
    # The lock, the kept checkpoint's check and the append in one call, nothing opened besides.
    assert sum("mf_append_folded" in q for q in counter.queries) == 1
    assert not any("mf_open_streams" in q or "FOR UPDATE" in q for q in counter.queries)
    assert not any("mf_lock_stream" in q or "FROM projection_state" in q for q in counter.queries)


async def test_a_node_reporting_on_its_two_streams_in_turn_sends_one_statement_each_time(
    counted: tuple[Services, Counter],
) -> None:
    # An agent sends an inventory report every 30 reports. A report on one stream moves the node
    # on; the other stream's kept position must follow it, or the next report on either stream
    # (a batch holding it, with every other report of the batch) opens its node again.
    services, counter = counted
    token = await services.enrollment.create_token(3600, 1)
    enrolled = await services.enrollment.enroll(
        token.token, EnrollRequest(identity_key="two-streams", identity_source="configured", hostname="h")
    )
    principal = await services.credentials.authenticate(enrolled.credential)
    for stream in ("inventory", "telemetry"):  # each stream's first report: nothing kept yet
        await services.reports.accept_report(
            principal, report_body("two-streams", 1, stream=stream, mem_avail=1), None
        )
    for seq, stream in (
        (2, "telemetry"),
        (2, "inventory"),
        (3, "telemetry"),
        (4, "telemetry"),
        (3, "inventory"),
    ):
        counter.queries.clear()
        ack = await services.reports.accept_report(
            principal, report_body("two-streams", seq, stream=stream, mem_avail=seq), None
        )
        assert (ack.status, ack.previous_sequence, ack.gap) == ("accepted", seq - 1, 0), (stream, ack)
        assert len(counter.queries) == REPORT_STATEMENTS, (stream, seq, counter.queries)
        assert not any("mf_open_streams" in q for q in counter.queries)


async def test_reports_that_arrive_together_share_one_statement(
    counted: tuple[Services, Counter],
) -> None:
    services, counter = counted
    token = await services.enrollment.create_token(3600, 8)
    principals = []
    for i in range(8):
        enrolled = await services.enrollment.enroll(
            token.token,
            EnrollRequest(identity_key=f"batch-{i}", identity_source="configured", hostname=f"h{i}"),
        )
        principals.append(await services.credentials.authenticate(enrolled.credential))
        await services.reports.accept_report(principals[-1], report_body(f"batch-{i}", 1, mem_avail=1), None)
    counter.queries.clear()
    acks = await asyncio.gather(
        *(
            services.reports.accept_report(p, report_body(f"batch-{i}", 2, mem_avail=2), None)
            for i, p in enumerate(principals)
        )
    )
    assert [a.status for a in acks] == ["accepted"] * 8
    assert len(counter.queries) == BATCH_STATEMENTS, counter.queries
    assert counter.reservations <= 1


async def test_a_steady_state_local_refresh_sends_one_lock_and_one_state_load(
    counted: tuple[Services, Counter],
) -> None:
    services, counter = counted
    await services.inventory.refresh()
    await services.inventory.refresh()  # finds the GPUs' set, which the first stored, committed
    counter.queries.clear()
    outcome = await services.inventory.refresh()
    assert outcome.outcome == "succeeded"
    assert all(e.event_class == "observation" for e in outcome.events)
    assert len(counter.queries) == REFRESH_STATEMENTS, counter.queries
    assert sum("mf_open_streams" in q for q in counter.queries) == 1
    assert not any("mf_lock_stream" in q or "FROM projection_state" in q for q in counter.queries)


async def test_a_report_keeps_gpu_metrics_in_its_event_not_in_the_nodes_checkpoint_or_a_copy(
    counted: tuple[Services, Counter],
) -> None:
    services, _counter = counted
    token = await services.enrollment.create_token(3600, 1)
    enrolled = await services.enrollment.enroll(
        token.token, EnrollRequest(identity_key="slim-agent", identity_source="configured", hostname="h")
    )
    principal = await services.credentials.authenticate(enrolled.credential)
    for sequence in (1, 2):
        ack = await services.reports.accept_report(
            principal, report_body("slim-agent", sequence, mem_avail=sequence), None
        )
        assert ack.status == "accepted"
    async with services.pool.acquire() as conn:
        state = msgspec.to_builtins(
            INVENTORY.decode_state(
                await conn.fetchval(
                    "SELECT state FROM projection_state WHERE projection = 'inventory' AND stream_id = $1",
                    principal.node_id,
                )
            )
        )
        columns = await conn.fetch(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'hw_accelerator_telemetry'"
        )
        own_rows = await conn.fetchval(
            "SELECT count(*) FROM hw_accelerator_telemetry WHERE node_id = $1", principal.node_id
        )
        newest = await conn.fetchval(
            "SELECT max(global_position) FROM events WHERE stream_id = $1 "
            "AND event_type = 'NODE_TELEMETRY_OBSERVED'",
            principal.node_id,
        )
        metrics = [(position, sample) for _, position, sample in await latest_samples(conn)]
    samples = [state["accelerator_telemetry"].get(u) for u in state["accelerators"]]
    # The checkpoint keeps when each GPU last reported (decisions read it), not what it reported.
    assert samples and all(t is not None and t["metrics"] == {} and t["received_at"] for t in samples)
    # Nor does a telemetry row: every GPU's sample is in the newest report's event, which the
    # host's row points at, and no GPU has a row of its own (each would be rewritten every report).
    assert {r["column_name"] for r in columns} == {
        "accelerator_id",
        "node_id",
        "observed_at",
        "received_at",
        "position",
    }
    assert own_rows == 0
    assert len(metrics) == len(samples) and all(p == newest and x and x.metrics for p, x in metrics)


async def test_a_batch_sends_the_same_statement_text_whatever_its_size(
    counted: tuple[Services, Counter],
) -> None:
    # The counts a folded statement checks are parameters: one prepared statement serves batches
    # of every size, instead of a new one (a Parse, a plan) per size.
    services, counter = counted
    token = await services.enrollment.create_token(3600, 5)
    principals = []
    for i in range(5):
        enrolled = await services.enrollment.enroll(
            token.token,
            EnrollRequest(identity_key=f"sized-{i}", identity_source="configured", hostname=f"s{i}"),
        )
        principals.append(await services.credentials.authenticate(enrolled.credential))
        await services.reports.accept_report(principals[-1], report_body(f"sized-{i}", 1, mem_avail=1), None)
    texts = []
    for seq, size in ((2, 1), (3, 5)):
        counter.queries.clear()
        acks = await asyncio.gather(
            *(
                services.reports.accept_report(p, report_body(f"sized-{i}", seq, mem_avail=seq), None)
                for i, p in enumerate(principals[:size])
            )
        )
        assert [a.status for a in acks] == ["accepted"] * size
        (text,) = counter.queries
        texts.append(text)
    assert "mf_append_folded" in texts[0] and texts[0] == texts[1]
