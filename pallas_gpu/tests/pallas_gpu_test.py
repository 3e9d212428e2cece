"""The conformance suite on the Pallas-Triton kernels: in Pallas interpret mode on
any machine, and compiled through Triton where a GPU is present."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from flashjax.common import (configs, conformance, conformance_kvcache, conformance_packed,
                             platform, spec, tolerances)
from flashjax.pallas_gpu import split_tail, tail_merge
from flashjax.pallas_gpu.triton import pallas_triton
from flashjax.pallas_gpu.triton.plan import KernelConfig, TritonConfig, TritonForward

ON_GPU = jax.default_backend() == "gpu"
# Paired (folded) causal forward programs too: the small-tile suite runs every
# causal case through that launch, with odd and even q-block counts.
SMALL = TritonConfig(fwd=TritonForward(block_q=32, block_kv=16, fold_causal=True),
                     dq=KernelConfig(block_q=16, block_kv=32),
                     dkv=KernelConfig(block_q=32, block_kv=16))


def tiles(c):
  return c.block_q, c.block_kv, c.num_warps, c.num_stages


class TestPallasTritonInterpret(conformance.ConformanceSuite):
  """The default tiles, on the tests whose results depend on the tiles; the
  small-tile instance below runs the whole suite (its 300-token limit skips
  test_dtypes' 333 keys, which this instance runs)."""

  CAPS = conformance.Capabilities.of(pallas_triton.CAPABILITIES,
                                     name="pallas-triton[interpret]", max_seq_len=400,
                                     hypothesis_examples=6)
  SUBSET = conformance.ConformanceSuite.TILING_TESTS

  def attention(self, q, k, v, **kwargs):
    return pallas_triton.flash_attention(q, k, v, interpret=True, **kwargs)


class TestPallasTritonInterpretSmallTiles(conformance.ConformanceSuite):
  """Different tiles per kernel: many edge tiles, shared padding, folded causal
  forward programs."""

  CAPS = conformance.Capabilities.of(pallas_triton.CAPABILITIES,
                                     name="pallas-triton[interpret,small]",
                                     max_seq_len=300, hypothesis_examples=4)

  def attention(self, q, k, v, **kwargs):
    return pallas_triton.flash_attention(q, k, v, interpret=True, config=SMALL,
                                         **kwargs)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestPallasTritonGpu(conformance.ConformanceSuite):
  # fp32 runs IEEE products by default, so the fp32 tolerance stands.
  CAPS = conformance.Capabilities.of(pallas_triton.CAPABILITIES,
                                     name="pallas-triton[gpu]")

  def attention(self, q, k, v, **kwargs):
    return pallas_triton.flash_attention(q, k, v, **kwargs)


class _FoldedLongTiles(conformance.ConformanceSuite):
  """The D = 128 long-key tiles with folded causal programs (not collected: the
  cases below pick what it runs)."""

  CAPS = conformance.Capabilities.of(pallas_triton.CAPABILITIES,
                                     name="pallas-triton[gpu,folded]")
  CONFIG = TritonConfig(fwd=TritonForward(block_q=128, block_kv=128, num_warps=8,
                                          num_stages=3, fold_causal=True),
                        dq=KernelConfig(block_q=64, block_kv=64, num_warps=4,
                                        num_stages=2),
                        dkv=KernelConfig(block_q=64, block_kv=64, num_warps=4,
                                         num_stages=2))

  def attention(self, q, k, v, **kwargs):
    from flashjax.common import launch
    s = spec.canonicalize(q, k, v, **kwargs)[1]
    return pallas_triton.flash_attention(
        q, k, v, config=launch.fit_to_shared_memory(self.CONFIG, s), **kwargs)


# 1000 rows: 8 q blocks of 128 (even); 1100: 9 (odd, the middle block alone).
FOLDED_CASES = {
    "even": conformance.Case(seq_q=1000, seq_k=1000, causal=True, head_dim=128,
                             dtype="bfloat16"),
    "odd-fp16": conformance.Case(seq_q=1100, seq_k=1100, causal=True, head_dim=128,
                                 dtype="float16"),
    "sq<sk": conformance.Case(seq_q=700, seq_k=1300, causal=True, head_dim=128,
                              dtype="bfloat16"),
    "sq>sk": conformance.Case(seq_q=1300, seq_k=700, causal=True, head_dim=128,
                              dtype="bfloat16"),
    "features": conformance.Case(batch=2, seq_q=1100, seq_k=1100, causal=True,
                                 head_dim=128, dtype="bfloat16", segment_ids="padded",
                                 bias_shape=(1, -1, -1, -1), sinks=1,
                                 dropout_rate=0.1),
}


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("name", sorted(FOLDED_CASES))
def test_folded_causal_forward_on_gpu(name):
  _FoldedLongTiles().check(FOLDED_CASES[name])


def test_fold_applies_to_causal_bands_only():
  from flashjax.pallas_gpu.triton import fwd as triton_fwd, plan as triton_plan
  make = lambda **kw: spec.abstract_spec(batch=1, seq_q=256, seq_k=256, heads_q=2,
                                         head_dim=64, **kw)
  plan = lambda s, bq=32: triton_plan.Plan(s, bq, 16, bq, 16)
  assert triton_fwd.folds(plan(make(causal=True)), True)
  assert not triton_fwd.folds(plan(make(causal=True)), False)
  assert not triton_fwd.folds(plan(make()), True)
  assert not triton_fwd.folds(plan(make(sliding_window=(64, 0))), True)
  assert not triton_fwd.folds(plan(make(causal=True), bq=256), True)  # one block
  d128 = lambda s: spec.abstract_spec(batch=1, seq_q=s, seq_k=s, heads_q=2,
                                      head_dim=128, dtype="bfloat16", causal=True)
  assert pallas_triton.default_config(d128(8192)).fwd.fold_causal
  assert not pallas_triton.default_config(d128(2048)).fwd.fold_causal


@pytest.mark.parametrize("seq", [160, 192])  # 5 and 6 q blocks of 32
def test_folded_forward_equals_one_program_per_block(seq):
  """Same arithmetic per q block, only the launch differs: exact equality, with
  the features that index by q block (bias rows, segment ids, dropout)."""
  ks = jax.random.split(jax.random.key(5), 4)
  q, k, v = (jax.random.normal(kk, (2, seq, 2, 32), jnp.float32) for kk in ks[:3])
  bias = jax.random.normal(ks[3], (1, 2, seq, seq))
  ids = jnp.broadcast_to((jnp.arange(seq) >= seq // 3).astype(jnp.int32), (2, seq))
  run = lambda cfg: pallas_triton.flash_attention(
      q, k, v, causal=True, bias=bias, segment_ids=(ids, ids), dropout_rate=0.2,
      dropout_seed=jnp.int32(3), return_lse=True, interpret=True, config=cfg)
  folded = run(SMALL)
  plain = run(configs.with_part(SMALL, "fwd", fold_causal=False))
  for a, b in zip(folded, plain):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tf32_option_is_documented_and_close():
  cfg = dataclasses.replace(pallas_triton.default_config(
      spec.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2, head_dim=64,
                         dtype="float32")), fp32_precision="tf32")
  assert cfg.fp32_precision == "tf32"
  with pytest.raises(ValueError, match="fp32_precision"):
    TritonConfig(fp32_precision="bf16")


def test_config_validation():
  with pytest.raises(ValueError, match="block_q must be a power of two"):
    KernelConfig(block_q=48, block_kv=32)
  with pytest.raises(ValueError, match="num_warps"):
    KernelConfig(block_q=32, block_kv=32, num_warps=3)
  fwd = dict(block_q=32, block_kv=32)
  with pytest.raises(ValueError, match="split_tail must be a bool, got 1"):
    TritonForward(split_tail=1, **fwd)
  with pytest.raises(ValueError, match="fold_causal must be a bool, got None"):
    TritonForward(fold_causal=None, **fwd)
  with pytest.raises(ValueError, match="tail_slots must be an int >= 0, got -1"):
    TritonForward(tail_slots=-1, **fwd)
  with pytest.raises(ValueError,
                     match="TritonConfig: fwd must be a TritonForward, got KernelConfig"):
    TritonConfig(fwd=KernelConfig(**fwd))
  # The cache's JSON form round-trips, forward class included.
  assert TritonConfig.from_json(dataclasses.asdict(SMALL)) == SMALL


# -- the forward's last wave split along the keys (split_tail.py) ------------------

def test_split_tail_plan():
  # B2 S8k H16 with 128-row programs, one per SM of an H100/H200: the 68 programs
  # of the 16th wave run as five key ranges each (three rounds of a fifth).
  tail = split_tail.plan(2048, 132, 64)
  assert (tail.full, tail.count, tail.parts, tail.units) == (1980, 68, 5, 2320)
  assert split_tail.plan(200, 132, 64) is None  # under two waves
  assert split_tail.plan(264, 132, 64) is None  # whole waves
  assert split_tail.plan(300, 132, 1) is None  # one key tile: nothing to split
  # A tail of one program above 2 waves: as many parts as tiles, up to 8.
  assert split_tail.plan(265, 132, 3).parts == 3
  assert split_tail.plan(265, 132, 64).parts == split_tail.MAX_PARTS
  # Nearly full last waves do not pay: 130 programs in two parts take two rounds.
  assert split_tail.plan(394, 132, 64) is None
  lo, hi = 3, 17
  cuts = [split_tail.key_range(lo, hi, p, 5) for p in range(5)]
  assert cuts[0][0] == lo and cuts[-1][1] == hi
  assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))


