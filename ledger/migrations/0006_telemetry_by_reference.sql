-- Version 6: a GPU's latest telemetry row keeps no copy of its sample (metrics, health signals):
-- it keeps the times and the position of the event that holds it, and readers take the sample
-- from that event (mf_accelerator_sample, mf_samples). Parsing and writing every report's eight
-- samples a second time costs 10-18 % of PostgreSQL's CPU and 29 % of the WAL per report
-- (docs/performance.md). The other columns stay as they are, so the rows stay valid.
ALTER TABLE hw_accelerator_telemetry DROP COLUMN IF EXISTS metrics;
ALTER TABLE hw_accelerator_telemetry DROP COLUMN IF EXISTS health_signals;

-- What a version-6 database has besides, where a version-5 database may lack it; each statement
-- changes nothing where its object is there already.

-- The change feed's listeners (schema.sql, mf_notify_log). A table with a `since` column is of a
-- development build; its registrations are only ever live ones, so it is simply made again.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema()
               AND table_name = 'mf_feed_listeners' AND column_name = 'since') THEN
        DROP TABLE mf_feed_listeners;
    END IF;
END;
$$;
CREATE TABLE IF NOT EXISTS mf_feed_listeners (
    pid            integer PRIMARY KEY,
    backend_start  timestamptz NOT NULL
);

-- The rows every agent report rewrites keep room on their pages, and the folded state stays in
-- its row (schema.sql says why). The settings apply to the pages written from now on; the tables
-- converge as rows are rewritten, and `rebuild` writes them anew at once.
ALTER TABLE projection_state SET (fillfactor = 50, toast_tuple_target = 8160);
ALTER TABLE hw_accelerator_telemetry SET (fillfactor = 50);
ALTER TABLE hw_host_telemetry SET (fillfactor = 50);
ALTER TABLE hw_node_storage SET (fillfactor = 50);
ALTER TABLE hw_inventory_runs SET (fillfactor = 50);
ALTER TABLE hw_nodes SET (fillfactor = 50);
ALTER TABLE agent_stream_positions SET (fillfactor = 50);
