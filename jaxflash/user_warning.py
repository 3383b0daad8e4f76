"""Warnings that name the user's line: the first frame outside the jaxflash package, however
many of jaxflash's frames (public entry points, tracing, lowering) lead from it to the warning.
Imports the standard library only."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message: str, category: type = RuntimeWarning) -> None:
  """warnings.warn(message, category), attributed to the first frame outside jaxflash."""
  frame, level = sys._getframe(1), 2  # stacklevel 2: this function's caller
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)
