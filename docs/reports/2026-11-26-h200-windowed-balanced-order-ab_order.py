"""Which balanced order for the persistent forward: the kernel alone (fwd.forward),
its order injected as a constant. Arms: one CTA per tile; snake over all tiles
(db73a02's device order); host least-loaded-first (db73a02's host order);
windowed deal (this tree)."""
import heapq, sys
import jax, jax.numpy as jnp, numpy as np
from flashjax.common import spec as spec_lib
from flashjax.common.shapes import MIXED_16K
from flashjax.common.timer import time_interleaved_ms
from flashjax.pallas_gpu.mosaic import mosaic, blocks, fwd as fwd_mod
from flashjax.common import configs

def snake(steps, ctas):
  n = len(steps); rounds = -(-n // ctas)
  by = np.argsort(-steps, kind="stable")
  tab = np.zeros((ctas, 2 + rounds), np.int32)
  for c in range(ctas):
    mine = [by[r * ctas + (c if r % 2 == 0 else ctas - 1 - c)] for r in range(rounds)
            if r * ctas + (c if r % 2 == 0 else ctas - 1 - c) < n]
    tab[c, 0] = len(mine); tab[c, 1:1 + len(mine)] = sorted(mine)
  return tab

def lpt(steps, ctas):
  return lptw(steps, ctas, w=10**9)  # one window: every tile longest first

def lptw(steps, ctas, w=4):
  n = len(steps); rounds = -(-n // ctas)
  heap = [(0.0, c) for c in range(ctas)]; mine = [[] for _ in range(ctas)]
  for t in sorted(range(n), key=lambda t: (t // (w * ctas), -steps[t])):
    load, c = heapq.heappop(heap); mine[c].append(t); heapq.heappush(heap, (load + steps[t] + 1, c))
  width = max(2 + rounds, 2 + max(len(m) for m in mine))
  tab = np.zeros((ctas, width), np.int32)
  for c, m in enumerate(mine):
    tab[c, 0] = len(m); tab[c, 1:1 + len(m)] = sorted(m)
  return tab

def windowed(steps, ctas):
  return blocks._deal(np.asarray(steps, np.int32), ctas, int(max(steps)), np)

H, D = 16, 128
cases = [("8x2048 packed", (2048,) * 8, True), ("mixed packed", MIXED_16K, True),
         ("32x512 packed", (512,) * 32, True),
         ("B8 S2k", None, (8, 2048)), ("B4 S4k", None, (4, 4096)), ("B2 S8k", None, (2, 8192))]
from flashjax_prev.pallas_gpu.mosaic import mosaic as mosaic_prev
real = fwd_mod.balanced_order
print(jax.devices(), flush=True)
for name, docs, arg in cases:
  if docs is not None:
    causal = arg; B, S = 1, sum(docs)
    ids = jnp.asarray(np.repeat(np.arange(len(docs), dtype=np.int32), docs)[None])
    seg = dict(segment_ids=(ids, ids))
  else:
    causal = True; B, S = arg; ids = None; seg = {}
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.bfloat16) for kk in ks)
  spec = spec_lib.canonicalize(q, k, v, causal=causal, **seg)[1]
  base = mosaic.default_config(spec)
  bal = configs.with_part(base, "fwd", persistent=True, balanced=True)
  one = configs.with_part(base, "fwd", persistent=False, balanced=None)
  g = mosaic.geometry(spec, bal); g1 = mosaic.geometry(spec, one)
  ops = spec_lib.Operands(q=q, k=k, v=v, q_segment_ids=ids, kv_segment_ids=ids)
  if ids is not None:
    visible = mosaic.segment_operands(ops, g)[2]
    steps = np.asarray(blocks.tile_steps(g, visible))
  else:
    steps = np.asarray(blocks.tile_steps(g), np.int32)
  calls = {}
  def mk(gg, table):
    fwd_mod.balanced_order = (lambda g, visible=None: table)
    f = jax.jit(lambda q, k, v: fwd_mod.forward(
        q, k, v, gg, mosaic.segment_operands(spec_lib.Operands(
            q=q, k=k, v=v, q_segment_ids=ids, kv_segment_ids=ids), gg))[0])
    jax.block_until_ready(f(q, k, v))
    fwd_mod.balanced_order = real
    return f
  calls["one per tile"] = (mk(g1, None), (q, k, v))
  arms = {"snake": snake(steps, g.num_ctas), "lpt": lpt(steps, g.num_ctas),
          "window snake 4": windowed(steps, g.num_ctas), "lpt window 2": lptw(steps, g.num_ctas, 2)}
  for a, tab in arms.items():
    calls[a] = (mk(g, tab), (q, k, v))
    loads = [sum(steps[t] + 1 for t in row[1:1 + row[0]]) for row in tab]
    print(f"  {name} {a}: max load {max(loads)} min {min(loads)} mean {np.mean(loads):.1f}")
  from flashjax_prev.common import configs as configs_prev, spec as spec_prev
  for nm, mod, cf, sp in (("call prev", mosaic_prev, configs_prev, spec_prev),
                          ("call new", mosaic, configs, spec_lib)):
    cb = cf.with_part(mod.default_config(sp.canonicalize(q, k, v, causal=causal, **seg)[1]),
                      "fwd", persistent=True, balanced=True)
    calls[nm] = (jax.jit(lambda q, k, v, mod=mod, cb=cb: mod.flash_attention(
        q, k, v, causal=causal, config=cb, **seg)), (q, k, v))
  outs = [calls[a][0](q, k, v) for a in calls]
  same = all(bool(jnp.array_equal(outs[0], o)) for o in outs[1:])
  t = time_interleaved_ms(calls, iters=20, repeats=7)
  b = t["one per tile"]
  print(f"{name} causal={causal} equal={same} " + " | ".join(
      f"{n} {x:.4f} ms ({b / x:.3f}x)" for n, x in t.items()), flush=True)
