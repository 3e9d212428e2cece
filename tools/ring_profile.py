"""Does each ring hop's transfer hide under the previous hop's kernels?

  python -m tools.ring_profile S [B,H,D] [LAYOUT] [N] [MASK]

Runs the ring (``ring_attention`` in ``shard_map`` over every device, LAYOUT
zigzag by default, MASK causal by default or full, bf16) forward and
forward+backward N times (default 5)
under ``jax.profiler`` and reads the trace's device events per GPU. Collective
kernels (NCCL's, by name) and peer copies are the communication, every other
event the compute.
The N calls run back to back (one wait at the end). Per device and call it
prints the span (first kernel's start to last kernel's end, over N), the
compute and communication busy times (unions of intervals: streams overlap),
the communication that ran while a compute kernel ran, the exposed
communication (the rest), and the compute split into the attention kernels'
busy time and the work beside them (all other compute: copies, packing,
merges), the span with no compute, and the part of it right after a
device-to-host copy (a conditional's index read by the host before it launches
the branch: the ring's ``lax.switch`` over devices costs this). Then each
device's attention kernels of the first call, in order, and the first call's
events of device 0 in time order, to see where each transfer sits. Before the
trace, the wall clock of 20 unprofiled back-to-back calls, and how far ahead
of the devices the host was when the last of them returned: while that lead
is shorter than the work between a call's last host read (a conditional's
index) and its end, the host cannot hide the next call's launch (four H200s,
8k tokens per GPU, 2026-11-26: 9.05 ms per forward and backward, the host
3.0 ms ahead; 2.13 ms per forward, 0.54 ms ahead). XLA flags (``XLA_FLAGS``)
change the schedule, so run it under each setting to compare. A full mask
makes every device's hops the same calls in either layout, with no
``lax.switch``: set against the causal ring's wall clock, it shows what the
switches' host reads cost.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from tools.launch_gaps import events_by_device, length, union


def is_comm(name: str) -> bool:
  low = name.lower()
  # NCCL's kernels, or the peer copies XLA issues for local devices under
  # --xla_gpu_collective_permute_mode=peer (copy engines, no SMs).
  return any(w in low for w in ("nccl", "sendrecv", "collective", "p2p", "ptop",
                                "peer"))


def is_attention(name: str) -> bool:
  """An attention kernel's event: Mosaic-GPU's custom call, or a kernel named
  by flashjax (the Pallas-Triton and triton platforms)."""
  low = name.lower()
  return "mosaic_gpu" in low or "flashjax" in low


def intersect(a, b):
  """Intersection of two sorted disjoint interval lists."""
  out, i, j = [], 0, 0
  while i < len(a) and j < len(b):
    s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
    if s < e:
      out.append((s, e))
    if a[i][1] < b[j][1]:
      i += 1
    else:
      j += 1
  return out


def is_host_copy(name: str) -> bool:
  """A device-to-host copy: XLA's GPU runtime reads a conditional's index (a
  ``lax.switch``/``lax.cond``) this way and launches the branch only after it."""
  return "d2h" in name.lower()


def after_host_copies(events, comp) -> float:
  """Time with no compute right after a device-to-host copy: the gaps of the
  compute intervals ``comp`` (sorted, disjoint) whose interval ends with such a
  copy, up to the next compute event."""
  ends = [ts + d for name, ts, d in events if is_host_copy(name)]
  total = 0.0
  for (_, end), (nxt, _) in zip(comp, comp[1:]):
    if any(abs(end - e) < 1e-6 for e in ends):
      total += nxt - end
  return total


def overlap(events, n: int = 1) -> dict:
  """Per-call span, compute and communication busy time, how much of the
  communication ran beside compute, how the compute splits into attention
  kernels and the work beside them (copies, packing, merges: busy time outside
  the kernels), the span with no compute, and the part of it that follows a
  device-to-host copy (host round trips), in us, from one device's events."""
  comm = union((ts, ts + d) for name, ts, d in events if is_comm(name))
  comp = union((ts, ts + d) for name, ts, d in events if not is_comm(name))
  kernels = union((ts, ts + d) for name, ts, d in events if is_attention(name))
  both = intersect(comm, comp)
  start = min(ts for _, ts, _ in events)
  end = max(ts + d for _, ts, d in events)
  return {"span": (end - start) / n, "compute": length(comp) / n,
          "comm": length(comm) / n, "hidden": length(both) / n,
          "exposed": (length(comm) - length(both)) / n,
          "kernels": length(kernels) / n,
          "beside": (length(comp) - length(kernels)) / n,
          "no_compute": (end - start - length(comp)) / n,
          "after_d2h": after_host_copies(events, comp) / n}


