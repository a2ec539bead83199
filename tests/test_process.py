"""The garbage collector's settings around a bulk job (runtime/process.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from runtime.process import DeferredCollections, older_collections_deferred


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        yield gc.get_threshold()
    finally:
        gc.set_threshold(*before)


def test_older_collections_wait_for_overlapping_jobs_and_come_back_when_the_last_ends(
    thresholds: tuple[int, int, int],
) -> None:
    with older_collections_deferred():
        young, older, oldest = gc.get_threshold()
        assert (young, oldest) == (thresholds[0], thresholds[2]) and older >= 10**9
        with older_collections_deferred():  # a second scrape while the first is sent
            assert gc.get_threshold()[1] >= 10**9
        assert gc.get_threshold()[1] >= 10**9  # the first is still running
    assert gc.get_threshold() == thresholds


def test_a_job_that_fails_gives_the_thresholds_back(thresholds: tuple[int, int, int]) -> None:
    with pytest.raises(RuntimeError), older_collections_deferred():
        raise RuntimeError("the database went away mid-scrape")
    assert gc.get_threshold() == thresholds


def test_a_deferral_that_outlives_its_handler_ends_once_or_when_dropped(
    thresholds: tuple[int, int, int],
) -> None:
    deferred = DeferredCollections()
    assert gc.get_threshold()[1] >= 10**9
    with older_collections_deferred():  # a job inside it: its end does not end the deferral
        pass
    assert gc.get_threshold()[1] >= 10**9
    deferred.end()
    assert gc.get_threshold() == thresholds
    deferred.end()  # once only: a second end would end someone else's deferral
    with older_collections_deferred():
        deferred.end()
        assert gc.get_threshold()[1] >= 10**9
    assert gc.get_threshold() == thresholds
    # A streamed response that is never sent: its deferral ends when it is dropped.
    dropped = DeferredCollections()
    assert gc.get_threshold()[1] >= 10**9
    del dropped
    assert gc.get_threshold() == thresholds
