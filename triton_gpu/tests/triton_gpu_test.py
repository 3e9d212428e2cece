"""The triton platform: the conformance suite on a GPU; on any machine, every kernel
of each variant compiled for sm_90 (some variants for sm_80 too) by Triton's
compiler (no GPU needed), the unavailable-platform reason and the seed's
environment variables (the block tables' band ranges are checked in
common/tests/blocking_test.py)."""

import dataclasses
import importlib.util
import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import triton_gpu
import flashjax
from flashjax.common import conformance, conformance_kvcache, spec as spec_lib
from flashjax.triton_gpu import plan

ON_GPU = jax.default_backend() == "gpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestTritonGpu(conformance.ConformanceSuite):
  CAPS = conformance.Capabilities.of(triton_gpu.CAPABILITIES, name="triton[gpu]")

  def attention(self, q, k, v, **kwargs):
    return triton_gpu.flash_attention(q, k, v, **kwargs)


def _spec(**kw):
  base = dict(batch=2, seq_q=300, seq_k=300, heads_q=4, heads_kv=2, head_dim=128,
              dtype="bfloat16")
  base.update(kw)
  return spec_lib.abstract_spec(**base)


VARIANTS = [
    ("bfloat16", 128, {}), ("bfloat16", 128, dict(causal=True)),
    ("float16", 64, dict(sliding_window=(40, 8), segment_ids=True)),
    ("bfloat16", 256, dict(logits_soft_cap=30.0, heads_kv=1)),
    ("bfloat16", 96, dict(seq_q=77, seq_k=200, causal=True, logits_soft_cap=5.0)),
    ("bfloat16", 64, dict(causal=True, bias=(1, 4, 1, 300), mask=(2, 1, 300, 300),
                          dropout_rate=0.1)),
    ("float32", 16, dict(bias=(2, 4, 300, 300), logits_soft_cap=20.0,
                          dropout_rate=0.3, segment_ids=True)),
]
TY = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}


def _compile(spec, arch, only=None):
  """The triton platform's kernels for ``spec`` with its default config, compiled
  by Triton for ``sm_<arch>`` (no GPU needed): ``{kernel name: (launch config,
  compiled kernel)}``; ``only`` names a subset."""
  import triton
  from triton.backends.compiler import GPUTarget
  from flashjax.triton_gpu import kernels
  cfg = triton_gpu.default_config(spec)
  geo = plan.Geometry.of(spec, cfg)
  # Padded bias/mask shapes as attention.py passes them (size-1 dims broadcast).
  padded = lambda shape: None if shape is None else tuple(
      n if n == 1 else p for n, p in zip(
          shape, (spec.batch, spec.heads_q, geo.seq_q_padded, geo.seq_k_padded)))
  bias_shape, mask_shape = padded(spec.bias_shape), padded(spec.mask_shape)
  t, f32, i32, i8 = TY[spec.dtype], "*fp32", "*i32", "*i8"
  bias_t = f32 if bias_shape is not None else i32
  mask_t = i8 if mask_shape is not None else i32
  opt = [i32, i32, bias_t, mask_t, i32, i32]  # ids, bias, mask, seed, table
  args = {
      kernels.fwd_kernel: (cfg.fwd, [t, t, t] + opt + [t, f32]),
      kernels.dq_kernel: (cfg.dq, [t, t, t, t, f32, f32] + opt + [t, f32]),
      kernels.dkv_kernel: (cfg.dkv, [t, t, t, t, f32, f32] + opt + [t, t]),
  }
  compiled = {}
  for fn, (launch, ptrs) in args.items():
    if only is not None and fn.__name__ not in only:
      continue
    constexprs = plan.constexprs(spec, geo, launch.block_q, launch.block_kv,
                                 dataclasses.replace(cfg, fp32_precision="ieee"),
                                 bias_shape, mask_shape)
    names = list(fn.arg_names)
    signature = dict(zip(names, ptrs))
    signature.update({n: "constexpr" for n in constexprs})
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled[fn.__name__] = (launch, triton.compile(
        src, target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages)))
  return compiled


# Shared memory one block may use on an H100/H200 (sm_90), as the device reports
# it (cudaDevAttrMaxSharedMemoryPerBlockOptin) and as launches that exceed it say.
HOPPER_MAX_SHARED = 232448


# fp32 dots at "ieee" precision take no tensor cores on either architecture, so
# sm_80 and sm_90 compile the same FMA loops; fp32 variants took 150-290 s per
# architecture on the 2-core CI machine (2026-11-27), so they compile for sm_90
# only, and the fp32 variant with every feature at D = 16 (38-39 s; D = 32
# 62-77 s, D = 64 115-133 s, D = 128 253 s). D = 256 compiles in bf16 (16-18 s;
# 193 s in fp32). sm_80's tensor-core path (mma, no wgmma) compiles on the plain
# variant and the one with window and ids; the one with bias, mask and dropout
# took 65-74 s there.
AMPERE = {0, 2}
ARCH_VARIANTS = [(variant, arch) for i, variant in enumerate(VARIANTS)
                 for arch in (80, 90)
                 if arch == 90 or i in AMPERE]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("variant,arch", ARCH_VARIANTS,
                         ids=lambda v: f"{v[0]}-D{v[1]}-{v[2]}" if isinstance(v, tuple)
                         else str(v))
