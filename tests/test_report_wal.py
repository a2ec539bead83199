"""What a steady agent report writes to the WAL on the tables the projections and the stream
positions rewrite: no GPU telemetry row, and nothing in TOAST (the folded state arrives
compressed, the recent digests as bytes), a row lock record only before each upserted read-model
row and checkpoint, and of the folded state and the digest window only the part the report
changed (PostgreSQL logs an update in place as the bytes between the old and new row's common
prefix and suffix). Read back with pg_walinspect, the
records of this test's database only. Also the two stored forms those take: the digests' bytes,
and checkpoints in either encoding compared by state in `rebuild --verify`."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from pathlib import Path

import asyncpg
import msgspec
from hypothesis import given
from hypothesis import strategies as st

from agent.protocol import EnrollRequest
from api.config import ServerConfig
from api.services.positions import advanced_bytes, recent_bytes, recent_digests
from api.wiring import build_services
from collectors.identity import NodeIdentity
from domain.node import node_id_for
from domain.reconcile import reconcile
from domain.report_decisions import RECENT_REPORT_DIGESTS
from ledger.db import create_pool
from ledger.events import NewEvent
from ledger.store import EventStore
from ledger.unit_of_work import UnitOfWork
from projections.inventory import ALL_PROJECTIONS, INVENTORY
from projections.rebuild import rebuild
from tests.agent_support import report_body
from tests.builders import meta
from tests.fakes.fake_pynvml import FakeNvml
from tests.fixtures_nvml import multi_gpu_scenario
from tests.test_projection_property import observation_of, plain_step

# The log's own tables (the stream row's lock is the append's) are not the projections' to write.
PROJECTION_WRITTEN = (
    "projection_state",
    "agent_stream_positions",
    "hw_accelerator_telemetry",
    "hw_host_telemetry",
    "hw_node_storage",
    "hw_nodes",
    "hw_accelerators",
)
_BLOCK = re.compile(r"rel \d+/(\d+)/(\d+)")


async def _records(
    conn: asyncpg.Connection, start: str, end: str, written: Counter[str] | None = None
) -> Counter[tuple[str, str]]:
    """(relation, record type) of this database's heap records between two WAL positions (and
    into `written`, the bytes of each relation's records)."""
    database = await conn.fetchval("SELECT oid FROM pg_database WHERE datname = current_database()")
    names = {
        str(r["node"]): r["relname"]
        for r in await conn.fetch(
            "SELECT pg_relation_filenode(c.oid) AS node, c.relname FROM pg_class c "
            "WHERE pg_relation_filenode(c.oid) IS NOT NULL"
        )
    }
    toast = {
        r["toast"]: r["relname"]
        for r in await conn.fetch(
            "SELECT t.relname AS toast, c.relname FROM pg_class c JOIN pg_class t ON t.oid = c.reltoastrelid"
        )
    }
    out: Counter[tuple[str, str]] = Counter()
    for r in await conn.fetch(
        "SELECT record_type, record_length, block_ref FROM pg_get_wal_records_info($1::text::pg_lsn, $2::text::pg_lsn) "
        "WHERE resource_manager = 'Heap'",
        start,
        end,
    ):
        m = _BLOCK.search(r["block_ref"] or "")
        if m is None or int(m.group(1)) != database:
            continue
        name = names.get(m.group(2), m.group(2))
        relation = f"TOAST of {toast[name]}" if name in toast else name
        out[(relation, r["record_type"])] += 1
        if written is not None:
            written[relation] += r["record_length"]
    return out


