-- Version 23: the inventory read model's version 8 keeps each GPU's latest sample beside its
-- accelerators in a node's folded state (docs/architecture.md, "Read models"). Nothing in the
-- tables changes; the step records that the checkpoints are of a shape a server of an earlier
-- release cannot decode, so such a server refuses the database (docs/upgrades.md). `migrate`
-- rebuilds the read model from the log after the step, as for every change of its version.
COMMENT ON COLUMN projection_state.state IS
    'A stream''s folded state (projections/framework.py); the inventory''s keeps each GPU''s latest sample beside its accelerators.';
