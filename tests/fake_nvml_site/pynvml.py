"""Test only: a `pynvml` module that is the fake NVML (tests/fakes/fake_pynvml.py), for running the
documented commands unchanged in a subprocess: put this directory first on PYTHONPATH (with the
repository root after it) and the product's lazy `import pynvml` gets the fake. `MF_TEST_GPUS`
H200-like GPUs (default 8).

Nothing in the product knows this exists: NVML is replaced only at the pynvml boundary.
"""

from __future__ import annotations

import os
from typing import Any

from tests.fakes.fake_pynvml import FakeNvml
from tests.fixtures_nvml import multi_gpu_scenario

_fake = FakeNvml(multi_gpu_scenario(int(os.environ.get("MF_TEST_GPUS", "8"))))


def __getattr__(name: str) -> Any:
    return getattr(_fake, name)
