"""The index helpers that ring attention (common/ring.py) and the partitioned
calls (common/partition.py) share, on one device: each hop's global q/k offsets
on 4 shards in both layouts, the bands they give, the switch that picks a
device's band, and the shard offsets the dropout hash takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import ring
from flashjax.common.mask import Band


def _plan(layout, band=Band(seq_q=32, seq_k=32)):
  return ring.RingPlan(axis_name="seq", num_shards=4, layout=layout, band=band)


def test_offsets_per_hop_on_four_shards():
  # Contiguous, 8 rows per device: device r holds rows [8r, 8r + 8) and at hop h
  # the keys of device (r - h) mod 4.
  contiguous = _plan("contiguous")
  want = {0: [(0, 0), (8, 8), (16, 16), (24, 24)],
          1: [(0, 24), (8, 0), (16, 8), (24, 16)],
          2: [(0, 16), (8, 24), (16, 0), (24, 8)],
          3: [(0, 8), (8, 16), (16, 24), (24, 0)]}
  for hop, offsets in want.items():
    got = [contiguous.offsets(r, hop, 0, 0, 8, 8) for r in range(4)]
    assert got == offsets, (hop, got)
  # Zigzag, chunks of 4 rows: device r holds chunks r and 7 - r.
  zigzag = _plan("zigzag")
  want = {(0, 0, 0): [(0, 0), (4, 4), (8, 8), (12, 12)],
          (1, 1, 1): [(28, 16), (24, 28), (20, 24), (16, 20)],
          (2, 0, 1): [(0, 20), (4, 16), (8, 28), (12, 24)],
          (3, 1, 0): [(28, 4), (24, 8), (20, 12), (16, 0)]}
  for (hop, a, b), offsets in want.items():
    got = [zigzag.offsets(r, hop, a, b, 4, 4) for r in range(4)]
    assert got == offsets, (hop, a, b, got)
  # Traced device and hop give the same numbers.
  traced = jax.jit(lambda r, h: jnp.stack(zigzag.offsets(r, h, 1, 0, 4, 4)))
  assert traced(1, 3).tolist() == [24, 8]


def _pair_bands(plan, len_q, len_k):
  """``[hop][device]``: the band of each device's (only) chunk pair per hop."""
  return [[plan.pair_band(r, hop, 0, 0, len_q, len_k) for r in range(4)]
          for hop in range(4)]


def test_pair_bands_of_a_causal_contiguous_ring():
  plan = _plan("contiguous", Band(seq_q=32, seq_k=32, right=0))
  diag, full = Band(seq_q=8, seq_k=8, right=0), Band(seq_q=8, seq_k=8)
  assert _pair_bands(plan, 8, 8) == [
      [diag] * 4,
      [None, full, full, full],
      [None, None, full, full],
      [None, None, None, full]]


def test_band_switch_runs_each_entrys_band():
  diag, full = Band(seq_q=8, seq_k=8, right=0), Band(seq_q=8, seq_k=8)
  bands = _pair_bands(_plan("contiguous", Band(seq_q=32, seq_k=32, right=0)), 8, 8)
  run = lambda band, x: x + (10.0 if band.right is None else 20.0)
  empty = lambda x: x - 1.0
  value = {diag: 21.5, full: 11.5, None: 0.5}
  call = lambda t, r: ring.band_switch(bands, (t, r), run, empty, jnp.float32(1.5))
  f = jax.jit(call)
  for t in range(4):
    assert [float(f(t, r)) for r in range(4)] == [value[b] for b in bands[t]], t
  # One branch per distinct band (diag, None, full), in the order they appear.
  switch = [e for e in jax.make_jaxpr(call)(0, 0).eqns if e.primitive.name == "cond"]
  assert len(switch) == 1 and len(switch[0].params["branches"]) == 3
  # A flat list indexed by the device, as partition.py's rows; one band: no switch.
  rows = [None, diag, full, full]
  g = jax.jit(lambda r: ring.band_switch(rows, r, run, empty, jnp.float32(1.5)))
  assert [float(g(r)) for r in range(4)] == [0.5, 21.5, 11.5, 11.5]
  one = jax.make_jaxpr(lambda r: ring.band_switch([full] * 4, r, run, empty,
                                                  jnp.float32(1.5)))(0)
  assert "cond" not in {e.primitive.name for e in one.eqns}


def test_shard_offset_is_the_first_index_of_the_shard():
  offsets = jax.vmap(lambda x: x + ring.shard_offset("b", 3), axis_name="b")(
      jnp.zeros(4, jnp.int32))
  np.testing.assert_array_equal(offsets, [0, 3, 6, 9])
  nested = jax.vmap(jax.vmap(lambda x: x + ring.shard_offset(("a", "b"), 5),
                             axis_name="b"), axis_name="a")(jnp.zeros((2, 3), jnp.int32))
  np.testing.assert_array_equal(nested, [[0, 5, 10], [15, 20, 25]])
  assert ring.shard_offset((), 7) == 0


