"""The one event-row reader: the column list every query of the `events` table selects, and the
function that turns such a row into a `RecordedEvent`. Every reader (stream reads, catch-up,
audit log, replay, rebuild, point in time) selects `EVENT_COLUMNS` and decodes with
`event_from_row`, so the row shape is defined once."""

from __future__ import annotations

import asyncpg

from ledger.events import RecordedEvent, decode_metadata, decode_payload

# jsonb as text: msgspec decodes the text straight into the catalog's Structs (no dict detour).
EVENT_COLUMNS = (
    "global_position, stream_id, stream_version, event_id, event_type, event_class, "
    "schema_version, data::text AS data, metadata::text AS metadata, recorded_at"
)


def event_from_row(row: asyncpg.Record) -> RecordedEvent:
    return RecordedEvent(
        global_position=row["global_position"],
        stream_id=row["stream_id"],
        stream_version=row["stream_version"],
        event_id=row["event_id"],
        event_type=row["event_type"],
        event_class=row["event_class"],
        schema_version=row["schema_version"],
        payload=decode_payload(row["data"]),
        metadata=decode_metadata(row["metadata"]),
        recorded_at=row["recorded_at"],
    )
