"""Packed causal rows against the same documents batched, one CTA per tile
("tile") and the balanced persistent launch ("bal"): per call, the GPU time of
each kernel from a jax.profiler trace of 20 calls (tools/launch_gaps.measure).
Run from the repository root with the package importable as flashjax."""
import sys, jax, jax.numpy as jnp, numpy as np
import flashjax
from tools.launch_gaps import measure
from flashjax.pallas_gpu.mosaic.config import MosaicConfig, MosaicForward
H, D = 16, 128
for docs in ((512,) * 32, (2048,) * 8):
  s = sum(docs); n = len(docs)
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (1, s, H, D), jnp.bfloat16) for kk in ks)
  ids = jnp.asarray(np.repeat(np.arange(n), docs)[None].astype(np.int32))
  qb, kb, vb = (x.reshape(n, docs[0], H, D) for x in (q, k, v))
  for launch in ("tile", "bal"):
    c = MosaicConfig(fwd=MosaicForward(persistent=launch == "bal"))
    for name, fn, args in (
        ("packed", lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True, segment_ids=(ids, ids), platform="pallas", config=c), (q, k, v)),
        ("batched", lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True, platform="pallas", config=c), (qb, kb, vb))):
      wall, (span, busy, idle, kernels) = measure(fn, args, 20)
      print(f"{n}x{docs[0]} {name:8s} {launch:5s} wall {wall:7.1f} span {span:7.1f} kernels {busy:7.1f} idle {idle:5.1f}")
      for kname, t in sorted(kernels.items(), key=lambda x: -x[1])[:8]:
        print(f"      {t:8.1f} us  {kname[:80]}")
      sys.stdout.flush()
