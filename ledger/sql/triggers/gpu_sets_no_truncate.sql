-- Nor emptied: a TRUNCATE of the GPU sets is refused as one of the log is.
CREATE OR REPLACE TRIGGER gpu_sets_no_truncate
    BEFORE TRUNCATE ON gpu_sets
    FOR EACH STATEMENT EXECUTE FUNCTION mf_refuse_truncate();
