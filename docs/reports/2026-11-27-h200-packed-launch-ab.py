"""The packed causal forward's launch with its ids as jit arguments: the
persistent launch walking the tiles in the balanced order that the device ranks
from the ids (the default up to 16384 keys), against one CTA per q tile (no
order to compute). Contiguous segments (``contiguous_segments=True``) and ids;
interleaved rounds, forward and forward + backward, outputs compared bitwise."""
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import shapes
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import config as mosaic_config
import flashjax

print(jax.devices()[0].device_kind, jax.__version__, flush=True)
H, D = 16, 128
CASES = [("8x2048 causal", (2048,) * 8), ("32x512 causal", (512,) * 32),
         ("mixed causal", shapes.MIXED_16K)]

for label, docs in CASES:
  ks = jax.random.split(jax.random.key(0), 4)
  shape = (1, sum(docs), H, D)
  q, k, v, w = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in ks)
  ids = jnp.asarray(np.repeat(np.arange(len(docs)), docs)[None].astype(np.int32))
  spec = flashjax.common.spec.canonicalize(
      q, k, v, causal=True, segment_ids=(ids, ids), contiguous_segments=True)[1]
  base = mosaic_config.default_config(spec)
  tiles = dataclasses.replace(base, fwd=dataclasses.replace(base.fwd, persistent=False))

  def arm(cfg, runs):
    return lambda q, k, v, ids: flashjax.flash_attention(
        q, k, v, causal=True, segment_ids=(ids, ids), contiguous_segments=runs,
        config=cfg)

  arms = {"balanced": arm(base, True), "per-tile": arm(tiles, True),
          "ids balanced": arm(base, False), "ids per-tile": arm(tiles, False)}
  args = (q, k, v, ids)
  fwd = {n: (jax.jit(f), args) for n, f in arms.items()}
  loss = lambda f: (lambda q, k, v, a: jnp.sum(
      f(q, k, v, a).astype(jnp.float32) * w.astype(jnp.float32)))
  grad = {n: (jax.jit(jax.grad(loss(f), argnums=(0, 1, 2))), args)
          for n, f in arms.items()}
  for name, calls in (("fwd", fwd), ("fwd+bwd", grad)):
    res = {n: jax.block_until_ready(f(*x)) for n, (f, x) in calls.items()}
    same = lambda a, b: all(bool(jnp.array_equal(x, y)) for x, y in
                            zip(jax.tree.leaves(res[a]), jax.tree.leaves(res[b])))
    t = time_interleaved_ms(calls, iters=20, repeats=7)
    line = " | ".join(f"{n} {ms:.4f}" for n, ms in t.items())
    print(f"{label:14s} {name:8s} ms {line} | per-tile/balanced "
          f"{t['per-tile'] / t['balanced']:.3f} ids {t['ids per-tile'] / t['ids balanced']:.3f}"
          f" | bit-equal {same('balanced', 'per-tile')} ids "
          f"{same('ids balanced', 'ids per-tile')}", flush=True)
