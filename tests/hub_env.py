"""The Hub environment of a test process: offline, no telemetry, a given cache, no kernels overrides.

It must be fixed before huggingface_hub is imported (it reads the environment at import): tests/conftest.py
does it for the pytest process, tests/distributed.py for each process it spawns.
"""

from __future__ import annotations

import os


def use_offline_hub(cache: str) -> None:
    """Make this process's Hub offline, with `cache` as its Hub cache folder."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=cache, HF_HUB_DISABLE_TELEMETRY="1")
    os.environ.pop("KERNELS_CACHE", None)
    os.environ.pop("LOCAL_KERNELS", None)
