"""The outbound compute-node agent."""