def test_split_tail_applies_to_equal_programs_only():
  from flashjax.pallas_gpu.triton import fwd as triton_fwd, plan as triton_plan
  make = lambda **kw: spec.abstract_spec(batch=2, seq_q=512, seq_k=512, heads_q=3,
                                         head_dim=64, **kw)
  plan = lambda s: triton_plan.Plan(s, 32, 16, 32, 16)
  assert triton_fwd.splits_tail(plan(make()), False, 5) is not None
  assert triton_fwd.splits_tail(plan(make()), False, 0) is None
  assert triton_fwd.splits_tail(plan(make(causal=True)), False, 5) is None
  assert triton_fwd.splits_tail(plan(make(sliding_window=(64, 64))), False, 5) is None
  assert triton_fwd.splits_tail(plan(make(dropout_rate=0.1)), False, 5) is None
  d128 = lambda s, **kw: pallas_triton.default_config(spec.abstract_spec(
      batch=1, seq_q=s, seq_k=s, heads_q=2, head_dim=128, dtype="bfloat16", **kw))
  assert d128(8192).fwd.split_tail and not d128(2048).fwd.split_tail


def test_split_tail_lowers_for_cuda():
  """The default long-key tiles at B2 S8k H16 D128 lower (on any machine) to the
  forward over 1980 whole programs and 68 x 5 parts plus the combining kernel."""
  sd = jax.ShapeDtypeStruct
  q = sd((2, 8192, 16, 128), jnp.bfloat16)

  def fwd(q, k, v):
    ops, s = spec.canonicalize(q, k, v)
    static = platform.Static(pallas_triton.default_config(s), False)
    return pallas_triton.forward(ops, s, static)

  text = jax.jit(fwd).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()
  assert "flashjax_pallas_triton_fwd_tail" in text
  assert "tensor<68x5x128x128xf32>" in text


