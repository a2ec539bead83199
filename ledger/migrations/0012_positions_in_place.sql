-- Version 12: `agent_stream_positions` with `recent` as its last column. An accepted report puts
-- its digest in front of the ones stored before (api/services/positions.py), so with `recent`
-- last the row's update changes one run of bytes (the scalar columns, then the new entry) and the
-- rest of the row is unchanged behind it: PostgreSQL logs an update in place as what lies between
-- the old and new row's common prefix and suffix. A column cannot move, so the table is made
-- again with its rows (one per node and agent stream) as they are.
CREATE TABLE agent_stream_positions_v12 (
    node_id           text NOT NULL,
    stream            text NOT NULL,
    last_sequence     bigint NOT NULL,
    reports           bigint NOT NULL,
    skipped           bigint NOT NULL,
    last_observed_at  timestamptz,
    last_received_at  timestamptz NOT NULL,
    recent            bytea NOT NULL
) WITH (fillfactor = 50);
INSERT INTO agent_stream_positions_v12
    (node_id, stream, last_sequence, reports, skipped, last_observed_at, last_received_at, recent)
SELECT node_id, stream, last_sequence, reports, skipped, last_observed_at, last_received_at, recent
FROM agent_stream_positions;
DROP TABLE agent_stream_positions;
ALTER TABLE agent_stream_positions_v12 RENAME TO agent_stream_positions;
ALTER TABLE agent_stream_positions ADD CONSTRAINT agent_stream_positions_pkey PRIMARY KEY (node_id, stream);
