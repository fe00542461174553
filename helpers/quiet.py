"""Keeping library noise out of a lesson's output: a block with stderr hidden, and torchao's
import done quietly.

The lowest layer of the package: it imports nothing from ``helpers``, so any module may use
it. ``models`` calls ``import_torchao`` before loading a model (transformers imports torchao
then, noisily); lesson 04 calls it before using torchao; lessons 05 and 06 wrap ``quiet_stderr``
around transformers and peft calls whose warnings do not concern the lesson.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings

# Loggers that print on stderr while torchao is imported on a machine without its CUDA
# extensions: "Failed to load ..._C_mxfp8..." (torchao) and "... is an Enum subclass ..."
# (torch's pytree registry, called by torchao).
_NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_stderr():
    """Hide what is written to stderr inside the block: Python warnings, log records and
    output written straight to file descriptor 2 by native code. (Lesson 04.)

    Used around torchao's import, whose warnings about CUDA extensions it cannot load on a
    CPU machine would otherwise land in the notebook's output. Errors still raise.
    """
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    saved_fd = None
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no usable fd 2: skip it
        sys.stderr.flush()
        saved_fd = os.dup(2)
    if saved_fd is not None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    try:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if saved_fd is not None:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)


def import_torchao(missing_ok: bool = False):
    """Import torchao without its import-time noise on stderr; return the module. (Lesson 04.)

    Once torchao is installed, transformers imports it too whenever a model class is loaded,
    so calling this first (before ``load_model``) keeps every later cell clean as well.
    Raises ImportError with the install command when torchao is missing, or returns None
    then if ``missing_ok``.
    """
    if sys.modules.get("torchao") is not None:
        return sys.modules["torchao"]
    try:
        with quiet_stderr():
            import torchao
            import torchao.quantization  # noqa: F401  (its submodules log too)
    except ImportError as err:
        if missing_ok:
            return None
        raise ImportError("torchao is not installed; install it with `pip install torchao` "
                          "(lesson 04 uses it for its int8 weight-only path)") from err
    with quiet_stderr():  # transformers' torchao bridge imports more of torchao, noisily
        with contextlib.suppress(ImportError):
            import transformers.quantizers.auto  # noqa: F401
    return torchao
