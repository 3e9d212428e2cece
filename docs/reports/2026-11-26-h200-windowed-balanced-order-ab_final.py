"""Full calls: the windowed balanced order (this tree) against db73a02 (flashjax_prev)."""
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import configs, spec as spec_lib
from flashjax.common.shapes import MIXED_16K
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import mosaic, blocks
from flashjax_prev.common import configs as configs_p, spec as spec_p
from flashjax_prev.pallas_gpu.mosaic import mosaic as mosaic_p, blocks as blocks_p
try:
  import flash_attn3_jax
except Exception as e:
  print("no fa3", e); flash_attn3_jax = None
H, D = 16, 128
cases = [("8x2048", (2048,) * 8, True), ("8x2048", (2048,) * 8, False),
         ("mixed", MIXED_16K, True), ("mixed", MIXED_16K, False),
         ("32x512", (512,) * 32, True), ("32x512", (512,) * 32, False),
         ("B8 S2k", (8, 2048), None), ("B4 S4k", (4, 4096), None),
         ("B2 S8k", (2, 8192), None), ("B1 S16k", (1, 16384), None)]
print(jax.devices(), flush=True)
for name, shape, causal in cases:
  packed = causal is not None
  if packed:
    B, S = 1, sum(shape)
    ids = jnp.asarray(np.repeat(np.arange(len(shape), dtype=np.int32), shape)[None])
    seg = dict(segment_ids=(ids, ids))
  else:
    (B, S), causal, seg, ids = shape, True, {}, None
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
  calls = {}
  for tag, mod, cf, sp, bl in (("new", mosaic, configs, spec_lib, blocks),
                               ("prev", mosaic_p, configs_p, spec_p, blocks_p)):
    spec = sp.canonicalize(q, k, v, causal=causal, **seg)[1]
    base = mod.default_config(spec)
    f = lambda cfg, mod=mod: jax.jit(lambda q, k, v: mod.flash_attention(
        q, k, v, causal=causal, config=cfg, **seg))
    calls[f"{tag} default"] = (f(base), (q, k, v))
    g = mod.geometry(spec, base)
    if not g.persistent_ctas:
      calls[f"{tag} persistent"] = (f(cf.with_part(base, "fwd", persistent=True)), (q, k, v))
    if packed:
      gb = mod.geometry(spec, cf.with_part(base, "fwd", persistent=True))
      calls[f"{tag} order alone"] = (jax.jit(lambda i, mod=mod, bl=bl, gb=gb, sp=sp: bl.balanced_order(
          gb, mod.segment_operands(sp.Operands(q=None, k=None, v=None, q_segment_ids=i,
                                               kv_segment_ids=i), gb)[2])), (ids,))
  if flash_attn3_jax is not None:
    if packed:
      docs = shape
      cu = jnp.asarray(np.concatenate([[0], np.cumsum(docs)]).astype(np.int32))
      calls["fa3"] = (jax.jit(lambda q, k, v: flash_attn3_jax.flash_mha_varlen(
          q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(docs),
          max_seqlen_k=max(docs), is_causal=causal)), (q, k, v))
    else:
      calls["fa3"] = (jax.jit(lambda q, k, v: flash_attn3_jax.flash_mha(
          q, k, v, is_causal=True)), (q, k, v))
  outs = {n: c[0](*c[1]) for n, c in calls.items() if "order" not in n and n != "fa3"}
  ref = outs["prev default"]
  same = {n: bool(jnp.array_equal(ref, o)) for n, o in outs.items()}
  t = time_interleaved_ms(calls, iters=20, repeats=9)
  b = t["prev default"]
  print(f"{name} causal={causal} equal={same}\n   " + " | ".join(
      f"{n} {x:.4f} ms ({b / x:.3f}x)" for n, x in t.items()), flush=True)
