-- 0.5: a GPU's latest telemetry row no longer copies its sample (metrics, health signals); it
-- keeps the times and the position of the event that holds it, and readers take the sample from
-- that event (schema.sql, mf_accelerator_sample). Parsing and writing every report's eight
-- samples a second time was 10-18 % of PostgreSQL's CPU and 29 % of the WAL per report
-- (docs/performance.md, issue 12, eighth step). The other columns are as they were, so the rows
-- stay valid; a database created by this release has the narrower table from schema.sql already.
ALTER TABLE hw_accelerator_telemetry DROP COLUMN IF EXISTS metrics;
ALTER TABLE hw_accelerator_telemetry DROP COLUMN IF EXISTS health_signals;
