#!/bin/sh
# Entrypoint of deploy/ha/compose.yaml's database containers (`monitor` or `node`). On the
# container's first start it creates its pg_auto_failover node: the monitor, or a PostgreSQL node
# that the monitor makes the primary (the first to register) or the secondary (the other, copied
# from the primary by pg_basebackup). Then, on every start, it runs pg_autoctl, which from then on
# starts, stops, promotes, demotes and re-joins PostgreSQL as the monitor decides.
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
  monitor)
    if [ ! -f "$config" ]; then
      pg_autoctl create monitor --hostname "$PGAF_HOSTNAME" --pgport "$port" \
        --auth scram-sha-256 --ssl-self-signed
      # pg_autoctl sets no password: the nodes' one, before any of them registers.
      echo "ALTER ROLE autoctl_node PASSWORD :'pw';" |
        local_sql pg_auto_failover -v pw="$PGAF_AUTOCTL_NODE_PASSWORD"
    fi
    ;;
  node)
    : "${PGAF_REPLICATION_PASSWORD:?set PGAF_REPLICATION_PASSWORD}" "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
    if [ ! -f "$config" ]; then
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
CREATE ROLE modelforge LOGIN PASSWORD :'app';
ALTER DATABASE modelforge OWNER TO modelforge;
GRANT ALL ON SCHEMA public TO modelforge;
-- A commit returns once the standby has applied it: nothing acknowledged is lost on failover.
ALTER SYSTEM SET synchronous_commit = 'remote_apply';
SQL
      fi
    fi
    ;;
  *)
    echo "usage: pgaf-entrypoint.sh monitor | node" >&2
    exit 2
    ;;
esac
exec pg_autoctl run