SPLIT = configs.with_part(SMALL, "fwd", fold_causal=False, split_tail=True,
                          tail_slots=5)


@pytest.mark.parametrize("dtype,combine_rows", [("float32", 32), ("bfloat16", 32),
                                                ("float32", 16)])
def test_split_tail_forward_matches_whole_programs(dtype, combine_rows, monkeypatch):
  """Interpret mode, small tiles, five programs at a time: the tail's parts
  combine to the unsplit output and lse (to rounding: the order of the sums
  differs), with the features that index by key tile (bias columns, mask,
  segment ids), a soft cap, grouped heads and padded keys; with 16 merge rows,
  each 32-row tail block is merged by two programs."""
  monkeypatch.setattr(tail_merge, "COMBINE_ROWS", combine_rows)
  ks = jax.random.split(jax.random.key(7), 5)
  sq, sk = 200, 237  # 7 q blocks of 32, 15 key tiles of 16 (padded)
  q = jax.random.normal(ks[0], (2, sq, 4, 48), jnp.float32).astype(dtype)
  k, v = (jax.random.normal(kk, (2, sk, 2, 48), jnp.float32).astype(dtype)
          for kk in ks[1:3])
  bias = jax.random.normal(ks[3], (1, 4, sq, sk))
  mask = jax.random.uniform(ks[4], (2, 1, sq, sk)) > 0.2
  ids_q = jnp.broadcast_to((jnp.arange(sq) >= 70).astype(jnp.int32), (2, sq))
  ids_k = jnp.broadcast_to((jnp.arange(sk) >= 90).astype(jnp.int32), (2, sk))
  run = lambda cfg: pallas_triton.flash_attention(
      q, k, v, bias=bias, mask=mask, segment_ids=(ids_q, ids_k), logits_soft_cap=30.0,
      return_lse=True, interpret=True, config=cfg)
  split, whole = run(SPLIT), run(configs.with_part(SPLIT, "fwd", split_tail=False))
  for a, b in zip(split, whole):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all() and np.abs(b).max() > 0
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5 if dtype == "float32"
                               else 8e-3)


