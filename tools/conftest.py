"""tools/ is a folder of the checkout, not of the installed package: its tests
import it as the top-level package ``tools`` from the repository root."""

import pathlib
import sys

_ROOT = str(pathlib.Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)
