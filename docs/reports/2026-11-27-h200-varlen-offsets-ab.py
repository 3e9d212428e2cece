"""Packed rows before and after ``flash_mha_varlen`` found each row's sequence
by one compare and sum with the offsets (few sequences) instead of a scatter
and a prefix sum. Arms in interleaved rounds, ids and offsets passed as jit
arguments:

* "prev" / "new": the tree before (importable as ``flashjax_prev``) and this
  tree, ``contiguous_segments=True``;
* "prev varlen" / "new varlen": their ``flash_mha_varlen``;
* "batched": this tree on the same documents as batched calls (one call per
  distinct length, benchmarks/packed.py);
* "fa3": flash-attn3-jax's ``flash_mha_varlen``, where it imports.

Forward, and forward + backward; each new arm is compared bitwise with its prev
arm."""
import jax, jax.numpy as jnp, numpy as np
from flashjax.benchmarks import packed as packed_lib
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
         ("mixed causal", shapes.MIXED_16K, True)]

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

  doc_shape = shapes.Shape(name=label, batch=1, seq_q=sum(docs), seq_k=sum(docs),
                           heads_q=H, heads_kv=H, head_dim=D, causal=causal,
                           documents=tuple(docs))
  batched = packed_lib._batched(
      lambda q, k, v, causal: new.flash_attention(q, k, v, causal=causal), doc_shape)
  arms = {"prev": packed(old), "new": packed(new), "prev varlen": varlen(old),
          "new varlen": varlen(new),
          "batched": lambda q, k, v, ids, cu: batched(q, k, v, causal)}
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
    same = lambda a, b: all(bool(jnp.array_equal(x, y)) for x, y in
                            zip(jax.tree.leaves(res[a]), jax.tree.leaves(res[b])))
    t = time_interleaved_ms(calls, iters=20, repeats=7)
    line = " | ".join(f"{n} {ms:.4f}" for n, ms in t.items())
    extra = (f" | fa3/new {t['fa3'] / t['new']:.3f} fa3/new-varlen "
             f"{t['fa3'] / t['new varlen']:.3f}" if "fa3" in t else "")
    print(f"{label:14s} {name:8s} ms {line} | prev/new {t['prev'] / t['new']:.3f} "
          f"varlen prev/new {t['prev varlen'] / t['new varlen']:.3f} | "
          f"batched/new {t['batched'] / t['new']:.3f} batched/new-varlen "
          f"{t['batched'] / t['new varlen']:.3f}{extra} | bit-equal new "
          f"{same('prev', 'new')} varlen {same('prev varlen', 'new varlen')}", flush=True)
