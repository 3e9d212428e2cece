"""``python -m flashjax.benchmarks --ring S``: a sequence of length S split over
every device present, four ways: the ring (``ring_attention`` in ``shard_map``,
zigzag layout when causal); ``flash_attention`` under ``jit`` on the split
inputs of an Auto mesh axis ("partitioned": the platforms' partitioner runs
the ring, common/partition.py); the same with q, k and v
constrained to whole sequences on every device (the all-gather); and the whole
problem on one device. Forward and forward+backward times, the compiled
per-device memory of forward+backward, and the largest difference of each
forward output from the one-device output (a wrong ring shows here)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import flashjax
from flashjax.common import timer

from . import timing


@dataclasses.dataclass
class RingRow:
  mode: str
  seq: int
  devices: int
  causal: bool
  fwd_ms: float | None
  fwd_bwd_ms: float | None
  mib: float | None
  max_diff: float | None = None  # |out - one device's out|, forward
  error: str = ""


def _functions(attend, causal):
  fwd = jax.jit(lambda q, k, v: attend(q, k, v, causal))
  loss = lambda q, k, v, do: jnp.sum(attend(q, k, v, causal).astype(jnp.float32) *
                                     do.astype(jnp.float32))
  return fwd, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(seq: int, *, dtype=jnp.float32, batch=1, heads=8, head_dim=64,
        causal_flags=(False, True), iters=2, repeats=3, platform=None):
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("seq",))
  sharded = NamedSharding(mesh, P(None, "seq"))
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (batch, seq, heads, head_dim)
  host = [jax.random.normal(kk, shape, dtype) for kk in keys]

  def ring_fn(layout):
    def local(q, k, v, causal):
      return flashjax.ring_attention(q, k, v, axis_name="seq", layout=layout,
                                     causal=causal, platform=platform)
    return lambda q, k, v, causal: jax.shard_map(
        lambda q, k, v: local(q, k, v, causal), mesh=mesh,
        in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"),
        check_vma=False)(q, k, v)  # Pallas kernels' outputs carry no varying axes

  whole = lambda q, k, v, causal: flashjax.flash_attention(q, k, v, causal=causal,
                                                           platform=platform)
  everywhere = NamedSharding(mesh, P())

  def gathered(q, k, v, causal):
    q, k, v = (jax.lax.with_sharding_constraint(x, everywhere) for x in (q, k, v))
    return whole(q, k, v, causal)

  rows = []
  for causal in causal_flags:
    layout = "zigzag" if causal and seq % (2 * n) == 0 else "contiguous"
    zigzag = layout == "zigzag"
    order = (lambda x: flashjax.zigzag_order(x, n)) if zigzag else (lambda x: x)
    restore = (lambda x: flashjax.zigzag_restore(x, n)) if zigzag else (
        lambda x: x)
    modes = {
        f"ring ({layout})": (ring_fn(layout), [jax.device_put(order(x), sharded)
                                               for x in host]),
        "partitioned": (whole, [jax.device_put(x, sharded) for x in host]),
        "all-gather": (gathered, [jax.device_put(x, sharded) for x in host]),
        "one device": (whole, [jax.device_put(x, devices[0]) for x in host]),
    }
    calls = {}
    for name, (attend, args) in modes.items():
      fwd, fwd_bwd = _functions(attend, causal)
      calls[name, "fwd"] = (fwd, args[:3])
      calls[name, "fwd_bwd"] = (fwd_bwd, args)
    times = timer.time_interleaved_ms(calls, iters=iters, repeats=repeats,
                                      settle_ms=0.0)
    outs = {}
    for name, (_, args) in modes.items():
      if not isinstance(times[name, "fwd"], Exception):
        out = calls[name, "fwd"][0](*args[:3])
        outs[name] = np.asarray(jax.device_get(
            restore(out) if name.startswith("ring") else out), np.float32)
    base = outs.get("one device")
    for name, (_, args) in modes.items():
      got = [times[name, d] for d in ("fwd", "fwd_bwd")]
      errors = [repr(t)[:120] for t in got if isinstance(t, Exception)]
      ms = [None if isinstance(t, Exception) else t for t in got]
      rows.append(RingRow(
          mode=name, seq=seq, devices=1 if name == "one device" else n, causal=causal,
          fwd_ms=ms[0], fwd_bwd_ms=ms[1],
          mib=timing.compiled_mib(calls[name, "fwd_bwd"][0], args),
          max_diff=None if base is None or name not in outs else float(
              np.max(np.abs(outs[name] - base))),
          error="; ".join(errors)))
  return rows


def table(rows) -> str:
  head = ("| mode | S | devices | causal | fwd ms | fwd+bwd ms | MiB / device "
          "| max diff |")
  lines = [head, "|" + "---|" * 8]
  fmt = lambda x, f: "-" if x is None else format(x, f)
  for r in rows:
    lines.append(f"| {r.mode} | {r.seq} | {r.devices} | {r.causal} | "
                 f"{fmt(r.fwd_ms, '.2f')} | {fmt(r.fwd_bwd_ms, '.2f')} | "
                 f"{fmt(r.mib, '.1f')} | {fmt(r.max_diff, '.1e')} |" +
                 (f" {r.error}" if r.error else ""))
  return "\n".join(lines)
