"""What every process of the hardware plane needs before it does anything: settings, structured
logs, process tuning and the embedded-PostgreSQL supervisor. Imports nothing of ours."""
