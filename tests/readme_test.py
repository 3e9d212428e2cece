"""Every ```python block of README.md runs as written (in order, one namespace)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_examples_run():
  text = README.read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert blocks, "README has no python examples"
  namespace = {}
  for i, code in enumerate(blocks):
    try:
      exec(compile(code, f"README.md[python block {i}]", "exec"), namespace)
    except Exception as e:
      raise AssertionError(f"README python block {i} failed: {e!r}\n{code}") from e
