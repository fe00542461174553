"""The server prints each stage of its start-up (compiling, capturing CUDA graphs can take
minutes: silence would look like a hang) to stderr, whatever the log level; ``serve_in_background``
follows these lines as it waits. (Lessons 07 and 10.)
"""

from __future__ import annotations

import sys

STAGE = "start-up: "


def report(message: str, *args) -> None:
    """Print one start-up line: ``report("compiling graph %d of %d", 1, 3)``."""
    print(f"helpers.server {STAGE}{message % args if args else message}", file=sys.stderr,
          flush=True)
