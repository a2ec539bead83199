"""Web console benchmark: the fleet overview's first page with 10,000 nodes x 8 GPUs.

    python -m bench.console            # 10,000 nodes, 200 timed requests per page
    python -m bench.console --quick    # 1,000 nodes, 40 requests

Fills a throwaway database (`mf_bench_<random>_console`) with bench.api's fold fill, starts
`modelforge-hw serve` on it (the harness), then times over HTTP on 127.0.0.1, one request at a
time, the console's overview first page, its hostname-prefix search and its liveness filter
against the baseline the API already meets: `GET /api/v1/hardware/nodes?limit=50`, the same 50
nodes as JSON. Reports medians and the ratio.

Target: the overview's first page in under 200 ms (its p95 here: one request at a time
on loopback, so the figure is server time plus a loopback round trip). The ratio to the baseline is printed for context: the
overview also counts the whole fleet by liveness and inventory status, which the baseline does not.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence

from bench.api import fill_by_fold
from bench.harness import parse_sized, throwaway_database
from bench.servers import OPERATOR_TOKEN, start_product_server, workdir

# The console's login cookie (api/http/console/routes.py COOKIE): the bench logs in like a person.
CONSOLE_COOKIE = "mf_console_token"


async def run(nodes: int, requests: int) -> int:
    import logging

    import httpx

    from ledger.db import create_pool
    from ledger.schema import migrate

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would drown the figures
    async with throwaway_database("console") as db, workdir("console", keep=False) as wd:
        pool = await create_pool(db.dsn, min_size=2, max_size=10)
        try:
            async with pool.acquire() as conn:
                await migrate(conn)
            t0 = time.perf_counter()
            await fill_by_fold(pool, nodes, random.Random(20261201))
            async with pool.acquire() as conn:
                await conn.execute("VACUUM ANALYZE")
                n = await conn.fetchval("SELECT count(*) FROM hw_nodes")
                host = await conn.fetchval("SELECT hostname FROM hw_nodes ORDER BY node_id LIMIT 1")
        finally:
            await pool.close()
        print(f"fill: {n:,} nodes in {time.perf_counter() - t0:.1f} s (untimed)")
        server = await start_product_server(db.dsn, wd, retention=False)
        try:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{server.port}",
                cookies={CONSOLE_COOKIE: OPERATOR_TOKEN},
                headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"},
                timeout=30,
            ) as client:
                pages = {
                    "baseline GET /api/v1/hardware/nodes?limit=50": "/api/v1/hardware/nodes?limit=50",
                    "console overview, first page": "/console/",
                    f"console search q={host[:6]}": f"/console/?q={host[:6]}",
                    "console liveness=offline": "/console/?liveness=offline",
                }
                medians: dict[str, float] = {}
                p95s: dict[str, float] = {}
                for name, path in pages.items():
                    for _ in range(5):  # warm the pool, the plans and the template cache
                        assert (await client.get(path)).status_code == 200
                    times = []
                    for _ in range(requests):
                        t = time.perf_counter()
                        r = await client.get(path)
                        times.append(time.perf_counter() - t)
                        assert r.status_code == 200
                    medians[name] = statistics.median(times)
                    p95s[name] = p95 = sorted(times)[int(len(times) * 0.95) - 1]
                    print(f"{name:55s} median {medians[name] * 1000:7.1f} ms  p95 {p95 * 1000:7.1f} ms")
        finally:
            server.stop()
    base = medians["baseline GET /api/v1/hardware/nodes?limit=50"]
    overview = "console overview, first page"
    print(f"overview / baseline (medians): {medians[overview] / base:.1f}")
    budget = p95s[overview] / 0.200
    print(f"overview p95 / 200 ms: {budget:.2f} (target < 1) {'MET' if budget < 1 else 'NOT MET'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=10_000)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="1,000 nodes, 40 requests")
    args = parse_sized(p, argv, {"nodes": 1_000, "requests": 40})
    return asyncio.run(run(args.nodes, args.requests))


if __name__ == "__main__":
    sys.exit(main())
