-- The change feed (ledger/feed.py): wake waiting readers when events commit (trigger
-- events_notify_log, once per append statement; PostgreSQL delivers the notification at commit
-- and folds duplicates within a transaction). It only wakes readers: the gap-safe read still
-- decides what they receive.
--
-- Only while some process listens (mf_feed_listeners): a transaction that notifies takes a lock
-- shared by the whole cluster at its commit and holds it through its WAL flush, so notifying
-- appenders commit one at a time, and servers sharing a database would halve each other's ingest
-- (docs/performance.md). A registration counts only while its backend lives: the pid and the
-- start time of a live backend both match, so a reused pid does not.
CREATE OR REPLACE FUNCTION mf_notify_log() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM mf_feed_listeners l JOIN pg_stat_activity a
               ON a.pid = l.pid AND a.backend_start = l.backend_start) THEN
        PERFORM pg_notify('mf_log', '');
    END IF;
    RETURN NULL;
END
$$;
