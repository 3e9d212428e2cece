"""The decode loop of docs/inference.md runs as written, and its last output is
causal attention over the whole sequence of inputs."""

import pathlib
import re

import jax.numpy as jnp
import numpy as np

from flashjax.common import reference, tolerances

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "inference.md"


def test_decode_loop_example_matches_attention_over_the_whole_sequence():
  blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
  assert len(blocks) == 1, "docs/inference.md should hold one python example"
  ns = {}
  exec(compile(blocks[0], "docs/inference.md[python]", "exec"), ns)
  np.testing.assert_array_equal(np.asarray(ns["lengths"]), [15, 15])
  seq = jnp.concatenate(ns["inputs"], axis=1)  # [B, 15, D]
  q, k, v = ns["project"](seq)
  want = reference.attention(q, k, v, causal=True)[:, -1:]
  tolerances.assert_close(ns["out"], want, tolerances.forward("float32"),
                          name="last decode output")
