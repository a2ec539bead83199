"""The central server: HTTP API, services and the operator CLI."""
