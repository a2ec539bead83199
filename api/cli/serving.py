"""`modelforge-hw serve`: the API server, every option of it a setting (flag, else variable, else
default)."""

from __future__ import annotations

from typing import Annotated

from api.cli.common import (
    CollectorTimeout,
    DatabaseUrl,
    LogLevel,
    NodeId,
    RetentionHours,
    StateDir,
    server_config,
)
from runtime.options import setting_option

Host = Annotated[str | None, setting_option("host")]
Port = Annotated[int | None, setting_option("port")]
StartupRefresh = Annotated[bool | None, setting_option("startup_refresh")]
StaleAfter = Annotated[float | None, setting_option("stale_after")]
OfflineAfter = Annotated[float | None, setting_option("offline_after")]
RetentionInterval = Annotated[float | None, setting_option("retention_interval")]
TelemetryHoursInterval = Annotated[float | None, setting_option("telemetry_hours_interval")]
RenderedReadsMib = Annotated[int | None, setting_option("rendered_reads_mib")]
StateCacheStreams = Annotated[int | None, setting_option("state_cache_streams")]
ReportTransactions = Annotated[int | None, setting_option("report_transactions")]
ReadDatabaseUrl = Annotated[str | None, setting_option("read_database_url")]


def serve(
    database_url: DatabaseUrl = None,
    state_dir: StateDir = None,
    log_level: LogLevel = None,
    host: Host = None,
    port: Port = None,
    node_id: NodeId = None,
    startup_refresh: StartupRefresh = None,
    collector_timeout: CollectorTimeout = None,
    stale_after: StaleAfter = None,
    offline_after: OfflineAfter = None,
    retention_hours: RetentionHours = None,
    retention_interval: RetentionInterval = None,
    telemetry_hours_interval: TelemetryHoursInterval = None,
    rendered_reads_mib: RenderedReadsMib = None,
    state_cache_streams: StateCacheStreams = None,
    report_transactions: ReportTransactions = None,
    read_database_url: ReadDatabaseUrl = None,
) -> int:
    """run the API server"""
    from api.http.server import serve as run_server

    return run_server(
        server_config(
            database_url=database_url,
            state_dir=state_dir,
            log_level=log_level,
            host=host,
            port=port,
            node_id=node_id,
            startup_refresh=startup_refresh,
            collector_timeout=collector_timeout,
            stale_after=stale_after,
            offline_after=offline_after,
            retention_hours=retention_hours,
            retention_interval=retention_interval,
            telemetry_hours_interval=telemetry_hours_interval,
            rendered_reads_mib=rendered_reads_mib,
            state_cache_streams=state_cache_streams,
            report_transactions=report_transactions,
            read_database_url=read_database_url,
        )
    )