class _SplitTailInterpret(conformance.ConformanceSuite):
  """Outputs and gradients against the reference with the last wave split (not
  collected: the cases below pick what it runs)."""

  CAPS = conformance.Capabilities.of(pallas_triton.CAPABILITIES,
                                     name="pallas-triton[interpret,split-tail]")

  def attention(self, q, k, v, **kwargs):
    return pallas_triton.flash_attention(q, k, v, interpret=True, config=SPLIT,
                                         **kwargs)


SPLIT_CASES = {
    "fp32-gqa": conformance.Case(batch=2, seq_q=200, seq_k=237, heads_q=4, heads_kv=2),
    "bf16-features": conformance.Case(batch=2, seq_q=230, seq_k=180, heads_q=3,
                                      heads_kv=1, dtype="bfloat16", sinks=1,
                                      bias_shape=(1, -1, -1, -1), segment_ids="padded",
                                      logits_soft_cap=20.0),
    "fp16-empty-rows": conformance.Case(batch=2, seq_q=160, seq_k=160, heads_q=4,
                                        dtype="float16", segment_ids="disjoint"),
}


@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_split_tail_against_reference(name):
  _SplitTailInterpret().check(SPLIT_CASES[name])


# On the GPU with the default tiles and the device's SM count (lengths within the
# suite's max_seq_len of 4096): 10 heads of 32
# q blocks (4096 rows) is 320 programs, 56 past two waves of 132.
SPLIT_GPU_CASES = {
    "bf16": conformance.Case(seq_q=4096, seq_k=4096, heads_q=10, heads_kv=10,
                             head_dim=128, dtype="bfloat16"),
    "fp16-gqa-padded": conformance.Case(seq_q=4000, seq_k=4090, heads_q=10, heads_kv=5,
                                        head_dim=96, dtype="float16",
                                        segment_ids="padded", sinks=1),
}


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("name", sorted(SPLIT_GPU_CASES))
def test_split_tail_forward_on_gpu(name):
  from flashjax.common import hardware
  from flashjax.pallas_gpu.triton import fwd as triton_fwd
  case = SPLIT_GPU_CASES[name]
  s = spec.abstract_spec(batch=case.batch, seq_q=case.seq_q, seq_k=case.seq_k,
                         heads_q=case.heads_q, heads_kv=case.heads_kv,
                         head_dim=case.head_dim, dtype=case.dtype)
  cfg = pallas_triton.default_config(s)
  plan = pallas_triton.tp.make_plans(s, cfg)["fwd"]
  assert cfg.fwd.split_tail and triton_fwd.splits_tail(plan, False, hardware.num_sms())
  TestPallasTritonGpu().check(case)