WALL_CLOCK_CALLS = 20


def wall_clock_ms(f, args, calls: int = WALL_CLOCK_CALLS):
  """``(ms per call, ms the host was ahead)`` of ``calls`` unprofiled
  back-to-back calls of ``f``, as the benchmark CLI times them: the wall clock
  per call, and the time from the last call's return to the end of its work
  (how far the host ran ahead of the devices)."""
  import jax
  t0 = time.perf_counter()
  for _ in range(calls):
    out = f(*args)
  t1 = time.perf_counter()
  jax.block_until_ready(out)
  t2 = time.perf_counter()
  return (t2 - t0) * 1e3 / calls, (t2 - t1) * 1e3


def first_call_kernels(events, n: int) -> list:
  """Durations (us) of the attention kernels of the first of ``n`` calls, in
  order, from one device's events: hops of equal work whose kernels differ
  across devices show here (the ring moves at its slowest device per hop)."""
  kernels = [d for name, _, d in events if is_attention(name)]
  return kernels[:max(1, len(kernels) // n)]


def main(argv):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import flashjax

  seq = int(argv[0])
  batch, heads, head_dim = (int(x) for x in (argv[1] if len(argv) > 1
                                             else "1,16,128").split(","))
  layout = argv[2] if len(argv) > 2 else "zigzag"
  n_calls = int(argv[3]) if len(argv) > 3 else 5
  mask = argv[4] if len(argv) > 4 else "causal"
  if mask not in ("causal", "full"):
    raise SystemExit(f"MASK is causal or full, got {mask!r}")
  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("seq",))
  sh = NamedSharding(mesh, P(None, "seq"))
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.device_put(jax.random.normal(
      x, (batch, seq, heads, head_dim), jnp.bfloat16), sh) for x in ks)
  attend = jax.shard_map(
      lambda q, k, v: flashjax.ring_attention(q, k, v, axis_name="seq",
                                              layout=layout, causal=mask == "causal"),
      mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"),
      check_vma=False)
  fwd = jax.jit(attend)
  step = jax.jit(jax.grad(lambda q, k, v, do: jnp.sum(
      attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
  print(f"{len(devices)} x {devices[0].device_kind}, S {seq}, B,H,D {batch},{heads},"
        f"{head_dim}, {layout}, {mask}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  for label, f, args in (("fwd", fwd, (q, k, v)), ("fwd+bwd", step, (q, k, v, do))):
    for _ in range(2):
      jax.block_until_ready(f(*args))
    wall, ahead = wall_clock_ms(f, args)
    print(f"{label:8s} wall clock {wall:8.3f} ms per call ({WALL_CLOCK_CALLS} "
          f"calls), the host "
          f"{ahead:.3f} ms ahead of the devices at the last return")
    with tempfile.TemporaryDirectory() as d:
      with jax.profiler.trace(d):
        for _ in range(n_calls):  # back to back, as a training loop runs them
          out = f(*args)
        jax.block_until_ready(out)
      per_device = events_by_device(d)
    if not per_device:
      print(f"{label}: no GPU events in the trace")
      continue
    for dev, events in sorted(per_device.items()):
      o = overlap(events, n_calls)
      print(f"{label:8s} {dev[:28]:28s} span {o['span']:9.1f} us  compute "
            f"{o['compute']:9.1f}  comm {o['comm']:8.1f}  hidden {o['hidden']:8.1f}  "
            f"exposed {o['exposed']:8.1f}  kernels {o['kernels']:9.1f}  "
            f"beside {o['beside']:8.1f}  no compute {o['no_compute']:8.1f}  "
            f"after D2H {o['after_d2h']:7.1f}")
    for dev, events in sorted(per_device.items()):
      print(f"  {label} {dev[:28]} kernels (us): " +
            " ".join(f"{d:.0f}" for d in first_call_kernels(events, n_calls)))
    first = sorted(per_device)[0]
    events = per_device[first]
    # One call's events: the calls ran one after another, so the first 1/n of
    # the events by count is close enough to see the order.
    print(f"  {label} on {first}, first call's events (start us, dur us, kind):")
    t0 = events[0][1]
    for name, ts, d in events[:max(1, len(events) // n_calls)]:
      print(f"    {ts - t0:9.1f} {d:8.1f} {'COMM' if is_comm(name) else '    '} "
            f"{name[:80]}")
    sys.stdout.flush()


if __name__ == "__main__":
  main(sys.argv[1:])
