"""The learners' checks: one per "Your turn" exercise of the lessons (every lesson).

    from helpers.checks import check_merge_batches
    merge_batches = check_merge_batches(merge_batches, model, tokenizer)

A check compares the learner's code with the course's on a few cases, edge cases included,
prints one line (a pass, "not written yet", or the first difference as a hint) and returns
what the rest of the lesson should use: the learner's code when it passed, the course's
otherwise. ``core`` holds the machinery; each ``lessonNN`` module holds one lesson's checks;
``hints`` gives every exercise's hints on demand, ``hint("replay")``, one step at a time.
"""

from .core import Hint, run_check
from .hints import hint  # noqa: F401
from .lesson01 import *  # noqa: F401,F403
from .lesson02 import *  # noqa: F401,F403
from .lesson03 import check_filter_batch, check_merge_batches  # noqa: F401
from .lesson04 import *  # noqa: F401,F403
from .lesson05 import *  # noqa: F401,F403
from .lesson06 import *  # noqa: F401,F403
from .lesson07 import *  # noqa: F401,F403
from .lesson08 import *  # noqa: F401,F403
from .lesson09 import *  # noqa: F401,F403
from .lesson10 import *  # noqa: F401,F403
from .lesson11 import *  # noqa: F401,F403
