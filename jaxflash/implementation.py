"""Which implementation runs a call: "cute" (the kernels) or "reference".

Shared by jaxflash.attention and jaxflash.kv_cache_attention. implementation=None (auto) takes
the kernels on a Hopper GPU when they cover the call and are installed or buildable, else the
reference: with a log line where no kernel covers the call, with a warning that says how to get
the kernel where only it is missing. implementation="cute" raises where auto would fall back.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from jaxflash import _jax_internal, user_warning

log = logging.getLogger("jaxflash")


def resolve(requested: Optional[str], support: tuple[bool, str],
            missing: Callable[[], str]) -> str:
  """Returns "cute" or "reference" for one call.

  support: config.kernel_support's (covered, reason) for the call. missing(): why a kernel the
  call needs is unavailable here ("" when each is installed or buildable), asked only where a
  CUDA device is visible. "cute" without a CUDA device lowers for a GPU that is elsewhere
  (jax.export).
  """
  if requested == "reference":
    return "reference"
  covered, reason = support
  if requested == "cute":
    if not covered:
      raise ValueError(f"implementation='cute': {reason}; use implementation=None (auto) or "
                       f"'reference'")
    if not _jax_internal.has_cuda_device():
      return "cute"
  elif not _jax_internal.has_hopper_device():
    return "reference"
  elif not covered:
    log.info("jaxflash: using the reference implementation: %s", reason)
    return "reference"
  why = missing()
  if not why:
    return "cute"
  if requested == "cute":
    raise ValueError(f"implementation='cute': {why}\nimplementation=None (auto) runs the "
                     f"reference meanwhile.")
  # Auto mode never fails for want of a build: it runs the reference and says how to build.
  user_warning.warn(f"{why}\njaxflash: running the reference implementation meanwhile.")
  return "reference"
