#!/bin/sh
# Entrypoint of deploy/ha/compose.yaml's database containers (`monitor` or `node`). Until the
# container's node is created it creates it: the monitor, or a PostgreSQL node that the monitor
# makes the primary (the first to register) or the secondary (the other, copied from the primary
# by pg_basebackup). Then, on every start, it runs pg_autoctl, which from then on starts, stops,
# promotes, demotes and re-joins PostgreSQL as the monitor decides. `ready` is the containers'
# healthcheck: the node is created and PostgreSQL answers.
#
# Environment: PGAF_HOSTNAME (this container's name on the network, required),
# PGAF_AUTOCTL_NODE_PASSWORD (the monitor's autoctl_node role, required), and for nodes
# PGAF_REPLICATION_PASSWORD and POSTGRES_PASSWORD (the modelforge role); PGAF_MONITOR_HOST
# and PGAF_MONITOR_PORT (default monitor, 5432), PGAF_PORT (this node's, default 5432), PGAF_NAME
# (the node's name on the monitor, default PGAF_HOSTNAME). Passwords
# must be URL-safe: they go into the monitor's URL.
set -eu

role=${1:-node}
: "${PGDATA:?}" "${PGAF_HOSTNAME:?set PGAF_HOSTNAME}" "${PGAF_AUTOCTL_NODE_PASSWORD:?set PGAF_AUTOCTL_NODE_PASSWORD}"
port=${PGAF_PORT:-5432}
config="${XDG_CONFIG_HOME:-$HOME/.config}/pg_autoctl${PGDATA}/pg_autoctl.cfg"
state="${XDG_DATA_HOME:-$HOME/.local/share}/pg_autoctl${PGDATA}/pg_autoctl.state"
init="${XDG_DATA_HOME:-$HOME/.local/share}/pg_autoctl${PGDATA}/pg_autoctl.init"
# Written once this script's own steps after pg_autoctl's are done too. A start that stopped
# before it (the container killed, the monitor away) creates again: pg_autoctl create resumes
# where it stopped, and every statement below can run twice.
created="${config%/*}/modelforge-created"

# Statements on this node's PostgreSQL, started for them alone and listening on no address;
# passwords reach psql as variables, never inside the SQL text.
local_sql() {
  database=$1
  shift
  pg_ctl -D "$PGDATA" -w -t 60 -o "-c listen_addresses=''" start >/dev/null
  psql -X -q -v ON_ERROR_STOP=1 -p "$port" -d "$database" "$@"
  pg_ctl -D "$PGDATA" -w -t 60 -m fast stop >/dev/null
}

case "$role" in
  ready)
    # While creating, PostgreSQL answers too (and restarts): a node that registered then, or
    # copied the primary then, would fail. Hence the mark first.
    [ -f "$created" ] && exec pg_isready -q -h 127.0.0.1 -p "$port"
    exit 1
    ;;
  monitor)
    if [ ! -f "$created" ]; then
      pg_autoctl create monitor --hostname "$PGAF_HOSTNAME" --pgport "$port" \
        --auth scram-sha-256 --ssl-self-signed
      # pg_autoctl sets no password: the nodes' one, before any of them registers.
      echo "ALTER ROLE autoctl_node PASSWORD :'pw';" |
        local_sql pg_auto_failover -v pw="$PGAF_AUTOCTL_NODE_PASSWORD"
      touch "$created"
    fi
    ;;
  node)
    : "${PGAF_REPLICATION_PASSWORD:?set PGAF_REPLICATION_PASSWORD}" "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
    if [ ! -f "$created" ]; then
      # pg_autoctl writes its state file before registering with the monitor, its init file
      # after, and when the monitor then fails the COMMIT (it restarted) it removes the state
      # file alone: every later try would read the state it never got. The monitor does not
      # know the node, so its registration starts over.
      if [ -f "$init" ] && [ ! -f "$state" ]; then
        rm -f "$init"
      fi
      monitor="postgresql://autoctl_node:${PGAF_AUTOCTL_NODE_PASSWORD}@${PGAF_MONITOR_HOST:-monitor}:${PGAF_MONITOR_PORT:-5432}/pg_auto_failover"
      # A secondary's pg_basebackup authenticates with the replication password.
      PGPASSWORD=$PGAF_REPLICATION_PASSWORD pg_autoctl create postgres \
        --name "${PGAF_NAME:-$PGAF_HOSTNAME}" --hostname "$PGAF_HOSTNAME" --pgport "$port" --dbname modelforge \
        --auth scram-sha-256 --ssl-self-signed --pg-hba-lan --monitor "$monitor"
      pg_autoctl config set replication.password "$PGAF_REPLICATION_PASSWORD" >/dev/null
      if [ ! -f "$PGDATA/standby.signal" ]; then
        # The primary: roles and settings, which the secondary then copies.
        local_sql modelforge -v replication="$PGAF_REPLICATION_PASSWORD" -v app="$POSTGRES_PASSWORD" <<'SQL'
ALTER ROLE pgautofailover_replicator PASSWORD :'replication';
SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'modelforge') AS absent \gset
\if :absent
CREATE ROLE modelforge LOGIN;
\endif
ALTER ROLE modelforge PASSWORD :'app';
ALTER DATABASE modelforge OWNER TO modelforge;
GRANT ALL ON SCHEMA public TO modelforge;
-- A commit returns once the standby has applied it: nothing acknowledged is lost on failover.
ALTER SYSTEM SET synchronous_commit = 'remote_apply';
SQL
      fi
      touch "$created"
    fi
    ;;
  *)
    echo "usage: pgaf-entrypoint.sh monitor | node | ready" >&2
    exit 2
    ;;
esac
exec pg_autoctl run
