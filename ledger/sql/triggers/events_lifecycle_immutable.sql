-- Lifecycle events are permanent: an UPDATE or DELETE of one is refused. A row trigger on the
-- partitioned log is cloned onto every segment, the day segments made later included.
CREATE OR REPLACE TRIGGER events_lifecycle_immutable
    BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW WHEN (OLD.event_class = 'lifecycle')
    EXECUTE FUNCTION mf_refuse_lifecycle_change();
