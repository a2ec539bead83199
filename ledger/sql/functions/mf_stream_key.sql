-- A stream's key in the log's indexes by stream (schema.sql): eight bytes in place of the stream
-- id's 36 characters (a UUID), so that each snapshot's entries in them are about half as wide.
-- Two streams may share a key; every read by one of these indexes also names the stream id,
-- which PostgreSQL checks on the rows the index finds. The indexes hold what this function
-- returned when each row was appended: its body never changes (a new body would take a numbered
-- step that rebuilds them).
CREATE OR REPLACE FUNCTION mf_stream_key(p_stream_id text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT hashtextextended(p_stream_id, 0) $$;
