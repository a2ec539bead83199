"""Copies of the agents' stream positions this process last read or wrote (`KeptPositions`), so
that a batch of reports on kept node states is decided before anything is sent
(api/services/reports.py). A copy is only a guess, checked by the transaction that uses it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import msgspec

from agent.protocol import STREAMS
from domain.node import NodeState
from domain.report_decisions import RECENT_REPORT_DIGESTS

# One entry of a stream's `recent` digests as stored: the sequence (8 bytes, big-endian), then the
# SHA-256 of the report accepted at it (32 bytes). Newest first: an accepted report puts its entry
# in front of the bytes stored before, and the entries the window has left stay behind them (read
# past: the window is the sequences within RECENT_REPORT_DIGESTS of the stream's last one) until
# the row holds `_MAX_ENTRIES`, when the window alone is written. The row's update then changes
# its scalar columns and the first entry only: PostgreSQL logs an update in place as the bytes
# between the old and new row's common prefix and suffix (`recent` is the row's last column), so
# a report costs about 100 bytes of WAL where rewriting the window cost 1,300. 46 entries keep
# the row under the 2 KB at which PostgreSQL would compress it or move `recent` to TOAST.
_SEQUENCE_BYTES = 8
_ENTRY_BYTES = _SEQUENCE_BYTES + 32
_MAX_ENTRIES = 46


def _entry(sequence: int, digest: str) -> bytes:
    return sequence.to_bytes(_SEQUENCE_BYTES, "big", signed=True) + bytes.fromhex(digest)


def recent_bytes(recent: Mapping[int, str], last_sequence: int, stored: bytes = b"") -> bytes:
    """`agent_stream_positions.recent` as stored, from the decision's {sequence: hex digest} at the
    stream's new `last_sequence`: the entries `stored` (the row's bytes before) lacks in front of
    them, where `recent_digests` of the result at `last_sequence` is exactly `recent`; else
    `recent` alone, newest first. A decision made on a kept copy's window: `advanced_bytes`."""
    floor = last_sequence - RECENT_REPORT_DIGESTS
    if stored and len(stored) % _ENTRY_BYTES == 0 and len(stored) // _ENTRY_BYTES + 1 <= _MAX_ENTRIES:
        # The stored entries still in the window must all be in `recent`, with the same digest,
        # and what `recent` holds besides them must lie above the floor. Compared as dict views (C).
        have = recent_digests(stored, last_sequence)
        added = sorted(recent.keys() - have.keys(), reverse=True)
        if (
            have.items() <= recent.items()
            and (not added or added[-1] > floor)
            and len(stored) // _ENTRY_BYTES + len(added) <= _MAX_ENTRIES
        ):
            return b"".join(_entry(seq, recent[seq]) for seq in added) + stored
    return b"".join(_entry(seq, recent[seq]) for seq in sorted(recent, reverse=True))


def advanced_bytes(recent: Mapping[int, str], sequence: int, stored: bytes) -> bytes:
    """`recent_bytes(recent, sequence, stored)` for a decision made on the stored entries' window
    at the stream's last sequence (a kept copy's `KeptPosition.window`): `recent` is then that
    window above the new floor with `sequence` added (`decide_report`), so every stored entry
    still in the window is in `recent` alike and `sequence` is the one entry to add: it goes in
    front of the stored bytes without the two windows compared entry by entry."""
    if stored and len(stored) % _ENTRY_BYTES == 0 and len(stored) // _ENTRY_BYTES + 1 <= _MAX_ENTRIES:
        return _entry(sequence, recent[sequence]) + stored
    return recent_bytes(recent, sequence)


def recent_digests(raw: bytes, last_sequence: int | None) -> dict[int, str]:
    """The decision's {sequence: hex digest} from `recent_bytes`: the entries within the window of
    the stream's `last_sequence` (None: a stream without a row)."""
    if len(raw) % _ENTRY_BYTES:
        raise ValueError(f"recent digests of {len(raw)} bytes: not whole entries")
    if last_sequence is None:
        return {}
    floor = last_sequence - RECENT_REPORT_DIGESTS
    out: dict[int, str] = {}
    for i in range(0, len(raw), _ENTRY_BYTES):
        seq = int.from_bytes(raw[i : i + _SEQUENCE_BYTES], "big", signed=True)
        if seq > floor:
            out[seq] = raw[i + _SEQUENCE_BYTES : i + _ENTRY_BYTES].hex()
    return out


class KeptPosition(msgspec.Struct, frozen=True):
    """A copy of one `agent_stream_positions` row: what a report's decision reads of it, the
    transaction that wrote the row (its `xmin`), and the node's checkpoint (stream version,
    position) in the transaction that read or wrote it: a copy is used only with that same kept
    node state, so that a batch never decides on a node state and a position of two moments."""

    last_sequence: int
    recent: bytes  # the row's `recent` as stored (`recent_bytes`)
    # The same as the decision reads it (`recent_digests` at `last_sequence`): kept decoded, so
    # that a steady report does not unpack its stream's digests again.
    window: dict[int, str]
    written: int
    node_version: int
    node_position: int


class KeptPositions:
    """The stream positions this process last read or wrote, by (node, agent stream), so that a
    batch of reports on kept node states can be decided before anything is sent and committed in
    one statement (`ReportService._commit_folded`), or five in a transaction instead of seven
    (`ReportService._commit_kept`). A copy is only a guess: the advance applies to a row only
    while its `xmin` is the copy's (no other transaction wrote it since: another server, or ours
    rolled back), else the batch writes nothing and runs again on what it reads (the one
    statement fails whole; a transaction raises ledger.group_commit.TryAgain). Least recently used
    first out."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self._kept: OrderedDict[tuple[str, str], KeptPosition] = OrderedDict()
        self.stale = 0  # batches that found a kept position was not the stored one (/metrics)

    def get(self, node_id: str, stream: str) -> KeptPosition | None:
        return self._kept.get((node_id, stream))

    def keep(
        self,
        node_id: str,
        stream: str,
        last_sequence: int,
        recent: bytes,
        window: dict[int, str],
        written: int,
        node: NodeState,
    ) -> None:
        if self.streams <= 0:
            return
        key = (node_id, stream)
        self._kept[key] = KeptPosition(
            last_sequence, recent, window, written, node.stream_version, node.position
        )
        self._kept.move_to_end(key)
        while len(self._kept) > self.streams:
            self._kept.popitem(last=False)

    def carry(self, node_id: str, wrote: str, before: tuple[int, int], after: NodeState) -> None:
        """After this process's own commit of a report on `wrote`, the node's other streams' copies
        that were paired with the checkpoint (stream version, position) the commit moved the node
        on from are paired with the one it moved to: the commit wrote the node's events and the
        position row of `wrote` only, so their rows are as they were when copied, and a node
        whose reports alternate between its streams is still decided on its copies. Should
        a row have been written all the same, its advance's `xmin` check still refuses the copy."""
        for stream in STREAMS:
            if stream == wrote:
                continue
            copy = self._kept.get((node_id, stream))
            if copy is not None and (copy.node_version, copy.node_position) == before:
                self._kept[(node_id, stream)] = msgspec.structs.replace(
                    copy, node_version=after.stream_version, node_position=after.position
                )

    def drop(self, node_id: str, stream: str) -> None:
        self._kept.pop((node_id, stream), None)
