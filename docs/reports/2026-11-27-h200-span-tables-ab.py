"""The preparation of contiguous segments' operands, before and after it was cut
to fewer XLA kernels (the visible-block table reduced from the spans instead of
the ids' block ranges, one scatter for each run's two ends, the persistent
launch's table seated by one scatter). Arms in interleaved rounds, ids (and
offsets) passed as jit arguments:

* "before": the tree before (importable as ``flashjax_prev``), with
  ``contiguous_segments=True``;
* "after": this tree, the same call;
* "varlen": this tree's ``flash_mha_varlen`` on the same documents;
* "fa3": flash-attn3-jax's ``flash_mha_varlen``, where it imports.

Forward, and forward + backward; "after" and "varlen" are compared bitwise with
"before"."""
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
import flashjax as new
import flashjax_prev as old

try:
  import flash_attn3_jax as fa3
except ImportError:
  fa3 = None

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
H, D = 16, 128
CASES = [("8x2048 causal", (2048,) * 8, True),
         ("32x512 causal", (512,) * 32, True),
         ("mixed causal", shapes.MIXED_16K, True),
         ("8x2048 full", (2048,) * 8, False),
         ("32x512 full", (512,) * 32, False)]

for label, docs, causal in CASES:
  ks = jax.random.split(jax.random.key(0), 4)
  shape = (1, sum(docs), H, D)
  q, k, v, w = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in ks)
  ids = jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None].astype(np.int32))
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(docs)]).astype(np.int32))
  longest = max(docs)

  def packed(m):
    return lambda q, k, v, ids, cu: m.flash_attention(
        q, k, v, causal=causal, segment_ids=(ids, ids), contiguous_segments=True)

  def varlen(m):
    return lambda q, k, v, ids, cu: m.flash_mha_varlen(
        q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
        max_seqlen_k=longest, is_causal=causal)[None]

  arms = {"before": packed(old), "after": packed(new), "varlen": varlen(new)}
  if fa3 is not None:
    arms["fa3"] = varlen(fa3)
  args = (q, k, v, ids, cu)
  fwd = {n: (jax.jit(f), args) for n, f in arms.items()}
  loss = lambda f: (lambda q, k, v, a, b: jnp.sum(
      f(q, k, v, a, b).astype(jnp.float32) * w.astype(jnp.float32)))
  grad = {n: (jax.jit(jax.grad(loss(f), argnums=(0, 1, 2))), args)
          for n, f in arms.items()}
  for name, calls in (("fwd", fwd), ("fwd+bwd", grad)):
    res = {n: jax.block_until_ready(f(*x)) for n, (f, x) in calls.items()}
    same = {n: all(bool(jnp.array_equal(x, y)) for x, y in
                   zip(jax.tree.leaves(res["before"]), jax.tree.leaves(res[n])))
            for n in ("after", "varlen")}
    t = time_interleaved_ms(calls, iters=20, repeats=7)
    line = " | ".join(f"{n} {ms:.4f}" for n, ms in t.items())
    extra = f" | fa3/after {t['fa3'] / t['after']:.3f}" if "fa3" in t else ""
    print(f"{label:14s} {name:8s} ms {line} | before/after {t['before'] / t['after']:.3f}"
          f"{extra} | bit-equal after {same['after']} varlen {same['varlen']}", flush=True)
