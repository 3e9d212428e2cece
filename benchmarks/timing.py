"""Timing, memory and the correctness check of one (implementation, shape) row."""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np

from flashjax.common import flops, reference, tolerances
from flashjax.common.timer import time_interleaved_ms, time_ms
from flashjax.common.mask import Band
from flashjax.common.shapes import Shape

from . import features, packed

# "jvp" times the whole jax.jvp call (the primal forward and its tangent), to set
# against "fwd".
DIRECTIONS = ("fwd", "bwd", "fwd_bwd", "jvp")


@dataclasses.dataclass
class Row:
  impl: str
  shape: str
  seq: int
  causal: bool
  direction: str
  ms: float | None = None
  tflops: float | None = None
  # Bytes of K and V read per second by a forward: the figure of merit where the
  # call is memory-bound (decode).
  gbs: float | None = None
  # gbs / the device's copy bandwidth (read + write bytes of a copy, measured once
  # per run: copy_gbs): how close a memory-bound call comes to the memory limit.
  x_copy: float | None = None
  ratio: float | None = None  # baseline time / this time (> 1 is faster)
  compiled_mib: float | None = None  # arguments + outputs + temporaries
  alloc_peak_mib: float | None = None  # GPU allocator peak so far in the process
  status: str = "ok"


def random_inputs(shape: Shape, dtype, seed: int = 0, max_seq: int | None = None,
                  batch: int | None = None, heads: int | None = None):
  """Normal random q, k, v, do (never zeros); ``max_seq`` caps both lengths."""
  sq, sk = shape.seq_q, shape.seq_k
  if max_seq:
    sq, sk = min(sq, max_seq), min(sk, max_seq)
  b = batch or shape.batch
  hq = heads or shape.heads_q
  hkv = max(1, hq * shape.heads_kv // shape.heads_q)
  keys = jax.random.split(jax.random.key(seed), 4)
  mk = lambda key, s, h, d: jax.random.normal(key, (b, s, h, d),
                                              jnp.float32).astype(dtype)
  return (mk(keys[0], sq, hq, shape.head_dim), mk(keys[1], sk, hkv, shape.head_dim),
          mk(keys[2], sk, hkv, shape.head_dim_v), mk(keys[3], sq, hq, shape.head_dim_v))


def functions(fn, causal: bool):
  """Jitted forward ``(q, k, v, *operands)`` and forward+backward ``(q, k, v, do,
  *operands)`` of ``fn``, with ``packed.operands(fn)`` (a packed row's ids or
  offsets, a feature shape's mask or bias) as arguments."""
  fwd = jax.jit(lambda q, k, v, *ops: fn(q, k, v, causal, *ops))

  def loss(q, k, v, do, *ops):
    return jnp.sum(fn(q, k, v, causal, *ops).astype(jnp.float32) *
                   do.astype(jnp.float32))

  # A trained operand (a benchmark bias) is differentiated too.
  trained = tuple(range(4, 4 + len(packed.operands(fn)))) if getattr(
      fn, "grad", False) else ()
  fwd_bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2) + trained))
  return fwd, fwd_bwd


def jvp_function(fn, causal: bool):
  """Jitted ``jax.jvp`` of ``fn`` in q, k and v: ``(q, k, v, tq, tk, tv,
  *operands) -> (out, tangent of out)``, with ``packed.operands(fn)`` as
  arguments."""
  return jax.jit(lambda q, k, v, tq, tk, tv, *ops: jax.jvp(
      lambda q, k, v: fn(q, k, v, causal, *ops), (q, k, v), (tq, tk, tv)))


def compiled_mib(f, args) -> float | None:
  """Arguments + outputs + temporaries of the compiled executable (XLA's memory
  analysis); None where the backend does not report it."""
  try:
    m = f.lower(*args).compile().memory_analysis()
  except Exception:
    return None
  if m is None:
    return None
  total = (m.argument_size_in_bytes + m.output_size_in_bytes +
           m.temp_size_in_bytes - getattr(m, "alias_size_in_bytes", 0))
  return total / 2**20


