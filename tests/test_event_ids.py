"""Event ids are made in time order (ledger/events.py `new_event_id`, docs/storage.md): version 7
UUIDs, so the log's unique index of event ids grows at its right edge."""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from hypothesis import given
from hypothesis import strategies as st

from ledger.events import NewEvent, NodeMetadataChanged, event_id_at, new_event_id
from tests.builders import meta


def _millis(event_id: uuid.UUID) -> int:
    return event_id.int >> 80


def test_an_event_id_is_a_version_7_uuid_of_the_time_it_was_made() -> None:
    before = time.time_ns() // 1_000_000
    ids = [new_event_id() for _ in range(10_000)]
    after = time.time_ns() // 1_000_000
    assert len(set(ids)) == len(ids)
    for event_id in ids:
        assert (event_id.version, event_id.variant) == (7, uuid.RFC_4122)
        assert before <= _millis(event_id) <= after
    # the text form sorts as the bytes do, and the database's uuid order is the bytes'
    assert sorted(ids, key=str) == sorted(ids, key=lambda u: u.bytes)


@given(st.lists(st.integers(min_value=0, max_value=2**48 - 1), min_size=2, max_size=20, unique=True))
def test_ids_made_in_later_milliseconds_sort_after_earlier_ones(times: list[int]) -> None:
    made = [(t, event_id_at(t)) for t in times]
    assert [u for _t, u in sorted(made)] == sorted(u for _t, u in made)
    assert all(_millis(u) == t and (u.version, u.variant) == (7, uuid.RFC_4122) for t, u in made)


def test_a_new_event_takes_a_time_ordered_id_unless_given_one() -> None:
    payload = NodeMetadataChanged(changes={})
    first = NewEvent(payload=payload, metadata=meta())
    time.sleep(0.002)
    second = NewEvent(payload=payload, metadata=meta())
    assert first.event_id.version == second.event_id.version == 7 and first.event_id < second.event_id
    given_id = uuid.uuid4()
    assert NewEvent(payload=payload, metadata=meta(), event_id=given_id).event_id == given_id


def test_ids_made_at_once_by_threads_and_by_a_forked_child_are_all_different() -> None:
    """The random bits are read ahead in batches (ledger/events.py `_random_74`): no two threads
    take the same bits, and a child forked with bits read ahead does not make its parent's ids."""
    new_event_id()  # bits read ahead before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its ids in the same milliseconds as the parent's, through the pipe
        try:
            os.write(write, b"".join(event_id_at(0).bytes for _ in range(200)))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        raw = pipe.read()
    os.waitpid(pid, 0)
    child = {uuid.UUID(bytes=raw[i : i + 16]) for i in range(0, len(raw), 16)}
    made: list[uuid.UUID] = []
    with ThreadPoolExecutor(8) as pool:
        for batch in pool.map(lambda _n: [event_id_at(0) for _ in range(2_000)], range(8)):
            made.extend(batch)
    parent = set(made)
    assert len(child) == 200 and len(parent) == len(made) == 16_000
    assert not child & parent