async def test_a_steady_report_changes_its_rows_in_place_without_toast(
    database_dsn: str, tmp_path: Path
) -> None:
    admin = await asyncpg.connect(database_dsn)
    await admin.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    pool = await create_pool(database_dsn, min_size=1, max_size=2)
    try:
        config = ServerConfig(state_dir=tmp_path / "state", node_id="wal-host", collector_timeout=5.0)
        services = build_services(pool, config, nvml=FakeNvml(multi_gpu_scenario(2)))
        token = await services.enrollment.create_token(3600, 1)
        enrolled = await services.enrollment.enroll(
            token.token, EnrollRequest(identity_key="wal-agent", identity_source="configured", hostname="h")
        )
        principal = await services.credentials.authenticate(enrolled.credential)
        # A full window of recent digests, as a long-running agent has.
        steady = RECENT_REPORT_DIGESTS + 2
        for sequence in range(1, steady):
            await services.reports.accept_report(
                principal, report_body("wal-agent", sequence, mem_avail=sequence), None
            )
        start = await admin.fetchval("SELECT pg_current_wal_lsn()::text")
        ack = await services.reports.accept_report(
            principal, report_body("wal-agent", steady, mem_avail=steady), None
        )
        assert ack.status == "accepted"
        end = await admin.fetchval("SELECT pg_current_wal_lsn()::text")
        bytes_of: Counter[str] = Counter()
        records = await _records(admin, start, end, bytes_of)
        stored = await admin.fetchrow(
            "SELECT recent, last_sequence FROM agent_stream_positions WHERE node_id = $1 AND stream = 'telemetry'",
            principal.node_id,
        )
        state = await admin.fetchval(
            "SELECT state FROM projection_state WHERE projection = 'inventory' AND stream_id = $1",
            principal.node_id,
        )
    finally:
        await pool.close()
        await admin.close()
    assert stored is not None
    assert len(recent_digests(stored["recent"], stored["last_sequence"])) == RECENT_REPORT_DIGESTS
    written = {rel for rel, _type in records}
    assert {"projection_state", "agent_stream_positions"} <= written
    # every GPU is in the report's own snapshot: none has a telemetry row to rewrite
    assert "hw_accelerator_telemetry" not in written
    assert not [k for k in records if k[0].startswith("TOAST of ") and k[0][9:] in PROJECTION_WRITTEN], (
        records
    )
    # The read models' rows and the checkpoint are upserted: each is locked before its update (one
    # record per row rewritten); the stream's position and the log's own rows are updated alone.
    upserted = {"projection_state", "hw_host_telemetry", "hw_node_storage", "hw_accelerator_telemetry"}
    locks = Counter(rel for rel, kind in records.elements() if kind == "LOCK")
    updates = Counter(rel for rel, kind in records.elements() if kind in ("UPDATE", "HOT_UPDATE"))
    assert locks and set(locks) <= upserted, records
    assert all(locks[rel] == updates[rel] for rel in locks), records
    # The checkpoint's unchanged part (all but what the report changed) is not logged again.
    assert bytes_of["projection_state"] < len(state) / 3, (bytes_of, len(state))
    # Nor the stream's window of digests: its new entry goes in front of the ones stored before.
    assert bytes_of["agent_stream_positions"] < len(stored["recent"]) / 3, bytes_of


@given(
    st.lists(st.integers(min_value=1, max_value=2 * RECENT_REPORT_DIGESTS), min_size=1, max_size=120),
    st.integers(min_value=-(2**40), max_value=2**40),
)
def test_recent_digests_round_trip_through_their_stored_bytes(steps: list[int], first: int) -> None:
    """A stream's accepted sequences (increasing, with gaps): after each, the stored bytes give
    back exactly the window the decision kept, stay under the 2 KB at which PostgreSQL would move
    them to TOAST, and mostly grow by the new entry in front of the bytes stored before."""
    stored = b""
    recent: dict[int, str] = {}
    seq = first
    in_front = 0
    for step in steps:
        seq += step
        recent = {k: v for k, v in recent.items() if k > seq - RECENT_REPORT_DIGESTS}
        recent[seq] = hashlib.sha256(str(seq).encode()).hexdigest()
        packed = recent_bytes(recent, seq, stored)
        assert recent_digests(packed, seq) == recent
        # A decision on a kept copy's window (the stored entries decoded at the sequence
        # before), told only the entry it added, stores the same.
        assert advanced_bytes(recent, seq, stored) == packed
        assert len(packed) <= 46 * 40
        in_front += packed.endswith(stored) and len(packed) == len(stored) + 40
        stored = packed
    assert in_front >= len(steps) * 2 // 3 - 1


