-- Version 20: a decommissioned node keeps when its last report was received (hw_nodes,
-- final_received_at): the decommission removes its telemetry row, which held that time, and the
-- node then read as never seen after its first discovery. The inventory read model's version 7
-- fills the column on the rebuild that follows (docs/upgrades.md).
ALTER TABLE hw_nodes ADD COLUMN final_received_at timestamptz;
