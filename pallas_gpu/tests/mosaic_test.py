"""The Mosaic-GPU (Hopper) platform: the conformance suite on a Hopper GPU; on any
machine, the kernel's CTA walks and persistent schedule, and every kernel
variant lowered for CUDA (Mosaic-GPU lowers in Python, so trace and lowering errors
show up on the CPU machine)."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import (autotune, configs, conformance, epilogue, hardware, platform,
                             spec as spec_lib, tolerances)
from flashjax.common.mask import Band
from flashjax.pallas_gpu.mosaic import dbias_sum
from flashjax.pallas_gpu.mosaic import blocks as mosaic_blocks, mosaic
from flashjax.pallas_gpu.mosaic import config as mosaic_config
from flashjax.pallas_gpu.triton import pallas_triton

ON_HOPPER = jax.default_backend() == "gpu" and hardware.is_hopper()


def _default_config(ops, spec):
  """The default config of a call, as ``mosaic.flash_attention`` resolves it
  (the forward's tiles fit beside the call's additive tile)."""
  return mosaic.default_config(spec, mosaic.tile_itemsize(ops, spec))


def _static(ops, spec, **fields):
  """The call's default config with ``fields`` replaced, and the Pallas-Triton
  backward's default where that one runs."""
  return platform.Static(dataclasses.replace(
      _default_config(ops, spec), backward=pallas_triton.default_config(spec),
      **fields))


def _backward_of_forward(ops, spec, static):
  """The gradients of the forward's output with itself as dO (for lowering)."""
  out, lse = mosaic.forward(ops, spec, static)
  return mosaic.backward(ops, spec, static, out, lse, out, jnp.zeros_like(lse))


def _attention_with(config_of):
  """``mosaic.flash_attention`` whose config is ``config_of(spec, default)``
  for each call's spec."""
  def attention(q, k, v, **kwargs):
    ops, spec = spec_lib.canonicalize(
        q, k, v, **{n: x for n, x in kwargs.items() if n != "return_lse"})
    config = config_of(spec, _default_config(ops, spec))
    return mosaic.flash_attention(q, k, v, config=config, **kwargs)
  return attention


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU; "
                    "Mosaic-GPU has no interpret mode for wgmma/TMA/barriers")
class TestPallasMosaicGpu(conformance.ConformanceSuite):
  CAPS = conformance.Capabilities.of(mosaic.CAPABILITIES, name="pallas-mosaic-gpu",
                                     default_dtype="bfloat16")

  def expected_error(self, case):
    """A bias or mask runs only over whole [Sq, Sk] slices, at head dims <= 128,
    and a mask not with a soft cap."""
    reason = super().expected_error(case)
    for shape in (case.bias_shape, case.mask_shape):
      if reason is None and shape is not None:
        whole = len(shape) >= 2 and shape[-2:] == (-1, -1)
        if not whole or max(case.head_dim, case.head_dim_v or 0) > 128:
          reason = f"bias/mask shape {shape} at head dim {case.head_dim}"
    if reason is None and case.mask_shape is not None and case.logits_soft_cap:
      reason = "a mask with a soft cap"
    return reason

  def attention(self, q, k, v, **kwargs):
    return mosaic.flash_attention(q, k, v, **kwargs)

  def may_vary(self, case):
    """dbias where the dQ kernel sums it with atomic adds
    (``config.sums_dbias_in_kernel``), for a bias in the inputs' dtype (an
    fp32 one takes Pallas-Triton's backward); dq where the default backward
    is the single pass (``config.single_pass_backward``)."""
    diff, const, static = conformance.make_inputs(case)
    ops, spec = spec_lib.canonicalize(**diff, **const, **static)
    vary = set()
    if _default_config(ops, spec).bwd_single_pass:
      vary.add("q")
    if case.bias_shape is not None and case.bias_dtype == "input":
      if mosaic.sums_dbias_in_kernel(spec):
        vary.add("bias")
    return frozenset(vary)

  @pytest.mark.parametrize("kw", [
      dict(), dict(causal=True), dict(seq_q=300, seq_k=200, sliding_window=(50, 10)),
      dict(heads_q=4, heads_kv=1, logits_soft_cap=20.0),
      dict(segment_ids="packed", causal=True), dict(dropout_rate=0.2, causal=True),
      dict(head_dim=192, seq_q=170, seq_k=333)], ids=str)
  def test_shared_block_backward(self, kw):
    """D > 128: the dQ and dK/dV kernels' warpgroups share one block in two
    roles (blocks.Geometry.shared_block)."""
    kw = {**dict(batch=2, seq_q=256, seq_k=384, heads_q=2, heads_kv=2,
                 head_dim=256, seed=11), **kw}
    self.check(conformance.Case(**kw))

  @pytest.mark.parametrize("kw", [
      dict(causal=True), dict(seq_q=300, seq_k=200, heads_q=4, heads_kv=2)], ids=str)
  def test_two_launch_backward(self, kw):
    """The dQ and dK/dV kernels as two launches (the default over long full
    bands, config.two_launch_backward)."""
    self.attention = _attention_with(
        lambda spec, cfg: dataclasses.replace(cfg, bwd_one_launch=False))
    self.check(conformance.Case(**{**dict(batch=2, seq_q=384, seq_k=384, seed=43), **kw}))

  def test_default_backward_is_the_single_pass_over_long_full_bands(self):
    """From 2048 queries and keys over the full band at D = 128 the default
    config's backward is the single pass (config.single_pass_backward; the
    lowering test of the same name checks the kernel it takes), with its dq
    allowed to vary between runs within rounding (may_vary)."""
    case = conformance.Case(batch=1, seq_q=2048, seq_k=2048, heads_q=2, heads_kv=2,
                            head_dim=128, seed=31)
    diff, const, static = conformance.make_inputs(self.resolve(case))
    ops, spec = spec_lib.canonicalize(**diff, **const, **static)
    assert _default_config(ops, spec).bwd_single_pass
    self.check(case)

  @pytest.mark.parametrize("one_launch,causal,dropout", [
      (True, True, 0.0), (False, False, 0.0), (True, True, 0.2)])
  def test_dbias_summed_over_the_batch_in_the_kernel(self, one_launch, causal, dropout):
    """A bf16 bias broadcast over 8 batch rows: the dQ kernel adds each row's
    dS into one fp32 sum (blocks.Geometry.ds_batch_sum), in one launch or two,
    and beside dropout (whose row stats take more shared memory)."""
    def config_of(spec, cfg):
      assert mosaic.sums_dbias_in_kernel(spec)
      return dataclasses.replace(cfg, bwd_one_launch=one_launch)
    summing = _attention_with(config_of)

    def attention(q, k, v, **kwargs):
      assert kwargs["bias"].dtype == jnp.bfloat16  # an fp32 one leaves Mosaic
      return summing(q, k, v, **kwargs)
    self.attention = attention
    self.check(conformance.Case(batch=8, seq_q=256, seq_k=320, heads_q=2, heads_kv=2,
                                bias_shape=(1, -1, -1, -1), bias_dtype="input",
                                causal=causal, dropout_rate=dropout, seed=41))

  @pytest.mark.parametrize("kw", [
      dict(causal=True), dict(causal=True, bias_shape=(-1, 1, -1, -1)),
      dict(seq_q=320, seq_k=448, sliding_window=(100, 30)),
      dict(causal=True, dropout_rate=0.2)], ids=str)
  def test_dbias_with_tiles_outside_the_band(self, kw):
    """A bf16 bias that XLA sums over the batch or heads, under a band that
    leaves tiles out: the dQ kernel does not write dS there
    (blocks.Geometry.ds_reached_only) and the sum's read zeroes them."""
    self.check(conformance.Case(**{**dict(
        batch=2, seq_q=384, seq_k=384, heads_q=2, heads_kv=2, head_dim=128,
        bias_shape=(1, -1, -1, -1), bias_dtype="input", seed=47), **kw}))

  def test_dbias_batch_sum_under_vmap(self):
    """Under vmap the kernels write each row's dS (plgpu.kernel batches them)
    and XLA sums it: the same dbias as the loop over the mapped axis."""
    keys = jax.random.split(jax.random.PRNGKey(5), 4)
    q, k, v = (jax.random.normal(key, (2, 8, 128, 2, 128), jnp.bfloat16)
               for key in keys[:3])
    bias = jax.random.normal(keys[3], (1, 2, 128, 128), jnp.bfloat16)
    loss = lambda q, k, v, bias: (mosaic.flash_attention(
        q, k, v, bias=bias, causal=True).astype(jnp.float32) ** 2).sum()
    grad = jax.grad(loss, argnums=3)
    got = np.asarray(jax.jit(jax.vmap(grad, in_axes=(0, 0, 0, None)))(q, k, v, bias),
                     np.float32)
    want = np.stack([np.asarray(jax.jit(grad)(q[i], k[i], v[i], bias), np.float32)
                     for i in range(2)])
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())

  @pytest.mark.parametrize("kw", [
      dict(segment_ids="documents", causal=True), dict(segment_ids="documents"),
      dict(segment_ids="packed", causal=True, heads_q=8, heads_kv=2)], ids=str)
  def test_balanced_packed_forward(self, kw):
    """Packed rows in a persistent launch whose tiles the device orders
    (blocks.balanced_order with the ids' visible blocks): about two tiles per
    CTA; outputs and gradients against the reference, and out and lse bit for
    bit those of one CTA per tile."""
    def config(balanced):
      def config_of(spec, cfg):
        cfg = configs.with_part(cfg, "fwd", persistent=balanced, balanced=balanced)
        g = mosaic.geometry(spec, cfg)
        assert g.segments and g.balanced == balanced
        assert bool(g.persistent_ctas) == balanced
        return cfg
      return _attention_with(config_of)
    case = conformance.Case(**{**dict(batch=2, seq_q=2048, seq_k=2048, heads_q=8,
                                      heads_kv=8, head_dim=128, seed=3), **kw})
    self.attention = config(True)
    got, _ = self.check(case)
    diff, const, static = conformance.make_inputs(self.resolve(case))
    want = config(False)(**diff, **const, **static, return_lse=True)
    np.testing.assert_array_equal(np.asarray(got["out"]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(got["lse"]), np.asarray(want[1]))


# Calls the single pass applies to beside its default's (the full band):
# grouped heads, D = 64 (whole dQ columns per warpgroup), a mask's tile.
SINGLE_PASS_CASES = [
    dict(), dict(causal=True, heads_q=4, heads_kv=2), dict(head_dim=64, causal=True),
    dict(mask_shape=(-1, 1, -1, -1), causal=True)]


def _single_pass_case(kw):
  return conformance.Case(**{**dict(batch=2, seq_q=384, seq_k=448, heads_q=2,
                                    heads_kv=2, head_dim=128, seed=29,
                                    dtype="bfloat16"), **kw})


def _lowered_backward(case, **fields):
  """The backward of ``case``'s inputs lowered for CUDA with the default config's
  ``fields`` replaced."""
  diff, const, static = conformance.make_inputs(case)
  ops, spec = spec_lib.canonicalize(**diff, **const, **static)
  static = _static(ops, spec, **fields)
  return jax.jit(lambda: _backward_of_forward(ops, spec, static)).trace().lower(
      lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kw", SINGLE_PASS_CASES, ids=str)
def test_single_pass_cases_lower_to_the_single_pass(kw):
  """mosaic.backward sends these calls to the single pass: one backward
  launch, with dQ's reduce-adds."""
  text = _lowered_backward(_single_pass_case(kw), bwd_single_pass=True)
  assert text.count("custom_call @mosaic_gpu") == 2
  assert "cp.reduce.async.bulk" in text


def test_default_backward_lowers_to_the_single_pass_over_long_full_bands():
  """The default config at S2k, full band, D = 128: the single pass; causal:
  the two kernels."""
  case = lambda **kw: conformance.Case(batch=1, seq_q=2048, seq_k=2048, heads_q=2,
                                       heads_kv=2, head_dim=128, seed=31,
                                       dtype="bfloat16", **kw)
  assert "cp.reduce.async.bulk" in _lowered_backward(case())
  assert "cp.reduce.async.bulk" not in _lowered_backward(case(causal=True))


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU; "
                    "Mosaic-GPU has no interpret mode for wgmma/TMA/barriers")
class TestPallasMosaicGpuSinglePass(TestPallasMosaicGpu):
  """``MosaicConfig(bwd_single_pass=True)``: the dK/dV kernel also adds dQ in
  fp32 by TMA reduce-adds, which land in any order, so dq may differ in its
  last bits between runs. The tests whose backward takes another path (a bias,
  D > 128) or that are about the forward are left to the suite above."""
  SUBSET = frozenset({
      "test_shapes", "test_head_dims", "test_value_head_dim_differs", "test_dtypes",
      "test_causal_alignment", "test_sliding_window", "test_segment_ids",
      "test_contiguous_segment_ids", "test_mask", "test_soft_cap", "test_sinks",
      "test_dropout", "test_combinations", "test_fully_masked_rows",
      "test_random_cases",
      "test_single_pass_runs_where_it_applies", "test_single_pass_under_vmap"})

  def attention(self, q, k, v, **kwargs):
    return _attention_with(
        lambda spec, cfg: dataclasses.replace(cfg, bwd_single_pass=True))(
            q, k, v, **kwargs)

  def may_vary(self, case):
    return super().may_vary(case) | {"q"}

  @pytest.mark.parametrize("kw", SINGLE_PASS_CASES, ids=str)
  def test_single_pass_runs_where_it_applies(self, kw):
    """Grouped heads, D = 64, a causal band and a mask's tile through the
    single pass (test_single_pass_cases_lower_to_the_single_pass checks that
    they take it), against the reference."""
    self.check(_single_pass_case(kw))

  def test_single_pass_under_vmap(self):
    """Under vmap the two kernels run instead (the dQ accumulator is a ref;
    test_single_pass_lowers_under_shard_map_and_falls_back_under_vmap checks
    which kernels): the same gradients as a loop over the mapped axis."""
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    q, k, v = (jax.random.normal(key, (2, 2, 256, 2, 128), jnp.bfloat16) for key in keys)
    loss = lambda q, k, v: (self.attention(q, k, v, causal=True).astype(
        jnp.float32) ** 2).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2))
    got = jax.jit(jax.vmap(grad))(q, k, v)
    for i in range(2):
      want = jax.jit(grad)(q[i], k[i], v[i])
      for x, y in zip(got, want):
        y = np.asarray(y, np.float32)
        assert np.abs(y).max() > 0
        np.testing.assert_allclose(np.asarray(x[i], np.float32), y, rtol=0,
                                   atol=2e-2 * np.abs(y).max())


