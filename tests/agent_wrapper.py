"""Run `modelforge-hw` (here: the agent) in a subprocess with the test doubles installed, for tests:

    python -m tests.agent_wrapper agent run --server URL ...

- `pynvml` is the fake NVML (tests/fakes/fake_pynvml.py) with `MF_TEST_GPUS` H200-like GPUs
  (default 2) whose UUIDs are derived from `MF_TEST_GPU_SEED` (default: MODELFORGE_NODE_ID), so
  every simulated node has GPUs of its own. The collector imports `pynvml` lazily, so putting the
  fake in sys.modules is all it takes; production code has no test hook.
- `MF_TEST_CLOCK_OFFSET` (seconds, may be negative) moves the agent's clock (agent.clock.now).
"""

from __future__ import annotations

import os
import sys
import uuid
from datetime import timedelta

from tests.fakes.fake_pynvml import FakeNvml
from tests.fixtures_nvml import multi_gpu_scenario

_GPU_NAMESPACE = uuid.UUID("9a1f5c2e-4b7d-5e60-8c3a-2d9e0f1b7a44")


def install() -> FakeNvml:
    scenario = multi_gpu_scenario(int(os.environ.get("MF_TEST_GPUS", "2")))
    seed = os.environ.get("MF_TEST_GPU_SEED") or os.environ.get("MODELFORGE_NODE_ID") or "node"
    for index, gpu in enumerate(scenario.gpus):
        gpu.uuid = f"GPU-{uuid.uuid5(_GPU_NAMESPACE, f'{seed}/{index}')}"
    fake = FakeNvml(scenario)
    sys.modules["pynvml"] = fake  # type: ignore[assignment]

    offset = float(os.environ.get("MF_TEST_CLOCK_OFFSET", "0") or 0)
    if offset:
        import agent.clock

        real = agent.clock.now
        agent.clock.now = lambda: real() + timedelta(seconds=offset)  # type: ignore[assignment]
    return fake


def main() -> int:
    install()
    from api.cli.main import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
