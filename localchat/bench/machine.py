"""What a result was measured on: hardware, library versions, peak memory."""

from __future__ import annotations

import os
import platform
import resource
import sys
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> dict:
    cuda = torch.cuda.is_available()
    return {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "platform": platform.platform(),
    }


def versions() -> dict:
    import transformers

    from localchat import __version__

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "localchat": __version__}


def max_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