def test_a_decision_on_a_kept_window_stores_what_the_window_gives_past_a_full_row() -> None:
    """A hundred reports in a row: time and again the row fills up (46 entries) and the window
    alone is written anew; a decision on the kept window stores the same bytes each time."""
    stored = b""
    recent: dict[int, str] = {}
    rewritten = 0
    for seq in range(1, 101):
        recent = {k: v for k, v in recent.items() if k > seq - RECENT_REPORT_DIGESTS}
        recent[seq] = hashlib.sha256(str(seq).encode()).hexdigest()
        packed = recent_bytes(recent, seq, stored)
        assert advanced_bytes(recent, seq, stored) == packed
        rewritten += not packed.endswith(stored)
        stored = packed
    assert rewritten >= 2


def test_recent_digests_written_anew_where_the_stored_ones_do_not_fit() -> None:
    window = {s: hashlib.sha256(bytes([s])).hexdigest() for s in (5, 6, 7)}
    # stored by another window: a digest that differs, or an entry the new window lacks
    other = recent_bytes({**window, 6: "00" * 32}, 7)
    assert recent_digests(recent_bytes(window, 7, other), 7) == window
    wider = recent_bytes({**window, 4: "11" * 32}, 7)
    assert recent_digests(recent_bytes(window, 7, wider), 7) == window
    # an entry at the window's floor is not put in front of the stored ones (it would be read past)
    stored = recent_bytes(window, 7)
    below = {**window, 8: "22" * 32, 8 - RECENT_REPORT_DIGESTS: "33" * 32}
    assert not recent_bytes(below, 8, stored).endswith(stored)
    assert recent_digests(b"", None) == {}


def test_a_checkpoint_decodes_from_either_encoding_and_refuses_an_unknown_one() -> None:
    state = INVENTORY.initial("node-a")
    assert INVENTORY.decode_state(INVENTORY.encode_state(state)) == state
    assert INVENTORY.decode_state(msgspec.json.encode(state)) == state
    assert INVENTORY.encode_state(state)[:1] == b"\x02"
    try:
        INVENTORY.decode_state(b"\x03abc")
    except ValueError as exc:
        assert "unknown encoding" in str(exc)
    else:
        raise AssertionError("an unknown encoding decoded")


async def test_verify_compares_checkpoints_by_state_whichever_encoding_stored_them(
    pool: asyncpg.Pool,
) -> None:
    """A checkpoint still stored as JSON (written before the binary encoding) equals the rebuilt
    binary one when their states are equal, and a state that differs is reported as such."""
    store = EventStore(pool, ALL_PROJECTIONS)
    identity = NodeIdentity(key="two-encodings", source="configured")
    node_id = node_id_for(identity.key)
    step = plain_step()
    async with UnitOfWork(store, INVENTORY).open(node_id) as stream:
        await stream.decide(
            lambda s: [NewEvent(p, meta()) for p in reconcile(observation_of(step), s, identity)]
        )
    async with pool.acquire() as conn:
        state = await INVENTORY.load_state(conn, node_id)
        write = "UPDATE projection_state SET state = $1 WHERE projection = 'inventory' AND stream_id = $2"
        await conn.execute(write, msgspec.json.encode(INVENTORY.persisted(state)), node_id)
    assert (await rebuild(pool, ALL_PROJECTIONS, verify=True)).differences == []

    async with pool.acquire() as conn:
        changed = msgspec.structs.replace(state, hostname="drifted.example")
        await conn.execute(write, msgspec.json.encode(INVENTORY.persisted(changed)), node_id)
    differences = (await rebuild(pool, ALL_PROJECTIONS, verify=True)).differences
    assert [(d.table, d.only_live_count, d.only_rebuilt_count) for d in differences] == [
        ("projection_state", 1, 1)
    ]
    assert "drifted.example" in differences[0].only_live[0]
    assert "drifted.example" not in differences[0].only_rebuilt[0]
