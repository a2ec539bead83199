-- Wake the change feed's readers once per append statement (mf_notify_log).
CREATE OR REPLACE TRIGGER events_notify_log
    AFTER INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION mf_notify_log();
