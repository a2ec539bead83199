"""The peer of bench/ledger.py: the same reports through the `eventsourcing` library's PostgreSQL
persistence (psycopg 3, synchronous; `pip install -e '.[bench]'`), one thread per writer."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import msgspec

from bench.ledger_workload import POOL, Node, Report


def run_threads(parts: list[list[Report]], worker: Callable[[list[Report]], None]) -> None:
    """One thread per task, started together (the peer's API is synchronous)."""
    errors: list[BaseException] = []

    def one(task: list[Report]) -> None:
        try:
            worker(task)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(task,)) for task in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _pg_env(dsn: str) -> dict[str, str]:
    u = urlsplit(dsn)
    return {
        "POSTGRES_DBNAME": u.path.lstrip("/"),
        "POSTGRES_HOST": u.hostname or "127.0.0.1",
        "POSTGRES_PORT": str(u.port or 5432),
        "POSTGRES_USER": unquote(u.username or "postgres"),
        "POSTGRES_PASSWORD": unquote(u.password or ""),
    }


class PeerRecorder:
    """eventsourcing's PostgresApplicationRecorder: 10 StoredEvents per insert_events."""

    def __init__(self, dsn: str, nodes: list[Node]) -> None:
        from eventsourcing.postgres import PostgresApplicationRecorder, PostgresDatastore

        env = _pg_env(dsn)
        self.datastore = PostgresDatastore(
            dbname=env["POSTGRES_DBNAME"],
            host=env["POSTGRES_HOST"],
            port=env["POSTGRES_PORT"],
            user=env["POSTGRES_USER"],
            password=env["POSTGRES_PASSWORD"],
            pool_size=POOL,
            max_overflow=0,
        )
        self.recorder = PostgresApplicationRecorder(self.datastore, events_table_name="bench_stored_events")
        self.recorder.create_table()
        self.version = {n.node_id: 0 for n in nodes}
        self.ids = {n.node_id: uuid.UUID(n.node_id) for n in nodes}

    def worker(self, reports: list[Report]) -> None:
        from eventsourcing.persistence import StoredEvent

        encode = msgspec.json.encode
        for r in reports:
            v = self.version[r.node_id]
            oid = self.ids[r.node_id]
            stored = []
            for e in r.events:
                v += 1
                state = encode(
                    {"data": msgspec.Raw(encode(e.payload)), "metadata": msgspec.Raw(encode(e.metadata))}
                )
                stored.append(
                    StoredEvent(originator_id=oid, originator_version=v, topic=e.event_type, state=state)
                )
            self.recorder.insert_events(stored)
            self.version[r.node_id] = v

    def close(self) -> None:
        self.datastore.close()


class PeerApplication:
    """eventsourcing's Application API: an aggregate per node, 2 events per `save`."""

    def __init__(self, dsn: str, nodes: list[Node]) -> None:
        from eventsourcing.application import Application
        from eventsourcing.domain import Aggregate, event

        class NodeAggregate(Aggregate):
            @event("Reported")
            def report(self, event_type: str, data: dict[str, Any], metadata: dict[str, Any]) -> None:
                pass

        class Inventory(Application[uuid.UUID]):
            pass

        env = {
            "PERSISTENCE_MODULE": "eventsourcing.postgres",
            "POSTGRES_POOL_SIZE": str(POOL),
            "POSTGRES_MAX_OVERFLOW": "0",
            "CREATE_TABLE": "y",
            **_pg_env(dsn),
        }
        self.app = Inventory(env=env)
        self.aggregates: dict[str, Any] = {}
        for n in nodes:
            agg = NodeAggregate()
            self.app.save(agg)
            self.aggregates[n.node_id] = agg

    def worker(self, reports: list[Report]) -> None:
        to_builtins = msgspec.to_builtins
        for r in reports:
            agg = self.aggregates[r.node_id]
            for e in r.events:
                agg.report(e.event_type, to_builtins(e.payload), to_builtins(e.metadata))
            self.app.save(agg)

    def close(self) -> None:
        self.app.close()
