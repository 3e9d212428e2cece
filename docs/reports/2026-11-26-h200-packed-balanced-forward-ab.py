"""A/B: packed rows' forward, one CTA per tile vs persistent balanced by the device."""

import jax, jax.numpy as jnp, numpy as np
from flashjax.common import configs, spec as spec_lib
from flashjax.common.shapes import MIXED_16K
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import mosaic
try:
  import flash_attn3_jax
except Exception as e:
  print("no fa3", e); flash_attn3_jax = None

H, D = 16, 128
sets = [(2048,) * 8, (512,) * 32, MIXED_16K, (2048,) * 16]
print(jax.devices(), flush=True)
for docs in sets:
  for causal in (True, False):
    S = sum(docs)
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, S, H, D), jnp.bfloat16) for kk in ks)
    ids = jnp.asarray(np.repeat(np.arange(len(docs), dtype=np.int32), docs)[None])
    spec = spec_lib.canonicalize(q, k, v, causal=causal, segment_ids=(ids, ids))[1]
    base = mosaic.default_config(spec)
    bal = configs.with_part(base, "fwd", persistent=True, balanced=True)
    one = configs.with_part(base, "fwd", persistent=False, balanced=None)
    mk = lambda cfg: jax.jit(lambda q, k, v: mosaic.flash_attention(
        q, k, v, causal=causal, segment_ids=(ids, ids), config=cfg))
    rr = configs.with_part(base, "fwd", persistent=True, balanced=False)
    calls = {"one CTA per tile": (mk(one), (q, k, v)), "balanced": (mk(bal), (q, k, v)),
             "round robin": (mk(rr), (q, k, v))}
    # The order alone, and the kernel with the order computed ahead (a constant).
    from flashjax.pallas_gpu.mosaic import blocks, fwd as fwd_mod
    g = mosaic.geometry(spec, bal)
    order_fn = jax.jit(lambda i: blocks.balanced_order(g, mosaic.segment_operands(
        spec_lib.Operands(q=None, k=None, v=None, q_segment_ids=i, kv_segment_ids=i), g)[2]))
    table = jax.block_until_ready(order_fn(ids))
    calls["order alone"] = (order_fn, (ids,))
    real = blocks.balanced_order
    fwd_mod.balanced_order = lambda g, visible=None: table if visible is not None else real(g)
    calls["balanced, order ahead"] = (mk(bal), (q, k, v))
    if len(set(docs)) == 1:
      n, L = len(docs), docs[0]
      r = lambda x: x.reshape(n, L, H, D)
      calls["batched"] = (jax.jit(lambda q, k, v: mosaic.flash_attention(
          q, k, v, causal=causal)), (r(q), r(k), r(v)))
    if flash_attn3_jax is not None:
      cu = jnp.asarray(np.concatenate([[0], np.cumsum(docs)]).astype(np.int32))
      calls["fa3 varlen"] = (jax.jit(lambda q, k, v: flash_attn3_jax.flash_mha_varlen(
          q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(docs),
          max_seqlen_k=max(docs), is_causal=causal)), (q, k, v))
    a = calls["one CTA per tile"][0](q, k, v); b = calls["balanced"][0](q, k, v)
    same = bool(jnp.array_equal(a, b))
    t = time_interleaved_ms(calls, iters=20, repeats=7)
    fwd_mod.balanced_order = real
    name = f"{len(docs)}x{docs[0]}" if len(set(docs)) == 1 else "mixed16k"
    base_t = t["one CTA per tile"]
    print(f"{name} causal={causal} bit-equal={same} " + " | ".join(
        f"{n} {x:.4f} ms ({base_t / x:.3f}x)" if isinstance(x, float) else f"{n} {x!r}"
        for n, x in t.items()), flush=True)
