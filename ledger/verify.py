"""Tamper evidence: walk every stream's hash chain of lifecycle events.

Each lifecycle event stores `hash = sha256(prev_hash || canonical bytes)`
(ledger/sql/functions/mf_event_hash.sql) and each stream keeps its newest lifecycle hash as
`head_hash`. An edit to an event's data or metadata breaks its own hash; an edit that also
rewrites that hash breaks the next event's link; an edit to the newest event, hash and all, no
longer matches the stream head; a removed event breaks a link or the head and the lifecycle count.
"""

from __future__ import annotations

from typing import Literal

import asyncpg
import msgspec

from ledger.reading import EVENT_COLUMNS, StoredEvent, entry_from_row

BreakKind = Literal["hash_mismatch", "broken_link", "head_mismatch", "count_mismatch"]


class ChainBreak(msgspec.Struct, frozen=True):
    stream_id: str
    kind: BreakKind
    detail: str
    stream_version: int | None = None
    global_position: int | None = None


class ChainReport(msgspec.Struct, frozen=True):
    streams: int
    lifecycle_events: int
    breaks: list[ChainBreak]

    @property
    def ok(self) -> bool:
        return not self.breaks


# Every lifecycle event's hash recomputed from its row, and its link to the previous lifecycle
# event of its stream checked; `n` numbers a stream's lifecycle events.
_CHECKED = """
WITH checked AS (
    SELECT stream_id, stream_version, global_position,
           hash IS NOT DISTINCT FROM mf_event_hash(prev_hash, stream_id, stream_version, event_id,
                                                   event_type, schema_version, data, metadata,
                                                   recorded_at) AS hash_ok,
           prev_hash IS NOT DISTINCT FROM lag(hash) OVER w AS link_ok,
           hash, row_number() OVER w AS n
    FROM events WHERE event_class = 'lifecycle'
    WINDOW w AS (PARTITION BY stream_id ORDER BY stream_version)
)"""

# The events whose hash or link does not hold.
_BROKEN_EVENTS = (
    _CHECKED
    + """
SELECT stream_id, stream_version, global_position, hash_ok, link_ok FROM checked
WHERE NOT hash_ok OR NOT link_ok
ORDER BY stream_id, stream_version
"""
)

# The streams whose head hash is not their newest lifecycle event's, or whose lifecycle count is
# not the number of lifecycle events the log holds.
_BROKEN_HEADS = (
    _CHECKED
    + """,
last AS (SELECT DISTINCT ON (stream_id) stream_id, hash, n FROM checked ORDER BY stream_id, n DESC),
heads AS (
    SELECT s.stream_id, s.head_hash IS NOT DISTINCT FROM l.hash AS head_ok,
           s.lifecycle_version = coalesce(l.n, 0) AS count_ok, s.lifecycle_version,
           coalesce(l.n, 0) AS found
    FROM streams s LEFT JOIN last l ON l.stream_id = s.stream_id
)
SELECT stream_id, head_ok, count_ok, lifecycle_version, found FROM heads
WHERE NOT head_ok OR NOT count_ok
"""
)

# The next batch of events in log order, for decoding.
_EVENTS_AFTER = (
    "SELECT " + EVENT_COLUMNS + " FROM events WHERE events.global_position > $1 "
    "ORDER BY events.global_position LIMIT $2"
)


async def verify_chains(conn: asyncpg.Connection) -> ChainReport:
    """Recompute every lifecycle event's hash and link, and every stream's head."""
    breaks: list[ChainBreak] = []
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        for r in await conn.fetch(_BROKEN_EVENTS):
            if not r["hash_ok"]:
                breaks.append(
                    ChainBreak(
                        r["stream_id"],
                        "hash_mismatch",
                        "the event's bytes no longer match its hash (data or metadata edited)",
                        r["stream_version"],
                        r["global_position"],
                    )
                )
            if not r["link_ok"]:
                breaks.append(
                    ChainBreak(
                        r["stream_id"],
                        "broken_link",
                        "prev_hash does not match the previous lifecycle event (edited or removed)",
                        r["stream_version"],
                        r["global_position"],
                    )
                )
        for r in await conn.fetch(_BROKEN_HEADS):
            if not r["head_ok"]:
                breaks.append(
                    ChainBreak(
                        r["stream_id"],
                        "head_mismatch",
                        "the stream's head hash does not match its newest lifecycle event",
                    )
                )
            if not r["count_ok"]:
                breaks.append(
                    ChainBreak(
                        r["stream_id"],
                        "count_mismatch",
                        f"the stream records {r['lifecycle_version']} lifecycle events, "
                        f"the log holds {r['found']}",
                    )
                )
        streams = await conn.fetchval("SELECT count(*) FROM streams")
        lifecycle = await conn.fetchval("SELECT count(*) FROM events WHERE event_class = 'lifecycle'")
    return ChainReport(streams=streams, lifecycle_events=lifecycle, breaks=breaks)


class DecodeFinding(msgspec.Struct, frozen=True):
    """A stored event the event catalog refuses: named so an operator can find it."""

    stream_id: str
    stream_version: int
    global_position: int
    error: str


async def find_undecodable(conn: asyncpg.Connection, *, batch: int = 5000) -> list[DecodeFinding]:
    """Decode every stored event with the catalog and name each one it refuses (a rebuild would
    stop at the first; verification lists them all)."""
    findings: list[DecodeFinding] = []
    after = 0
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        while True:
            rows = await conn.fetch(_EVENTS_AFTER, after, batch)
            if not rows:
                return findings
            for row in rows:
                entry = entry_from_row(row)
                if isinstance(entry, StoredEvent):
                    findings.append(
                        DecodeFinding(
                            entry.stream_id, entry.stream_version, entry.global_position, entry.error
                        )
                    )
            after = rows[-1]["global_position"]