def _geometry(seq_q, seq_k, left, right, block_kv=64):
  band = Band(seq_q=seq_q, seq_k=seq_k, left=left, right=right)
  return mosaic_blocks.Geometry(
      batch=1, seq_q=seq_q, seq_k=seq_k, seq_q_padded=-(-seq_q // 128) * 128,
      seq_k_padded=-(-seq_k // block_kv) * block_kv, heads_q=1, heads_kv=1,
      head_dim=64, band=band, softmax_scale=1.0, soft_cap=None, block_q=64,
      block_kv=block_kv, num_stages=2, dtype="bfloat16")


@pytest.mark.parametrize("bounds", [(0, 2, 4, 7, 9, 11), (0, 0, 0, 5, 5, 5),
                                    (1, 3, 3, 3, 6, 6), (0, 4, 4, 4, 4, 8)])
def test_band_walk_runs_each_phase_over_its_steps(bounds):
  """blocks.band_walk (the forward, dQ and dK/dV kernels' step loops) runs every
  step of [lo_c, hi_c) once and in order: [lo_c, lo) skipped, [lo, a) masked,
  [a, b) plain, [b, hi) masked, [hi, hi_c) skipped. Skipped steps matter too:
  the kernels' barrier phases advance on them."""
  lo_c, lo, a, b, hi, hi_c = bounds
  ran = []

  def body(s, carry, masked):
    ran.append((int(s), "masked" if masked else "plain"))
    return carry + 1

  def skip(s, carry):
    ran.append((int(s), "skip"))
    return carry

  with jax.disable_jit():  # the loops run step by step in Python
    count = mosaic_blocks.band_walk(body, skip, jnp.int32(0), lo_c, (lo, a, b, hi),
                                    hi_c)
  kind = lambda s: ("skip" if s < lo or s >= hi else
                    "plain" if a <= s < b else "masked")
  assert ran == [(s, kind(s)) for s in range(lo_c, hi_c)]
  assert int(count) == hi - lo


@pytest.mark.parametrize("seq_q,seq_k,left,right", [
    (200, 333, None, None), (333, 200, None, 0), (1000, 64, 100, 20),
    (64, 1000, 5, None)])
def test_cta_walks_hold_the_common_ranges_of_both_warpgroups(seq_q, seq_k, left, right):
  """Forward and dK/dV: each warpgroup's ranges are common/blocking.py's for its
  rows (keys) and the CTA walk [lo_c, hi_c) contains both (the ranges
  themselves are checked against the dense band in common/tests)."""
  g = _geometry(seq_q, seq_k, left, right)
  g = dataclasses.replace(g, seq_k_padded=-(-seq_k // 128) * 128)
  for walk, own, tiles, rows, step in (
      (mosaic_blocks.cta_block_ranges, mosaic_blocks.wg_block_ranges, g.num_q_tiles,
       g.block_q, g.seq_k_padded // g.block_kv),
      (mosaic_blocks.cta_q_ranges, mosaic_blocks.wg_q_ranges, g.num_kv_tiles,
       g.block_kv, g.seq_q_padded // g.block_q)):
    for tile in range(tiles):
      rng, lo_c, hi_c = walk(g, tile)
      for w in (0, 1):
        lo, a, b, hi = (int(x) for x in own(g, tile * 2 * rows + w * rows))
        if hi > lo:
          assert tuple(int(x) for x in rng[w]) == (lo, a, b, hi)
        assert int(lo_c) <= int(rng[w][0]) <= int(rng[w][3]) <= int(hi_c) <= step
  # A shared block (the backward above D = 128): both warpgroups own block `tile`.
  g = dataclasses.replace(g, shared_block=True)
  for walk, own, tiles, rows in (
      (mosaic_blocks.cta_block_ranges, mosaic_blocks.wg_block_ranges, g.num_q_tiles,
       g.block_q),
      (mosaic_blocks.cta_q_ranges, mosaic_blocks.wg_q_ranges, g.num_kv_tiles,
       g.block_kv)):
    for tile in range(tiles):
      rng, lo_c, hi_c = walk(g, tile)
      want = tuple(int(x) for x in own(g, tile * rows))
      for w in (0, 1):
        got = tuple(int(x) for x in rng[w])
        assert got == want or (want[3] <= want[0] and got[3] <= got[0])
      assert (int(lo_c), int(hi_c)) == ((want[0], want[3]) if want[3] > want[0] else (0, 0))


@pytest.mark.parametrize("batch,heads,seq,ctas", [
    (1, 1, 128, 0), (2, 3, 1000, 0), (2, 3, 1000, 5), (8, 16, 2048, 132),
    (1, 2, 256, 132)])
def test_persistent_schedule_covers_every_tile_once(batch, heads, seq, ctas):
  band = Band(seq_q=seq, seq_k=seq)
  g = mosaic_blocks.Geometry(
      batch=batch, seq_q=seq, seq_k=seq, seq_q_padded=-(-seq // 128) * 128,
      seq_k_padded=-(-seq // 128) * 128, heads_q=heads, heads_kv=1, head_dim=64,
      band=band, softmax_scale=1.0, soft_cap=None, block_q=64, block_kv=128,
      num_stages=2, dtype="bfloat16", persistent_ctas=ctas)
  assert g.num_ctas == (min(ctas, g.num_tiles) if ctas else g.num_tiles)
  seen = []
  for cta in range(g.num_ctas):
    n = int(mosaic_blocks.tiles_of_cta(g, cta))
    assert n >= 1
    seen += [tuple(int(x) for x in mosaic_blocks.tile_coords(g, cta + i * g.num_ctas))
             for i in range(n)]
  expected = {(b, h, t) for b in range(batch) for h in range(heads)
              for t in range(g.num_q_tiles)}
  assert len(seen) == len(expected) and set(seen) == expected


def _tail_geometry(batch, heads, seq_q, seq_k, ctas, block_kv=128, **band):
  return mosaic_blocks.Geometry(
      batch=batch, seq_q=seq_q, seq_k=seq_k, seq_q_padded=-(-seq_q // 128) * 128,
      seq_k_padded=-(-seq_k // block_kv) * block_kv, heads_q=heads, heads_kv=1,
      head_dim=128, band=Band(seq_q=seq_q, seq_k=seq_k, **band), softmax_scale=1.0,
      soft_cap=None, block_q=64, block_kv=block_kv, num_stages=2, dtype="bfloat16",
      persistent_ctas=ctas, split_tail=True)


@pytest.mark.parametrize("batch,heads,seq_q,seq_k,ctas,block_kv", [
    (2, 16, 8192, 8192, 132, 128), (1, 20, 2048, 2000, 132, 128),
    (3, 5, 1000, 700, 7, 64), (1, 3, 640, 1000, 4, 128)])
def test_split_tail_walk_covers_every_block_once(batch, heads, seq_q, seq_k, ctas,
                                                 block_kv):
  """The persistent forward with its last round split along the keys: over all
  CTAs' work items, every (tile, kv block) of the unsplit walk runs exactly once,
  whole tiles first, and each part's warpgroup ranges lie inside its key range."""
  g = _tail_geometry(batch, heads, seq_q, seq_k, ctas, block_kv)
  tail = mosaic_blocks.tail_plan(g)
  assert tail is not None and tail.parts >= 2
  assert tail.full % g.num_ctas == 0 and tail.full + tail.count == g.num_tiles
  units = np.array([cta + i * g.num_ctas for cta in range(g.num_ctas)
                    for i in range(int(mosaic_blocks.tiles_of_cta(g, cta)))], np.int32)

  # Every unit's walk at once (one compile; unit by unit, eagerly, the 2048 tiles
  # of the first case took 37 s on the CI machine).
  @jax.jit
  @jax.vmap
  def walk(u):
    t, whole, _, ranges, lo_c, hi_c = mosaic_blocks.unit_walk(g, u)
    return (t, whole, ranges, lo_c, hi_c, mosaic_blocks.unit_tile(g, u),
            mosaic_blocks.tile_coords(g, t))

  t, whole, ranges, lo_c, hi_c, tile, coords = jax.tree.map(np.asarray, walk(units))
  np.testing.assert_array_equal(whole, units < tail.full)
  np.testing.assert_array_equal(t, tile)
  assert (lo_c < hi_c).all()
  for lo, a, b, hi in ranges:
    assert ((lo_c <= lo) & (lo <= a) & (a <= b) & (b <= hi) & (hi <= hi_c)).all()
  seen = [(int(b), int(h), int(tile), s)
          for b, h, tile, first, end in zip(*coords, lo_c, hi_c)
          for s in range(first, end)]
  _, lo_c, hi_c = mosaic_blocks.cta_block_ranges(g, 0)
  expected = {(b, h, t, s) for b in range(batch) for h in range(heads)
              for t in range(g.num_q_tiles) for s in range(int(lo_c), int(hi_c))}
  assert len(seen) == len(expected) and set(seen) == expected


@pytest.mark.parametrize("batch,heads,seq,window", [
    (8, 16, 2048, None), (1, 16, 16384, None), (2, 3, 1000, None), (1, 2, 4096, 300)])
def test_balanced_order_covers_every_tile_once_and_balances(batch, heads, seq, window):
  """blocks.balanced_order: every tile once, each CTA's in window order,
  no CTA's load (kv steps plus a per-tile overhead) above the least loaded
  one's by more than one tile's, and each CTA's tiles within the windows."""
  kw = dict(causal=True) if window is None else dict(sliding_window=(window, 0))
  s = spec_lib.abstract_spec(batch=batch, seq_q=seq, seq_k=seq, heads_q=heads,
                             head_dim=128, **kw)
  cfg = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(persistent=True))
  g = dataclasses.replace(mosaic.geometry(s, cfg), persistent_ctas=132)
  assert g.balanced
  table = mosaic_blocks.balanced_order(g)
  assert table.shape[0] == g.num_ctas
  steps = {}
  for tile in range(g.num_q_tiles):
    _, lo_c, hi_c = mosaic_blocks.cta_block_ranges(g, tile)
    steps[tile] = int(hi_c) - int(lo_c)
  _assert_balanced(table, g, [
      steps[int(mosaic_blocks.tile_coords(g, t)[2])] + TILE_OVERHEAD
      for t in range(g.num_tiles)])


TILE_OVERHEAD = 1  # a tile's fixed cost in the loads checked, in kv steps


def _assert_balanced(table, g, cost):
  """A balanced_order table: a row per CTA of its tile count (at least one),
  its tiles and a zero padding column (the kernel reads one entry past a CTA's
  last tile); every tile once; no CTA's load (the sum of ``cost[t]``) above the
  least loaded one's by more than one tile's; and each CTA's tiles in window
  order, one per round of the window (blocks.WINDOW_ROUNDS rounds of
  consecutive tiles), so the CTAs move through the heads together."""
  assert table.shape == (g.num_ctas, 2 + -(-g.num_tiles // g.num_ctas))
  assert not table[:, -1].any()
  seen, loads = [], []
  window = mosaic_blocks.WINDOW_ROUNDS * g.num_ctas
  for row in table:
    tiles = list(row[1:1 + row[0]])
    assert row[0] >= 1 and not row[1 + row[0]:].any()
    windows = [t // window for t in tiles]
    assert windows == [r // mosaic_blocks.WINDOW_ROUNDS for r in range(len(tiles))]
    seen += tiles
    loads.append(sum(cost[t] for t in tiles))
  assert sorted(seen) == list(range(g.num_tiles))
  assert max(loads) - min(loads) <= max(cost)


@pytest.mark.parametrize("xp", (np, jnp))
def test_deal_orders_by_window_then_longest_on_host_and_device(xp):
  """blocks._deal orders the tiles on the host by one int32 key where window
  and steps fit in it and by a lexsort otherwise, and on the device by each
  tile's rank in its window (no sort): the tables agree and follow (window,
  longest first, tile)."""
  rng = np.random.default_rng(3)
  steps = rng.integers(0, 40, 1000).astype(np.int32)
  one_key = np.asarray(mosaic_blocks._deal(xp.asarray(steps), 24, 40, xp))
  lexsort = np.asarray(mosaic_blocks._deal(xp.asarray(steps), 24, 2**30, xp))
  np.testing.assert_array_equal(one_key, lexsort)
  window = 24 * mosaic_blocks.WINDOW_ROUNDS
  want = sorted(range(1000), key=lambda t: (t // window, -steps[t], t))
  w, c = mosaic_blocks.WINDOW_ROUNDS, 7
  # Window 0 runs its rounds forward, reversed, ...; window 1 reversed, forward.
  for r, flip in ((0, False), (1, True), (2, False), (w, True), (w + 1, False)):
    assert one_key[c, 1 + r] == want[r * 24 + (23 - c if flip else c)]


@pytest.mark.parametrize("n,ctas,most", [
    (50, 24, 40),  # fewer tiles than one window
    (24 * 4 * 3, 24, 40),  # whole windows only
    (1000, 24, 3),  # a partial last window, many ties
    (2048, 132, 128)])  # a 16k-token row's tiles on an H100 / H200
def test_device_deal_equals_host_deal(n, ctas, most):
  """The device's table (each tile's rank in its window, blocks._window_ranks)
  is the host's (a stable sort), zero-step tiles and ties included."""
  steps = np.random.default_rng(n).integers(0, most + 1, n).astype(np.int32)
  steps[::7] = 0
  host = mosaic_blocks._deal(steps, ctas, most, np)
  device = jax.jit(lambda s: mosaic_blocks._deal(s, ctas, most, jnp))(jnp.asarray(steps))
  np.testing.assert_array_equal(np.asarray(device), host)


# The last: fewer tiles than CTAs, one round. Shuffled tokens are not
# contiguous segments.
@pytest.mark.parametrize("lengths,contiguous", [
    (lengths, contiguous) for lengths in
    ((2048,) * 8, (64, 192, 256, 768, 1024, 2048, 4096, 7936), (512,) * 32, "shuffled",
     (64, 64, 128))
    for contiguous in ((False,) if lengths == "shuffled" else (False, True))])
@pytest.mark.parametrize("causal", (True, False))
def test_device_order_covers_every_tile_once_and_balances(lengths, causal, contiguous):
  """blocks.balanced_order under segment ids (the tiles ordered on the device
  from the ids' visible blocks, or with contiguous segments from the spans'):
  every tile once, each CTA's in window order, the steps those of the kernel's
  walk, and no CTA's load above the least loaded one's by more than one
  tile's."""
  rng = np.random.default_rng(1)
  if lengths == "shuffled":  # unsorted ids: a q block's blocks need not be one run
    ids = rng.permutation(np.repeat(np.arange(40), 100))[None].astype(np.int32)
  else:
    ids = np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32)
  seq = ids.shape[1]
  sd = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  s = spec_lib.abstract_spec(batch=1, seq_q=seq, seq_k=seq, heads_q=16, head_dim=128,
                             causal=causal, segment_ids=(sd, sd),
                             contiguous_segments=contiguous)
  cfg = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(persistent=True))
  g = dataclasses.replace(mosaic.geometry(s, cfg), persistent_ctas=132)
  assert g.balanced and g.segments and g.segment_spans == contiguous
  ops = spec_lib.Operands(q=None, k=None, v=None, q_segment_ids=jnp.asarray(ids),
                          kv_segment_ids=jnp.asarray(ids))

  def order(ops):  # one program: the visible blocks, each tile's steps, the table
    visible = mosaic.segment_operands(ops, g)[2]
    return (visible, mosaic_blocks.tile_steps(g, visible),
            mosaic_blocks.balanced_order(g, visible))
  vis, steps, table = (np.asarray(x) for x in jax.jit(order)(ops))
  for t in rng.choice(g.num_tiles, 20, replace=False):  # the kernel's own walk
    b, _, tile = (int(x) for x in mosaic_blocks.tile_coords(g, int(t)))
    narrow = lambda i, b=b: tuple(int(vis[b, j, i]) for j in range(4))
    _, lo_c, hi_c = mosaic_blocks.cta_block_ranges(g, tile, narrow)
    assert steps[t] == int(hi_c) - int(lo_c)
  _assert_balanced(table, g, steps + TILE_OVERHEAD)


def test_ds_dtype_halves_the_dbias_traffic_for_bf16_only():
  """dS for dbias is bf16 beside a bf16 additive tile, fp32 beside an fp16 one
  (fp16's range would flush small dS), as the dQ kernel's output type."""
  from flashjax.pallas_gpu.mosaic import bwd as mosaic_bwd
  sd = jax.ShapeDtypeStruct
  for dtype, want in (("bfloat16", jnp.bfloat16), ("float16", jnp.float32)):
    s = spec_lib.abstract_spec(batch=2, seq_q=256, seq_k=256, heads_q=2, head_dim=128,
                               dtype=dtype, bias=sd((1, 2, 256, 256), dtype))
    g = mosaic.backward_geometries(s, mosaic.default_config(s))[0]
    g = dataclasses.replace(g, bias_dtype=dtype, bias_grad=True)
    assert mosaic_bwd.ds_dtype(g) == want
    assert mosaic_bwd._ds_type(g)[0].dtype == want


def test_dbias_batch_sum_lowers_to_reduce_adds():
  """From ``DBIAS_KERNEL_SUM_MIN_BATCH`` rows a bias broadcast over the batch
  (whatever a mask adds) has its dS summed by the dQ kernel: fp32 TMA
  reduce-adds into a zeroed sum aliased in and out of the kernel, in one
  launch or two, and inside a shard_map that checks varying axes. Under vmap,
  and for a bias per batch row, the kernels write each row's dS instead (a
  Ref does not batch)."""
  assert mosaic_config.DBIAS_KERNEL_SUM_MIN_BATCH == 8
  sd = jax.ShapeDtypeStruct

  def spec(batch, bias_batch, **kw):
    return spec_lib.abstract_spec(batch=batch, seq_q=128, seq_k=128, heads_q=2,
                                  head_dim=128, dtype="bfloat16",
                                  bias=sd((bias_batch, 2, 128, 128), jnp.bfloat16), **kw)
  mask = sd((8, 1, 128, 128), jnp.bool_)
  assert [mosaic.sums_dbias_in_kernel(spec(*bb)) for bb in ((7, 1), (8, 1), (8, 8))] == [
      False, True, False]
  assert mosaic.sums_dbias_in_kernel(spec(8, 1, mask=mask))
  assert not mosaic.sums_dbias_in_kernel(spec_lib.abstract_spec(
      batch=8, seq_q=128, seq_k=128, heads_q=2, head_dim=128, dtype="bfloat16",
      mask=mask))

  def lowered(bias_batch, one_launch=True, mapped=False, sharded=False):
    q = sd((8, 128, 2, 128), jnp.bfloat16)
    bias = sd((bias_batch, 2, 128, 128), jnp.bfloat16)

    def bwd(q, k, v, bias):
      ops, spec = spec_lib.canonicalize(q, k, v, bias=bias, causal=True)
      grads = _backward_of_forward(ops, spec,
                                   _static(ops, spec, bwd_one_launch=one_launch))
      assert grads.bias.shape == bias.shape
      return grads
    if mapped:
      bwd, q = jax.vmap(bwd, in_axes=(0, 0, 0, None)), sd((2,) + q.shape, q.dtype)
    if sharded:
      mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
      rows = jax.sharding.PartitionSpec("x")
      per_shard = bwd
      bwd = jax.shard_map(lambda *a: per_shard(*a).bias, mesh=mesh,
                          in_specs=(rows,) * 3 + (jax.sharding.PartitionSpec(),),
                          out_specs=jax.sharding.PartitionSpec(), check_vma=True)
    text = jax.jit(bwd).trace(q, q, q, bias).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == (2 if one_launch else 3)
    return "cp.reduce.async.bulk" in text, "output_operand_alias" in text

  assert lowered(1) == lowered(1, one_launch=False) == (True, True)
  assert lowered(1, sharded=True) == (True, True)
  assert lowered(1, mapped=True) == lowered(8) == (False, False)


@pytest.mark.parametrize("seq_q,seq_k,window", [
    (512, 512, (None, 0)), (300, 450, (None, 0)), (450, 300, (None, 0)),
    (640, 640, (100, 0)), (640, 512, (130, 70))])
def test_ds_tiles_outside_the_band_are_left_to_the_sum(seq_q, seq_k, window):
  """Where dS is summed over the batch or heads, the dQ kernel writes only the
  tiles its walk reaches (Geometry.ds_reached_only) and dbias_sum reads only
  those: they are exactly the tiles holding an allowed (row, key) pair, every
  warpgroup's walk covers its row of them, and what the unwritten tiles hold
  never reaches dbias (the kernel in interpret mode, summed over the batch or
  the heads, against NumPy)."""
  sd = jax.ShapeDtypeStruct

  def spec(batch=2, bias=(1, 2), **kw):
    return spec_lib.abstract_spec(
        batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=2, head_dim=128,
        dtype="bfloat16", sliding_window=window,
        bias=sd(bias + (seq_q, seq_k), jnp.bfloat16), **kw)

  def geometry(s):
    g = mosaic.backward_geometries(s, mosaic.MosaicConfig())[0]
    g = dataclasses.replace(g, bias_grad=True, ds_batch_sum=mosaic.sums_dbias_in_kernel(s))
    return dataclasses.replace(g, ds_reached_only=mosaic._ds_reached_only(s, g))

  g = geometry(spec())
  reached = mosaic_blocks.reached_tiles(g)
  nq, nk = g.seq_q_padded // g.block_q, g.seq_k_padded // g.block_kv
  allowed = np.zeros((g.seq_q_padded, g.seq_k_padded), bool)
  allowed[:seq_q, :seq_k] = np.asarray(g.band.as_array())
  np.testing.assert_array_equal(
      reached, allowed.reshape(nq, g.block_q, nk, g.block_kv).any((1, 3)))
  assert not reached.all() and reached.any()
  for tile in range(g.num_q_tiles):
    ranges = mosaic_blocks.cta_block_ranges(g, tile)[0]
    for w in (0, 1):
      lo, _, _, hi = (int(x) for x in ranges[w])
      assert reached[2 * tile + w, lo:hi].all()
      assert reached[2 * tile + w].sum() == hi - lo

  assert g.ds_reached_only
  assert geometry(spec(bias=(2, 1))).ds_reached_only  # summed over heads
  assert not geometry(spec(bias=(2, 2))).ds_reached_only  # nothing summed
  assert not geometry(spec(batch=8)).ds_reached_only  # the kernel's own sum
  ids = sd((2, seq_q), jnp.int32), sd((2, seq_k), jnp.int32)
  with_ids = geometry(spec(segment_ids=ids))
  assert with_ids.segments and not with_ids.ds_reached_only
  # A full band reaches every tile but those of padding rows or keys alone.
  full = dataclasses.replace(g, band=Band(seq_q=seq_q, seq_k=seq_k), ds_reached_only=False)
  assert mosaic._ds_reached_only(spec(), full) == (
      g.seq_q_padded - seq_q >= g.block_q or g.seq_k_padded - seq_k >= g.block_kv)

  rng = np.random.default_rng(seq_q)
  ds = rng.standard_normal((2, 2, g.seq_q_padded, g.seq_k_padded)).astype(np.float32)
  ds = np.asarray(jnp.asarray(ds, jnp.bfloat16), np.float32)  # exact in the kernel's input
  unwritten = ~np.repeat(np.repeat(reached, g.block_q, 0), g.block_kv, 1)
  written = np.where(unwritten, 0, ds)
  ds[:, :, unwritten] = np.nan
  for bias_dims in ((1, 2), (2, 1), (1, 1)):
    got = dbias_sum.band_sum(jnp.asarray(ds, jnp.bfloat16), reached, *bias_dims,
                             jnp.float32, interpret=True)
    want = epilogue.reduce_to_shape(written, bias_dims + written.shape[2:])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="out_rows 3"):
    dbias_sum.band_sum(jnp.asarray(ds), reached, 3, 2, jnp.float32, interpret=True)
  with pytest.raises(ValueError, match="does not tile"):
    dbias_sum.band_sum(jnp.asarray(ds), reached[:, :-1], 1, 2, jnp.float32,
                       interpret=True)


def test_mask_alone_streams_a_float8_tile_and_takes_128_key_blocks():
  """A mask alone rides as float8_e5m2 0 / -inf (exact, half a bf16 tile's
  bytes); a bias keeps its dtype. 128-key forward blocks (the default; 64-key
  ones allowed) fit beside a 16-bit or float8 tile, but not an fp32 one, nor
  a 16-bit one and segment ids."""
  sd = jax.ShapeDtypeStruct
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, 200, 2, 64), jnp.bfloat16)
  mask = jax.random.bernoulli(keys[1], 0.7, (2, 1, 200, 200))
  bias = jax.random.normal(keys[2], (1, 2, 200, 200), jnp.float32)
  for kw, want in ((dict(mask=mask), jnp.float8_e5m2),
                   (dict(mask=mask, bias=bias.astype(jnp.bfloat16)), jnp.bfloat16),
                   (dict(bias=bias), jnp.float32)):
    ops, spec = spec_lib.canonicalize(q, q, q, **kw)
    g, tile = mosaic.additive_tile(ops, spec, mosaic.geometry(spec, mosaic.default_config(spec)))
    assert tile.dtype == want and g.bias_dtype == jnp.dtype(want).name
    assert tile.shape == (tile.shape[0], tile.shape[1], g.seq_q_padded, g.seq_k_padded)
    got = np.asarray(tile[:, :, :200, :200], np.float32)
    want_tile = np.zeros(got.shape, np.float32)
    if "mask" in kw:
      want_tile = want_tile + np.where(np.asarray(mask), 0.0, -np.inf)
    if "bias" in kw:
      want_tile = want_tile + np.asarray(kw["bias"], np.float32)
    if "bias" not in kw:
      np.testing.assert_array_equal(got, want_tile)
    else:
      np.testing.assert_allclose(got, want_tile, rtol=1e-2)
  spec = lambda **kw: spec_lib.abstract_spec(batch=1, seq_q=256, seq_k=256, heads_q=2,
                                             head_dim=128, **kw)
  m = sd((1, 1, 256, 256), jnp.bool_)
  b = sd((1, 2, 256, 256), jnp.bfloat16)
  ids = sd((1, 256), jnp.int32)
  tiles = lambda s, item=2: [(f.block_kv, f.num_stages)
                             for f in mosaic_config.additive_forwards(s, item)]
  wide, narrow = (128, 2), (64, 2)
  assert tiles(spec(mask=m), 1) == tiles(spec(mask=m, causal=True), 1) == [wide, narrow]
  assert tiles(spec(mask=m, segment_ids=(ids, ids)), 1) == [wide, narrow]
  assert tiles(spec(bias=b)) == tiles(spec(bias=b, mask=m)) == [wide, narrow]
  assert tiles(spec(bias=b), 4) == tiles(spec(bias=b, segment_ids=(ids, ids))) == [narrow]
  assert tiles(spec()) == []
  for s in (spec(mask=m), spec(mask=m, causal=True)):
    assert mosaic.default_config(s).fwd.block_kv == tiles(s)[0][0]
  # A bias's default takes its tile's size; unknown, the tiles that fit beside any.
  assert mosaic.default_config(spec(bias=b), 2).fwd.block_kv == 128
  assert mosaic.default_config(spec(bias=b), 4).fwd.block_kv == 64
  assert mosaic.default_config(spec(bias=b)).fwd.block_kv == 64
  # What the tiles allow fits Hopper's shared memory (fwd.smem_bytes counts
  # each buffer at Mosaic-GPU's 1 KiB alignment); the output has its own
  # staging buffer beside 64-key blocks only.
  from flashjax.pallas_gpu.mosaic import fwd as mosaic_fwd
  g0 = mosaic.geometry(spec(bias=b), mosaic.default_config(spec(bias=b)))
  staged = {}
  for dtype in ("float8_e5m2", "bfloat16", "float32"):
    for seg in (False, True):
      kw = dict(mask=m) if dtype == "float8_e5m2" else dict(bias=b)
      s = spec(segment_ids=(ids, ids), **kw) if seg else spec(**kw)
      for f in mosaic_config.additive_forwards(s, jnp.dtype(dtype).itemsize):
        g = dataclasses.replace(g0, block_kv=f.block_kv, num_stages=f.num_stages,
                                bias_dtype=dtype, segments=seg)
        assert mosaic_fwd.smem_bytes(g, False) <= mosaic_fwd.SMEM_BYTES, (dtype, seg, f)
        staged[dtype, seg, f.block_kv] = mosaic_fwd.separate_out_smem(g)
  assert staged == {("float8_e5m2", False, 128): False, ("float8_e5m2", False, 64): True,
                    ("float8_e5m2", True, 128): False, ("float8_e5m2", True, 64): True,
                    ("bfloat16", False, 128): False, ("bfloat16", False, 64): True,
                    ("bfloat16", True, 64): True, ("float32", False, 64): True,
                    ("float32", True, 64): True}
  # Swizzled rows of the tile: up to 128 bytes, a 64-key float8 row's 64.
  swz = lambda dtype, width: [(t.tiling if hasattr(t, "tiling") else t.swizzle)
                              for t in mosaic_blocks.additive_tiling(dtype, width)]
  assert swz(jnp.float8_e5m2, 64) == [(8, 64), 64]
  assert swz(jnp.float8_e5m2, 128) == [(8, 128), 128]
  assert swz(jnp.bfloat16, 64) == [(8, 64), 128]
  assert swz(jnp.float32, 64) == [(8, 32), 128]


@pytest.mark.parametrize("kw,head_dim,block_kv", [
    (dict(), 128, None), (dict(), 64, None), (dict(), 256, None),
    (dict(bias="bfloat16"), 128, 128), (dict(bias="bfloat16"), 128, 64),
    (dict(bias="float32"), 128, 64), (dict(mask=True), 128, 128),
    (dict(mask=True, segment_ids=True), 128, 128),
    (dict(bias="bfloat16", segment_ids=True), 128, 64),
    (dict(bias="bfloat16", mask=True), 64, 128)])
def test_forward_shared_memory_model_matches_mosaic(monkeypatch, kw, head_dim, block_kv):
  """fwd.smem_bytes, which picks the output's staging buffer and the tiles
  that fit beside an additive tile, counts what Mosaic-GPU allocates: its
  buffers exactly, and no fewer bytes of barriers than the kernel has. Mosaic
  checks a kernel's shared memory against Hopper's 227 KiB while lowering, and
  names the bytes when it is over; a bound of one byte makes it name them."""
  from jax.experimental.mosaic.gpu import core as mgpu_core
  from flashjax.pallas_gpu.mosaic import fwd as mosaic_fwd
  sd = jax.ShapeDtypeStruct
  q = sd((2, 256, 2, head_dim), jnp.bfloat16)
  arrays = {}
  if "bias" in kw:
    arrays["bias"] = sd((1, 2, 256, 256), kw["bias"])
  if kw.get("mask"):
    arrays["mask"] = sd((2, 1, 256, 256), jnp.bool_)
  if kw.get("segment_ids"):
    arrays["q_ids"] = arrays["kv_ids"] = sd((2, 256), jnp.int32)
  seen = []
  staged = mosaic_fwd.separate_out_smem
  monkeypatch.setattr(mosaic_fwd, "separate_out_smem",
                      lambda g: seen.append((g, staged(g))) or seen[-1][1])

  def fwd(q, k, v, *values):
    f = dict(zip(arrays, values))
    if "q_ids" in f:
      f["segment_ids"] = (f.pop("q_ids"), f.pop("kv_ids"))
    ops, spec = spec_lib.canonicalize(q, k, v, **f)
    config = mosaic.default_config(spec)
    if block_kv is not None:
      config = configs.with_part(config, "fwd", block_kv=block_kv, num_stages=2)
    return mosaic.forward(ops, spec, platform.Static(config))

  monkeypatch.setattr(mgpu_core, "_SMEM_SIZE_BOUND", 1)
  with pytest.raises(ValueError, match="exceeds available shared memory") as err:
    jax.jit(fwd).trace(q, q, q, *arrays.values()).lower(lowering_platforms=("cuda",))
  allocated = int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1))
  [(g, separate_o)] = seen
  model = mosaic_fwd.smem_bytes(g, separate_o)
  assert 0 < model - allocated <= mosaic_fwd._BARRIERS, (model, allocated)
  assert allocated <= mosaic_fwd.SMEM_BYTES


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["mask", "bias"])
def test_both_additive_forward_tiles_match_the_reference(kind, causal):
  """A mask alone or a bf16 bias: the forward with either tile it allows (128
  or 64 keys beside the float8 or bf16 tile) and the backward give the
  reference's output, lse and gradients; other tiles, and 128-key ones beside
  an fp32 bias, raise, naming the allowed ones."""
  from flashjax.common import reference
  keys = jax.random.split(jax.random.key(5), 6)
  q = jax.random.normal(keys[0], (2, 320, 2, 128), jnp.bfloat16)
  k, v = (jax.random.normal(x, (2, 448, 2, 128), jnp.bfloat16) for x in keys[1:3])
  do = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
  if kind == "mask":
    extra = dict(mask=jax.random.bernoulli(keys[4], 0.8, (2, 1, 320, 448)))
  else:
    extra = dict(bias=jax.random.normal(keys[4], (1, 2, 320, 448), jnp.bfloat16))
  loss = lambda f: lambda q, k, v, *b: jnp.sum(
      f(q, k, v, *b)[0].astype(jnp.float32) * do.astype(jnp.float32))
  args = (q, k, v) + ((extra["bias"],) if kind == "bias" else ())
  with_extra = lambda *b: dict(bias=b[0]) if b else extra
  ref = lambda q, k, v, *b: reference.attention(q, k, v, causal=causal, return_lse=True,
                                                **with_extra(*b))
  want = ref(*args)
  wrt = tuple(range(len(args)))
  want_grads = jax.grad(loss(ref), wrt)(*args)
  for block_kv in (128, 64):
    cfg = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(block_kv=block_kv))
    f = lambda q, k, v, *b: mosaic.flash_attention(q, k, v, causal=causal, config=cfg,
                                                   return_lse=True, **with_extra(*b))
    out, lse = jax.jit(f)(*args)
    tolerances.assert_close(out, want[0], tolerances.forward(jnp.bfloat16), name="out")
    tolerances.assert_close(lse, want[1], tolerances.forward(jnp.bfloat16), name="lse")
    grads = jax.jit(jax.grad(loss(f), wrt))(*args)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
      tolerances.assert_close(a, b, tolerances.grad(jnp.bfloat16), name=name)
  cfg = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(block_kv=128, num_stages=3))
  with pytest.raises(ValueError, match=f"with a {kind}, the forward's tiles must be "
                     "fwd.block_kv=.*got fwd.block_kv=128, fwd.num_stages=3"):
    mosaic.flash_attention(q, k, v, causal=causal, config=cfg, **extra)
  if kind == "bias":
    cfg = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(block_kv=128))
    with pytest.raises(ValueError, match=r"must be fwd.block_kv=64, fwd.num_stages=2 "
                       r"\(.*got fwd.block_kv=128, fwd.num_stages=2"):
      mosaic.flash_attention(q, k, v, causal=causal, config=cfg,
                             bias=extra["bias"].astype(jnp.float32))


def test_launch_defaults():
  """Persistent for the full band (with segment ids balanced in the device's
  order); persistent and balanced for a causal band up to 8192 keys at any
  head dim, and over segment ids up to 16384 keys; one CTA per tile for
  longer causal bands and windows."""
  def geometry(seq, d, **kw):
    s = spec_lib.abstract_spec(batch=1, seq_q=seq, seq_k=seq, heads_q=2, head_dim=d,
                               **kw)
    g = mosaic.geometry(s, mosaic.default_config(s))
    return bool(g.persistent_ctas), g.balanced
  ids = lambda seq: (jax.ShapeDtypeStruct((1, seq), jnp.int32),) * 2
  assert geometry(2048, 128) == (True, False)
  assert geometry(2048, 128, causal=True) == (True, True)
  assert geometry(8192, 64, causal=True) == (True, True)
  assert geometry(8192, 128, causal=True) == (True, True)
  assert geometry(8192, 256, causal=True) == (True, True)
  assert geometry(16384, 64, causal=True) == (False, False)
  assert geometry(2048, 128, sliding_window=(256, 0)) == (False, False)
  assert geometry(2048, 128, causal=True, segment_ids=ids(2048)) == (True, True)
  assert geometry(16384, 128, causal=True, segment_ids=ids(16384)) == (True, True)
  assert geometry(16385, 128, causal=True, segment_ids=ids(16385)) == (False, False)
  assert geometry(2048, 128, sliding_window=(256, 0), segment_ids=ids(2048)) == (
      False, False)
  s = spec_lib.abstract_spec(batch=1, seq_q=1024, seq_k=4096, heads_q=2, head_dim=128,
                             causal=True, segment_ids=(
                                 jax.ShapeDtypeStruct((1, 1024), jnp.int32),
                                 jax.ShapeDtypeStruct((1, 4096), jnp.int32)))
  g = mosaic.geometry(s, mosaic.default_config(s))
  assert g.persistent_ctas and g.balanced
  assert geometry(2048, 128, segment_ids=ids(2048)) == (True, True)
  s = spec_lib.abstract_spec(batch=1, seq_q=2048, seq_k=2048, heads_q=2, head_dim=128,
                             causal=True)
  cfg = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(balanced=False))
  g = mosaic.geometry(s, cfg)
  assert g.persistent_ctas and not g.balanced


def test_split_tail_default_where_it_was_measured_to_pay():
  """On by default for D <= 64 with more than 2048 keys only (H200, 2026-11-23)."""
  s = lambda d, seq: spec_lib.abstract_spec(batch=2, seq_q=seq, seq_k=seq, heads_q=12,
                                            head_dim=d, dtype="bfloat16")
  assert mosaic.default_config(s(64, 8192)).fwd.split_tail
  assert mosaic.default_config(s(48, 4096)).fwd.split_tail
  assert not mosaic.default_config(s(64, 2048)).fwd.split_tail
  assert not mosaic.default_config(s(128, 8192)).fwd.split_tail
  assert not mosaic.default_config(s(256, 8192)).fwd.split_tail


def test_two_launch_backward_default_where_it_was_measured_to_pay():
  """Two backward launches by default for the full band at D = 128 from 8192
  queries and keys, without an additive tile or dropout (H200, 2026-11-27);
  one launch elsewhere."""
  def one_launch(seq, d=128, seq_q=None, **kw):
    s = spec_lib.abstract_spec(batch=1, seq_q=seq_q or seq, seq_k=seq, heads_q=4,
                               head_dim=d, **kw)
    return mosaic.default_config(s).bwd_one_launch
  sd = jax.ShapeDtypeStruct
  assert not one_launch(8192)
  assert not one_launch(8192, seq_q=16384)
  assert one_launch(8192, seq_q=4096)
  assert one_launch(4096, seq_q=8192)
  assert not one_launch(16384, segment_ids=(sd((1, 16384), jnp.int32),) * 2)
  assert not one_launch(8192, d=96)  # padded to 128
  assert one_launch(4096)
  assert one_launch(8192, causal=True)
  assert one_launch(8192, sliding_window=(512, 512))
  assert one_launch(8192, d=64)
  assert one_launch(8192, d=256)
  assert one_launch(8192, dropout_rate=0.1)
  assert one_launch(8192, bias=sd((1, 4, 8192, 8192), jnp.bfloat16))


def test_split_tail_applies_to_the_persistent_full_band_only():
  g = _tail_geometry(2, 16, 8192, 8192, 132)
  assert mosaic_blocks.tail_plan(g) == mosaic_blocks.split_tail.Tail(1980, 68, 5)
  assert mosaic_blocks.num_units(g) == 1980 + 68 * 5
  for other in (dataclasses.replace(g, split_tail=False),
                dataclasses.replace(g, persistent_ctas=0),
                _tail_geometry(2, 16, 8192, 8192, 132, right=0),
                _tail_geometry(1, 2, 256, 256, 132)):  # one round: nothing to split
    assert mosaic_blocks.tail_plan(other) is None
    assert mosaic_blocks.num_units(other) == other.num_tiles


VARIANTS = [
    dict(), dict(causal=True), dict(head_dim=64, causal=True), dict(head_dim=256),
    dict(head_dim=96, seq_q=300, seq_k=700, sliding_window=(100, 20)),
    dict(logits_soft_cap=20.0, heads_q=4, heads_kv=1), dict(dtype="float16"),
    dict(sinks=True, causal=True),
    # The forward's launch kinds (persistent by default for the full band and for
    # causal bands up to 8192 keys, 16384 over segment ids).
    dict(causal=True, persistent=True), dict(persistent=False),
    dict(head_dim=256, sliding_window=(64, 0), persistent=True),
    # A persistent causal launch walking blocks.balanced_order's tiles, or
    # every n-th tile.
    dict(causal=True, persistent=True, balanced=True, seq_q=1024, seq_k=1024),
    dict(causal=True, persistent=True, balanced=False, seq_q=1024, seq_k=1024),
    # A persistent launch of 320 tiles on 132 SMs: the last round split by keys.
    dict(seq_q=2048, seq_k=2000, heads_q=20, heads_kv=4, split_tail=True),
    # The backward's dQ and dK/dV kernels as one launch (default) or two.
    dict(causal=True, bwd_one_launch=False), dict(seq_q=300, seq_k=200, heads_q=4,
                                                  heads_kv=2, bwd_one_launch=False),
    # Segment ids in all three kernels (ids and visible-block tables as operands).
    # (Causal over ids with one CTA per tile: rows past 16384 keys.)
    dict(segment_ids=True, causal=True, persistent=False),
    dict(segment_ids=True, bwd_one_launch=False),
    # A persistent launch over packed documents, balanced by the device's order.
    dict(segment_ids=True, causal=True, persistent=True, balanced=True),
    dict(segment_ids=True, persistent=True, balanced=True, seq_q=300, seq_k=700),
    # The additive tile (bias and / or mask) in all three kernels.
    # A mask alone: a float8 tile beside 128-key forward blocks.
    dict(bias=True, causal=True), dict(mask=True, logits_soft_cap=None, seq_q=200),
    dict(mask=True, causal=True),
    dict(bias=True, mask=True, dtype="float16"),
    # The dK/dV kernel's walk over a kv head's query heads, each with its own
    # rows of a per-head tile.
    dict(bias=True, mask=True, heads_q=4, heads_kv=2, causal=True),
    # Dropout in all three kernels (the row keys ride in the backward's stats),
    # with the persistent split tail, grouped heads and two launches, segment
    # ids, and beside the additive tile.
    dict(dropout=True, causal=True),
    dict(dropout=True, seq_q=2048, seq_k=2000, heads_q=20, heads_kv=4, split_tail=True),
    dict(dropout=True, seq_q=300, seq_k=200, heads_q=4, heads_kv=2,
         bwd_one_launch=False),
    dict(dropout=True, segment_ids=True, logits_soft_cap=20.0),
    dict(dropout=True, bias=True, causal=True),
    dict(dropout=True, head_dim=256, sliding_window=(64, 0)),
    # D = 256: the backward's warpgroups share a block in two roles, in one
    # launch or two, with grouped heads, segment ids and a soft cap.
    dict(head_dim=256, causal=True, bwd_one_launch=False),
    dict(head_dim=256, seq_q=300, seq_k=200, heads_q=4, heads_kv=2,
         logits_soft_cap=20.0),
    dict(head_dim=192, segment_ids=True, causal=True),
    dict(segment_ids=True, causal=True, contiguous_segments=True),
    dict(segment_ids=True, sliding_window=(64, 64), contiguous_segments=True,
         bwd_one_launch=False),
    dict(head_dim=192, segment_ids=True, contiguous_segments=True),
    # The single-pass backward (dQ in the dK/dV kernel) beside what
    # test_single_pass_cases_lower_to_the_single_pass lowers (the full band,
    # grouped heads, D = 64, a mask's tile): a window and soft cap, segment ids
    # with dropout; with a bias the two kernels run (dbias takes the dQ
    # kernel's dS).
    dict(seq_q=300, seq_k=200, heads_q=4, heads_kv=2, sliding_window=(50, 10),
         logits_soft_cap=20.0, bwd_single_pass=True),
    dict(segment_ids=True, causal=True, dropout=True, bwd_single_pass=True),
    dict(bias=True, causal=True, bwd_single_pass=True),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_every_variant_lowers_for_cuda(variant):
  """The variant's forward, with its launch kind, and the backward of its
  output lowered for CUDA as one program: the kernels each variant takes, and
  no transposed copy of an additive tile."""
  kw = dict(variant)
  shape = dict(batch=1, seq_q=kw.pop("seq_q", 256), seq_k=kw.pop("seq_k", 256),
               heads_q=kw.pop("heads_q", 2), heads_kv=kw.pop("heads_kv", 2),
               head_dim=kw.pop("head_dim", 128))
  dtype = kw.pop("dtype", "bfloat16")
  sinks = kw.pop("sinks", False)
  persistent = kw.pop("persistent", None)
  split_tail = kw.pop("split_tail", False)
  balanced = kw.pop("balanced", None)
  one_launch = kw.pop("bwd_one_launch", True)
  single_pass = kw.pop("bwd_single_pass", False)
  sd = jax.ShapeDtypeStruct
  b, sq, sk, hq = shape["batch"], shape["seq_q"], shape["seq_k"], shape["heads_q"]
  q = sd((b, sq, hq, shape["head_dim"]), dtype)
  k = sd((b, sk, shape["heads_kv"], shape["head_dim"]), dtype)
  arrays = {}
  if sinks:
    arrays["sinks"] = sd((hq, 1), jnp.float32)
  if kw.pop("segment_ids", False):
    arrays["q_ids"], arrays["kv_ids"] = sd((b, sq), jnp.int32), sd((b, sk), jnp.int32)
  if kw.pop("bias", False):
    arrays["bias"] = sd((1, hq, sq, sk), dtype)
  if kw.pop("mask", False):
    arrays["mask"] = sd((b, 1, sq, sk), jnp.bool_)
  if kw.pop("dropout", False):
    arrays["dropout_seed"] = sd((), jnp.int32)
    kw["dropout_rate"] = 0.2
  names = tuple(arrays)
  extra = tuple(arrays.values())

  def features(values):
    f = dict(zip(names, values))
    if "q_ids" in f:
      f["segment_ids"] = (f.pop("q_ids"), f.pop("kv_ids"))
    return f

  def fwd_bwd(q, k, v, *values):
    # One program holds the forward (with the variant's launch) and the
    # backward of its output: each kernel is traced and lowered once.
    ops, spec = spec_lib.canonicalize(q, k, v, **features(values), **kw)
    assert mosaic.supported(spec) is None
    static = _static(ops, spec, bwd_one_launch=one_launch, bwd_single_pass=single_pass)
    config = configs.with_part(static.config, "fwd", persistent=persistent,
                               split_tail=split_tail, balanced=balanced)
    if balanced is not None:
      assert mosaic.geometry(spec, config).balanced == balanced
    assert (mosaic_blocks.tail_plan(mosaic.geometry(spec, config)) is not None) == (
        split_tail)
    return _backward_of_forward(ops, spec, platform.Static(config))

  text = jax.jit(fwd_bwd).trace(q, k, k, *extra).lower(
      lowering_platforms=("cuda",)).as_text()
  # The split tail's parts are merged by tail_merge's (Pallas-Triton) kernel.
  assert ("flashjax_pallas_triton_fwd_tail" in text) == split_tail
  # Forward, dQ and dK/dV kernels (one launch or two), with an additive tile
  # too; or the single pass's one kernel, whose dQ goes out by reduce-adds
  # (with a bias the two kernels run).
  fused = single_pass and "bias" not in names
  mosaic_bwd_launches = 1 if one_launch or fused else 2
  assert text.count("custom_call @mosaic_gpu") == 1 + mosaic_bwd_launches
  assert ("cp.reduce.async.bulk" in text) == fused
  # The dK/dV kernel reads the additive tile transposed itself: XLA makes no
  # transposed copy of it (the pattern is checked on a swapaxes' own text).
  swapped = jax.jit(lambda x: jnp.swapaxes(x, 2, 3)).trace(
      sd((1, 2, 8, 16), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
  transposed = re.compile(r"stablehlo\.transpose[^\n]*dims = \[0, 1, 3, 2\]")
  assert transposed.search(swapped) and not transposed.search(text)


@pytest.mark.parametrize("kw,head_dim,wide", [
    (dict(), 128, False), (dict(causal=True), 128, True),
    (dict(sliding_window=(64, 64)), 128, True), (dict(causal=True), 64, False),
    (dict(causal=True, segment_ids=True), 128, True), (dict(segment_ids=True), 128, False),
    (dict(), 256, True)])
def test_register_split_per_kernel(monkeypatch, kw, head_dim, wide):
  """The kernels ask setmaxnreg for one of the two splits, each handing out
  exactly the 168 x 384 registers a three-warpgroup CTA launches with (more
  hangs): the forward always the narrow one, the backward the wide one for
  D = 128 with a causal or window band and above D = 128 (bwd.registers), as
  recorded while the kernels are traced for CUDA."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from flashjax.pallas_gpu.mosaic import pipeline
  for compute, memory in (pipeline.REGISTERS, pipeline.REGISTERS_WIDE):
    assert 2 * compute + memory == 168 * 3 and compute % 8 == memory % 8 == 0
  asked = []
  original = plgpu.set_max_registers
  monkeypatch.setattr(plgpu, "set_max_registers", lambda n, *, action: (
      asked.append((n, action)), original(n, action=action))[1])
  sd = jax.ShapeDtypeStruct
  q = sd((1, 256, 2, head_dim), jnp.bfloat16)
  kw = dict(kw)
  ids = (sd((1, 256), jnp.int32),) if kw.pop("segment_ids", False) else ()

  by_kernel = {}

  def call(q, k, v, *i):
    # The kernels ask while they are traced: the forward's asks are those made
    # before the backward is traced.
    ops, spec = spec_lib.canonicalize(q, k, v, segment_ids=(i[0], i[0]) if i else None,
                                      **kw)
    static = platform.Static(mosaic.default_config(spec))
    out, lse = mosaic.forward(ops, spec, static)
    by_kernel["fwd"] = set(asked)
    asked.clear()
    grads = mosaic.backward(ops, spec, static, out, lse, out, jnp.zeros_like(lse))
    by_kernel["bwd"] = set(asked)
    return grads
  jax.jit(call).trace(q, q, q, *ids).lower(lowering_platforms=("cuda",))

  narrow = {(pipeline.REGISTERS[0], "increase"), (pipeline.REGISTERS[1], "decrease")}
  wide_split = {(pipeline.REGISTERS_WIDE[0], "increase"),
                (pipeline.REGISTERS_WIDE[1], "decrease")}
  assert by_kernel["fwd"] == narrow
  assert by_kernel["fwd"] | by_kernel["bwd"] == narrow | (wide_split if wide else set())


def test_dropout_keys_with_offsets_and_their_fp32_halves():
  """The kernels' dropout factors (blocks.dropout_row_keys / dropout_col_keys,
  with a position seed's batch, head, row and key offsets, some wrapping past
  2**32) give the NumPy keep-mask of the global coordinates; row keys survive
  the backward's fp32 stats as 16-bit halves, NaN bit patterns included."""
  import numpy as np
  from flashjax.common import dropout
  b0, h0, i0, j0 = 3, 2**31 + 5, 2**32 - 40, 2**32 - 7
  words = dropout.kernel_seed(dropout.position_seed(
      jnp.int32(-9), *(np.uint32(x) for x in (b0, h0, i0, j0))), positions=True)
  b, h = 1, 2
  rows, cols = jnp.arange(64, dtype=jnp.int32), jnp.arange(96, dtype=jnp.int32)
  row_keys = mosaic_blocks.dropout_row_keys(words, b, h, rows)
  col_keys = mosaic_blocks.dropout_col_keys(words, cols)
  got = dropout.keep_from_keys(row_keys[:, None], col_keys[None, :], 0.3)
  u = lambda x: np.uint64(x) % 2**32
  want = dropout.keep_numpy(-9, u(b + b0), u(h + h0), (np.arange(64)[:, None] + i0) % 2**32,
                            (np.arange(96)[None, :] + j0) % 2**32, 0.3)
  np.testing.assert_array_equal(np.asarray(got), want)
  keys = jnp.asarray([0, 1, 0x7FC00000, 0xFFFFFFFF, 0x80000000, 0x7F800001], jnp.uint32)
  halves = mosaic_blocks.dropout_key_halves(keys)
  assert all(bool(jnp.isfinite(x).all()) for x in halves)
  np.testing.assert_array_equal(mosaic_blocks.dropout_keys_from_halves(*halves), keys)


def test_supported_reasons():
  s = lambda **kw: spec_lib.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2,
                                          head_dim=kw.pop("d", 64), **kw)
  assert mosaic.supported(s()) is None
  assert "dtype float32" in mosaic.supported(s(dtype="float32"))
  assert "head dim 512" in mosaic.supported(s(d=512))
  assert mosaic.supported(s(segment_ids=(
      jax.ShapeDtypeStruct((1, 64), jnp.int32),) * 2)) is None
  assert mosaic.supported(s(dropout_rate=0.1)) is None
  sd = jax.ShapeDtypeStruct
  assert mosaic.supported(s(bias=sd((1, 2, 64, 64), jnp.float32))) is None
  assert mosaic.supported(s(mask=sd((1, 1, 64, 64), jnp.bool_))) is None
  assert "broadcast along Sq or Sk" in mosaic.supported(
      s(bias=sd((1, 2, 1, 64), jnp.float32)))
  assert "head dim 256" in mosaic.supported(s(d=256, mask=sd((1, 1, 64, 64), jnp.bool_)))
  assert "soft cap" in mosaic.supported(s(mask=sd((1, 1, 64, 64), jnp.bool_),
                                          logits_soft_cap=30.0))
  if not ON_HOPPER:
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="Hopper"):
      mosaic.flash_attention(q, q, q)


def test_config_validation():
  """Each error names the kernel's class, the field and the value."""
  bad = [(mosaic.MosaicForward, dict(block_q=128), "MosaicForward: block_q .* got 128"),
         (mosaic.MosaicForward, dict(block_kv=96), "block_kv .* got 96"),
         (mosaic.MosaicForward, dict(num_stages=1), "num_stages .* got 1"),
         (mosaic.MosaicForward, dict(split_tail=None), "split_tail .* got None"),
         (mosaic.MosaicForward, dict(persistent=1), "persistent .* got 1"),
         (mosaic.MosaicDq, dict(block_kv=96), "MosaicDq: block_kv .* got 96"),
         (mosaic.MosaicDq, dict(num_stages=1), "MosaicDq: num_stages"),
         (mosaic.MosaicDkv, dict(num_stages=1), "MosaicDkv: num_stages"),
         (mosaic.MosaicDkv, dict(block_kv=128), "MosaicDkv: block_kv .* got 128"),
         # 32 once passed validation and failed inside Mosaic-GPU.
         (mosaic.MosaicDkv, dict(block_q=32), "MosaicDkv: block_q .* got 32"),
         (mosaic.MosaicDkv, dict(block_q=40), "MosaicDkv: block_q .* got 40"),
         (mosaic.MosaicConfig, dict(backward_kernel="cudnn"), "backward_kernel .*cudnn"),
         (mosaic.MosaicConfig, dict(bwd_one_launch=1), "bwd_one_launch .* got 1"),
         (mosaic.MosaicConfig, dict(bwd_single_pass="yes"),
          "bwd_single_pass must be a bool, got 'yes'"),
         (mosaic.MosaicConfig, dict(dq=mosaic.MosaicDkv()),
          "MosaicConfig: dq must be a MosaicDq, got MosaicDkv")]
  for cls, kw, match in bad:
    with pytest.raises(ValueError, match=match):
      cls(**kw)
  # Above D = 128 or with a bias or mask the backward's tiles must be the
  # defaults (mosaic.py raises this for an explicit config and resets a cached
  # one).
  from flashjax.pallas_gpu.mosaic import config as mosaic_config
  spec = lambda d, **kw: spec_lib.abstract_spec(batch=1, seq_q=256, seq_k=256,
                                                heads_q=2, head_dim=d, **kw)
  big = mosaic.MosaicConfig(dq=mosaic.MosaicDq(block_kv=128))
  for s, why in ((spec(256), "above head dim 128"),
                 (spec(64, bias=jax.ShapeDtypeStruct((1, 2, 256, 256), jnp.bfloat16)),
                  "with a bias or mask")):
    assert mosaic_config.backward_tiles_error(s, mosaic.MosaicConfig()) is None
    msg = mosaic_config.backward_tiles_error(s, big)
    assert msg.startswith(why) and "got dq=MosaicDq(block_q=64, block_kv=128" in msg
  assert mosaic_config.backward_tiles_error(spec(128), big) is None


def test_backward_kernel_choice():
  """Mosaic backward unless the config asks for Pallas-Triton's (mosaic.backward
  also sends an fp32 bias there); both backward kernels share one padding of Sq
  and Sk; above D = 128 their warpgroups share one block."""
  s = lambda d, **kw: spec_lib.abstract_spec(batch=1, seq_q=300, seq_k=200, heads_q=2,
                                             head_dim=d, dtype="bfloat16", **kw)
  cfg = mosaic.MosaicConfig()
  assert mosaic.uses_mosaic_backward(s(64), cfg)
  assert mosaic.uses_mosaic_backward(s(96), cfg)
  assert mosaic.uses_mosaic_backward(s(256), cfg)
  assert not mosaic.uses_mosaic_backward(
      s(64), mosaic.MosaicConfig(backward_kernel="triton"))
  g_dq, g_dkv = mosaic.backward_geometries(
      s(96), mosaic.MosaicConfig(dkv=mosaic.MosaicDkv(block_q=128)))
  assert (g_dq.seq_q_padded, g_dq.seq_k_padded, g_dq.head_dim) == (384, 256, 128)
  assert (g_dkv.seq_q_padded, g_dkv.seq_k_padded) == (384, 256)
  assert (g_dq.block_q, g_dq.block_kv, g_dkv.block_q, g_dkv.block_kv) == (64, 64, 128, 64)
  assert not (g_dq.shared_block or g_dkv.shared_block)
  assert (g_dq.num_q_tiles, g_dkv.num_kv_tiles) == (3, 2)
  g_dq, g_dkv = mosaic.backward_geometries(s(256), cfg)
  assert g_dq.shared_block and g_dkv.shared_block
  assert (g_dq.seq_q_padded, g_dq.seq_k_padded) == (384, 256)
  assert (g_dq.num_q_tiles, g_dkv.num_kv_tiles) == (6, 4)


def test_single_pass_default_where_it_was_measured_to_pay():
  """The default config's backward is the single pass over the full band at
  D = 128, one query head per kv head, from 2048 queries and keys, with or
  without dropout, and with no segment ids, additive tile or soft cap
  (config.single_pass_backward)."""
  sd = jax.ShapeDtypeStruct
  def on(seq=2048, d=128, heads=(16, 16), **kw):
    spec = spec_lib.abstract_spec(batch=2, seq_q=seq, seq_k=seq, heads_q=heads[0],
                                  heads_kv=heads[1], head_dim=d, dtype="bfloat16",
                                  **kw)
    assert mosaic.single_pass_backward(spec) == mosaic.default_config(
        spec).bwd_single_pass
    return mosaic.single_pass_backward(spec)
  assert on() and on(seq=16384) and on(d=96)
  assert not on(seq=1024)
  assert not on(causal=True)
  assert not on(sliding_window=(512, 512))
  assert not on(d=64)
  assert not on(d=256)
  assert not on(heads=(32, 8))
  assert on(dropout_rate=0.1) and not on(dropout_rate=0.1, causal=True)
  assert not on(mask=sd((2, 1, 2048, 2048), jnp.bool_))
  assert not on(segment_ids=(sd((2, 2048), jnp.int32),) * 2)
  assert not on(logits_soft_cap=20.0)


@pytest.mark.parametrize("how", ["plain", "sharded", "mapped"])
def test_single_pass_lowers_under_shard_map_and_falls_back_under_vmap(how):
  """The single pass's dQ accumulator is a ref aliased through the kernel: it
  lowers inside shard_map (ring hops, sharded batches) as on its own, one
  backward launch with reduce-adds; under vmap, where a ref cannot batch, the
  two kernels run instead."""
  sd = jax.ShapeDtypeStruct
  q = sd((2, 256, 2, 128), jnp.bfloat16)

  def bwd(q, k, v):
    ops, spec = spec_lib.canonicalize(q, k, v)
    return _backward_of_forward(ops, spec, _static(ops, spec, bwd_single_pass=True)).q
  if how == "mapped":
    bwd, q = jax.vmap(bwd), sd((3,) + q.shape, q.dtype)
  if how == "sharded":
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    rows = jax.sharding.PartitionSpec("x")
    bwd = jax.shard_map(bwd, mesh=mesh, in_specs=(rows,) * 3, out_specs=rows,
                        check_vma=True)
  text = jax.jit(bwd).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
  fused = how != "mapped"
  assert text.count("custom_call @mosaic_gpu") == 1 + 1
  assert ("cp.reduce.async.bulk" in text) == fused


def test_may_vary_names_the_gradients_of_reduce_adds():
  """The GPU suite's repeat check lets exactly these gradients differ between
  runs: dbias where the dQ kernel sums it over the batch, dq where the default
  backward is the single pass, either where the instance forces it."""
  base, single = TestPallasMosaicGpu(), TestPallasMosaicGpuSinglePass()
  vary = lambda suite, **kw: suite.may_vary(base.resolve(conformance.Case(**{
      **dict(batch=2, seq_q=256, seq_k=256, heads_q=2, heads_kv=2, head_dim=128),
      **kw})))
  assert vary(base) == frozenset() and vary(single) == {"q"}
  assert vary(base, batch=1, seq_q=2048, seq_k=2048) == {"q"}
  assert vary(base, batch=1, seq_q=2048, seq_k=2048, causal=True) == frozenset()
  summed = dict(batch=8, bias_shape=(1, -1, -1, -1), bias_dtype="input")
  assert vary(base, **summed) == {"bias"}
  assert vary(single, **summed) == {"bias", "q"}


def test_single_pass_applies_up_to_d128_without_a_bias():
  """MosaicConfig.bwd_single_pass: head dims up to 128, a mask alone allowed;
  a bias (dbias from the dQ kernel's dS) and D > 128 take the two kernels."""
  sd = jax.ShapeDtypeStruct
  s = lambda d, **kw: spec_lib.abstract_spec(batch=2, seq_q=256, seq_k=256, heads_q=2,
                                             head_dim=d, dtype="bfloat16", **kw)
  assert mosaic.single_pass_applies(s(64)) is None
  assert mosaic.single_pass_applies(s(96, causal=True)) is None
  assert mosaic.single_pass_applies(s(128, mask=sd((2, 1, 256, 256), jnp.bool_))) is None
  assert "head dim 128" in mosaic.single_pass_applies(s(192))
  assert "bias" in mosaic.single_pass_applies(
      s(128, bias=sd((1, 2, 256, 256), jnp.bfloat16)))
  # Its buffers fit shared memory beside the default dK/dV tiles only.
  assert mosaic.single_pass_applies(s(128), mosaic.MosaicConfig()) is None
  for dkv in (mosaic.MosaicDkv(block_q=128), mosaic.MosaicDkv(num_stages=3)):
    assert "dK/dV tiles" in mosaic.single_pass_applies(
        s(128), mosaic.MosaicConfig(dkv=dkv))
  assert not mosaic.MosaicConfig().bwd_single_pass  # the default_config decides


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("heads", [(16, 4), (8, 1)], ids=str)
def test_grouped_dk_dv_are_summed_before_rounding(heads):
  """dK and dV of a kv head are summed over its query heads in fp32 and rounded
  once: closer to an fp32 reference than the same call with K and V repeated
  per query head, whose per-head bf16 dK and dV are then summed in fp32 and
  rounded (what the kernel's outputs were before: mean error 18-20% higher on
  an H200, 2026-11-29)."""
  hq, hkv = heads
  g = hq // hkv
  ks = jax.random.split(jax.random.key(1), 4)
  q = jax.random.normal(ks[0], (1, 2048, hq, 128), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (1, 2048, hkv, 128), jnp.bfloat16) for kk in ks[1:3])
  do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
  f32 = lambda x: x.astype(jnp.float32)

  def grads(attn, *args):
    loss = lambda *a: jnp.sum(f32(attn(*a)) * f32(do))
    return jax.jit(jax.grad(loss, (1, 2)))(*args)

  want = grads(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla"), f32(q), f32(k), f32(v))
  got = grads(lambda q, k, v: mosaic.flash_attention(q, k, v, causal=True), q, k, v)
  rep = lambda x: jnp.repeat(x, g, axis=2)
  per_head = grads(lambda q, k, v: mosaic.flash_attention(q, k, v, causal=True),
                   q, rep(k), rep(v))
  per_head = [f32(x).reshape(x.shape[:2] + (hkv, g, 128)).sum(3).astype(x.dtype)
              for x in per_head]
  err = lambda x, y: float(jnp.mean(jnp.abs(f32(x) - y)))
  for name, x, y, w in zip(("dk", "dv"), got, per_head, want):
    assert err(x, w) < 0.95 * err(y, w), (name, err(x, w), err(y, w))


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("kw", [dict(causal=True), dict(sliding_window=(100, 20)),
                                dict(seq_k=333, logits_soft_cap=20.0),
                                dict(causal=True, dropout_rate=0.2, dropout_seed=3),
                                dict(head_dim=256, sliding_window=(100, 20))],
                         ids=str)
def test_one_launch_backward_equals_two_launches(kw):
  """The combined dQ + dK/dV launch runs the same arithmetic per CTA, so its
  gradients equal the two-launch ones bit for bit (and the reference's, within
  the conformance tolerances, through the suite above)."""
  kw = dict(kw)
  sk, d = kw.pop("seq_k", 512), kw.pop("head_dim", 128)
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (2, 384, 4, d), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (2, sk, 2, d), jnp.bfloat16) for kk in ks[1:3])
  do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)

  def grads(one_launch):
    # D = 256 forwards fit shared memory with 64-key blocks only.
    fwd = mosaic.MosaicForward(block_kv=64 if d > 128 else 128)
    cfg = mosaic.MosaicConfig(fwd=fwd, bwd_one_launch=one_launch)
    f = lambda q, k, v: jnp.sum(mosaic.flash_attention(q, k, v, config=cfg, **kw)
                                .astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)

  one, two = grads(True), grads(False)
  for a, b in zip(one, two):
    assert float(jnp.abs(b.astype(jnp.float32)).max()) > 0
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_autotune_picks_the_fastest_and_caches_it(tmp_path, monkeypatch):
  """A fake run and timer (no GPU needed): the fastest forward, then the fastest
  backward with that forward, is cached per shape class and read back by
  resolve_config; candidates that fail are skipped."""
  from flashjax.pallas_gpu.mosaic import autotune as mosaic_autotune
  monkeypatch.setenv("FLASHJAX_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
  s = spec_lib.abstract_spec(batch=1, seq_q=4096, seq_k=4096, heads_q=8,
                             head_dim=128, dtype="bfloat16")
  tuner = mosaic_autotune.TUNER
  assert tuner.lookup(s) is None
  # An entry of the flat layout cached before the per-kernel configs is a miss.
  key = tuner.cache.key_prefix + autotune.shape_class(s)
  (tmp_path / "tune.json").write_text(json.dumps({key: dict(block_kv=64,
                                                            persistent=True)}))
  assert tuner.lookup(s) is None
  assert mosaic.resolve_config(s, None) == mosaic.default_config(s)
  timed = []

  def run(cfg, with_grad):
    if cfg.fwd.num_stages == 4:
      raise ValueError("does not fit")  # skipped, not fatal
    return (cfg, with_grad), ()

  winner = mosaic.MosaicForward(block_kv=64, num_stages=3, persistent=False)

  def timer(fn, args):
    cfg, with_grad = fn
    timed.append(fn)
    if not with_grad:
      return 0.5 if cfg.fwd == winner else 1.0
    assert cfg.fwd == winner
    return 0.7 if cfg.dkv.num_stages == 3 else 1.0

  base = mosaic.default_config(s)
  cfg = tuner.tune(s, run, timer=timer, base=base)
  assert (cfg.fwd, cfg.dkv.num_stages) == (winner, 3)
  # The default competes first; every distinct candidate is timed once.
  assert timed[0] == (base, False)
  fwd = {base, *mosaic_autotune.forward_candidates(s, base)}
  fwd_winner = dataclasses.replace(base, fwd=winner)
  bwd = {fwd_winner, *mosaic_autotune.backward_candidates(s, fwd_winner)}
  assert len(timed) == sum(c.fwd.num_stages != 4 for c in fwd) + len(bwd)
  assert tuner.lookup(s) == cfg  # read back from the JSON file
  assert mosaic.resolve_config(s, None) == cfg
  explicit = mosaic.MosaicConfig(fwd=mosaic.MosaicForward(block_kv=64))
  assert mosaic.resolve_config(s, explicit) == explicit
  other = spec_lib.abstract_spec(batch=1, seq_q=4096, seq_k=4096, heads_q=8,
                                 head_dim=64, dtype="bfloat16")
  assert mosaic.resolve_config(other, None) == mosaic.default_config(other)


def test_autotune_candidates_are_valid_per_head_dim():
  from flashjax.pallas_gpu.mosaic import autotune as mosaic_autotune
  for d in (64, 96, 128, 256):
    s = spec_lib.abstract_spec(batch=1, seq_q=1024, seq_k=1024, heads_q=4, head_dim=d,
                               dtype="bfloat16")
    base = mosaic.default_config(s)
    fwd = mosaic_autotune.forward_candidates(s, base)
    assert base in fwd  # the default is among them (the driver drops repeats)
    assert all(isinstance(c, mosaic.MosaicConfig) for c in fwd)
    # Above D = 128 only the launch varies: larger tiles do not fit. Up to
    # D = 128 the single pass competes too (one candidate).
    bwd = mosaic_autotune.backward_candidates(s, base)
    assert len(bwd) == (6 if d <= 128 else 1)
    assert sum(c.bwd_single_pass for c in bwd) == (d <= 128)
    assert all(c.dkv == mosaic.MosaicDkv() for c in bwd if c.bwd_single_pass)
    # The launch candidate is the other of one launch and two.
    assert [c.bwd_one_launch for c in bwd].count(not base.bwd_one_launch) == 1
    two = dataclasses.replace(base, bwd_one_launch=False)
    assert any(c.bwd_one_launch for c in mosaic_autotune.backward_candidates(s, two))
    if d > 128 or d == 64:
      s = spec_lib.abstract_spec(batch=1, seq_q=1024, seq_k=1024, heads_q=4,
                                 head_dim=d, dtype="bfloat16",
                                 mask=jax.ShapeDtypeStruct((1, 1, 1024, 1024), jnp.bool_))
      bwd = mosaic_autotune.backward_candidates(s, mosaic.default_config(s))
      assert len(bwd) == (1 if d > 128 else 2)
      assert all((c.dq, c.dkv) == (mosaic.MosaicDq(), mosaic.MosaicDkv()) for c in bwd)
  # Where the default is the single pass, the tile and launch candidates are
  # the two kernels' (else they would change nothing), and one is the two
  # kernels with the default tiles.
  s = spec_lib.abstract_spec(batch=1, seq_q=2048, seq_k=2048, heads_q=4, head_dim=128,
                             dtype="bfloat16")
  base = mosaic.default_config(s)
  assert base.bwd_single_pass
  bwd = mosaic_autotune.backward_candidates(s, base)
  assert [c.bwd_single_pass for c in bwd] == [False] * 5 + [False]
  assert bwd[-1] == dataclasses.replace(base, bwd_single_pass=False)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
def test_autotune_on_gpu(tmp_path, monkeypatch):
  """FLASHJAX_AUTOTUNE=1: the first call of a shape class times the real
  candidates on the device and caches a valid winner; the tuned call matches the
  reference, and a second call reads the cache."""
  from flashjax.common import reference
  from flashjax.pallas_gpu.mosaic import autotune as mosaic_autotune
  monkeypatch.setenv("FLASHJAX_AUTOTUNE", "1")
  monkeypatch.setenv("FLASHJAX_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
  ks = jax.random.split(jax.random.key(4), 3)
  q, k, v = (jax.random.normal(kk, (1, 1024, 4, 128), jnp.bfloat16) for kk in ks)
  out = mosaic.flash_attention(q, k, v, causal=True)
  s = spec_lib.canonicalize(q, k, v, causal=True)[1]
  cfg = mosaic_autotune.TUNER.lookup(s)
  assert isinstance(cfg, mosaic.MosaicConfig)
  assert mosaic.resolve_config(s, None) == cfg
  ref = reference.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                            v.astype(jnp.float32), causal=True)
  tolerances.assert_close(out, ref, tolerances.forward("bfloat16"))


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("kw", [
    dict(), dict(seq_k=2000, logits_soft_cap=20.0, heads_kv=4),
    dict(seq_q=2000, sinks=True, dtype="float16"), dict(head_dim=64, seq_k=3000),
    dict(head_dim=256)], ids=str)
def test_split_tail_matches_unsplit_and_reference(kw):
  """A 320-tile persistent forward on 132 SMs runs its last 56 tiles as key-range
  parts (normalised outputs as high and low halves, lse): output, lse and
  gradients (which read the merged lse) match the reference, and the tail rows'
  error is the unsplit kernel's size."""
  from flashjax.common import reference
  kw = dict(kw)
  b, sq, sk, hq = 1, kw.pop("seq_q", 2048), kw.pop("seq_k", 2048), 20
  hkv, d = kw.pop("heads_kv", hq), kw.pop("head_dim", 128)
  dtype = kw.pop("dtype", "bfloat16")
  ks = jax.random.split(jax.random.key(5), 5)
  q = jax.random.normal(ks[0], (b, sq, hq, d), dtype)
  k, v = (jax.random.normal(kk, (b, sk, hkv, d), dtype) for kk in ks[1:3])
  do = jax.random.normal(ks[3], q.shape, dtype)
  if kw.pop("sinks", False):
    kw["sinks"] = jax.random.normal(ks[4], (hq, 1), jnp.float32)
  spec = spec_lib.canonicalize(q, k, v, **kw)[1]
  base = mosaic.default_config(spec)
  on = configs.with_part(base, "fwd", split_tail=True)
  assert mosaic_blocks.tail_plan(mosaic.geometry(spec, on))
  off = configs.with_part(on, "fwd", split_tail=False)

  def run(attn, q, k, v):
    def loss(q, k, v):
      out, lse = attn(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), (out, lse)
    grads, (out, lse) = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
    return out, lse, grads

  split = run(lambda q, k, v: mosaic.flash_attention(
      q, k, v, config=on, return_lse=True, **kw), q, k, v)
  whole = run(lambda q, k, v: mosaic.flash_attention(
      q, k, v, config=off, return_lse=True, **kw), q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  ref = run(lambda q, k, v: reference.attention(q, k, v, return_lse=True, **kw),
            f32(q), f32(k), f32(v))
  tolerances.assert_close(split[0], ref[0], tolerances.forward(dtype), name="out")
  tolerances.assert_close(split[1], ref[1], tolerances.forward("float32"), name="lse")
  for name, g, r in zip("qkv", split[2], ref[2]):
    tolerances.assert_close(g, r, tolerances.grad(dtype), name=f"d{name}")
  # The parts round their own P to the input dtype before PV (as every tile
  # does), so split and unsplit outputs differ by that rounding: on the tail
  # tiles' rows, the split's error against the reference is the unsplit's size.
  g = mosaic.geometry(spec, on)
  tail = mosaic_blocks.tail_plan(g)
  rows = np.zeros((b, hq, g.seq_q_padded), bool)
  for t in range(tail.full, tail.full + tail.count):
    bi, h, tile = (int(x) for x in mosaic_blocks.tile_coords(g, t))
    rows[bi, h, tile * 128:(tile + 1) * 128] = True
  rows = np.transpose(rows[:, :, :sq], (0, 2, 1))  # [B, Sq, H] like out
  err = lambda x: tolerances.rel_l2(np.asarray(f32(x[0]))[rows],
                                    np.asarray(ref[0])[rows])
  assert err(split) <= 1.25 * err(whole) + 1e-6, (err(split), err(whole))
  np.testing.assert_allclose(np.asarray(split[1]), np.asarray(whole[1]), atol=1e-3)


@pytest.mark.parametrize("causal", (False, True))
@pytest.mark.parametrize("seq_q,seq_k", [(512, 512), (300, 450), (450, 300)])
def test_segment_walks_cover_every_allowed_pair(seq_q, seq_k, causal):
  """Under segment ids each warpgroup walks only the kv blocks (forward, dQ) or q
  blocks (dK/dV) the ids and band leave visible: every allowed (row, key) pair
  must still lie inside its warpgroup's walk, and its unmasked steps hold only
  allowed pairs, for sorted and shuffled ids."""
  from flashjax.common import spec as sl
  rng = np.random.default_rng(seq_q + seq_k + causal)
  def ids(n):  # documents of 100-299 tokens; row 1 shuffled
    doc = np.repeat(np.arange(n), rng.integers(100, 300, n))[:n]
    return np.stack([doc, doc]).astype(np.int32)

  q_ids = ids(seq_q)
  kv_ids = q_ids if seq_q == seq_k else ids(seq_k)
  q_ids, kv_ids = q_ids.copy(), kv_ids.copy()
  q_ids[1], kv_ids[1] = rng.permutation(q_ids[1]), rng.permutation(kv_ids[1])
  spec = sl.abstract_spec(batch=2, seq_q=seq_q, seq_k=seq_k, heads_q=1, head_dim=64,
                          causal=causal, dtype="bfloat16", segment_ids=(
                              jax.ShapeDtypeStruct((2, seq_q), jnp.int32),
                              jax.ShapeDtypeStruct((2, seq_k), jnp.int32)))
  ops = spec_lib.Operands(q=None, k=None, v=None, q_segment_ids=jnp.asarray(q_ids),
                          kv_segment_ids=jnp.asarray(kv_ids))
  allowed = np.asarray(spec.band.as_array())[None] & (
      q_ids[:, :, None] == kv_ids[:, None, :])
  g_fwd = mosaic.geometry(spec, mosaic.MosaicConfig())
  g_dq, g_dkv = mosaic.backward_geometries(spec, mosaic.MosaicConfig())
  skipped = unmasked = 0
  for g, over_kv in ((g_fwd, True), (g_dq, True), (g_dkv, False)):
    table = np.asarray(jax.jit(
        lambda ops: mosaic.segment_operands(ops, g, over_kv)[2])(ops))
    rows, cols = (g.block_q, g.block_kv) if over_kv else (g.block_kv, g.block_q)
    walk = mosaic_blocks.cta_block_ranges if over_kv else mosaic_blocks.cta_q_ranges
    n_tiles = g.num_q_tiles if over_kv else g.num_kv_tiles
    pairs = allowed if over_kv else np.swapaxes(allowed, 1, 2)
    for b in range(2):
      for tile in range(n_tiles):
        rng_w, lo_c, hi_c = walk(g, tile, lambda i: tuple(table[b, :, i]))
        for w in (0, 1):
          lo, a, bb, hi = (int(x) for x in rng_w[w])
          r0 = (2 * tile + w) * rows
          seen = np.zeros(pairs.shape[2], bool)
          seen[lo * cols:hi * cols] = True
          block = pairs[b, r0:r0 + rows]
          assert not (block & ~seen[None]).any(), (g, b, tile, w)
          if block.shape[0]:  # unmasked steps: every real pair allowed
            assert block[:, a * cols:bb * cols].all(), (g, b, tile, w)
          band_lo, _, _, band_hi = (int(x) for x in walk(g, tile)[0][w])
          skipped += (band_hi - band_lo) - (hi - lo)
          unmasked += bb - a
  # Sorted documents leave blocks out, and where q and kv share them, whole
  # blocks need no mask.
  assert skipped > 0 and (unmasked > 0 or seq_q != seq_k)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("causal", (False, True))
def test_blocks_between_documents_are_skipped(causal):
  """Forward, dQ and dK/dV kernels leave out the blocks of other documents: one
  document's NaN values reach no other document."""
  from flashjax.common import conformance_packed
  conformance_packed.check_skips_between_documents(
      mosaic.flash_attention, doc_len=256, causal=causal, dtype="bfloat16",
      head_dim=64)


def _windows(seq_q, causal, head_dim=128, single_pass=False):
  """Operands as rows.Rows windows, as a ring hop passes them: q and dO rows
  ``[128, 128 + seq_q)`` of 512-row arrays, K and V batch entries ``[0, 2)``
  and ``[2, 4)`` of one buffer, at key rows ``[256, 512)``; with the spec and
  config of the windows' shapes (with the single-pass backward if asked)."""
  from flashjax.common import rows
  ks = jax.random.split(jax.random.key(5), 4)
  q_base, do_base = (jax.random.normal(k, (2, 512, 4, head_dim), jnp.bfloat16)
                     for k in ks[:2])
  kv_base = jax.random.normal(ks[2], (4, 512, 2, head_dim), jnp.bfloat16)
  q, do = (rows.Rows(x, 0, 2, 128, seq_q) for x in (q_base, do_base))
  k, v = rows.Rows(kv_base, 0, 2, 256, 256), rows.Rows(kv_base, 2, 2, 256, 256)
  ops, spec = spec_lib.canonicalize(*rows.materialize((q, k, v)), causal=causal)
  static = _static(ops, spec, bwd_single_pass=single_pass)
  dlse = jax.random.normal(ks[3], (2, 4, seq_q), jnp.float32)
  return ops._replace(q=q, k=k, v=v), spec, static, do, dlse


def _forward_backward(ops, spec, static, do, dlse):
  out, lse = mosaic.forward(ops, spec, static)
  grads = mosaic.backward(ops, spec, static, out, lse, do, dlse)
  return out, lse, grads.q, grads.k, grads.v


def test_windows_are_read_in_place():
  """Rows windows that need no padding reach the kernels as their base arrays
  (offsets in the Geometry), with no slice before the custom calls; a window
  of 200 rows (padded to a tile) is sliced and padded."""
  from flashjax.common import rows
  assert mosaic.forward.takes_rows and mosaic.backward.takes_rows
  for seq_q, in_place, single_pass in ((256, True, False), (200, False, False),
                                       (256, True, True)):
    ops, spec, static, do, dlse = _windows(seq_q, causal=True, single_pass=single_pass)
    text = jax.jit(lambda o, d: _forward_backward(o, spec, static, d, dlse)).trace(
        ops, do).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 2, calls  # forward, one-launch backward (or single pass)
    assert ("cp.reduce.async.bulk" in text) == single_pass
    for call in calls:
      # K and V: one operand type twice, the whole buffer.
      assert call.count("tensor<4x512x2x128xbf16>") == 2, call
      assert ("tensor<2x512x4x128xbf16>" in call) == in_place, call
  ops, spec, static, do, dlse = _windows(256, causal=False)
  g = mosaic.kernel_operands(mosaic.geometry(spec, static.config), ops.q, ops.k,
                             ops.v)[1]
  assert (g.q_at, g.k_at, g.v_at) == ((0, 128), (0, 256), (2, 256))
  # q and dO windows of the same length at different rows: both sliced.
  other = rows.Rows(do.base, 0, 2, 0, 256)
  (q, _, _, d), g = mosaic.kernel_operands(g, ops.q, ops.k, ops.v, other)
  assert g.q_at == (0, 0) and g.k_at == (0, 256)
  assert q.shape == d.shape == (2, 256, 4, 128), (q.shape, d.shape)


def _assert_within_bf16_ulps(a, b, ulps: int, name: str):
  """``|a - b|`` at most ``ulps`` bf16 units in the last place of ``|b|``, or of
  1/64 of ``b``'s largest magnitude where ``|b|`` is smaller (a sum that
  cancels to a small value moves by its terms' ulps, not its own)."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  size = np.maximum(np.abs(b), np.abs(b).max() / 64)
  exponent = np.floor(np.log2(np.maximum(size, np.finfo(np.float32).tiny)))
  bound = ulps * np.exp2(exponent - 7)  # bf16: 7 stored bits
  worst = np.abs(a - b) / bound
  assert worst.max() <= 1, (name, float(worst.max()), np.argwhere(worst > 1)[:4])


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("seq_q,causal,head_dim,single_pass", [
    (256, True, 128, False), (256, False, 128, False), (200, True, 128, False),
    (256, True, 256, False), (256, False, 128, True), (200, True, 128, True)])
def test_windows_equal_their_slices(seq_q, causal, head_dim, single_pass):
  """Outputs and lse from windows read in place equal those of the same windows
  sliced out bit for bit (the kernels run the same arithmetic on the same
  data), gradients within two bf16 ulps, and all equal the reference's; at
  D = 256 through the backward's shared blocks, whose copies take column halves
  of the windows. The gradients' kernels take the rows' delta = rowsum(dO *
  out), an XLA reduction of the two programs' own fusions, whose summation
  order XLA's autotuning picks per compilation: at D = 256 on an H200
  (2026-11-26) it differed between the two programs in 3 of 4 processes (1004
  of 2048 deltas, then 2 dq and 1 dk elements of 524,288 one or two ulps
  apart), and in none of 4 with --xla_gpu_autotune_level=0. A window read at
  the wrong offset is off by far more than two ulps. The single-pass backward
  reads the same windows; its dq's reduce-adds land in any order, within the
  same two ulps."""
  from flashjax.common import reference, rows
  ops, spec, static, do, dlse = _windows(seq_q, causal, head_dim, single_pass)
  run = jax.jit(lambda o, d: _forward_backward(o, spec, static, d, dlse))
  got = run(ops, do)
  want = run(*rows.materialize((ops, do)))
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
    assert float(jnp.abs(b.astype(jnp.float32)).max()) > 0
    if name in ("out", "lse"):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    else:
      _assert_within_bf16_ulps(a, b, 2, name)
  q, k, v, d = (x.array().astype(jnp.float32) for x in (ops.q, ops.k, ops.v, do))
  (ref_out, ref_lse), pull = jax.vjp(
      lambda q, k, v: reference.attention(q, k, v, causal=causal, return_lse=True),
      q, k, v)
  ref_grads = pull((d, dlse))
  tol, gtol = tolerances.forward("bfloat16"), tolerances.grad("bfloat16")
  tolerances.assert_close(got[0], ref_out, tol, name="out")
  tolerances.assert_close(got[1], ref_lse, tol, name="lse")
  for name, g, r in zip("qkv", got[2:], ref_grads):
    tolerances.assert_close(g, r, gtol, name="d" + name)


@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("kw", [
    dict(causal=True), dict(causal=True, shared=False), dict(sliding_window=(300, 0)),
    dict(padding=700), dict(causal=True, head_dim=256), dict(causal=True, group=4),
    dict(causal=True, seq_k=3000, shared=False)], ids=str)
def test_contiguous_segments_match_the_ids_bitwise(kw):
  """With contiguous_segments the kernels mask by position spans instead of ids:
  the same masked values, so output, lse and gradients equal the ids' bitwise,
  and the ids' match the reference. Documents of mixed lengths and, with
  ``padding``, a trailing -1 run; one ids array for q and kv, or two."""
  from flashjax.common import reference
  kw = dict(kw)
  sq, d, group = 4096, kw.pop("head_dim", 128), kw.pop("group", 1)
  sk, shared, pad = kw.pop("seq_k", sq), kw.pop("shared", True), kw.pop("padding", 0)
  ks = jax.random.split(jax.random.key(6), 4)
  q = jax.random.normal(ks[0], (1, sq, 8, d), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (1, sk, 8 // group, d), jnp.bfloat16) for kk in ks[1:3])
  do = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
  docs = lambda n: np.minimum(np.searchsorted([300, 1500, 1600, 3500], np.arange(n),
                                              side="right"), 4)
  q_ids = docs(sq).astype(np.int32)
  q_ids[sq - pad:] = -1
  kv_ids = q_ids if shared else docs(sk).astype(np.int32)

  def run(contiguous, q_ids, kv_ids):
    def f(q, k, v, q_ids, kv_ids):
      ids = (q_ids, q_ids) if shared else (q_ids, kv_ids)
      out, vjp = jax.vjp(lambda q, k, v: mosaic.flash_attention(
          q, k, v, segment_ids=ids, return_lse=True, contiguous_segments=contiguous,
          **kw), q, k, v)
      return out, vjp((do, jnp.zeros_like(out[1])))
    return jax.jit(f)(q, k, v, jnp.asarray(q_ids)[None], jnp.asarray(kv_ids)[None])

  spans, ids = run(True, q_ids, kv_ids), run(False, q_ids, kv_ids)
  for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), jax.tree.leaves(spans),
                        jax.tree.leaves(ids)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
  f32 = lambda x: x.astype(jnp.float32)
  ref = reference.attention(f32(q), f32(k), f32(v), return_lse=True, **kw,
                            segment_ids=(jnp.asarray(q_ids)[None],
                                         jnp.asarray(kv_ids)[None]))
  tolerances.assert_close(ids[0][0], ref[0], tolerances.forward("bfloat16"))
