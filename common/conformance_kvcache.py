"""The KV-cache part of the conformance suite (``flash_mha_with_kvcache``).

A platform's test module subclasses :class:`KvCacheSuite`, sets ``KV_CAPS`` and
implements ``kvcache`` (the platform's ``flash_mha_with_kvcache``)::

    class TestXlaKvCache(conformance_kvcache.KvCacheSuite):
      KV_CAPS = conformance_kvcache.KvCapabilities(name="xla")

      def kvcache(self, *args, **kwargs):
        return flashjax.flash_mha_with_kvcache(*args, platform="xla", **kwargs)

Every case draws random inputs, fills the cache slots a row does not hold with NaN
(no platform may read them), runs the platform under ``jit`` with the lengths,
page table and indices traced, and checks the output and lse against
``reference.attention_with_kvcache``, the updated caches bit for bit, and off the
CPU that a second run is bit-identical. A case the platform does not declare must
raise ``NotImplementedError``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from . import conformance, reference, tolerances

ALL_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KvCapabilities:
  """What a platform's KV-cache entry declares; everything else must raise."""

  name: str
  contiguous: bool = True
  paged: bool = True
  dtypes: tuple[str, ...] = ALL_DTYPES
  head_dim_ok: Callable[[int], bool] = lambda d: d <= 512
  hypothesis_examples: int = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class KvCase:
  batch: int = 2
  seq_q: int = 1
  seq_new: int = 0  # new keys appended (0: attend to the cache only)
  heads_q: int = 2
  heads_kv: int = 1
  head_dim: int = 32
  head_dim_v: int | None = None
  dtype: str = "float32"
  capacity: int = 48  # positions per batch row
  page_size: int | None = None  # None: contiguous
  batch_idx: bool = False  # contiguous: more cache rows than batch rows, shuffled
  leftpad: bool = False
  rotary: str | None = None  # "interleaved" | "halves"
  rotary_dim: int | None = None  # default: the whole head dim
  causal: bool = False
  window: tuple | None = None
  logits_soft_cap: float | None = None
  sinks: int = 0
  empty_row: bool = False  # row 1 starts from an empty cache (Sq > T: masked rows)
  seed: int = 0


