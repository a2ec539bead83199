#!/usr/bin/env bash
# Failover by pg_auto_failover instead of an operator's `pg_ctl promote` (Debian packages
# postgresql-15-auto-failover and pg-auto-failover-cli). A monitor on a third host, then the two
# database hosts; the monitor promotes the secondary when the primary stops answering, sets
# synchronous_standby_names itself (number_sync_standbys), and re-joins the old primary with
# pg_rewind when it comes back. Run each block on its host as the postgres user.
set -euo pipefail
MONITOR_HOST=${MONITOR_HOST:-10.0.0.10}

case "${1:?monitor | node}" in
  monitor)
    pg_autoctl create monitor --pgdata /var/lib/postgresql/monitor --hostname "$MONITOR_HOST" \
      --auth scram-sha-256 --ssl-self-signed --run
    ;;
  node)
    # First run makes the primary, second run (the other host) a secondary by pg_basebackup.
    pg_autoctl create postgres --pgdata /var/lib/postgresql/15/ha --hostname "$(hostname -I | cut -d' ' -f1)" \
      --dbname modelforge --monitor "postgres://autoctl_node@$MONITOR_HOST/pg_auto_failover" \
      --auth scram-sha-256 --ssl-self-signed --replication-quorum true --run
    ;;
esac
# The server's URL is the one `pg_autoctl show uri --formation default` prints: both hosts and
# target_session_attrs=read-write, exactly the form docs/operations/HIGH_AVAILABILITY.md uses.
