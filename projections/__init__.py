"""Read models: pure folds per stream and their PostgreSQL tables; rebuild and verify."""