def test_needs_gpu_or_interpret():
  q = jnp.ones((1, 16, 1, 32))
  if not ON_GPU:
    with pytest.raises(NotImplementedError, match="interpret=True"):
      pallas_triton.flash_attention(q, q, q)


def test_frontend_runs_it_in_interpret_mode():
  import flashjax
  from flashjax.common import reference
  ks = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(kk, (1, 96, 2, 64)) for kk in ks)
  out = flashjax.flash_attention(q, k, v, causal=True, backend="gpu",
                                 platform="pallas-triton", interpret=True)
  tolerances.assert_close(out, reference.attention(q, k, v, causal=True),
                          tolerances.forward("float32"))


def test_autotune_picks_the_fastest_and_caches_it(tmp_path, monkeypatch):
  import functools
  from flashjax.common import autotune as common_autotune
  from flashjax.pallas_gpu.triton import autotune
  monkeypatch.setenv("FLASHJAX_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
  s = spec.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2, head_dim=32,
                         dtype="float32", causal=True)
  assert autotune.TUNER.lookup(s) is None
  fwd_times = iter([5.0, 3.0, 9.0, 4.0, 7.0, 8.0])
  bwd_times = iter([2.0, 1.0, 3.0])
  timer = lambda fn, args: next(bwd_times if len(args) == 3 and getattr(
      fn, "_grad", False) else fwd_times)
  run = common_autotune.random_run(s, functools.partial(pallas_triton.flash_attention,
                                                        interpret=True))

  def marked(cfg, with_grad):
    fn, args = run(cfg, with_grad)
    fn = functools.partial(fn)
    fn._grad = with_grad
    return fn, args

  # A base equal to the first candidates keeps the candidate order as listed.
  first = TritonForward(**dataclasses.asdict(autotune.FWD_CANDIDATES[0]))
  base = TritonConfig(fwd=first, dq=autotune.BWD_CANDIDATES[0][0],
                      dkv=autotune.BWD_CANDIDATES[0][1])
  cfg = autotune.TUNER.tune(s, marked, timer=timer, base=base)
  assert type(cfg.fwd) is TritonForward
  assert tiles(cfg.fwd) == tiles(autotune.FWD_CANDIDATES[1])
  assert (cfg.dq, cfg.dkv) == autotune.BWD_CANDIDATES[1]
  assert autotune.TUNER.lookup(s) == cfg  # read back from the JSON file
  assert pallas_triton.resolve_config(s, None, interpret=True) == cfg
  other = spec.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2, head_dim=64,
                             dtype="float32", causal=True)
  assert common_autotune.shape_class(other) != common_autotune.shape_class(s)
  assert pallas_triton.resolve_config(other, None, interpret=True) == (
      pallas_triton.default_config(other))


def test_autotune_candidates_follow_head_dim_and_include_the_default():
  from flashjax.pallas_gpu.triton import autotune
  wide = spec.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2, head_dim=256)
  narrow = spec.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2, head_dim=128)
  assert autotune.candidates(wide) == (autotune.WIDE_FWD_CANDIDATES,
                                       autotune.WIDE_BWD_CANDIDATES)
  assert autotune.candidates(narrow) == (autotune.FWD_CANDIDATES,
                                         autotune.BWD_CANDIDATES)
  seen = []
  base = pallas_triton.default_config(wide)

  def run(cfg, with_grad):
    seen.append((with_grad, cfg))
    raise RuntimeError("does not fit")  # every candidate fails: tune must say so

  with pytest.raises(NotImplementedError, match="no candidate ran"):
    autotune.TUNER.tune(wide, run, timer=lambda fn, args: 1.0, base=base)
  assert seen[0] == (False, base)  # the default is timed first


