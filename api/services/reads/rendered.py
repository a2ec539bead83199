"""Rendered reads: a read's JSON rendered once per change of what it shows, and never stale.

A node or a page of accelerators changes only when its node's stream does (an agent report every
few seconds at most), so its rendered bytes and their ETag (`api.services.reads.rendering`) are
kept, keyed by the read, with the streams they were built from. Every request first joins a
**probe** of the log (`ledger.changes.read_changes`) that starts after the request arrived: the
probe's answer drops every kept rendering whose streams got events since the previous probe (all
of them after a `rebuild`). A request therefore sees every commit that happened before it
arrived, on this server or any other, exactly as a query of its own would; what it saves is the
query, the decode and the encode. Concurrent requests share one probe (one in flight, the next
one gathering whoever arrives meanwhile), so under load a probe costs a fraction of a round trip
per request.

Four further rules keep a kept rendering true:
  * A rendering made after probe `e` is kept only if none of its streams changed in a probe after
    `e` (a change the rendering's own query may have missed); otherwise it is served once and
    dropped.
  * What the clock decides (a node's liveness) is kept only until the moment the verdict would
    change (`until`).
  * Memory is bounded (`max_bytes`, least recently used go first; the server's
    `MODELFORGE_RENDERED_READS_MIB`, 0 keeps nothing); a miss costs a query, a decode and an encode.
  * A probe reads at most `probe_limit` events; when more came since the previous one, every
    rendering is dropped (the probe cannot tell which streams the rest were on).

A probe that fails fails its requests, as their queries would have: nothing is served unchecked.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from datetime import UTC, datetime

import asyncpg
import structlog

from api.services.reads.rendering import Loaded, Rendered
from ledger.changes import DEFAULT_LIMIT, ChangeMark, read_changes
from runtime.settings import default

log = structlog.get_logger(__name__)

DEFAULT_MAX_BYTES = int(default("rendered_reads_mib")) * 2**20
# Past this many remembered stream changes the memory is cleared (renderings still being made are
# then not kept): the map only serves renderings in flight.
_MAX_REMEMBERED_CHANGES = 100_000


class _Kept:
    __slots__ = ("rendered", "streams", "until")

    def __init__(self, rendered: Rendered, streams: frozenset[str] | None, until: datetime | None) -> None:
        self.rendered = rendered
        self.streams = streams  # None: built from every stream (a page of the whole fleet)
        self.until = until


class RenderedReads:
    def __init__(
        self, pool: asyncpg.Pool, *, max_bytes: int = DEFAULT_MAX_BYTES, probe_limit: int = DEFAULT_LIMIT
    ) -> None:
        self.pool = pool
        self.max_bytes = max_bytes
        self.probe_limit = probe_limit
        self._kept: OrderedDict[Hashable, _Kept] = OrderedDict()
        self._bytes = 0
        self._by_stream: dict[str, set[Hashable]] = {}
        self._wide: set[Hashable] = set()
        self._mark: ChangeMark | None = None
        self._rebuilt_at: datetime | None = None
        self._epoch = 0
        self._changed_at: dict[str, int] = {}  # stream -> the last probe that saw it change
        self._any_change_at = 0  # the last probe that saw any stream change
        self._cleared_at = 0  # the last probe after which nothing older may be kept
        self._next: asyncio.Future[int] | None = None  # the probe that arrivals join
        self._prober: asyncio.Task[None] | None = None
        self._server_started: datetime | None = None  # the server the mark was taken on
        # Observability (the server's /metrics).
        self.hits = 0
        self.misses = 0
        self.probes = 0

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    # --- the probe -------------------------------------------------------------------------------

    async def fresh(self) -> int:
        """Wait for a probe that starts after this call and apply what it found; its number."""
        # The loop only when a probe or its task is made: most requests join the one waiting, and
        # Python 3.11's get_running_loop() asks the kernel for the process id on every call (a
        # tenth of a kept read's server CPU on a VM, docs/performance.md).
        waiting = self._next
        if waiting is None:
            waiting = self._next = asyncio.get_running_loop().create_future()
            # A probe nobody waits for any more (the clients went away) must not warn.
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
        if self._prober is None:
            self._prober = asyncio.get_running_loop().create_task(self._probe_while_waited())
        return await asyncio.shield(waiting)

    async def _probe_while_waited(self) -> None:
        # One connection for the probes of a busy spell, back to the pool when nobody waits: an
        # acquire and a release per probe cost a third of the probe's server CPU.
        conn: asyncpg.Connection | None = None
        try:
            while self._next is not None:
                # Whoever arrives from here on waits for the next probe: this one's snapshot is
                # taken after every one of its waiters arrived.
                waiting, self._next = self._next, None
                try:
                    if conn is None:
                        conn = await self.pool.acquire()
                        await self._same_server(conn)
                    epoch = await self._probe(conn)
                except Exception as exc:
                    waiting.set_exception(exc)
                    if conn is not None:  # perhaps broken: the pool checks it, the next probe takes another
                        held, conn = conn, None
                        await self.pool.release(held)
                    continue
                except BaseException:
                    # Cancelled (the server stops): nobody may be left waiting for a probe.
                    waiting.cancel()
                    if self._next is not None:
                        self._next.cancel()
                        self._next = None
                    raise
                waiting.set_result(epoch)
        finally:
            self._prober = None
            if conn is not None:
                await self.pool.release(conn)

    async def _same_server(self, conn: asyncpg.Connection) -> None:
        """A mark holds for the server that took it. Another one (a standby promoted after a
        failover, a restarted server) may hand out again transaction ids the mark counts as
        seen (those the old primary used but never replicated), so its first probe starts afresh."""
        started = await conn.fetchval("SELECT pg_postmaster_start_time()")
        if self._server_started is not None and started != self._server_started:
            log.info("rendered.server_changed", renderings=len(self._kept))
            self._mark = None
        self._server_started = started

    async def _probe(self, conn: asyncpg.Connection) -> int:
        changes = await read_changes(conn, self._mark, limit=self.probe_limit)
        self.probes += 1
        self._epoch += 1
        epoch = self._epoch
        if self._mark is None or not changes.complete or changes.rebuilt_at != self._rebuilt_at:
            # The first probe (nothing known yet), more changes than a probe reads, or the read
            # models were swapped: nothing kept can be trusted.
            if self._mark is not None:
                log.info(
                    "rendered.cleared",
                    reason="rebuilt" if changes.rebuilt_at != self._rebuilt_at else "too_many_changes",
                    renderings=len(self._kept),
                )
            self.clear(epoch)
        else:
            for stream in changes.streams:
                self._changed_at[stream] = epoch
                for key in self._by_stream.pop(stream, ()):
                    self._drop(key)
            if changes.streams:
                self._any_change_at = epoch
                for key in list(self._wide):
                    self._drop(key)
            if len(self._changed_at) > _MAX_REMEMBERED_CHANGES:
                self._changed_at.clear()
                self._cleared_at = epoch
        self._mark, self._rebuilt_at = changes.mark, changes.rebuilt_at
        return epoch

    def clear(self, epoch: int | None = None) -> None:
        """Drop every rendering (and keep none made before probe `epoch`)."""
        self._kept.clear()
        self._by_stream.clear()
        self._wide.clear()
        self._changed_at.clear()
        self._bytes = 0
        self._cleared_at = self._epoch if epoch is None else epoch

    # --- reads -----------------------------------------------------------------------------------

    async def read(
        self,
        key: Hashable,
        streams: frozenset[str] | None,
        load: Callable[[], Awaitable[Loaded | None]],
    ) -> Rendered | None:
        """The rendering of `key`, built by `load` from `streams` (None: from every stream) when
        none is kept; None when `load` finds nothing (not kept: the next read asks again)."""
        if self.max_bytes <= 0:
            return None if (loaded := await load()) is None else loaded[0]  # keeping nothing: no probe
        epoch = await self.fresh()
        kept = self._kept.get(key)
        if kept is not None:
            if kept.until is None or datetime.now(UTC) < kept.until:
                self._kept.move_to_end(key)
                self.hits += 1
                return kept.rendered
            self._drop(key)
        self.misses += 1
        loaded = await load()
        if loaded is None:
            return None
        rendered, until = loaded
        self._keep(key, epoch, streams, rendered, until)
        return rendered

    def _keep(
        self,
        key: Hashable,
        epoch: int,
        streams: frozenset[str] | None,
        rendered: Rendered,
        until: datetime | None,
    ) -> None:
        # Made after probe `epoch`: keep it only if no later probe saw one of its streams change.
        if self._cleared_at > epoch:
            return
        if streams is None:
            if self._any_change_at > epoch:
                return
        elif any(self._changed_at.get(s, 0) > epoch for s in streams):
            return
        size = len(rendered.body)
        if size > self.max_bytes // 4:
            return
        self._drop(key)
        self._kept[key] = _Kept(rendered, streams, until)
        self._bytes += size
        if streams is None:
            self._wide.add(key)
        else:
            for s in streams:
                self._by_stream.setdefault(s, set()).add(key)
        while self._bytes > self.max_bytes and self._kept:
            oldest = next(iter(self._kept))
            self._drop(oldest)

    def _drop(self, key: Hashable) -> None:
        kept = self._kept.pop(key, None)
        if kept is None:
            return
        self._bytes -= len(kept.rendered.body)
        if kept.streams is None:
            self._wide.discard(key)
            return
        for s in kept.streams:
            keys = self._by_stream.get(s)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_stream[s]