def make_kv_inputs(case: KvCase):
  """``(arrays, static)``: keyword arrays (traced under jit) and static keywords."""
  rng = np.random.default_rng(case.seed)
  dt = jnp.dtype(case.dtype)
  dv = case.head_dim_v or case.head_dim
  b, hkv, d, cap = case.batch, case.heads_kv, case.head_dim, case.capacity
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  # Row 0 ends exactly at the capacity; the others end anywhere.
  lens = rng.integers(0, cap - case.seq_new + 1, b)
  lens[0] = cap - case.seq_new
  if case.empty_row and b > 1:
    lens[1] = 0
  pad = np.zeros(b, np.int64)
  if case.leftpad:
    pad = np.array([rng.integers(0, n + 1) for n in lens])
    pad[0] = min(lens[0], 3)
  dense_k = normal(b, cap, hkv, d)
  dense_v = normal(b, cap, hkv, dv)
  held = (np.arange(cap)[None] >= pad[:, None]) & (np.arange(cap)[None] < lens[:, None])
  dense_k[~held] = np.nan  # free slots: never read
  dense_v[~held] = np.nan
  arrays = {"q": jnp.asarray(normal(b, case.seq_q, case.heads_q, d), dt),
            "cache_seqlens": jnp.asarray(lens, jnp.int32)}
  if case.page_size is None:
    rows = np.arange(b)
    if case.batch_idx:
      extra = 2
      rows = rng.permutation(b + extra)[:b]
      kc = normal(b + extra, cap, hkv, d)
      vc = normal(b + extra, cap, hkv, dv)
      kc[rows], vc[rows] = dense_k, dense_v
      arrays["cache_batch_idx"] = jnp.asarray(rows, jnp.int32)
    else:
      kc, vc = dense_k, dense_v
  else:
    ps = case.page_size
    max_pages = -(-cap // ps)
    num_pages = b * max_pages + 3  # a few pages nobody uses
    order = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages)
    kc = normal(num_pages, ps, hkv, d)
    vc = normal(num_pages, ps, hkv, dv)
    padded = lambda x: np.concatenate(
        [x, np.full((b, max_pages * ps - cap) + x.shape[2:], np.nan, np.float32)], 1)
    kc[order] = padded(dense_k).reshape(b, max_pages, ps, hkv, d)
    vc[order] = padded(dense_v).reshape(b, max_pages, ps, hkv, dv)
    table = order.copy()
    # Entries past a row's pages may hold anything (here: out of the pool).
    used = -(-(lens + case.seq_new) // ps)
    for row, n in enumerate(used):
      table[row, n:] = -1 if row % 2 else num_pages + 5
    arrays["page_table"] = jnp.asarray(table, jnp.int32)
  arrays["k_cache"] = jnp.asarray(kc, dt)
  arrays["v_cache"] = jnp.asarray(vc, dt)
  if case.seq_new:
    arrays["k"] = jnp.asarray(normal(b, case.seq_new, hkv, d), dt)
    arrays["v"] = jnp.asarray(normal(b, case.seq_new, hkv, dv), dt)
  if case.leftpad:
    arrays["cache_leftpad"] = jnp.asarray(pad, jnp.int32)
  if case.rotary:
    rd = case.rotary_dim or d
    angles = np.arange(cap + case.seq_q)[:, None] * (
        10000.0 ** (-np.arange(rd // 2) / (rd // 2)))[None]
    arrays["rotary_cos"] = jnp.asarray(np.cos(angles), jnp.float32)
    arrays["rotary_sin"] = jnp.asarray(np.sin(angles), jnp.float32)
  if case.sinks:
    shape = (case.heads_q,) if case.sinks == 1 else (case.heads_q, case.sinks)
    arrays["sinks"] = jnp.asarray(normal(*shape) + 1.0)
  static = dict(is_causal=case.causal, window_size=case.window or (-1, -1),
                logits_soft_cap=case.logits_soft_cap,
                rotary_interleaved=case.rotary != "halves")
  return arrays, static


def _reference(arrays, static):
  """``reference.attention_with_kvcache``'s out, lse and updated caches."""
  a = dict(arrays)
  q, kc, vc = a.pop("q"), a.pop("k_cache"), a.pop("v_cache")
  k, v = a.pop("k", None), a.pop("v", None)
  kw = dict(static)
  kw["causal"] = kw.pop("is_causal")
  return jax.jit(lambda q, kc, vc, k, v, a: reference.attention_with_kvcache(
      q, kc, vc, k, v, precision="float32", **a, **kw))(q, kc, vc, k, v, a)


class KvCacheSuite:
  """Base class; subclasses set ``KV_CAPS`` and implement ``kvcache``."""

  KV_CAPS: KvCapabilities

  def kvcache(self, *args, **kwargs):
    raise NotImplementedError("the platform's test must implement kvcache()")

  @pytest.fixture(autouse=True)
  def _share_reference_results(self, tmp_path_factory):
    conformance.share_reference_results(tmp_path_factory)

  def kv_expected_error(self, case: KvCase) -> str | None:
    caps = self.KV_CAPS
    if not (caps.paged if case.page_size else caps.contiguous):
      return "paged" if case.page_size else "contiguous"
    if case.dtype not in caps.dtypes:
      return f"dtype {case.dtype}"
    if not caps.head_dim_ok(max(case.head_dim, case.head_dim_v or 0)):
      return f"head dim {case.head_dim}"
    return None

  def run_kv(self, arrays, static, **extra):
    fn = jax.jit(lambda a: self.kvcache(
        **a, **static, return_softmax_lse=True, return_updated_cache=True, **extra))
    return fn, fn(arrays)

  def kv_check(self, case: KvCase):
    arrays, static = make_kv_inputs(case)
    if self.kv_expected_error(case) is not None:
      with pytest.raises(NotImplementedError):
        jax.block_until_ready(self.run_kv(arrays, static)[1])
      return None
    fn, got = self.run_kv(arrays, static)
    if jax.default_backend() != "cpu":
      # As in the main suite: on the CPU every platform runs serially (XLA, or a
      # kernel interpreted), so a second run could not differ.
      again = fn(arrays)
      for name, x, y in zip(("out", "lse", "k_cache", "v_cache"), got, again):
        # fp32 holds bf16/fp16 exactly; numpy matches NaN with NaN in its own dtypes
        np.testing.assert_array_equal(np.asarray(x, np.float32),
                                      np.asarray(y, np.float32),
                                      err_msg=f"{name} differs between two runs")
    # Every instance checks the same cases: their reference results are kept,
    # in fp32 (which holds bf16/fp16 exactly; the comparisons are in fp32).
    kept = conformance.kept_reference(("kvcache", case), lambda: {
        n: np.asarray(x).astype(np.float32) for n, x in zip(
            ("out", "lse", "k_cache", "v_cache"), _reference(arrays, static))})
    ref = tuple(kept[n] for n in ("out", "lse", "k_cache", "v_cache"))
    name = self.KV_CAPS.name
    tol = tolerances.forward(case.dtype)
    out, lse, k_cache, v_cache = got
    assert out.dtype == arrays["q"].dtype and out.shape == ref[0].shape
    tolerances.assert_close(np.asarray(out, np.float32), ref[0], tol,
                            name=f"{name} kvcache out")
    tolerances.assert_close(lse, ref[1], tol, name=f"{name} kvcache lse")
    for n, x, r in (("k_cache", k_cache, ref[2]), ("v_cache", v_cache, ref[3])):
      np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(
          r, np.float32), err_msg=f"{name}: updated {n} differs from the reference")
    return got, ref

  # -- contiguous caches -----------------------------------------------------------

  @pytest.mark.parametrize("kw", [
      dict(seq_q=1, seq_new=1, causal=True, rotary="interleaved"),  # decode step
      dict(seq_q=1, seq_new=0, capacity=100),  # several blocks, nothing appended
      dict(seq_q=5, seq_new=5, causal=True, batch_idx=True, leftpad=True,
           rotary="halves", rotary_dim=16),  # chunked prefill, partial rotary
      dict(seq_q=4, seq_new=0, heads_q=6, heads_kv=2, window=(3, 2),
           logits_soft_cap=2.0,
           sinks=2, rotary=None),  # GQA 3, window, soft cap, sinks
      dict(seq_q=3, seq_new=2, batch_idx=True, rotary="interleaved",
           head_dim_v=48),  # non-causal rotary: queries share one position
      dict(seq_q=8, seq_new=8, causal=True, heads_q=4, heads_kv=2, leftpad=True,
           capacity=80),  # 16 query rows per kv head, powers of two
  ], ids=["decode", "no-append", "prefill-chunk", "window-softcap-sinks",
          "noncausal-rotary-dv", "gqa-chunk-16-rows"])
  def test_kv_contiguous(self, kw):
    self.kv_check(KvCase(**kw, seed=len(kw)))

  # -- paged caches ----------------------------------------------------------------

  @pytest.mark.parametrize("page_size,kw", [
      (1, dict(capacity=12, seq_q=1, seq_new=1, causal=True, rotary="interleaved")),
      (16, dict(capacity=80, seq_q=3, seq_new=3, causal=True, leftpad=True,
                window=(20, 0), heads_q=4, heads_kv=2)),
      (64, dict(capacity=192, seq_q=1, seq_new=0, sinks=1, logits_soft_cap=3.0)),
      (256, dict(capacity=256, seq_q=2, seq_new=1, heads_q=3, rotary="halves",
                 causal=True)),  # MQA, one page per row
      (7, dict(capacity=35, seq_q=6, seq_new=4, causal=True, leftpad=True, sinks=2,
               head_dim_v=16, rotary="interleaved", rotary_dim=8)),  # odd pages
      (16, dict(capacity=96, seq_q=4, seq_new=2, causal=True, heads_q=8, heads_kv=2,
                window=(10, 0), sinks=1)),  # 16 query rows per kv head, sinks
  ])
  def test_kv_paged(self, page_size, kw):
    self.kv_check(KvCase(page_size=page_size, **kw, seed=page_size))

  @pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
  def test_kv_dtypes(self, dtype):
    self.kv_check(KvCase(dtype=dtype, page_size=16, capacity=64, seq_q=2, seq_new=1,
                         causal=True, rotary="halves", seed=3))

  def test_kv_head_dim_limit(self):
    self.kv_check(KvCase(head_dim=320, heads_q=2, heads_kv=1, capacity=16, seed=5))

  def test_kv_fully_masked_rows(self):
    """Row 1 starts empty and appends 2 keys for 5 causal queries: its first 3
    queries see nothing (output 0, lse -inf, no NaN)."""
    case = KvCase(seq_q=5, seq_new=2, causal=True, page_size=8, capacity=32,
                  empty_row=True, seed=7)
    res = self.kv_check(case)
    if res is None:
      return
    (out, lse, _, _), _ = res
    lse, out = np.asarray(lse), np.asarray(out, np.float32)
    assert np.all(lse[1, :, :3] == -np.inf) and np.all(np.isfinite(lse[1, :, 3:]))
    assert np.all(out[1, :3] == 0) and not np.isnan(out).any()

  # -- the entry's contract ------------------------------------------------------

  def test_kv_num_splits_and_eager_call(self):
    """``num_splits`` never changes results; an eager call (concrete values: the
    value checks run) gives the jitted results and leaves its inputs untouched."""
    case = KvCase(seq_q=2, seq_new=1, causal=True, page_size=8, capacity=16, seed=9)
    if self.kv_expected_error(case) is not None:
      return self.kv_check(case)
    arrays, static = make_kv_inputs(case)
    before = {n: np.asarray(x, np.float32) for n, x in arrays.items()}
    full = dict(return_softmax_lse=True, return_updated_cache=True)
    base, auto = jax.jit(lambda a: [self.kvcache(**a, **static, num_splits=n, **full)
                                    for n in (1, 0)])(arrays)
    eager = self.kvcache(**arrays, **static, num_splits=3, **full)
    for got in (auto, eager):
      for x, y in zip(got, base):
        np.testing.assert_array_equal(np.asarray(x, np.float32),
                                      np.asarray(y, np.float32))
    for n, x in arrays.items():
      np.testing.assert_array_equal(np.asarray(x, np.float32), before[n],
                                    err_msg=f"input {n} was written")

  def test_kv_random_cases(self):
    caps = self.KV_CAPS
    dtypes = [d for d in caps.dtypes if d in ALL_DTYPES]

    @st.composite
    def cases(draw):
      hkv = draw(st.sampled_from([1, 2]))
      page_size = draw(st.sampled_from([None, 1, 5, 16, 32]))
      seq_q = draw(st.integers(1, 6))
      return KvCase(
          batch=draw(st.integers(1, 3)), seq_q=seq_q,
          seq_new=draw(st.sampled_from([0, 1, seq_q])),
          heads_kv=hkv, heads_q=hkv * draw(st.sampled_from([1, 2, 4])),
          head_dim=draw(st.sampled_from([16, 32, 64])),
          dtype=draw(st.sampled_from(dtypes)),
          capacity=draw(st.integers(8, 70)), page_size=page_size,
          batch_idx=page_size is None and draw(st.booleans()),
          leftpad=draw(st.booleans()),
          rotary=draw(st.sampled_from([None, "interleaved", "halves"])),
          causal=draw(st.booleans()),
          window=draw(st.sampled_from([None, (4, 0), (2, 3)])),
          logits_soft_cap=draw(st.sampled_from([None, 2.5])),
          sinks=draw(st.sampled_from([0, 1])),
          seed=draw(st.integers(0, 10**6)))

    @conformance.derandomized(caps.hypothesis_examples)
    @given(case=cases())
    def run(case):
      if case.rotary and not case.seq_new:
        case = dataclasses.replace(case, seq_new=1)  # rotary needs new keys
      self.kv_check(case)

    run()
