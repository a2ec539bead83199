-- The log cannot be truncated (a statement trigger on the partitioned table covers a TRUNCATE of
-- it, not of one of its partitions: events_permanent_no_truncate covers that one).
CREATE OR REPLACE TRIGGER events_no_truncate
    BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION mf_refuse_truncate();
