"""The console's lemons page: GPUs ranked by failures per day of service over a window, with the
events that are their failures, as the API's `/hardware/health/lemons` reads them (docs/lemons.md).
A plain server-rendered table; the window as an operator types it (`90d`, `12h`, or a time)."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.params import FromQuery
from litestar.response import Template

from api.http.context import AppContext
from domain.lemons import DEFAULT_SINCE, since_of

# The console shows a screenful; the API and the command give more on request.
LEMONS_SHOWN = 100


@get("/lemons", name="console-lemons")
async def lemons_page(request: Request[Any, Any, Any], since: FromQuery[str | None] = None) -> Template:
    """SinceRefused (a window that is none) is the console's 400 page (routes.py)."""
    context: AppContext = request.app.state.ctx
    typed = (since or "").strip() or DEFAULT_SINCE
    start = since_of(typed, context.repository.clock())
    ranked = await context.repository.lemons.ranked(since=start, limit=LEMONS_SHOWN)
    return Template(
        template_name="lemons.html.j2",
        context={"as_of": None, "as_of_q": "", "supports_as_of": False, "since": typed, "lemons": ranked},
    )
