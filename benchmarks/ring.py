"""``python -m flashjax.benchmarks --ring S``: a sequence of length S split over
every device present, side by side in one process:

- ``ring (contiguous)`` and, when causal, ``ring (zigzag)``: ``ring_attention``
  in ``shard_map``;
- ``partitioned``: ``flash_attention`` under ``jit`` on inputs split along an
  Auto mesh axis (the platforms' partitioner runs the ring, zigzag when causal:
  common/partition.py);
- ``all-gather``: all-gather context parallelism, q's rows split and K/V
  gathered whole on every device (each device attends its rows to all keys);
- ``one device``: the whole problem on one device.

Forward and forward+backward times, the scaling against the ideal (the one-device
time over the device count), the compiled per-device memory of forward+backward,
and the largest difference of each forward output from the one-device output (a
wrong ring shows here).

``layers`` (``--ring-layers``) chains that many calls in one jitted function,
each call's output the next one's q, as the layers of a model's step; times are
per call; the memory column is the whole chain's. On four H200s (one process,
2026-11-26) a lone ring call's first kernel started 120-580 us after its first
fusion, behind its first transfer's launch; chained calls show what of that a
step pays per layer."""

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
  # One device's time of the whole sequence over this row's device count.
  ideal_fwd_ms: float | None = None
  ideal_fwd_bwd_ms: float | None = None


def _functions(attend, causal, layers=1):
  def chain(q, k, v):
    for _ in range(layers):
      q = attend(q, k, v, causal)
    return q

  fwd = jax.jit(chain)
  loss = lambda q, k, v, do: jnp.sum(chain(q, k, v).astype(jnp.float32) *
                                     do.astype(jnp.float32))
  return fwd, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _modes(mesh, n, seq, causal, platform):
  """``{name: (attend, zigzag)}``; ``zigzag``: the inputs go in zigzag order."""
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
    k, v = (jax.lax.with_sharding_constraint(x, everywhere) for x in (k, v))
    return whole(q, k, v, causal)

  modes = {"ring (contiguous)": (ring_fn("contiguous"), False)}
  if causal and seq % (2 * n) == 0:
    modes["ring (zigzag)"] = (ring_fn("zigzag"), True)
  modes.update({"partitioned": (whole, False), "all-gather": (gathered, False),
                "one device": (whole, False)})
  return modes


MODES = ("ring (contiguous)", "ring (zigzag)", "partitioned", "all-gather",
         "one device")


def check_modes(only):
  """``only`` (name prefixes) must each pick a mode."""
  for word in only or ():
    if not any(m.startswith(word) for m in MODES):
      raise ValueError(f"ring modes are {', '.join(MODES)}; {word!r} names none")


def _wanted(name, only):
  """Whether mode ``name`` runs: every mode by default, else those named."""
  return name == "one device" or only is None or any(name.startswith(w) for w in only)


def run(seq: int, *, dtype=jnp.float32, batch=1, heads=8, head_dim=64,
        causal_flags=(False, True), iters=2, repeats=3, platform=None, only=None,
        layers=1):
  """Rows of the modes (``only``: those whose names start with one of these
  words; "one device" always runs, as the ideal's base); ``layers`` calls
  chained per timed function, times per call."""
  check_modes(only)
  if layers < 1:
    raise ValueError(f"layers must be >= 1, got {layers}")
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("seq",))
  sharded = NamedSharding(mesh, P(None, "seq"))
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (batch, seq, heads, head_dim)
  host = [jax.random.normal(kk, shape, dtype) for kk in keys]
  zig = lambda x: flashjax.zigzag_order(x, n)

  rows = []
  for causal in causal_flags:
    modes = {name: m for name, m in _modes(mesh, n, seq, causal, platform).items()
             if _wanted(name, only)}
    calls, inputs = {}, {}
    for name, (attend, zigzag) in modes.items():
      if name == "one device":
        args = [jax.device_put(x, devices[0]) for x in host]
      else:
        args = [jax.device_put(zig(x) if zigzag else x, sharded) for x in host]
      inputs[name] = args
      fwd, fwd_bwd = _functions(attend, causal, layers)
      calls[name, "fwd"] = (fwd, args[:3])
      calls[name, "fwd_bwd"] = (fwd_bwd, args)
    times = timer.time_interleaved_ms(calls, iters=iters, repeats=repeats,
                                      settle_ms=0.0)
    times = {key: t if isinstance(t, Exception) else t / layers
             for key, t in times.items()}
    outs = {}
    for name, (_, zigzag) in modes.items():
      if not isinstance(times[name, "fwd"], Exception):
        out = calls[name, "fwd"][0](*inputs[name][:3])
        outs[name] = np.asarray(jax.device_get(
            flashjax.zigzag_restore(out, n) if zigzag else out), np.float32)
    base = outs.get("one device")
    one = {d: times["one device", d] for d in ("fwd", "fwd_bwd")}
    for name in modes:
      got = [times[name, d] for d in ("fwd", "fwd_bwd")]
      errors = [repr(t)[:120] for t in got if isinstance(t, Exception)]
      ms = [None if isinstance(t, Exception) else t for t in got]
      count = 1 if name == "one device" else n
      ideal = [None if isinstance(one[d], Exception) else one[d] / count
               for d in ("fwd", "fwd_bwd")]
      rows.append(RingRow(
          mode=name, seq=seq, devices=count, causal=causal,
          fwd_ms=ms[0], fwd_bwd_ms=ms[1],
          mib=timing.compiled_mib(calls[name, "fwd_bwd"][0], inputs[name]),
          max_diff=None if base is None or name not in outs else float(
              np.max(np.abs(outs[name] - base))),
          error="; ".join(errors), ideal_fwd_ms=ideal[0], ideal_fwd_bwd_ms=ideal[1]))
  return rows


def _of_ideal(ideal, ms):
  return None if ideal is None or not ms else ideal / ms


def table(rows) -> str:
  head = ("| mode | S | devices | causal | fwd ms | fwd of ideal | fwd+bwd ms "
          "| fwd+bwd of ideal | MiB / device | max diff |")
  lines = [head, "|" + "---|" * 10]
  fmt = lambda x, f: "-" if x is None else format(x, f)
  for r in rows:
    lines.append(f"| {r.mode} | {r.seq} | {r.devices} | {r.causal} | "
                 f"{fmt(r.fwd_ms, '.3f')} | "
                 f"{fmt(_of_ideal(r.ideal_fwd_ms, r.fwd_ms), '.0%')} | "
                 f"{fmt(r.fwd_bwd_ms, '.3f')} | "
                 f"{fmt(_of_ideal(r.ideal_fwd_bwd_ms, r.fwd_bwd_ms), '.0%')} | "
                 f"{fmt(r.mib, '.1f')} | {fmt(r.max_diff, '.1e')} |" +
                 (f" {r.error}" if r.error else ""))
  return "\n".join(lines)
