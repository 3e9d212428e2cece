"""pytest configuration for running the suite from a checkout.

The repository root is the package ``flashjax`` (see docs/DESIGN.md), so every test
directory sits inside packages. pytest imports each package's ``__init__.py`` to
look for package-level setup functions, naming it after the checkout's folder; in a
clone whose folder is not a valid identifier (``ci-check``) the root and platform
packages are then imported as top-level modules and their relative imports fail.
flashjax's packages define no setup functions, so that import is skipped: tests
import the installed ``flashjax`` like any user.
"""

import _pytest.python

_pytest.python.Package.setup = lambda self: None

import importlib.util
import os

# On a host without an accelerator the suite is bound by XLA's CPU compiles: with
# LLVM at -O0 the xla and Pallas-Triton interpret suites ran in 45-60% of their
# time (2-core VM, 2026-11-27). Where a GPU or TPU plugin is installed the flag
# is left alone, so that kernels around the GPU tests compile as users get them.
_ACCELERATED = os.environ.get("JAX_PLATFORMS", "") != "cpu" and any(
    importlib.util.find_spec(name) for name in ("jax_plugins", "libtpu"))
if not _ACCELERATED:
  from flashjax.common.env import with_xla_flags
  os.environ["XLA_FLAGS"] = with_xla_flags("--xla_backend_optimization_level=0")


def pytest_collection_modifyitems(config, items):
  """Deselects the tests a conformance suite instance leaves out
  (``ConformanceSuite.SUBSET``)."""
  from flashjax.common.conformance import split_by_subset
  keep, drop = split_by_subset(items)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
