"""The read side: what the API, the console and the CLI show of the read models, one kind of read
per module (`nodes`, `accelerators`, `fleet`, `events`, `health`), gathered by `repository`
(`HardwareRepository`). Their statements are fixed fragments with numbered parameters
(`statement`), a node's liveness is judged by one SQL rule (`liveness`), the bodies they answer
with are in `bodies`, their cursors in `cursors`. The two hot reads are kept rendered between
changes (`hot`, `rendered`, `rendering`)."""
