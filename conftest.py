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
