"""Experiments, not product code: each applies one proposed product change outside the product
(a subclass, or a monkeypatch in the benchmark's own server process) to estimate its effect with
the same harness. They lean on product internals and may need updating when the product changes."""