def test_fp32_defaults_fit_shared_memory():
  # The D = 128 forward default (128-key tiles, 3 stages) was tuned on bf16; in
  # fp32 it asked the H200 for 384 KiB of shared memory and failed to launch. fp32
  # dots also stage the resident tile and the probabilities in shared memory (an
  # fp32 triton forward with 64-key tiles asked for 295424 bytes), so 3 stages of
  # 64 keys do not fit either.
  from flashjax.common import hardware, launch
  make = lambda dtype: spec.abstract_spec(batch=1, seq_q=4096, seq_k=4096, heads_q=2,
                                          head_dim=128, dtype=dtype)
  bf16, fp32 = (pallas_triton.default_config(make(d)) for d in ("bfloat16", "float32"))
  assert (bf16.fwd.block_kv, fp32.fwd.block_kv) == (128, 32)
  assert fp32.dq == bf16.dq and fp32.dkv == bf16.dkv
  for cfg, streamed, resident in (
      (fp32.fwd, fp32.fwd.block_kv, fp32.fwd.block_q * (128 + fp32.fwd.block_kv)),
      (fp32.dq, fp32.dq.block_kv, fp32.dq.block_q * 128),
      (fp32.dkv, fp32.dkv.block_q, fp32.dkv.block_kv * 128)):
    pipelined = cfg.num_stages * streamed * 256 * 4
    assert pipelined <= launch.SHARED_MEMORY_BUDGET
    assert pipelined + 4 * resident <= hardware.HOPPER.shared_memory


def test_bias_and_mask_tiles_count_in_the_shared_memory_fit():
  # The bf16 D = 128 long-key forward (128 keys x 3 stages) with a full fp32 bias
  # asked an H200 for 353 KiB; a full int8 mask adds 48 KiB to 192 (over the
  # budget too); a bias that is one value per key stays cheap.
  make = lambda **kw: pallas_triton.default_config(spec.abstract_spec(
      batch=1, seq_q=4096, seq_k=4096, heads_q=2, head_dim=128, dtype="bfloat16",
      **kw))
  sd = jax.ShapeDtypeStruct
  full = make(bias=sd((1, 2, 4096, 4096), jnp.float32))
  keys_only = make(bias=sd((1, 1, 1, 4096), jnp.float32))
  masked = make(mask=sd((1, 1, 4096, 4096), jnp.bool_))
  assert (full.fwd.block_kv, keys_only.fwd.block_kv, masked.fwd.block_kv) == (
      64, 128, 64)
  assert full.dkv.block_q == 64 and full.fwd.block_q == 128


def test_fast_exp2_only_in_compiled_kernels(monkeypatch):
  """The inline ex2.approx.ftz PTX is for compiled kernels; the interpreter (which
  has no PTX) gets jnp.exp2. The compiled path is checked by the GPU class."""
  from flashjax.pallas_gpu.triton import plan as triton_plan
  seen = []
  make = triton_plan.make_plans
  monkeypatch.setattr(triton_plan, "make_plans", lambda *a, **kw: (
      seen.append(kw.get("fast_exp2")), make(*a, **kw))[1])
  ks = jax.random.split(jax.random.key(3), 3)
  q, k, v = (jax.random.normal(kk, (1, 64, 2, 32), jnp.float32) for kk in ks)
  # Forward and backward each make their plans.
  jax.grad(lambda q: pallas_triton.flash_attention(
      q, k, v, interpret=True, config=SMALL).sum())(q)
  assert len(seen) >= 2 and not any(seen)
  plan = triton_plan.make_plans(spec.canonicalize(q, k, v)[1], SMALL, fast_exp2=True)
  assert all(p.fast_exp2 for p in plan.values())
  x = jnp.linspace(-200.0, 20.0, 64)
  slow = dataclasses.replace(plan["fwd"], fast_exp2=False)
  assert jnp.array_equal(triton_plan.exp2(x, slow), jnp.exp2(x))