def test_every_kernel_compiles_for_ampere_and_hopper(variant, arch):
  dtype, d, kw = variant
  kw = dict(kw)
  if kw.pop("segment_ids", False):
    kw["segment_ids"] = (jax.ShapeDtypeStruct((2, kw.get("seq_q", 300)), jnp.int32),
                         jax.ShapeDtypeStruct((2, kw.get("seq_k", 300)), jnp.int32))
  for name, dt in (("bias", jnp.float32), ("mask", jnp.bool_)):
    if name in kw:
      kw[name] = jax.ShapeDtypeStruct(kw[name], dt)
  spec = _spec(head_dim=d, dtype=dtype, **kw)
  assert triton_gpu.supported(spec) is None or "not installed" in triton_gpu.supported(spec)
  for name, (launch, compiled) in _compile(spec, arch).items():
    assert compiled.asm["cubin"], name
    if arch == 90:  # without a GPU the defaults are sized for Hopper
      assert compiled.metadata.shared <= HOPPER_MAX_SHARED, (name, launch)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_fp32_forward_fits_hopper_shared_memory():
  """fp32 D = 80 with a per-key bias, causal, window (0, 0), sinks: the default
  forward (128 x 64 tiles, 3 stages) asked an H200 for 295424 bytes of shared
  memory (the limit is 232448) and failed at run time; fp32 dots stage Q and P in
  shared memory too, which the sizing now counts."""
  sd = jax.ShapeDtypeStruct
  spec = spec_lib.abstract_spec(
      batch=1, seq_q=130, seq_k=130, heads_q=4, head_dim=80, dtype="float32",
      causal=True, sliding_window=(0, 0), bias=sd((1, 4, 1, 130), jnp.float32),
      sinks=sd((4,), jnp.float32), softmax_scale=0.3)
  launch, compiled = _compile(spec, 90, only=("fwd_kernel",))["fwd_kernel"]
  assert compiled.metadata.shared <= HOPPER_MAX_SHARED, (
      launch, compiled.metadata.shared)


def test_supported_reasons(monkeypatch):
  # The dependency check comes first; either reason names why it cannot run.
  for s, why in ((_spec(head_dim=320), "head dim 320"),
                 (_spec(head_dim=512), "head dim 512")):
    reason = triton_gpu.supported(s)
    assert reason and (why in reason or "not installed" in reason), reason
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "jax_triton" else real(name, *a))
  reason = triton_gpu.supported(_spec())
  assert "jax-triton" in reason and "not installed" in reason
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="jax-triton"):
    triton_gpu.flash_attention(q, q, q)


def test_every_feature_is_supported():
  if not HAS_TRITON or importlib.util.find_spec("jax_triton") is None:
    pytest.skip("the feature check comes after the dependency check")
  assert triton_gpu.supported(_spec(
      dropout_rate=0.1, causal=True, logits_soft_cap=3.0,
      bias=jax.ShapeDtypeStruct((1, 4, 300, 300), jnp.float32),
      mask=jax.ShapeDtypeStruct((2, 1, 1, 300), jnp.bool_))) is None


def test_blocksize_environment_variables(monkeypatch):
  monkeypatch.setenv("BLOCKSIZE_M_FLASH_ATTN", "32")
  monkeypatch.setenv("BLOCKSIZE_N_FLASH_ATTN", "16")
  cfg = triton_gpu.default_config(_spec())
  assert (cfg.fwd.block_q, cfg.fwd.block_kv) == (32, 16)
  cfg = triton_gpu.config_from_block_sizes(_spec(), 64, 32)
  assert (cfg.fwd.block_q, cfg.fwd.block_kv) == (64, 32)


def test_config_validation():
  with pytest.raises(ValueError, match="block_q must be a power of two"):
    plan.KernelConfig(block_q=48, block_kv=32)
  with pytest.raises(ValueError, match="fp32_precision"):
    plan.KernelsConfig(fp32_precision="bf16")