def allocator_peak_mib() -> float | None:
  stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
  if not stats or "peak_bytes_in_use" not in stats:
    return None
  return stats["peak_bytes_in_use"] / 2**20


def copy_gbs(mib: int | None = None, *, iters: int, repeats: int) -> float:
  """The device's copy bandwidth, GB/s: bytes read plus bytes written per second
  by a jitted elementwise copy (``-x``, which XLA cannot elide as it may an
  identity) of a float32 array of ``mib`` MiB; by default 1 GiB on an accelerator (far past
  its caches), 64 MiB on CPU."""
  if mib is None:
    mib = 64 if jax.default_backend() == "cpu" else 1024
  x = jnp.ones((mib * 2**18,), jnp.float32)  # 2**18 floats in a MiB
  ms = time_ms(jax.jit(jnp.negative), (x,), iters=iters, repeats=repeats)
  return 2 * x.nbytes / (ms * 1e-3) / 1e9


def check(fn, shape: Shape, dtype) -> str:
  """Runs ``fn`` on a smaller slice (B=1, S<=512, <=2 kv heads; a packed shape
  whole, so pass packed.check_shape) against the reference; returns "ok" or why
  the implementation is wrong."""
  heads = shape.heads_q // shape.heads_kv * min(shape.heads_kv, 2)
  # A packed row is checked whole (its documents are its point); others on a slice.
  max_seq = None if shape.documents else 512
  q, k, v, _ = random_inputs(shape, dtype, seed=1, max_seq=max_seq, batch=1,
                             heads=heads)
  kw = features.kwargs(shape, *features.operands(shape, q, k))
  if shape.documents:
    ids = jnp.asarray(packed.segment_ids(shape))
    kw = dict(segment_ids=(ids, ids))
  try:
    out = np.asarray(jax.jit(lambda q, k, v: fn(q, k, v, shape.causal))(q, k, v),
                     np.float32)
  except Exception as e:
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
  ref = np.asarray(reference.attention(q, k, v, causal=shape.causal, **kw))
  err = tolerances.rel_l2(out, ref)
  if not np.isfinite(out).all() or err > 2 * tolerances.forward(dtype).rel_l2:
    return f"WRONG (rel. L2 error {err:.2e} on a small slice)"
  return "ok"


def shape_flops(shape: Shape, direction: str) -> int:
  """Useful flops: a packed row counts its documents' own."""
  if shape.documents:
    return sum(shape_flops(dataclasses.replace(shape, seq_q=n, seq_k=n, documents=()),
                           direction) for n in shape.documents)
  band = Band(seq_q=shape.seq_q, seq_k=shape.seq_k, right=0 if shape.causal else None)
  fwd = flops.forward_flops(batch=shape.batch, heads_q=shape.heads_q,
                            head_dim=shape.head_dim, head_dim_v=shape.head_dim_v,
                            band=band)
  # jvp: the primal forward (two matmuls) and the tangent's five (q k^T,
  # dq k^T, q dk^T, then (p ds) v and p dv), counted on the same band.
  return int(fwd * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5, "jvp": 3.5}[direction])


def run_row(name, fn, shape: Shape, dtype, directions, *, iters, repeats):
  """Rows for every direction of one (implementation, shape)."""
  return run_shape({name: fn}, shape, dtype, directions, iters=iters, repeats=repeats)


