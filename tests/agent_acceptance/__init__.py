"""The outbound agent, enrollment and the report protocol, end to end (conftest.py says how)."""