def test_import_of_the_frontend_does_not_import_triton():
  code = ("import sys, flashjax, flashjax.triton_gpu; "
          "assert 'triton' not in sys.modules and 'jax_triton' not in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not ON_GPU, reason="jax-triton imports only with a GPU jaxlib")
def test_seed_environment_variables_on_gpu(tmp_path):
  code = ("import os, flashjax.triton_gpu.attention as a, jax_triton.triton_lib as t; "
          f"assert os.environ['TRITON_CACHE_DIR'] == {str(tmp_path / 'c')!r}; "
          f"assert t._JAX_TRITON_DUMP_DIR == {str(tmp_path / 'd')!r}; "
          "os.environ['GPU_IDX_FLASH_ATTN'] = '0'; assert a._compute_capability() >= 80")
  env = dict(os.environ, CACHE_TRITON_KERNELS="1", TRITON_CACHE_DIR=str(tmp_path / "c"),
             _JAX_TRITON_DUMP_DIR=str(tmp_path / "d"))
  subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_autotune_picks_the_fastest_caches_it_and_shares_the_file(tmp_path, monkeypatch):
  from flashjax.pallas_gpu.triton import autotune as pt_autotune
  from flashjax.triton_gpu import autotune
  monkeypatch.setenv("FLASHJAX_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
  s = _spec(seq_q=64, seq_k=64, head_dim=64, causal=True)
  assert autotune.TUNER.lookup(s) is None
  base = plan.KernelsConfig(fwd=autotune.FWD_CANDIDATES[0],
                            dq=autotune.BWD_CANDIDATES[0][0],
                            dkv=autotune.BWD_CANDIDATES[0][1])
  fwd_times = {c: t for c, t in zip(autotune.FWD_CANDIDATES, [5.0, 9.0, 2.0, 7.0, 8.0])}
  bwd_times = {c: t for c, t in zip(autotune.BWD_CANDIDATES, [3.0, 1.0, 4.0])}

  def run(cfg, with_grad):
    if with_grad:
      return (lambda: bwd_times[(cfg.dq, cfg.dkv)]), ()
    if cfg.fwd == autotune.FWD_CANDIDATES[3]:
      raise RuntimeError("out of shared memory")  # skipped, not fatal
    return (lambda: fwd_times[cfg.fwd]), ()

  cfg = autotune.TUNER.tune(s, run, timer=lambda fn, args: fn(), base=base)
  assert cfg.fwd == autotune.FWD_CANDIDATES[2]
  assert (cfg.dq, cfg.dkv) == autotune.BWD_CANDIDATES[1]
  assert autotune.TUNER.lookup(s) == cfg  # read back from the JSON file
  resolve = lambda s: autotune.TUNER.resolve(s, None, attention=None,
                                             default=triton_gpu.default_config(s),
                                             may_tune=False)
  assert resolve(s) == cfg
  # Pallas-Triton shares the file under its own keys: no cross-talk.
  assert pt_autotune.TUNER.lookup(s) is None
  other = _spec(seq_q=64, seq_k=64, head_dim=128)
  assert resolve(other) == triton_gpu.default_config(other)


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
class TestTritonKvCacheGpu(conformance_kvcache.KvCacheSuite):
  """No Triton KV-cache kernel yet: the entry runs the xla path (logged once)."""

  KV_CAPS = conformance_kvcache.KvCapabilities(name="triton[kvcache,gpu]")

  def kvcache(self, *args, **kwargs):
    return flashjax.flash_mha_with_kvcache(*args, platform="triton", **kwargs)

@pytest.mark.parametrize("band", [(None, None), (None, 0), (40, 8)])
def test_block_tables_narrowed_by_segment_ids(band):
  """Per batch element, blocks holding an allowed pair stay in [lo, hi); interior
  runs stay unmasked-exact; sorted documents shrink the work to theirs."""
  from flashjax.common import conformance_packed
  kw = {}
  if band != (None, None):
    kw = dict(causal=True) if band == (None, 0) else dict(sliding_window=band)
  rng = np.random.default_rng(len(kw))
  ids = conformance_packed.segment_ids(rng, "documents", 2, 300)
  spec = _spec(**kw)
  geo = plan.Geometry(spec, 64, 32)
  dense = np.asarray(spec.band.as_array())[None] & (ids[:, :, None] == ids[:, None, :])
  for bq, bk in ((64, 32), (32, 32)):
    for over_kv in (True, False):
      table = np.asarray(geo.block_table(bq, bk, over_kv, (ids, ids)))
      band_only = geo.block_table(bq, bk, over_kv)
      assert table.shape == band_only.shape
      for x, i in itertools.product(range(2), range(table.shape[1])):
        lo, a, b, hi = table[x, i]
        assert lo <= a <= b <= hi
        lo0, a0, b0, hi0 = band_only[x, i]
        assert lo0 <= lo and hi <= hi0 and (a >= b or a0 <= a <= b <= b0)
        inner = geo.seq_k_padded // bk if over_kv else geo.seq_q_padded // bq
        for n in range(inner):
          r, c = (i, n) if over_kv else (n, i)
          if dense[x, r * bq:(r + 1) * bq, c * bk:(c + 1) * bk].any():
            assert lo <= n < hi, (over_kv, x, i, n)
  work = lambda t: int((t[0, :, 3] - t[0, :, 0]).sum())
  if band[0] is None:  # sorted documents of 4-24 tokens in a full or causal band
      assert work(geo.block_table(32, 32, True, (ids, ids))) < work(
        geo.block_table(32, 32, True)) // 2
