"""Group commit (ledger/group_commit.py): concurrent units of work share one transaction, each
caller gets its own unit's outcome, and a unit that fails fails nobody else."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import asyncpg
import pytest

from agent.protocol import EnrollRequest
from api.config import ServerConfig
from api.wiring import build_services
from ledger.group_commit import GroupCommit, TryAgain
from tests.agent_support import report_body
from tests.sample_reads import logged


@pytest.fixture
async def probe(pool: asyncpg.Pool) -> asyncpg.Pool:
    async with pool.acquire() as conn:
        await conn.execute(
            "CREATE TABLE gc_probe (k text NOT NULL, tx xid8 NOT NULL DEFAULT pg_current_xact_id())"
        )
    return pool


class Item:
    def __init__(self, key: str, *, refuse: bool = False, explode: bool = False) -> None:
        self.key, self.refuse, self.explode = key, refuse, explode


seen: list[list[str]] = []  # the keys of each batch the handler got, in order


async def handler(conn: asyncpg.Connection, items: Sequence[Item]) -> list[str | BaseException]:
    """Inserts a row per item and answers its key in capitals; a refused item writes nothing and
    is answered with its error; an exploding one fails the whole call after the others wrote."""
    seen.append([i.key for i in items])
    out: list[str | BaseException] = []
    for item in items:
        if item.refuse:
            out.append(PermissionError(f"{item.key} refused"))
            continue
        await conn.execute("INSERT INTO gc_probe (k) VALUES ($1)", item.key)
        if item.explode:
            raise ValueError(f"{item.key} exploded")
        out.append(item.key.upper())
    return out


async def rows(pool: asyncpg.Pool) -> list[tuple[str, int]]:
    async with pool.acquire() as conn:
        return [
            (r["k"], r["n"])
            for r in await conn.fetch("SELECT k, count(*) AS n FROM gc_probe GROUP BY k ORDER BY k")
        ]


async def transactions(pool: asyncpg.Pool) -> list[int]:
    async with pool.acquire() as conn:
        return sorted(r["n"] for r in await conn.fetch("SELECT count(*) AS n FROM gc_probe GROUP BY tx"))


async def test_items_that_arrive_together_commit_in_one_transaction(probe: asyncpg.Pool) -> None:
    group: GroupCommit[Item, str] = GroupCommit(probe, handler, max_batch=8, concurrency=1)
    keys = [f"k{i}" for i in range(8)]
    results = await asyncio.gather(*(group.run(k, Item(k)) for k in keys))
    assert results == [k.upper() for k in keys]
    assert await transactions(probe) == [8] and (group.batches, group.units) == (1, 8)
    assert await rows(probe) == [(k, 1) for k in keys]


async def test_items_that_arrive_together_are_shared_by_the_free_lanes(probe: asyncpg.Pool) -> None:
    """Callers that come back together (answered by one batch) fill both lanes, side by side,
    instead of one transaction after the other."""
    group: GroupCommit[Item, str] = GroupCommit(probe, handler, max_batch=32, concurrency=2, share=True)
    keys = [f"k{i}" for i in range(8)]
    results = await asyncio.gather(*(group.run(k, Item(k)) for k in keys))
    assert results == [k.upper() for k in keys]
    assert await transactions(probe) == [4, 4] and (group.batches, group.units) == (2, 8)


async def test_another_lane_opens_only_once_a_full_batch_waits(probe: asyncpg.Pool) -> None:
    """Callers that arrive independently wait for the running transaction and go together in the
    next, unless a full batch waits: then a free lane takes it, even while the first is held up."""
    release = asyncio.Event()

    async def held(conn: asyncpg.Connection, items: Sequence[Item]) -> list[str | BaseException]:
        if items[0].key == "first":
            await release.wait()
        return await handler(conn, items)

    group: GroupCommit[Item, str] = GroupCommit(probe, held, max_batch=4, concurrency=3)
    first = asyncio.create_task(group.run("first", Item("first")))
    try:
        await asyncio.sleep(0.05)
        few = [asyncio.create_task(group.run(k, Item(k))) for k in ("a", "b", "c")]
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in few), "less than a batch waits: no second transaction"
        fourth = asyncio.create_task(group.run("d", Item("d")))
        assert await asyncio.wait_for(asyncio.gather(*few, fourth), 10) == ["A", "B", "C", "D"]
        assert not first.done()
    finally:
        release.set()  # the held transaction ends whatever the test found
    assert await first == "FIRST"
    assert await transactions(probe) == [1, 4]


async def test_a_batch_never_exceeds_max_batch(probe: asyncpg.Pool) -> None:
    group: GroupCommit[Item, str] = GroupCommit(probe, handler, max_batch=3, concurrency=1)
    keys = [f"k{i:02d}" for i in range(10)]
    await asyncio.gather(*(group.run(k, Item(k)) for k in keys))
    assert await transactions(probe) == [1, 3, 3, 3] and group.units == 10


async def test_a_refused_item_gets_its_error_and_the_others_commit_together(probe: asyncpg.Pool) -> None:
    group: GroupCommit[Item, str] = GroupCommit(probe, handler, max_batch=8, concurrency=1)
    keys = [f"k{i}" for i in range(5)]
    outcomes = await asyncio.gather(
        *(group.run(k, Item(k, refuse=k == "k1")) for k in keys), return_exceptions=True
    )
    assert [o if isinstance(o, str) else type(o).__name__ for o in outcomes] == [
        "K0",
        "PermissionError",
        "K2",
        "K3",
        "K4",
    ]
    assert await transactions(probe) == [4] and group.batches == 1


async def test_a_failing_item_fails_only_itself_and_the_others_are_stored_once(probe: asyncpg.Pool) -> None:
    group: GroupCommit[Item, str] = GroupCommit(probe, handler, max_batch=8, concurrency=1)
    keys = [f"k{i}" for i in range(5)]
    outcomes = await asyncio.gather(
        *(group.run(k, Item(k, explode=k == "k2")) for k in keys), return_exceptions=True
    )
    assert [o if isinstance(o, str) else type(o).__name__ for o in outcomes] == [
        "K0",
        "K1",
        "ValueError",
        "K3",
        "K4",
    ]
    assert await rows(probe) == [("k0", 1), ("k1", 1), ("k3", 1), ("k4", 1)], "nothing of k2, nothing twice"
    assert await transactions(probe) == [1, 1, 1, 1], "after the failed batch, each item ran alone"


async def test_a_batch_is_sorted_by_key_and_holds_one_item_per_key(probe: asyncpg.Pool) -> None:
    group: GroupCommit[Item, str] = GroupCommit(probe, handler, max_batch=16, concurrency=1)
    seen.clear()
    calls = ["c", "a", "b", "a", "c", "a"]
    results = await asyncio.gather(*(group.run(k, Item(k)) for k in calls))
    assert results == [k.upper() for k in calls]
    # The first batch takes one item per key, sorted; later items of a key wait, in arrival order.
    assert seen == [["a", "b", "c"], ["a", "c"], ["a"]]


async def test_a_handler_that_answers_too_few_items_commits_nothing_and_leaves_nobody_waiting(
    probe: asyncpg.Pool,
) -> None:
    async def forgetful(conn: asyncpg.Connection, items: Sequence[Item]) -> list[str | BaseException]:
        for item in items:
            await conn.execute("INSERT INTO gc_probe (k) VALUES ($1)", item.key)
        return [i.key.upper() for i in items][:-1]

    group: GroupCommit[Item, str] = GroupCommit(probe, forgetful, max_batch=8, concurrency=1)
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(group.run(k, Item(k)) for k in ("a", "b", "c")), return_exceptions=True), 30
    )
    assert all(isinstance(o, RuntimeError) for o in outcomes), outcomes
    assert await rows(probe) == []


async def test_concurrent_agent_reports_share_transactions_and_are_each_accepted_once(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    """Eight nodes report at once: every report is accepted and stored once, in fewer
    transactions than reports; the same reports again are recognized as duplicates."""
    services = build_services(pool, ServerConfig(state_dir=tmp_path / "state", collector_timeout=5.0))
    token = await services.enrollment.create_token(3600, 8)
    principals = []
    for i in range(8):
        enrolled = await services.enrollment.enroll(
            token.token,
            EnrollRequest(identity_key=f"gc-agent-{i}", identity_source="configured", hostname=f"h{i}"),
        )
        principals.append(await services.credentials.authenticate(enrolled.credential))
    bodies = [report_body(f"gc-agent-{i}", 1, mem_avail=i) for i in range(8)]
    before = (services.reports.group_commit.batches, services.reports.group_commit.units)
    acks = await asyncio.gather(
        *(services.reports.accept_report(p, b, None) for p, b in zip(principals, bodies, strict=True))
    )
    assert [a.status for a in acks] == ["accepted"] * 8
    batches, units = (
        services.reports.group_commit.batches - before[0],
        services.reports.group_commit.units - before[1],
    )
    assert units == 8 and batches < 8, (batches, units)
    async with pool.acquire() as conn:
        firsts = [
            e.stream_id
            for e in await logged(conn, "event_type = 'NODE_TELEMETRY_OBSERVED'")
            if e.metadata.agent_sequence == 1
        ]
        stored = [{"n": firsts.count(sid)} for sid in set(firsts)]
        sharing = await conn.fetchval(
            "SELECT max(n) FROM (SELECT count(DISTINCT stream_id) AS n FROM events "
            "WHERE event_type = 'NODE_TELEMETRY_OBSERVED' GROUP BY tx_id) t"
        )
    assert sorted(r["n"] for r in stored) == [1] * 8 and sharing > 1
    again = await asyncio.gather(
        *(services.reports.accept_report(p, b, None) for p, b in zip(principals, bodies, strict=True))
    )
    assert [a.status for a in again] == ["duplicate"] * 8


async def test_a_handler_that_asks_to_try_again_runs_its_item_once_more_and_only_once(
    probe: asyncpg.Pool,
) -> None:
    """TryAgain after writing: that transaction is rolled back and the item runs again alone;
    a handler that asks again on the second run fails its caller, with nothing committed."""
    calls: list[str] = []

    async def guessing(conn: asyncpg.Connection, items: Sequence[Item]) -> list[str | BaseException]:
        for item in items:
            calls.append(item.key)
            await conn.execute("INSERT INTO gc_probe (k) VALUES ($1)", item.key)
        if any(calls.count(i.key) == 1 or i.refuse for i in items):
            raise TryAgain("guessed wrong")
        return [i.key.upper() for i in items]

    group: GroupCommit[Item, str] = GroupCommit(probe, guessing)
    assert await group.run("a", Item("a")) == "A"
    assert calls == ["a", "a"]
    with pytest.raises(TryAgain):
        await group.run("b", Item("b", refuse=True))
    assert calls.count("b") == 2
    assert await rows(probe) == [("a", 1)]


async def test_an_outside_handler_answers_in_one_statement_or_hands_the_batch_to_the_transaction(
    probe: asyncpg.Pool,
) -> None:
    # The outside handler writes every item of a batch in one statement (its own transaction) and
    # answers, or answers None for a batch holding "later": that batch goes to the handler, in a
    # transaction. One holding "broken" fails its statement: nothing of it stands, and each item
    # is handled alone, where an item whose statement fails again gets that error.
    outside_seen: list[list[str]] = []

    async def outside(conn: asyncpg.Connection, items: Sequence[Item]) -> list[str | BaseException] | None:
        keys = [i.key for i in items]
        outside_seen.append(keys)
        assert not conn.is_in_transaction()
        if "later" in keys:
            return None
        await conn.execute(
            "INSERT INTO gc_probe (k) SELECT CASE WHEN k = 'broken' THEN NULL ELSE k END FROM unnest($1::text[]) k",
            keys,
        )
        return [f"outside:{k}" for k in keys]

    seen.clear()
    gc: GroupCommit[Item, str] = GroupCommit(probe, handler, max_batch=3, concurrency=1, outside=outside)
    assert await gc.run("a", Item("a")) == "outside:a"
    answers = await asyncio.gather(*(gc.run(k, Item(k)) for k in ("b", "later", "c")))
    assert answers == ["B", "LATER", "C"]  # the handler's answers: the batch went to it
    answers = await asyncio.gather(*(gc.run(k, Item(k)) for k in ("d", "broken")), return_exceptions=True)
    assert answers[0] == "outside:d"
    assert isinstance(answers[1], asyncpg.NotNullViolationError)
    assert await rows(probe) == [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("later", 1)]
    assert ["b", "c", "later"] in outside_seen and ["broken", "d"] in outside_seen
