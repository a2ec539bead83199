"""Copies of the agents' stream positions this process last read or wrote (`KeptPositions`), so
that a batch of reports on kept node states is decided before anything is sent
(api/services/reports.py). A copy is only a guess, checked by the transaction that uses it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import msgspec

from agent.protocol import STREAMS
from domain.node import NodeState

# One entry of a stream's `recent` digests as stored: the sequence (8 bytes, big-endian), then the
# SHA-256 of the report accepted at it (32 bytes).
_SEQUENCE_BYTES = 8
_ENTRY_BYTES = _SEQUENCE_BYTES + 32


def recent_bytes(recent: Mapping[str, str]) -> bytes:
    """`agent_stream_positions.recent` as stored, from the decision's {sequence: hex digest}: a
    full window is 1,280 bytes and stays in the row, where its JSON (2.4 KB, and incompressible)
    went to TOAST and was written there anew with every report."""
    return b"".join(
        int(sequence).to_bytes(_SEQUENCE_BYTES, "big", signed=True) + bytes.fromhex(digest)
        for sequence, digest in recent.items()
    )


def recent_digests(raw: bytes) -> dict[str, str]:
    """The decision's {sequence: hex digest} from `recent_bytes`."""
    if len(raw) % _ENTRY_BYTES:
        raise ValueError(f"recent digests of {len(raw)} bytes: not whole entries")
    return {
        str(int.from_bytes(raw[i : i + _SEQUENCE_BYTES], "big", signed=True)): raw[
            i + _SEQUENCE_BYTES : i + _ENTRY_BYTES
        ].hex()
        for i in range(0, len(raw), _ENTRY_BYTES)
    }


class KeptPosition(msgspec.Struct, frozen=True):
    """A copy of one `agent_stream_positions` row: what a report's decision reads of it, the
    transaction that wrote the row (its `xmin`), and the node's checkpoint (stream version,
    position) in the transaction that read or wrote it: a copy is used only with that same kept
    node state, so that a batch never decides on a node state and a position of two moments."""

    last_sequence: int
    recent: bytes  # the row's `recent` as stored (`recent_bytes`), decoded when used
    written: int
    node_version: int
    node_position: int


class KeptPositions:
    """The stream positions this process last read or wrote, by (node, agent stream), so that a
    batch of reports on kept node states can be decided before anything is sent and committed in
    five statements instead of seven (`ReportService._commit_kept`). A copy is only a guess: the
    advance applies to a row only while its `xmin` is the copy's (no other transaction wrote it
    since: another server, or ours rolled back), else the batch is rolled back and runs again on
    what it reads (ledger.group_commit.TryAgain). Least recently used first out."""

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
        written: int,
        node: NodeState,
    ) -> None:
        if self.streams <= 0:
            return
        key = (node_id, stream)
        self._kept[key] = KeptPosition(last_sequence, recent, written, node.stream_version, node.position)
        self._kept.move_to_end(key)
        while len(self._kept) > self.streams:
            self._kept.popitem(last=False)

    def carry(self, node_id: str, wrote: str, before: tuple[int, int], after: NodeState) -> None:
        """After this process's own commit of a report on `wrote`, the node's other streams' copies
        that were paired with the checkpoint (stream version, position) the commit moved the node
        on from are paired with the one it moved to: the commit wrote the node's events and the
        position row of `wrote` only, so their rows are as they were when copied, and a node
        whose reports alternate between its streams is still decided in five statements. Should
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
