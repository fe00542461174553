"""The server says what its start-up is doing, one line a stage. (Lessons 07 and 10.)

A server that compiles its step and captures CUDA graphs before it answers anything can take
from seconds to minutes to start, depending on the machine and on what torch has kept in its
caches. Silence would look like a hang. So each stage is printed as it begins (loading the
model, compiling graph 2 of 3, capturing the graph for 8 rows, ...) and as it ends, on the
server's standard error, whatever its log level: ``serve_in_background`` reads these lines to
wait for a start-up that is getting on, and to say where one got stuck.
"""

from __future__ import annotations

import sys

#: What each start-up line holds, before the stage itself.
STAGE = "start-up: "


def report(message: str, *args) -> None:
    """Print one start-up line: ``report("compiling graph %d of %d", 1, 3)``."""
    print(f"helpers.server {STAGE}{message % args if args else message}", file=sys.stderr,
          flush=True)
