"""A/B: the persistent forward reading each tile's walk a tile ahead (this tree)
against the same kernel reading it at the tile start (flashjax_prev, db73a02)."""
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import configs, spec as spec_lib
from flashjax.common.shapes import MIXED_16K
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import mosaic
from flashjax_prev.pallas_gpu.mosaic import mosaic as mosaic_prev
try:
  import flash_attn3_jax
except Exception as e:
  print("no fa3", e); flash_attn3_jax = None

H, D = 16, 128
sets = [(2048,) * 8, (512,) * 32, MIXED_16K]
print(jax.devices(), flush=True)
for docs in sets:
  for causal in (True, False):
    S = sum(docs)
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (1, S, H, D), jnp.bfloat16) for kk in ks)
    ids = jnp.asarray(np.repeat(np.arange(len(docs), dtype=np.int32), docs)[None])
    spec = spec_lib.canonicalize(q, k, v, causal=causal, segment_ids=(ids, ids))[1]
    calls = {}
    for name, mod in (("new", mosaic), ("prev", mosaic_prev)):
      base = mod.default_config(spec)
      bal = configs.with_part(base, "fwd", persistent=True, balanced=True)
      one = configs.with_part(base, "fwd", persistent=False, balanced=None)
      mk = lambda cfg, mod=mod: jax.jit(lambda q, k, v: mod.flash_attention(
          q, k, v, causal=causal, segment_ids=(ids, ids), config=cfg))
      calls[f"{name} balanced"] = (mk(bal), (q, k, v))
      calls[f"{name} one per tile"] = (mk(one), (q, k, v))
      if len(set(docs)) == 1:
        n, L = len(docs), docs[0]
        r = lambda x: x.reshape(n, L, H, D)
        calls[f"{name} batched"] = (jax.jit(lambda q, k, v, mod=mod: mod.flash_attention(
            q, k, v, causal=causal)), (r(q), r(k), r(v)))
    if flash_attn3_jax is not None:
      cu = jnp.asarray(np.concatenate([[0], np.cumsum(docs)]).astype(np.int32))
      calls["fa3 varlen"] = (jax.jit(lambda q, k, v: flash_attn3_jax.flash_mha_varlen(
          q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(docs),
          max_seqlen_k=max(docs), is_causal=causal)), (q, k, v))
    same = [bool(jnp.array_equal(calls[f"new {x}"][0](q, k, v), calls[f"prev {x}"][0](q, k, v)))
            for x in ("balanced", "one per tile")]
    t = time_interleaved_ms(calls, iters=20, repeats=7)
    name = f"{len(docs)}x{docs[0]}" if len(set(docs)) == 1 else "mixed16k"
    base_t = t["prev balanced"]
    print(f"{name} causal={causal} bit-equal={same} " + " | ".join(
        f"{n} {x:.4f} ms ({base_t / x:.3f}x)" for n, x in t.items()), flush=True)
