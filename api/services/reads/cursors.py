"""The lists' paging cursors, opaque to clients: base64url of a JSON array whose first element
names the list it pages, so a cursor from one list handed to another is refused (400), not
misread."""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, Protocol, TypeVar

import msgspec

from ledger.reading import MAX_POSITION, MAX_TX_ID, Checkpoint


class BadCursor(ValueError):
    pass


_Id = Annotated[str, msgspec.Meta(max_length=256, pattern="^[^\\x00]*$")]
_TxId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TX_ID)]
_Position = Annotated[int, msgspec.Meta(ge=0, le=MAX_POSITION)]
_IdCursor = tuple[Literal["id"], _Id]
_LogCursor = tuple[Literal["log"], _TxId, _Position]
_FleetCursor = tuple[Literal["fleet"], _Id, _Id]
_GpuHistoryCursor = tuple[Literal["gpu-history"], _TxId, _Position]
_DeliveryId = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
_DeliveriesCursor = tuple[Literal["webhook-deliveries"], _Id, _DeliveryId]


def _encode(parts: tuple[Any, ...]) -> str:
    return base64.urlsafe_b64encode(msgspec.json.encode(parts)).decode().rstrip("=")


def _decode(cursor: str, shape: Any) -> Any:
    try:
        raw = base64.urlsafe_b64decode(cursor.encode("ascii") + b"=" * (-len(cursor) % 4))
        return msgspec.json.decode(raw, type=shape, strict=True)
    except (ValueError, msgspec.DecodeError) as exc:
        raise BadCursor("cursor is not one this list issued") from exc


def encode_id_cursor(last_id: str) -> str:
    return _encode(("id", last_id))


def decode_id_cursor(cursor: str) -> str:
    _, last_id = _decode(cursor, _IdCursor)
    return str(last_id)


class _HasId(Protocol):
    @property
    def id(self) -> str: ...


R = TypeVar("R")
B = TypeVar("B", bound=_HasId)


def id_page(rows: Sequence[R], limit: int, body: Callable[[R], B]) -> tuple[list[B], str | None]:
    """A page by id from the rows of a query limited to `limit + 1`: the first `limit` as bodies,
    and the cursor after the last of them when the extra row says more follow."""
    items = [body(r) for r in rows[:limit]]
    return items, encode_id_cursor(items[-1].id) if len(rows) > limit and items else None


def encode_fleet_cursor(hostname: str, node_id: str) -> str:
    return _encode(("fleet", hostname, node_id))


def decode_fleet_cursor(cursor: str) -> tuple[str, str]:
    _, hostname, node_id = _decode(cursor, _FleetCursor)
    return str(hostname), str(node_id)


def encode_log_cursor(checkpoint: Checkpoint) -> str:
    return _encode(("log", checkpoint.tx_id, checkpoint.position))


def decode_log_cursor(cursor: str) -> Checkpoint:
    _, tx_id, position = _decode(cursor, _LogCursor)
    return Checkpoint(tx_id, position)


def encode_gpu_history_cursor(checkpoint: Checkpoint) -> str:
    return _encode(("gpu-history", checkpoint.tx_id, checkpoint.position))


def decode_gpu_history_cursor(cursor: str) -> Checkpoint:
    _, tx_id, position = _decode(cursor, _GpuHistoryCursor)
    return Checkpoint(tx_id, position)


def encode_deliveries_cursor(subscription_id: str, last_delivery_id: int) -> str:
    return _encode(("webhook-deliveries", subscription_id, last_delivery_id))


def decode_deliveries_cursor(cursor: str, subscription_id: str) -> int:
    """The delivery id a page of `subscription_id`'s attempts continues below; another
    subscription's cursor is refused, not read as a place in this one's attempts."""
    _, issued_for, last_delivery_id = _decode(cursor, _DeliveriesCursor)
    if issued_for != subscription_id:
        raise BadCursor("cursor is not one this list issued")
    return int(last_delivery_id)
