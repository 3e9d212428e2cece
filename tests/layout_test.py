"""The monorepo's structure: one py_library per subpackage, common depends on no
platform, platforms depend on common only (Bazel deps and Python imports), every
subpackage has a test target, and `import flashjax` is light."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLATFORMS = ("xla_cpu", "pallas_tpu", "pallas_gpu", "triton_gpu")


def _build(pkg):
  return (ROOT / pkg / "BUILD").read_text()


@pytest.mark.parametrize("pkg", ("common",) + PLATFORMS)
def test_each_subpackage_has_a_library_and_a_test(pkg):
  text = _build(pkg)
  assert re.search(r'py_library\(\s*name = "%s"' % pkg, text)
  assert "py_test(" in text


def test_common_depends_on_no_platform():
  text = _build("common")
  for p in PLATFORMS:
    assert f"//{p}" not in text
  for path in (ROOT / "common").glob("*.py"):
    src = path.read_text()
    for p in PLATFORMS:
      assert not re.search(rf"^\s*(from|import) [.\w]*{p}", src, re.M), (path, p)


@pytest.mark.parametrize("pkg", PLATFORMS)
def test_platforms_depend_only_on_common(pkg):
  deps = re.findall(r'"//(\w+)', _build(pkg))
  assert set(deps) <= {"common", "tests", "visibility"}, deps


def test_workspace_is_named_flashjax_with_offline_stubs():
  ws = (ROOT / "WORKSPACE").read_text()
  assert 'workspace(name = "flashjax")' in ws
  for repo in ("rules_cc", "rules_java", "platforms", "remote_coverage_tools"):
    assert f'name = "{repo}"' in ws
    assert (ROOT / "third_party" / repo / "WORKSPACE").exists()


def test_import_is_light():
  code = ("import sys, flashjax, flashjax.common; "
          "bad = [m for m in sys.modules if m.split('.')[0] in "
          "('triton', 'jax_triton', 'pytest', 'hypothesis') or "
          "m.startswith(('flashjax.pallas', 'flashjax.triton_gpu'))]; "
          "print(bad); sys.exit(1 if bad else 0)")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert res.returncode == 0, res.stdout + res.stderr


def _imports_of_source(src, path):
  """Absolute names of the flashjax modules that ``src`` (the text of ``path``)
  imports, at any depth: lazy imports inside functions count."""
  parts = ["flashjax"] + list(path.relative_to(ROOT).with_suffix("").parts)
  package = parts[:-1]  # an __init__.py's package is its folder too
  found = []
  for node in ast.walk(ast.parse(src, str(path))):
    if isinstance(node, ast.Import):
      found += [a.name for a in node.names if a.name.split(".")[0] == "flashjax"]
    elif isinstance(node, ast.ImportFrom):
      base = package[:len(package) - node.level + 1] if node.level else []
      module = ".".join(base + ([node.module] if node.module else []))
      if module.split(".")[0] != "flashjax":
        continue
      if module == "flashjax":  # from .. import api, registry
        found += [f"flashjax.{a.name}" for a in node.names]
      else:
        found.append(module)
  return found


def _sources(pkg):
  """The package's Python files, its tests excepted (tests may use the frontend)."""
  return [p for p in sorted((ROOT / pkg).rglob("*.py")) if "tests" not in p.parts]


def _imports(path):
  return _imports_of_source(path.read_text(), path)


@pytest.mark.parametrize("pkg", PLATFORMS)
def test_platform_imports_only_common_and_itself(pkg):
  """No platform imports another platform or the frontend (api, registry,
  inference, ring, info, compat/): what platforms share lives in common/."""
  for path in _sources(pkg):
    for name in _imports(path):
      assert name.startswith(("flashjax.common.", f"flashjax.{pkg}.")) or name in (
          "flashjax.common", f"flashjax.{pkg}"), (str(path.relative_to(ROOT)), name)


def test_common_imports_no_platform_or_frontend():
  for path in _sources("common"):
    for name in _imports(path):
      assert name == "flashjax.common" or name.startswith("flashjax.common."), (
          str(path.relative_to(ROOT)), name)


def test_import_rules_see_relative_and_lazy_imports():
  """The rules above see relative imports at any depth, ``from .. import x`` and
  imports inside functions."""
  src = ("from .. import registry\nfrom ..common import spec\nfrom . import plan\n"
         "import jax\nfrom jax import numpy\n"
         "def f():\n  from ..xla_cpu import forward\n  import flashjax.api\n")
  names = _imports_of_source(src, ROOT / "triton_gpu" / "probe.py")
  assert sorted(names) == ["flashjax.api", "flashjax.common", "flashjax.registry",
                           "flashjax.triton_gpu", "flashjax.xla_cpu"], names
  assert _imports_of_source("from . import spec", ROOT / "common" / "__init__.py") == [
      "flashjax.common"]