def _pair_mask(plan, device, hop, a, b, len_q, len_k):
  """The dense mask of pair (a, b), from the band of the whole sequences."""
  q0, k0 = plan.offsets(device, hop, a, b, len_q, len_k)
  whole = plan.band.as_array()
  return np.asarray(whole)[q0:q0 + len_q, k0:k0 + len_k]


def _call_masks(plan, device, hop, len_q, len_k, positions=False):
  """Each pair's mask as the calls of ``hop_calls`` cover it (False where no call
  covers the pair), and how many calls cover each pair."""
  nc = plan.num_chunks
  masks = {(a, b): np.zeros((len_q, len_k), bool) for a in range(nc) for b in range(nc)}
  count = {pair: 0 for pair in masks}
  for (a0, a1), (b0, b1), band in plan.hop_calls(device, hop, len_q, len_k,
                                                  positions) or ():
    dense = np.asarray(band.as_array())
    for a in range(a0, a1):
      for b in range(b0, b1):
        masks[a, b] = dense[(a - a0) * len_q:(a - a0 + 1) * len_q,
                            (b - b0) * len_k:(b - b0 + 1) * len_k]
        count[a, b] += 1
  return masks, count


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("band", [dict(right=0), {}, dict(left=20, right=3),
                                  dict(left=5, right=0), dict(left=-2, right=9),
                                  dict(left=12, right=-4)])
@pytest.mark.parametrize("lengths", [(64, 64), (32, 64), (64, 32)])
@pytest.mark.parametrize("positions", [False, True])
def test_hop_calls_cover_each_pair_with_its_band(layout, band, lengths, positions):
  # Every pair the band reaches is covered once, by a call whose band, cut to
  # the pair, is the pair's mask in the whole sequences (a merged call may span
  # pairs the band misses: its band masks them whole).
  plan = _plan(layout, Band(seq_q=lengths[0], seq_k=lengths[1], **band))
  cq, ck = (s // 4 // plan.num_chunks for s in lengths)
  for hop in range(4):
    for r in range(4):
      masks, count = _call_masks(plan, r, hop, cq, ck, positions)
      for pair, mask in masks.items():
        want = _pair_mask(plan, r, hop, *pair, cq, ck)
        np.testing.assert_array_equal(mask, want, err_msg=str((hop, r, pair)))
        assert count[pair] <= 1 and (count[pair] == 1 or not want.any()), (
            hop, r, pair, count)


def test_hop_calls_of_a_causal_zigzag_ring_are_one_call_per_hop():
  plan = _plan("zigzag", Band(seq_q=64, seq_k=64, right=0))
  for hop in range(4):
    for r in range(4):
      calls = plan.hop_calls(r, hop, 8, 8)
      assert len(calls) == 1, (hop, r, calls)
      (rows, keys, band), = calls
      if hop == 0:  # the own block: causal over both chunks
        assert (rows, keys, band) == ((0, 2), (0, 2), Band(seq_q=16, seq_k=16, right=0))
      elif (r - hop) % 4 < r:  # an earlier block: all rows, its first chunk
        assert (rows, keys, band) == ((0, 2), (0, 1), Band(seq_q=16, seq_k=8))
      else:  # a later block: the last chunk's rows, both chunks
        assert (rows, keys, band) == ((1, 2), (0, 2), Band(seq_q=8, seq_k=16))
  # With dropout the calls keep to chunks that are adjacent in the sequence:
  # device 3 holds chunks 3 and 4, so its own block is still one call.
  assert [len(plan.hop_calls(r, 0, 8, 8, positions=True)) for r in range(4)] == [
      3, 3, 3, 1]


def test_packet_round_trip():
  # Mixed dtypes and odd sizes through one flat buffer of the smallest unit.
  xs = [jnp.arange(15, dtype=jnp.bfloat16).reshape(3, 5) / 7,
        jnp.arange(7, dtype=jnp.int32) - 3,
        jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(2, 3),
        jnp.array([True, False, True])]
  packet = ring.Packet.of(xs)
  buf = jax.jit(packet.pack)(xs)
  assert buf.dtype == jnp.uint8 and buf.size == 30 + 28 + 24 + 3
  got = jax.jit(packet.unpack)(buf)
  for g, x in zip(got, xs):
    assert g.dtype == x.dtype and g.shape == x.shape
    np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
  assert ring.Packet.of(xs[:3]).unit == jnp.uint16
  assert ring.Packet.of([xs[0], xs[0]]).unit == jnp.bfloat16


def test_packet_rows_are_windows_of_the_buffer():
  # K and V of one dtype come as windows of the buffer seen as rows; with fp32
  # accumulators or int32 ids beside them the unit is an unsigned int and every
  # array is sliced out (and exact: no bits travel as floats).
  from flashjax.common.rows import Rows
  key = iter(jax.random.split(jax.random.key(0), 8))
  kv = [jax.random.normal(next(key), (2, 6, 3, 4), jnp.bfloat16) for _ in range(2)]
  packet = ring.Packet.of(kv)
  buf = packet.pack(kv)
  assert buf.dtype == jnp.bfloat16 and buf.size == 2 * 2 * 6 * 3 * 4
  got = packet.unpack(buf, rows=True)
  for i, (g, x) in enumerate(zip(got, kv)):
    assert isinstance(g, Rows) and g.base.shape == (4, 6, 3, 4), g
    assert g.at == (2 * i, 0) and g.shape == x.shape and g.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(g.array(), np.float32),
                                  np.asarray(x, np.float32))
  narrow = got[1].rows(2, 3)
  assert narrow.at == (2, 2) and narrow.shape == (2, 3, 3, 4)
  np.testing.assert_array_equal(np.asarray(narrow.array(), np.float32),
                                np.asarray(kv[1][:, 2:5], np.float32))
  # Denormal and NaN-pattern bits of fp32 accumulators survive the trip.
  acc = [jax.lax.bitcast_convert_type(
      jax.random.bits(next(key), (2, 6, 3, 4), jnp.uint32), jnp.float32)] * 2
  ids = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  for extra in (acc, [ids]):
    mixed = ring.Packet.of(kv + extra)
    got = jax.jit(lambda b: mixed.unpack(b, rows=True))(
        jax.jit(mixed.pack)(kv + extra))
    assert mixed.unit == jnp.uint16 and not any(isinstance(g, Rows) for g in got)
    for g, x in zip(got, kv + extra):
      bits = lambda y: np.asarray(jax.lax.bitcast_convert_type(
          y, jnp.dtype(f"uint{8 * y.dtype.itemsize}")))
      np.testing.assert_array_equal(bits(g), bits(x))
  with pytest.raises(ValueError, match="outside"):
    Rows(kv[0], 1, 2, 0, 6)
  # Tree maps may rebuild a window around leaves that are no arrays.
  assert jax.tree.map(lambda a: a.dtype, narrow).base == jnp.bfloat16
  assert jax.tree.map(lambda a: a.astype(jnp.float32), narrow).shape == narrow.shape
  with pytest.raises(ValueError, match="outside"):
    Rows.of(kv[0]).rows(4, 3)


