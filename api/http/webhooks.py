"""Operator routes for webhook subscriptions (docs/integrations.md, "Webhooks"), under /api/v1
and the operator bearer token (a viewer token may not use them):

    POST   /webhooks                     subscribe (201) {url, secret, event_types?, event_classes?, node_id?}
    GET    /webhooks                     every subscription not deleted, with its delivery state
    GET    /webhooks/{id}                one subscription
    DELETE /webhooks/{id}                unsubscribe
    POST   /webhooks/{id}/resume         deliver again now from the cursor (a failing one)
    GET    /webhooks/{id}/deliveries     delivery attempts, newest first, a page at a time (cursor, limit)

Routes do no SQL: they call the WebhookService, given to them as a dependency.
"""

from __future__ import annotations

from typing import Annotated

from litestar import Router, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from api.http.context import operator_guard
from api.services.webhooks import (
    MAX_DELIVERIES_PAGE,
    DeliveryPage,
    WebhookBody,
    WebhookCreateRequest,
    WebhookService,
)


@post("/webhooks", status_code=201, summary="Subscribe a receiver to the log's events (CloudEvents, signed)")
async def create_webhook(
    webhooks: NamedDependency[WebhookService], data: JSONBody[WebhookCreateRequest]
) -> WebhookBody:
    return await webhooks.create(data)


@get("/webhooks", summary="Webhook subscriptions and their delivery state")
async def list_webhooks(webhooks: NamedDependency[WebhookService]) -> dict[str, list[WebhookBody]]:
    return {"items": await webhooks.list_all()}


@get("/webhooks/{subscription_id:str}", summary="One webhook subscription")
async def get_webhook(
    webhooks: NamedDependency[WebhookService], subscription_id: FromPath[str]
) -> WebhookBody:
    return await webhooks.get(subscription_id)


@delete("/webhooks/{subscription_id:str}", status_code=200, summary="Unsubscribe (recorded in the log)")
async def delete_webhook(
    webhooks: NamedDependency[WebhookService], subscription_id: FromPath[str]
) -> WebhookBody:
    return await webhooks.delete(subscription_id)


@post(
    "/webhooks/{subscription_id:str}/resume",
    status_code=200,
    summary="Deliver again now, from the subscription's cursor",
)
async def resume_webhook(
    webhooks: NamedDependency[WebhookService], subscription_id: FromPath[str]
) -> WebhookBody:
    return await webhooks.resume(subscription_id)


@get("/webhooks/{subscription_id:str}/deliveries", summary="Delivery attempts, newest first (paged)")
async def list_deliveries(
    webhooks: NamedDependency[WebhookService],
    subscription_id: FromPath[str],
    cursor: FromQuery[str | None] = None,
    limit: Annotated[int, QueryParameter(ge=1, le=MAX_DELIVERIES_PAGE)] = 50,
) -> DeliveryPage:
    return await webhooks.deliveries(subscription_id, cursor=cursor, limit=limit)


def webhook_routers() -> list[Router]:
    """A fresh router for one app (create_app registers it)."""
    return [
        Router(
            path="/api/v1",
            route_handlers=[
                create_webhook,
                list_webhooks,
                get_webhook,
                delete_webhook,
                resume_webhook,
                list_deliveries,
            ],
            guards=[operator_guard],
            security=[{"bearer": []}],
        )
    ]
