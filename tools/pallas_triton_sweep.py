"""Device-run sweep of Pallas-Triton forward tiles on a shape set, with JAX's
Pallas-Triton example timed in the same process for ratios.

  python -m tools.pallas_triton_sweep [shape_set] [cand ...]

A candidate is ``block_q,block_kv,num_warps,num_stages`` (e.g. ``128,64,8,3``);
``-`` is the default config. Trailing ``,fold``/``,nofold`` and ``,split``/
``,nosplit`` set ``TritonForward.fold_causal`` and ``split_tail`` (e.g.
``-,nosplit``); without them the default's stand.
"""

import functools
import sys

from tools import sweeps
from flashjax.benchmarks.impls import _jax_pallas_triton
from flashjax.common import configs
from flashjax.common.spec import canonicalize
from flashjax.pallas_gpu.triton import pallas_triton

DEFAULT = ["-", "128,64,8,3", "128,64,8,4"]


def _config(text, q, k, v, causal):
  _, spec = canonicalize(q, k, v, causal=causal)
  base = pallas_triton.default_config(spec)
  parts = text.split(",")
  flags = {"fold": "fold_causal", "split": "split_tail"}
  while parts[-1].removeprefix("no") in flags:
    flag = parts.pop()
    base = configs.with_part(
        base, "fwd", **{flags[flag.removeprefix("no")]: not flag.startswith("no")})
  if parts == ["-"]:
    return base
  bq, bk, w, s = (int(x) for x in parts)
  return configs.with_part(base, "fwd", block_q=bq, block_kv=bk, num_warps=w,
                           num_stages=s)


def main():
  example = _jax_pallas_triton()
  sweeps.forward_rows(
      sys.argv[1] if len(sys.argv) > 1 else "standard", sys.argv[2:] or DEFAULT,
      "example", lambda shp: lambda q, k, v: example(q, k, v, shp.causal),
      lambda text, shp, q, k, v: functools.partial(
          pallas_triton.flash_attention, causal=shp.causal,
          config=_config(text, q, k, v, shp.causal)))

if __name__ == "__main__":
  main()
