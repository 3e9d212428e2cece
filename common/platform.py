"""What the platforms share of their plumbing."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Static:
  """The static half of a kernel platform's call (hashable: ``custom_vjp``'s
  static argument): its resolved config and whether it runs interpreted."""

  config: Any
  interpret: bool = False