def _result_dtypes(plan, positions, hops):
  """``_Ring.result_dtype`` of the rows and of the keys of ``hops`` (bf16
  kernels), on device 0 of a 4-device axis bound by ``vmap``."""
  from flashjax.common.spec import AttentionSpec
  spec = AttentionSpec(batch=1, seq_q=16, seq_k=16, heads_q=1, heads_kv=1,
                       head_dim=8, head_dim_v=8, dtype="bfloat16",
                       softmax_scale=1.0, band=plan.band)
  got = []

  def f(x):
    r = ring._Ring(plan, spec, positions)
    got.append([r.result_dtype(hops, side, jnp.bfloat16) for side in (0, 1)])
    return x

  jax.vmap(f, axis_name="seq")(jnp.zeros(4))
  return got[0]


def test_hop_results_keep_the_kernels_dtype_unless_calls_share_a_chunk():
  # Causal zigzag: one call per hop, so no hop sums or merges parts and its
  # results stay bf16 (the fp32 conversion fuses into the accumulation).
  causal = _plan("zigzag", Band(seq_q=64, seq_k=64, right=0))
  assert _result_dtypes(causal, False, [1, 2]) == [jnp.bfloat16] * 2
  # With dropout device 0's own block is three pair calls: two share row chunk
  # 1 (merged) and two share key chunk 0 (summed), so both sides are fp32.
  assert _result_dtypes(causal, True, [0]) == [jnp.float32] * 2
  # Full attention in zigzag with dropout: pairs over rows and keys at each hop.
  full = _plan("zigzag", Band(seq_q=64, seq_k=64))
  assert _result_dtypes(full, True, [1]) == [jnp.float32] * 2
  # A contiguous ring has one chunk: one call at most, never shared.
  assert _result_dtypes(_plan("contiguous", Band(seq_q=64, seq_k=64, right=0)),
                        True, [0, 1, 2, 3]) == [jnp.bfloat16] * 2