def test_d128_forward_tiles_follow_the_key_length():
  from flashjax.pallas_gpu.triton import autotune
  make = lambda s: spec.abstract_spec(batch=1, seq_q=s, seq_k=s, heads_q=2,
                                      head_dim=128, dtype="bfloat16")
  short, long = (pallas_triton.default_config(make(s)).fwd for s in (2048, 8192))
  assert (short.block_q, short.block_kv, short.num_warps, short.num_stages) == (
      128, 64, 4, 2)
  assert (long.block_q, long.block_kv, long.num_warps, long.num_stages) == (
      128, 128, 8, 3)
  candidates = [tiles(c) for c in autotune.FWD_CANDIDATES]
  assert tiles(short) in candidates and tiles(long) in candidates


# Wide heads take 64x64 backward tiles over 8 warps (half the accumulator
# registers per thread of 4 warps); fp32 halves the streamed rows to fit.
WIDE_CASES = {
    "d256-bf16-causal": conformance.Case(batch=2, seq_q=300, seq_k=333, head_dim=256,
                                         causal=True, dtype="bfloat16"),
    "d256-fp32-features": conformance.Case(seq_q=200, seq_k=260, head_dim=256,
                                           dtype="float32", bias_shape=(1, -1, -1, -1),
                                           sinks=1, segment_ids="padded"),
    "d192-fp16-window-dropout": conformance.Case(seq_q=260, seq_k=190, head_dim=192,
                                                 dtype="float16",
                                                 sliding_window=(40, 5),
                                                 dropout_rate=0.1),
    # 2-byte inputs with a full bias, a mask or segment ids beside the wide rows.
    "d256-bf16-bias-segments": conformance.Case(batch=2, seq_q=300, seq_k=333,
                                                head_dim=256, dtype="bfloat16",
                                                bias_shape=(-1, -1, -1, -1),
                                                segment_ids="packed"),
    "d256-fp16-mask-causal": conformance.Case(seq_q=260, seq_k=260, head_dim=256,
                                              dtype="float16", causal=True,
                                              mask_shape=(1, -1, -1, -1)),
}


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("name", sorted(WIDE_CASES))
def test_wide_head_backward_tiles_on_gpu(name):
  TestPallasTritonGpu().check(WIDE_CASES[name])


def test_wide_head_backward_tiles():
  import jax
  def wide(dtype, **kw):
    return pallas_triton.default_config(spec.abstract_spec(
        batch=2, seq_q=8192, seq_k=8192, heads_q=8, head_dim=256, dtype=dtype, **kw))
  bias = dict(bias=jax.ShapeDtypeStruct((2, 8, 8192, 8192), "float32"))
  bf16, fp32, fp32_bias, bf16_bias = (wide("bfloat16"), wide("float32"),
                                      wide("float32", **bias), wide("bfloat16", **bias))
  assert bf16.dq == bf16.dkv == pallas_triton.WIDE_BWD
  # fp32 (with or without a bias): the streamed side halved to fit shared memory.
  for cfg in (fp32, fp32_bias):
    assert (cfg.dq.block_q, cfg.dq.block_kv, cfg.dq.num_warps) == (64, 32, 8)
    assert (cfg.dkv.block_q, cfg.dkv.block_kv, cfg.dkv.num_warps) == (32, 64, 8)
  # A 2-byte input with a full fp32 bias: 64 streamed rows of 2 x 256 x 2 + 64 x 4
  # bytes fit twice, so the wide tiles stay whole.
  assert bf16_bias.dq == bf16_bias.dkv == pallas_triton.WIDE_BWD


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_tiles_fit_every_generation(dtype):
  """The Triton-based platforms' default streamed tiles fit each generation's
  shared memory (with a full fp32 bias too); only Hopper gets the long-key tiles
  and the split tail."""
  from flashjax.common import hardware, launch
  from flashjax.triton_gpu import plan as triton_plan_gpu
  targets = list(hardware.BY_CAPABILITY.values()) + [hardware.AMD]
  for target in targets:
    for d in (64, 128, 256):
      for bias in (None, jax.ShapeDtypeStruct((1, 4, 8192, 8192), "float32")):
        s = spec.abstract_spec(batch=1, seq_q=8192, seq_k=8192, heads_q=4, head_dim=d,
                               dtype=dtype, bias=bias)
        for cfg in (pallas_triton.default_config(s, target),
                    triton_plan_gpu.default_config(s, target)):
          for kernel, streamed, other in ((cfg.fwd, "block_kv", "block_q"),
                                          (cfg.dq, "block_kv", "block_q"),
                                          (cfg.dkv, "block_q", "block_kv")):
            # Each streamed row: K and V (or Q and dO) plus a bias row as wide as
            # the resident tile.
            row = 2 * d * jnp.dtype(dtype).itemsize + (
                4 * getattr(kernel, other) if bias is not None else 0)
            n = getattr(kernel, streamed)
            assert n == 16 or kernel.num_stages * n * row <= launch.streamed_budget(target), (
                target.name, d, kernel)
        p = pallas_triton.default_config(s, target)
        long_tiles = p.fwd.block_kv == 128 and p.fwd.num_warps == 8
        assert (long_tiles and d == 128 and dtype == "bfloat16") == (
            target.hopper and d == 128 and dtype == "bfloat16" and bias is None), (
                target.name, d, p.fwd)
        assert not p.fwd.split_tail or target.hopper


