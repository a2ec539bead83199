-- Version 16: the index of events by type on the permanent segment only. Every lifecycle event
-- lives there; a day segment holds telemetry snapshots, which a read by type finds by walking the
-- day in commit order (they are nearly all of its rows), so every snapshot wrote an entry nobody
-- read. A partition's index cannot leave its parent's, so the parent's goes (with every
-- partition's) and the permanent segment's is built again, under the same name: the build holds
-- the permanent segment's SHARE lock, so lifecycle appends wait for it (docs/upgrades.md).
DROP INDEX events_type_idx;
CREATE INDEX events_permanent_type_idx ON events_permanent (event_type, global_position);
