"""Use cases of the hardware plane, with no HTTP and no argparse: inventory (local refresh),
the agent plane (enrollment, credentials, reports), work leases and decommission; the read side
(`reads`), the as-of reads (`audit`) and /metrics (`metrics`). Each command on a node runs as one
unit of work (`ledger.unit_of_work`); errors are the typed `api.services.errors`."""
