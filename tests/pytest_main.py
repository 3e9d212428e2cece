"""Runs one test file under pytest: the `main` of every py_test target."""

import os
import sys

import pytest

if __name__ == "__main__":
  path = sys.argv[1]
  args = [path, "-q", "-p", "no:cacheprovider",
          "-o", "python_files=*_test.py"]
  # Bazel sets this when it wants a JUnit report.
  if os.environ.get("XML_OUTPUT_FILE"):
    args.append("--junitxml=" + os.environ["XML_OUTPUT_FILE"])
  sys.exit(pytest.main(args + sys.argv[2:]))
