"""The monorepo's structure: one py_library per subpackage, common depends on no
platform, every subpackage has a test target, and `import flashjax` is light."""

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
