"""Forward tiles beside an additive tile, one process: ratios to the plain call.

  python3 2026-11-28-h200-bias-forward-tile-ab.py [fwd|bwd]

"bias 64" / "bias 128": a [1, H, S, S] bf16 bias with 64- or 128-key forward
blocks; "mask 128 own O": a mask alone with the output's own staging buffer
(patched in: the kept default stages it in Q's buffer, "mask 128 O in Q");
"plain 3 stages": no bias, three K/V stages of 128 keys.
"""
import sys
import jax, jax.numpy as jnp
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu import mosaic
from flashjax.pallas_gpu.mosaic import fwd as mfwd

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
f32 = lambda x: x.astype(jnp.float32)
which = sys.argv[1] if len(sys.argv) > 1 else "fwd"
shapes = [(8, 2048, False), (8, 2048, True), (2, 8192, False), (2, 8192, True)]
Cfg, Fwd = mosaic.MosaicConfig, mosaic.MosaicForward
for b, s, causal in shapes:
  h, d = 16, 128
  ks = jax.random.split(jax.random.key(0), 6)
  q, k, v, do = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:4])
  bias = jax.random.normal(ks[4], (1, h, s, s), jnp.bfloat16)
  mask = jax.random.bernoulli(ks[5], 0.9, (b, 1, s, s))

  def build(cfg=None, own_o=False, **kw):
    def fwd(q, k, v, *x):
      extra = dict(kw)
      if x:
        extra["bias"] = x[0]
      return mosaic.flash_attention(q, k, v, causal=causal, config=cfg, **extra)
    if which == "fwd":
      fn = fwd
    else:
      def loss(q, k, v, *x):
        return jnp.sum(f32(fwd(q, k, v, *x)) * f32(do))
      fn = jax.grad(loss, (0, 1, 2, 3) if "bias" in kw else (0, 1, 2))
    args = (q, k, v) + ((bias,) if "bias" in kw else ())
    if "bias" in kw:
      kw.pop("bias")
    saved = mfwd.separate_out_smem
    if own_o:
      mfwd.separate_out_smem = lambda g: mfwd.smem_bytes(g, True) <= mfwd.SMEM_BYTES
    try:
      c = jax.jit(fn).lower(*args).compile()
    finally:
      mfwd.separate_out_smem = saved
    return c, args

  calls = {"plain": build(),
           "plain 3 stages": build(Cfg(fwd=Fwd(block_kv=128, num_stages=3))),
           "bias 64": build(Cfg(fwd=Fwd(block_kv=64)), bias=bias),
           "bias 128": build(Cfg(fwd=Fwd(block_kv=128)), bias=bias),
           "mask 128 own O": build(Cfg(fwd=Fwd(block_kv=128)), own_o=True, mask=mask),
           "mask 128 O in Q": build(Cfg(fwd=Fwd(block_kv=128)), mask=mask)}
  if which != "fwd":
    del calls["plain 3 stages"], calls["mask 128 O in Q"]
  t = time_interleaved_ms(calls, iters=10, repeats=5)
  base = t["plain"]
  print(f"{which} B{b} S{s}{' causal' if causal else ''} ms: " + " | ".join(
      f"{n} {x:.3f} ({base / x:.3f})" for n, x in t.items()), flush=True)
