-- The GPU sets the log's compact snapshots name are never changed nor removed.
CREATE OR REPLACE TRIGGER gpu_sets_immutable
    BEFORE UPDATE OR DELETE ON gpu_sets
    FOR EACH ROW EXECUTE FUNCTION mf_refuse_gpu_set_change();
