-- Version 8: a GPU's lifecycle events found by its UUID, and the fleet's failures found without
-- reading every health change (api/services/reads/gpu_history.py, lemons.py; docs/lemons.md).
-- Lifecycle events all live in the permanent segment and the reads name it, so the day segments
-- (telemetry only) need neither index: an index on the permanent segment alone.
CREATE INDEX IF NOT EXISTS events_permanent_gpu_uuid_idx
    ON events_permanent ((coalesce(data->>'uuid', data->>'accelerator_uuid')), tx_id, global_position)
    WHERE event_class = 'lifecycle';
CREATE INDEX IF NOT EXISTS events_permanent_gpu_failed_idx
    ON events_permanent (global_position)
    WHERE event_type = 'ACCELERATOR_HEALTH_CHANGED' AND data->>'after' = 'failed';
-- The read models of one GPU UUID: one row per node it was ever in.
CREATE INDEX IF NOT EXISTS hw_accelerators_uuid_idx ON hw_accelerators (uuid);