def error_status(e) -> str:
  return f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def run_shape(fns: dict, shape: Shape, dtype, directions, *, iters, repeats):
  """Rows for every (implementation, direction) of one shape, implementations in
  ``fns`` order. The implementations' forwards are timed in interleaved rounds
  (``timer.time_interleaved_ms``), then their forward+backwards, so their ratios
  come from the same stretch of time; ``bwd`` is forward+backward minus forward.
  A KV-cache shape runs its own variants (benchmarks/kvcache.py)."""
  if shape.page_size is not None:
    from . import kvcache  # kvcache builds on this module
    return kvcache.run_shape(fns, shape, dtype, directions, iters=iters,
                             repeats=repeats)
  q, k, v, do = random_inputs(shape, dtype)
  tangents = random_inputs(shape, dtype, seed=2)[:3] if "jvp" in directions else ()
  status, compiled, calls = {}, {}, {}
  if shape.documents:  # packed row: packed, batched and varlen variants
    builders, small = packed.variants(fns), packed.check_shape(shape)
  elif features.feature(shape):  # each flashjax implementation with and without it
    builders, small = features.variants(fns, shape, q, k), shape
  else:
    builders, small = {n: (lambda s, fn=fn: fn) for n, fn in fns.items()}, shape
  fns = {}
  for name, build in builders.items():
    try:
      status[name] = check(build(small), features.check_shape(name, small), dtype)
      fns[name] = build(shape)
    except Exception as e:  # a variant whose entry does not import
      status[name], fns[name] = error_status(e), None
    if status[name] != "ok":
      continue
    fn = fns[name]
    fwd, fwd_bwd = functions(fn, shape.causal)
    ops = packed.operands(fn)
    compiled[name] = (fwd, (q, k, v, *ops)), (fwd_bwd, (q, k, v, do, *ops))
    if {"fwd", "bwd"} & set(directions):
      calls[(name, "fwd")] = compiled[name][0]
    if {"bwd", "fwd_bwd"} & set(directions):
      calls[(name, "fwd_bwd")] = compiled[name][1]
    if "jvp" in directions:
      calls[(name, "jvp")] = (jvp_function(fn, shape.causal),
                              (q, k, v, *tangents, *ops))
  # Forwards are interleaved with forwards, backwards with backwards, jvps with
  # jvps.
  times = {}
  for direction in ("fwd", "fwd_bwd", "jvp"):
    group = {key: c for key, c in calls.items() if key[1] == direction}
    if group:
      times.update(time_interleaved_ms(group, iters=iters, repeats=repeats))
  rows = []
  for name in fns:
    base = dict(impl=name, shape=shape.name, seq=shape.seq_q, causal=shape.causal)
    mine = {d: t for (n, d), t in times.items() if n == name}
    # A peer without forward mode (a custom_vjp) fails its jvp row alone.
    failed = next((t for d, t in mine.items()
                   if d != "jvp" and isinstance(t, Exception)), None)
    if status[name] != "ok" or failed is not None:
      msg = status[name] if status[name] != "ok" else error_status(failed)
      rows.extend(Row(**base, direction=d, status=msg) for d in directions)
      continue
    if "bwd" in directions:
      mine["bwd"] = mine["fwd_bwd"] - mine["fwd"]
    fwd, fwd_bwd = compiled[name]
    mem = {"fwd": compiled_mib(*fwd), "fwd_bwd": compiled_mib(*fwd_bwd)}
    mem["bwd"] = mem["fwd_bwd"]
    if "jvp" in directions:
      mem["jvp"] = (None if isinstance(mine["jvp"], Exception) else
                    compiled_mib(*calls[(name, "jvp")]))
    peak = allocator_peak_mib()
    for d in directions:
      ms = mine[d]
      if isinstance(ms, Exception):
        rows.append(Row(**base, direction=d, status=error_status(ms)))
        continue
      kv_bytes = k.size * k.dtype.itemsize + v.size * v.dtype.itemsize
      rows.append(Row(**base, direction=d, ms=ms,
                      tflops=shape_flops(shape, d) / (ms * 1e-3) / 1e12 if ms > 0 else None,
                      gbs=kv_bytes / (ms * 1e-3) / 1e9 if ms > 0 and d == "fwd" else None,
                      compiled_mib=mem[d], alloc_peak_mib=peak))
  return rows
