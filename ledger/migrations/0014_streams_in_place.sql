-- Version 14: `streams` with what every append changes (`version`, `updated_at`) first and
-- together, so that PostgreSQL logs a telemetry append's update of the row as those two values
-- (the bytes between the old and new row's common prefix and suffix) and not the lifecycle hash
-- after them. A column cannot move, so the table is made again with its rows as they are.
CREATE TABLE streams_v14 (
    stream_id          text NOT NULL,
    version            bigint NOT NULL,
    updated_at         timestamptz NOT NULL DEFAULT now(),
    lifecycle_version  bigint NOT NULL DEFAULT 0,
    head_hash          bytea,
    tombstoned_at      timestamptz,
    created_at         timestamptz NOT NULL DEFAULT now()
);
INSERT INTO streams_v14 (stream_id, version, updated_at, lifecycle_version, head_hash, tombstoned_at,
                         created_at)
SELECT stream_id, version, updated_at, lifecycle_version, head_hash, tombstoned_at, created_at
FROM streams;
DROP TABLE streams;
ALTER TABLE streams_v14 RENAME TO streams;
ALTER TABLE streams ADD CONSTRAINT streams_pkey PRIMARY KEY (stream_id);
