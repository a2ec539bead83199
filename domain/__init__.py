"""The hardware domain: pure decisions over observations and events (node fold, reconcile, GPU
health rules, decommission decisions). No I/O; the event store never imports it."""
