"""Operator routes for the GPU health policy (docs/health-policy.md), under /api/v1 and the
operator bearer token:

    GET  /hardware/health/policy      the policy in force: name, digest, since which position, text
    POST /hardware/health/policy      apply one {policy, actor?}: an audited HEALTH_POLICY_APPLIED
    POST /hardware/health/backtest    {policy, since_seconds?, cursor?, limit?}: the GPUs whose
                                      verdict would differ under it, a page at a time; writes nothing

Routes do no SQL: they call HealthPolicies, given to them as a dependency.
"""

from __future__ import annotations

from litestar import Router, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from api.http.context import operator_guard
from api.services.clock import central_now
from api.services.health_policy import (
    ApplyRequest,
    BacktestBody,
    BacktestRequest,
    HealthPolicies,
    PolicyBody,
)


def _actor(given: str | None) -> str:
    """Who, as the request says (the operator token is shared; the name is the caller's word)."""
    name = (given or "").strip()[:100]
    return f"operator:{name}" if name else "operator"


@get("/hardware/health/policy", summary="The GPU health policy in force: name, digest, since, text")
async def show_health_policy(health_policies: NamedDependency[HealthPolicies]) -> PolicyBody:
    return await health_policies.in_force()


@post("/hardware/health/policy", status_code=200, summary="Put a GPU health policy in force (audited)")
async def apply_health_policy(
    health_policies: NamedDependency[HealthPolicies], data: JSONBody[ApplyRequest]
) -> PolicyBody:
    return await health_policies.apply(data.policy, _actor(data.actor))


@post(
    "/hardware/health/backtest",
    status_code=200,
    summary="Backtest a GPU health policy on the log: GPUs whose verdict would differ (writes nothing)",
)
async def backtest_health_policy(
    health_policies: NamedDependency[HealthPolicies], data: JSONBody[BacktestRequest]
) -> BacktestBody:
    return await health_policies.backtest(data, central_now())


def health_policy_routers() -> list[Router]:
    """A fresh router for one app (create_app registers it)."""
    return [
        Router(
            path="/api/v1",
            route_handlers=[show_health_policy, apply_health_policy, backtest_health_policy],
            guards=[operator_guard],
            security=[{"bearer": []}],
        )
    ]
