"""The audit log as the API shows it: pages in commit order through the ledger's one gap-safe
read, held open for the next commit when asked (the change feed)."""

from __future__ import annotations

from datetime import datetime

import asyncpg

from api.services.reads.bodies import EventBody, EventPage, UndecodableBody
from api.services.reads.cursors import decode_log_cursor, encode_log_cursor
from ledger.events import EventClass, RecordedEvent
from ledger.feed import LogFeed
from ledger.reading import Checkpoint, LogEntry, LogFilter, LogPage, read_log
from runtime.process import older_collections_deferred


def event_body(entry: LogEntry) -> EventBody:
    """An event as the API shows it; one the catalog cannot decode is shown as stored, marked."""
    body = EventBody(
        global_position=entry.global_position,
        stream_id=entry.stream_id,
        stream_version=entry.stream_version,
        event_type=entry.event_type,
        event_class=entry.event_class,
        node_id=entry.stream_id,
        recorded_at=entry.recorded_at,
    )
    if isinstance(entry, RecordedEvent):
        body.data = entry.payload
        body.metadata = entry.metadata
    else:
        body.undecodable = UndecodableBody(
            error=entry.error, stored_data=entry.raw_data(), stored_metadata=entry.raw_metadata()
        )
    return body


class EventReads:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self.feed = LogFeed(pool)

    async def page(
        self,
        *,
        node_id: str | None = None,
        types: list[str] | None = None,
        event_class: EventClass | None = None,
        accelerator_uuid: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        cursor: str | None = None,
        limit: int = 100,
        wait_seconds: float = 0,
    ) -> EventPage:
        """A page of the log in commit order. Every page carries the cursor to resume from, so a
        poller continues exactly where it stopped. With `wait_seconds`, an empty page is held
        until an event commits (the change feed)."""
        after = decode_log_cursor(cursor) if cursor else Checkpoint()
        where = LogFilter(
            stream_id=node_id,
            event_types=tuple(types or ()),
            event_class=event_class,
            accelerator_uuid=accelerator_uuid,
            recorded_since=since,
            recorded_until=until,
        )
        if wait_seconds > 0:
            page = await self.feed.wait(after, limit=limit, where=where, wait_seconds=wait_seconds)
            return _page(page)
        # A page of a thousand snapshots is hundreds of thousands of objects that live until it
        # is sent, none of them garbage: the collector's older passes over them (tens of ms each, the
        # event loop held) wait until the page is made.
        with older_collections_deferred():
            async with self.pool.acquire() as conn:
                page = await read_log(conn, after, limit=limit, where=where)
            return _page(page)


def _page(page: LogPage) -> EventPage:
    return EventPage(
        items=[event_body(e) for e in page.entries],
        next_cursor=encode_log_cursor(page.resume),
        has_more=page.more,
    )
