"""The server says what its start-up is doing, one line a stage. (Lessons 07 and 10.)

Compiling the step and capturing CUDA graphs can take minutes, and silence would look like a
hang: each stage (loading the model, compiling graph 2 of 3, ...) is printed to standard error
as it begins, whatever the log level. ``serve_in_background`` follows these lines as it waits.
"""

from __future__ import annotations

import sys

#: What each start-up line holds, before the stage itself.
STAGE = "start-up: "


def report(message: str, *args) -> None:
    """Print one start-up line: ``report("compiling graph %d of %d", 1, 3)``."""
    print(f"helpers.server {STAGE}{message % args if args else message}", file=sys.stderr,
          flush=True)
