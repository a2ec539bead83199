-- The permanent segment holds every lifecycle event: it cannot be truncated on its own either.
-- (Day segments hold observations only; retention detaches and drops them whole.)
CREATE OR REPLACE TRIGGER events_permanent_no_truncate
    BEFORE TRUNCATE ON events_permanent
    FOR EACH STATEMENT EXECUTE FUNCTION mf_refuse_truncate();
