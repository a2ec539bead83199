-- The log's day segments: one partition of `events` per UTC day of received observations,
-- created ahead of time so that appends never wait for one (ledger/segments.py). A partition is
-- made as a table of its own and then attached, which locks `events` only against other DDL
-- (SHARE UPDATE EXCLUSIVE), never against appends or reads. Returns the days it created.
-- format('%I') quotes the partition's name: a statement cannot take a table name as a parameter.
CREATE OR REPLACE FUNCTION mf_ensure_segments(p_from date, p_to date)
RETURNS SETOF date
LANGUAGE plpgsql AS $$
DECLARE
    v_day   date;
    v_name  text;
BEGIN
    -- Two servers making the same day: the second waits, then finds it made.
    PERFORM pg_advisory_xact_lock(7305820114);
    FOR v_day IN SELECT d::date FROM generate_series(p_from, p_to, interval '1 day') d LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM event_segments WHERE day = v_day);
        v_name := 'events_d' || to_char(v_day, 'YYYYMMDD');
        EXECUTE format('CREATE TABLE %I (LIKE events INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                       'INCLUDING COMPRESSION)', v_name);
        EXECUTE format('ALTER TABLE events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       v_name, v_day, v_day + 1);
        INSERT INTO event_segments (day, partition) VALUES (v_day, v_name);
        RETURN NEXT v_day;
    END LOOP;
END;
$$;
