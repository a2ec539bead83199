-- Version 22: the log's two indexes by stream that are not its stream-version key are keyed by the
-- stream's eight-byte key (mf_stream_key) instead of its id, half as wide per entry (schema.sql,
-- docs/storage.md). The function is made here because the indexes need it before every migrate
-- installs the functions again. A partition's index cannot leave its parent's, so the parent's go
-- (with every partition's), the permanent segment's are built under the names schema.sql gives
-- them, and the parent's then take those over and build each day segment's: the upgrade reads the
-- whole log once per index.
CREATE OR REPLACE FUNCTION mf_stream_key(p_stream_id text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT hashtextextended(p_stream_id, 0) $$;
DROP INDEX events_stream_tx_idx;
DROP INDEX events_stream_observation_received_idx;
CREATE INDEX events_permanent_stream_tx_idx
    ON events_permanent (mf_stream_key(stream_id), tx_id, global_position);
CREATE INDEX events_permanent_stream_observation_received_idx
    ON events_permanent (mf_stream_key(stream_id), received_at) WHERE event_class = 'observation';
CREATE INDEX events_stream_tx_idx ON events (mf_stream_key(stream_id), tx_id, global_position);
CREATE INDEX events_stream_observation_received_idx ON events (mf_stream_key(stream_id), received_at)
    WHERE event_class = 'observation';
