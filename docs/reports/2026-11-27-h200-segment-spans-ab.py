"""Mosaic kernels under segment ids, three arms in interleaved rounds: the tree
before ("before", importable as ``flashjax_prev``), this tree with the ids
("ids") and with ``contiguous_segments=True`` ("spans": masked steps compare
positions with each row's span of the other side, the band folded in). Packed
causal and full rows, a row ending in a padding id, and ids given as one array
for q and kv or as two (run F of the report timed spans found by scans for one
array and by a sort for two; run G the landed hash slots). Forward, and forward
+ backward; the ids are passed as arguments (ids closed over as constants let
XLA fold their preparation away); results compared bitwise with "before"."""
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic as new
from flashjax_prev.pallas_gpu import mosaic as old

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
H, D = 16, 128
CASES = [("8x2048 causal", (2048,) * 8, True, "one"),
         ("8x2048 causal, two id arrays", (2048,) * 8, True, "two"),
         ("32x512 causal", (512,) * 32, True, "one"),
         ("mixed causal", shapes.MIXED_16K, True, "one"),
         ("8x2048 full", (2048,) * 8, False, "one"),
         ("7x2048 + 2048 padding (-1) causal", (2048,) * 8, True, "padded")]


def operands(docs, kind):
  ks = jax.random.split(jax.random.key(0), 4)
  shape = (1, sum(docs), H, D)
  q, k, v, w = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in ks)
  ids = np.repeat(np.arange(len(docs)), docs)[None].astype(np.int32)
  if kind == "padded":
    ids[:, -docs[-1]:] = -1
  return (q, k, v), w, jnp.asarray(ids)


for label, docs, causal, kind in CASES:
  (q, k, v), w, ids = operands(docs, kind)
  two = kind == "two"
  args = (q, k, v, ids, jnp.array(ids) if two else ids)

  def call(m, **kw):
    def f(q, k, v, q_ids, kv_ids):
      seg = (q_ids, kv_ids) if two else (q_ids, q_ids)
      return m.flash_attention(q, k, v, causal=causal, segment_ids=seg,
                               return_lse=True, **kw)
    return f

  arms = {"before": call(old), "ids": call(new), "spans": call(new, contiguous_segments=True)}
  fwd = {n: (jax.jit(f), args) for n, f in arms.items()}
  loss = lambda f: (lambda q, k, v, a, b: jnp.sum(
      f(q, k, v, a, b)[0].astype(jnp.float32) * w.astype(jnp.float32)))
  grad = {n: (jax.jit(jax.grad(loss(f), argnums=(0, 1, 2))), args)
          for n, f in arms.items()}
  for name, calls in (("fwd", fwd), ("fwd+bwd", grad)):
    res = {n: jax.block_until_ready(f(*x)) for n, (f, x) in calls.items()}
    same = {n: all(bool(jnp.array_equal(x, y)) for x, y in
                   zip(jax.tree.leaves(res["before"]), jax.tree.leaves(r)))
            for n, r in res.items() if n != "before"}
    t = time_interleaved_ms(calls, iters=20, repeats=7)
    print(f"{label:34s} {name:8s} ms before {t['before']:.4f} | ids {t['ids']:.4f} | "
          f"spans {t['spans']:.4f} | before/spans {t['before'] / t['spans']:.3f} | "
          f"before/ids {t['before'] / t['ids']:.3f} | bit-equal ids {same['ids']} "
          f"spans {same['spans']}", flush=True)
