"""Packed Mosaic forward: segment ids streamed with K ("ids") or each row's key
range ("ranges", FLASHJAX_MOSAIC_DOCUMENTS=1, read when the call is traced), each
with one CTA per tile ("tile") and the balanced persistent launch ("bal"); the
same documents batched beside them. Full forward calls, interleaved rounds."""
import os
import jax, jax.numpy as jnp, numpy as np
import flashjax
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic.config import MosaicConfig, MosaicForward

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
H, D = 16, 128
CASES = [((2048,) * 8, True), ((512,) * 32, True), (shapes.MIXED_16K, True),
         ((2048,) * 8, False)]


def cfg(persistent):
  return MosaicConfig(fwd=MosaicForward(persistent=persistent))


for docs, causal in CASES:
  s = sum(docs)
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (1, s, H, D), jnp.bfloat16) for kk in ks)
  ids = jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None].astype(np.int32))
  calls, results = {}, {}
  for mode in ("ids", "ranges"):
    os.environ["FLASHJAX_MOSAIC_DOCUMENTS"] = "1" if mode == "ranges" else "0"
    jax.clear_caches()  # the geometry is read when traced: trace again
    for launch in (("tile", "bal") if causal else ("bal",)):
      f = jax.jit(lambda q, k, v, c=cfg(launch == "bal"): flashjax.flash_attention(
          q, k, v, causal=causal, segment_ids=(ids, ids), return_lse=True,
          platform="pallas", config=c)).lower(q, k, v).compile()
      hlo = f.as_text()
      assert (f"s32[1,2,{s}]" in hlo) == (mode == "ranges"), mode
      calls[f"{mode}/{launch}"] = (f, (q, k, v))
      results[f"{mode}/{launch}"] = jax.block_until_ready(f(q, k, v))
  os.environ["FLASHJAX_MOSAIC_DOCUMENTS"] = "0"
  if len(set(docs)) == 1:
    n = len(docs)
    qb, kb, vb = (x.reshape(n, docs[0], H, D) for x in (q, k, v))
    for launch in (("tile", "bal") if causal else ("bal",)):
      f = jax.jit(lambda q, k, v, c=cfg(launch == "bal"): flashjax.flash_attention(
          q, k, v, causal=causal, platform="pallas", config=c))
      calls[f"batched/{launch}"] = (f, (qb, kb, vb))
  (o0, l0) = results["ids/bal"]
  same = {m: bool(jnp.array_equal(o0, o)) and bool(jnp.array_equal(l0, l))
          for m, (o, l) in results.items()}
  t = time_interleaved_ms(calls, iters=20, repeats=7)
  label = f"{len(docs)} docs{' causal' if causal else ''}"
  base = t["ids/tile" if causal else "ids/bal"]
  print(f"{label}: bit-equal to ids/bal {same}", flush=True)
  for m, ms in t.items():
    print(f"  {label:16s} {m:14s} {ms:.4f} ms  ids/{'tile' if causal else 'bal'} over "
          f"this {base / ms:.3f}", flush=True)
