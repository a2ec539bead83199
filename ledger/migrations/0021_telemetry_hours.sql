-- Version 21: telemetry hours, the history reads' columns of each closed hour of a node's
-- snapshots (ledger/telemetry_hours.py). Empty at the upgrade: the server stores the retained
-- hours in the background, the newest first, and reads the log for an hour not stored yet.
CREATE TABLE telemetry_hours (
    node_id       text NOT NULL,
    hour          timestamptz NOT NULL,
    subject       text NOT NULL,
    format        smallint NOT NULL,
    observations  integer NOT NULL,
    body          bytea,
    PRIMARY KEY (node_id, hour, subject)
);
-- lz4 where this PostgreSQL has it.
DO $$
BEGIN
    ALTER TABLE telemetry_hours ALTER COLUMN body SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN NULL;
END;
$$;
