#!/usr/bin/env bash
# Make this host a hot standby of PRIMARY (docs/operations/HIGH_AVAILABILITY.md, "Set-up").
# Run as root on the standby host, with PostgreSQL 15 installed and its cluster stopped:
#   PRIMARY=10.0.0.11 deploy/ha/make-standby.sh
set -euo pipefail
PRIMARY=${PRIMARY:?the primary host}
DATA=${DATA:-/var/lib/postgresql/15/main}
SLOT=${SLOT:-mf_standby}
# The slot keeps the WAL the standby has not received yet (also across its restarts).
sudo -u postgres psql -h "$PRIMARY" -U replicator -d postgres -Atc \
  "SELECT pg_create_physical_replication_slot('$SLOT') WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = '$SLOT')"
systemctl stop postgresql@15-main
rm -rf "$DATA"
# -R writes standby.signal and primary_conninfo (with application_name, the name the primary's
# synchronous_standby_names waits for); -S streams through the slot.
sudo -u postgres pg_basebackup -d "host=$PRIMARY user=replicator application_name=mf_standby" \
  -D "$DATA" -R -S "$SLOT" -X stream --checkpoint=fast --progress
systemctl start postgresql@15-main
sudo -u postgres psql -h "$PRIMARY" -U replicator -d postgres -Atc \
  "SELECT application_name, state, sync_state FROM pg_stat_replication"
