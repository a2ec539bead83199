-- Version 7: one node's observations found by the time they were received, for the telemetry
-- history (api/services/reads/telemetry.py): without it a history reads every node's observations
-- of its window. The permanent segment's index is made under the name schema.sql gives it, then
-- the log's, which takes it over and makes each day segment's.
CREATE INDEX IF NOT EXISTS events_permanent_stream_observation_received_idx
    ON events_permanent (stream_id, received_at) WHERE event_class = 'observation';
CREATE INDEX IF NOT EXISTS events_stream_observation_received_idx
    ON events (stream_id, received_at) WHERE event_class = 'observation';
