"""How a process that hosts the ledger's write path runs Python's garbage collector: the server
(`serve`) and the ledger's benchmark, which runs `EventStore` in its own process, alike."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import structlog

log = structlog.get_logger(__name__)

# Young-generation collections after this many new container objects (the default is 700): a
# report decodes into a few thousand (msgspec Structs, lists, dicts), nearly all freed by their
# reference counts at once, so at 700 the collector ran several times per report over the
# reports still in flight. Older generations every 20 and 100 of the younger (10 and 10).
GC_THRESHOLDS = (20_000, 20, 100)


def settle_garbage_collector() -> None:
    """Once the process is set up (the server: its app built and the database migrated): what
    exists now (modules, the app, its routes and schemas, hundreds of thousands of objects) lives
    as long as the process, so it is moved out of the collector's sight (`gc.freeze`), and the
    thresholds raised. With Python's defaults the collector takes a quarter of the server's CPU
    per report (`bench.ingest` profiled with py-spy --native); measured effect in
    docs/performance.md. Cycles are still collected, only less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    log.info("process.gc_settled", frozen_objects=gc.get_freeze_count(), thresholds=list(GC_THRESHOLDS))


_deferring = 0
_thresholds_before: tuple[int, int, int] = GC_THRESHOLDS


@contextmanager
def older_collections_deferred() -> Iterator[None]:
    """Around one bulk job whose hundreds of thousands of objects live as long as it does (a
    fleet's `/metrics` scrape: a row per GPU and its decoded samples): the collections of the
    older generations wait until it ends, the young one's go on. Each older pass went over all
    of the job's objects with the event loop held (70-280 ms per pass, 10,000 nodes x 8 GPUs;
    docs/performance.md), and there is no garbage among them: they are freed by their reference
    counts when the job ends. Jobs may overlap; the thresholds come back when the last ends."""
    global _deferring, _thresholds_before
    if _deferring == 0:
        _thresholds_before = gc.get_threshold()
        young, _older, oldest = _thresholds_before
        gc.set_threshold(young, 1_000_000_000, oldest)
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if _deferring == 0:
            gc.set_threshold(*_thresholds_before)


class DeferredCollections:
    """`older_collections_deferred` across a boundary a `with` cannot span: a response streamed
    after its handler has returned. The collections are deferred from construction until
    `end()`, which restores them once; dropping the object without `end()` (a response never
    sent) restores them too. End it only once the job's objects are gone: the first older pass
    after it goes over every one still alive, with the event loop held (a fleet's scrape at
    10,000 nodes: hundreds of milliseconds)."""

    def __init__(self) -> None:
        self._deferral: AbstractContextManager[None] | None = older_collections_deferred()
        self._deferral.__enter__()

    def end(self) -> None:
        deferral, self._deferral = self._deferral, None
        if deferral is not None:
            deferral.__exit__(None, None, None)

    def __del__(self) -> None:
        self.end()