class TestPallasTritonKvCacheInterpret(conformance_kvcache.KvCacheSuite):
  """The Pallas-Triton KV-cache kernel (pallas_gpu/triton/kvcache.py) in interpret
  mode where it applies (pages of 1, 5, 7 and 8 positions load gathered tiles, of 64
  and 256 one page per tile); the rest (head dims that are not a power of two)
  runs the xla path through the same dispatch."""

  KV_CAPS = conformance_kvcache.KvCapabilities(name="pallas-triton[kvcache,interpret]",
                                               hypothesis_examples=1)

  def kvcache(self, *args, **kwargs):
    return flashjax.flash_mha_with_kvcache(*args, backend="gpu",
                                           platform="pallas-triton", interpret=True,
                                           **kwargs)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("platform", ["pallas", "pallas-triton"])
class TestPallasKvCacheGpu(conformance_kvcache.KvCacheSuite):
  KV_CAPS = conformance_kvcache.KvCapabilities(name="pallas[kvcache,gpu]")

  @pytest.fixture(autouse=True)
  def _platform(self, platform):
    self.platform = platform

  def kvcache(self, *args, **kwargs):
    return flashjax.flash_mha_with_kvcache(*args, platform=self.platform, **kwargs)

def test_blocks_between_documents_are_skipped():
  """Forward, dq and dkv kernels (folded causal forward too) leave out the blocks
  of other documents: one document's NaN values reach no other document."""
  conformance_packed.check_skips_between_documents(
      lambda *a, **kw: pallas_triton.flash_attention(*a, interpret=True,
                                                     config=SMALL, **kw),
      doc_len=32, causal=True)


def test_segment_ranges_lower_for_cuda():
  """The visible-range tables reach all three kernels of a compiled call."""
  sd = jax.ShapeDtypeStruct
  q = sd((1, 1024, 4, 64), jnp.bfloat16)
  ids = sd((1, 1024), jnp.int32)

  def fwd_bwd(q, k, v, ids):
    ops, s = spec.canonicalize(q, k, v, segment_ids=(ids, ids), causal=True)
    static = platform.Static(pallas_triton.default_config(s), False)
    out, lse = pallas_triton.forward(ops, s, static)
    return pallas_triton.backward(ops, s, static, out, lse, out, lse)

  text = jax.jit(fwd_bwd).trace(q, q, q, ids).lower(
      lowering_platforms=("cuda",)).as_text()
  for name in ("fwd", "bwd_dq", "bwd_dkv"):
    assert f"flashjax_pallas_triton_{name}" in text
