-- The event log is never truncated, whole or a segment at a time: retention drops a day segment
-- only after detaching it (triggers events_no_truncate, events_permanent_no_truncate).
CREATE OR REPLACE FUNCTION mf_refuse_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the event log cannot be truncated' USING ERRCODE = 'restrict_violation';
END;
$$;
