"""The conformance suite every platform instantiates.

A platform's test module subclasses :class:`ConformanceSuite` (pytest collects
``Test*`` classes, so the base itself never runs), sets ``CAPS`` from the
platform's declared ``CAPABILITIES`` and implements ``attention``::

    class TestXlaCpu(conformance.ConformanceSuite):
      CAPS = conformance.Capabilities.of(xla_cpu.CAPABILITIES, name="xla")

      def attention(self, q, k, v, **kwargs):
        return xla_cpu.flash_attention(q, k, v, **kwargs)

Every case draws random inputs (never zeros), runs the platform and the reference
under ``jit``, and checks the output, the lse and the gradients of
``sum(out * do) + sum(lse * dlse)`` with respect to q, k, v, bias and sinks, then
checks, off the CPU, that a second run is bit-identical. A test's cases run as one
program (``ConformanceSuite.check_cases``), each checked on its own numbers. A case
that uses a feature, dtype or head dim the platform does not declare must raise
``NotImplementedError`` instead: a flag that is off is tested, not skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import zipfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, HealthCheck, strategies as st

from . import reference, tolerances
from .conformance_x64 import X64Cases
from .conformance_packed import KINDS as PACKED_KINDS, PackedSegmentCases
from .conformance_packed import segment_ids as packed_segment_ids
from .conformance_jvp import JvpChecks
from .spec import FEATURES

ALL_DTYPES = ("float32", "bfloat16", "float16")


def derandomized(examples: int):
  """Hypothesis settings of the suites' random cases: derandomized, so CI is
  reproducible (the examples still vary every feature), no deadline, no
  example database."""
  return settings(max_examples=examples, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
  """What a platform declares it does; everything else must raise."""

  name: str
  features: frozenset[str] = frozenset(FEATURES)
  dtypes: tuple[str, ...] = ALL_DTYPES
  head_dim_ok: Callable[[int], bool] = lambda d: d <= 512
  different_v_head_dim: bool = True
  gradients: bool = True
  # Largest sequence length this suite instance runs (interpret modes are slow);
  # longer cases are reported as skipped, never as passed.
  max_seq_len: int = 4096
  hypothesis_examples: int = 12
  # The dtype of cases that name none: a platform without fp32 runs every case in
  # its own dtype, so each feature is checked in numbers, not only for an error.
  default_dtype: str = "float32"
  forward_tol: dict = dataclasses.field(default_factory=dict)
  grad_tol: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, declared, *, name: str, **settings) -> "Capabilities":
    """The flags a platform declares once (its ``CAPABILITIES``, a
    ``common.platform.Capabilities``: features, dtypes, head dims) with this
    suite instance's ``settings`` (sequence limit, examples, tolerances)."""
    return cls(name=name, features=frozenset(declared.features),
               dtypes=tuple(declared.dtypes), head_dim_ok=declared.head_dim_ok,
               **settings)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  batch: int = 1
  seq_q: int = 128
  seq_k: int = 128
  heads_q: int = 4
  heads_kv: int = 2
  head_dim: int = 64
  head_dim_v: int | None = None
  dtype: str | None = None  # None: the platform's Capabilities.default_dtype
  causal: bool = False
  sliding_window: object = None
  segment_ids: str | None = None  # "packed" | "padded" | "disjoint"
  contiguous_segments: bool = False  # passed only when True
  bias_shape: tuple | None = None  # "full" dims written as -1
  bias_dtype: str = "float32"  # or "input": the inputs' dtype
  mask_shape: tuple | None = None
  softmax_scale: float | None = None
  logits_soft_cap: float | None = None
  sinks: int = 0  # 0 none; 1 -> [Hq]; n -> [Hq, n]
  dropout_rate: float = 0.0
  seed: int = 0

  @property
  def features(self) -> set[str]:
    used = {"lse"}
    if self.causal:
      used.add("causal")
    if self.sliding_window is not None:
      used.add("window")
    for name, on in (("segment_ids", self.segment_ids), ("bias", self.bias_shape),
                     ("mask", self.mask_shape), ("soft_cap", self.logits_soft_cap),
                     ("sinks", self.sinks), ("dropout", self.dropout_rate)):
      if on:
        used.add(name)
    return used


def _segments(rng, batch, seq, n, pad):
  """Sorted random segment ids; ``pad`` trailing positions get id -1 - pad_tag."""
  ids = np.zeros((batch, seq), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, max(seq, 2)), size=min(n - 1, max(seq - 1, 0)),
                              replace=False)) if seq > 1 else []
    ids[b] = np.searchsorted(cuts, np.arange(seq), side="right")
  if pad:
    ids[:, seq - pad:] = -1
  return ids


def make_inputs(case: Case):
  """Random arrays and keyword arguments for ``case``.

  Returns ``(diff, const, static)``: differentiable arrays, other arrays, and
  static keyword arguments.
  """
  rng = np.random.default_rng(case.seed)
  dv = case.head_dim_v or case.head_dim
  dt = jnp.dtype(case.dtype or "float32")
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  diff = {
      "q": jnp.asarray(normal(case.batch, case.seq_q, case.heads_q, case.head_dim), dt),
      "k": jnp.asarray(normal(case.batch, case.seq_k, case.heads_kv, case.head_dim), dt),
      "v": jnp.asarray(normal(case.batch, case.seq_k, case.heads_kv, dv), dt),
  }
  full = (case.batch, case.heads_q, case.seq_q, case.seq_k)
  if case.bias_shape is not None:
    shape = tuple(full[4 - len(case.bias_shape) + i] if s == -1 else s
                  for i, s in enumerate(case.bias_shape))
    diff["bias"] = jnp.asarray(normal(*shape),
                               dt if case.bias_dtype == "input" else jnp.float32)
  if case.sinks:
    shape = (case.heads_q,) if case.sinks == 1 else (case.heads_q, case.sinks)
    diff["sinks"] = jnp.asarray(normal(*shape) + 1.0)
  const = {}
  if case.mask_shape is not None:
    shape = tuple(full[4 - len(case.mask_shape) + i] if s == -1 else s
                  for i, s in enumerate(case.mask_shape))
    m = rng.random(shape) < 0.75
    m.reshape(-1, shape[-1])[0, :] = False  # at least one fully masked row
    const["mask"] = jnp.asarray(m)
  if case.segment_ids:
    if case.segment_ids == "packed":  # same segmentation for q and kv (Sq == Sk)
      q_ids = _segments(rng, case.batch, case.seq_q, 3, 0)
      kv_ids = q_ids if case.seq_q == case.seq_k else _segments(
          rng, case.batch, case.seq_k, 3, 0)
    elif case.segment_ids == "padded":  # varlen with padding on both sides
      q_ids = _segments(rng, case.batch, case.seq_q, 2, case.seq_q // 5)
      kv_ids = _segments(rng, case.batch, case.seq_k, 2, case.seq_k // 7)
      q_ids = np.where(q_ids < 0, -2, q_ids)  # q padding matches nothing
    elif case.segment_ids in PACKED_KINDS:  # conformance_packed.py
      q_ids = packed_segment_ids(rng, case.segment_ids, case.batch, case.seq_q)
      kv_ids = q_ids if case.seq_q == case.seq_k else packed_segment_ids(
          rng, case.segment_ids, case.batch, case.seq_k)
    else:  # "disjoint": random ids, many rows match nothing
      q_ids = rng.integers(0, 4, (case.batch, case.seq_q)).astype(np.int32)
      kv_ids = rng.integers(2, 6, (case.batch, case.seq_k)).astype(np.int32)
    const["segment_ids"] = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
  if case.dropout_rate:
    const["dropout_seed"] = jnp.asarray((case.seed * 7919 + 17) % 2**31, jnp.int32)
  static = dict(causal=case.causal, sliding_window=case.sliding_window,
                softmax_scale=case.softmax_scale,
                logits_soft_cap=case.logits_soft_cap, dropout_rate=case.dropout_rate)
  if case.contiguous_segments:
    static["contiguous_segments"] = True
  return diff, const, static


def _objective(fn, const, static, cot, with_lse):
  def objective(diff):
    res = fn(**diff, **const, **static, return_lse=with_lse)
    out, lse = res if with_lse else (res, None)
    loss = jnp.sum(out.astype(jnp.float32) * cot[0])
    if with_lse:
      loss = loss + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * cot[1])
    return loss, (out, lse)
  return objective


# The reference's results by (case, with_lse, grads, x64): every suite instance of a
# process checks many of the same cases, and on the CPU the reference's compile
# is about half a second of each check. Results are numpy arrays, never mutated.
_REFERENCE_RESULTS: dict = {}
# Under pytest-xdist the workers of one run also share them, as files in the
# run's temporary folder (share_reference_results): the same case's tests of
# different instances land on either worker.
_SHARED_REFERENCE_DIR: str | None = None


def _reference_file(key) -> str | None:
  if _SHARED_REFERENCE_DIR is None:
    return None
  name = hashlib.sha256(repr(key).encode()).hexdigest()[:40]
  return os.path.join(_SHARED_REFERENCE_DIR, name + ".npz")


def _kept_reference(key):
  """The reference's results for ``key`` if this process or another worker of
  the run has them, else None."""
  if key not in _REFERENCE_RESULTS and (path := _reference_file(key)):
    try:
      with np.load(path) as f:
        _REFERENCE_RESULTS[key] = {n: f[n] for n in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
      pass  # not there (yet): computed here
  return _REFERENCE_RESULTS.get(key)


def _keep_reference(key, res: dict):
  _REFERENCE_RESULTS[key] = res
  if path := _reference_file(key):
    partial = f"{path}.{os.getpid()}"
    try:
      with open(partial, "wb") as f:
        np.savez(f, **res)
      os.replace(partial, path)  # whole files only, for the other workers
    except OSError:
      pass


def kept_reference(key, compute) -> dict:
  """The reference's results for ``key`` (a dict of fp32 numpy arrays, never
  mutated) that this process or another worker of the run computed, else
  ``compute()``'s, kept. For the suites' other parts (KV cache, jvp)."""
  res = _kept_reference(key)
  if res is None:
    res = compute()
    _keep_reference(key, res)
  return res


def share_reference_results(tmp_path_factory):
  """Under pytest-xdist, a folder of the run's temporary folder (which pytest
  removes with old runs) where the workers share the reference's results."""
  global _SHARED_REFERENCE_DIR
  if _SHARED_REFERENCE_DIR is None and os.environ.get("PYTEST_XDIST_WORKER"):
    # A worker's base folder is popen-gwN inside the run's.
    path = tmp_path_factory.getbasetemp().parent / "flashjax-reference-results"
    path.mkdir(exist_ok=True)
    _SHARED_REFERENCE_DIR = str(path)


def _cotangents(case: Case):
  """Random ``(do, dlse)`` of ``case``: the objective's weights of out and lse."""
  rng = np.random.default_rng(case.seed + 1)
  dv = case.head_dim_v or case.head_dim
  do = jnp.asarray(rng.standard_normal((case.batch, case.seq_q, case.heads_q, dv)),
                   jnp.float32)
  dlse = jnp.asarray(rng.standard_normal((case.batch, case.heads_q, case.seq_q)),
                     jnp.float32)
  return do, dlse


def _as_f32(x) -> np.ndarray:
  return np.asarray(x).astype(np.float32)


def run_cases(fn, cases, *, with_lse: bool, grads: bool, may_vary=None):
  """A list of ``(platform, reference)`` per case of ``cases``, each a dict of
  fp32 numpy arrays. Off the CPU the platform runs twice and must give the
  same bits, except in the gradients that case's entry of ``may_vary`` names
  (by argument name, e.g. ``"bias"``).

  The cases run as one jitted program (and the reference's, for the cases whose
  results are not kept yet, as another). Cases of one shape share most of the
  functions they trace and the loops XLA compiles, which one program lowers and
  compiles once: on the CPU a third to a half less time than one program per
  case. Each case's numbers are its own, as if it ran alone."""
  may_vary = may_vary or [frozenset()] * len(cases)
  inputs = [make_inputs(case) for case in cases]
  cots = [_cotangents(case) for case in cases]
  ref_fn = functools.partial(reference.attention, precision="float32")
  x64 = bool(jax.config.jax_enable_x64)
  ref_keys = [(case, with_lse, grads, x64) for case in cases]

  def program(f, picked):
    objs = [_objective(f, inputs[i][1], inputs[i][2], cots[i], with_lse)
            for i in picked]
    if grads:
      return jax.jit(lambda diffs: [jax.grad(obj, has_aux=True)(d)
                                    for obj, d in zip(objs, diffs)])
    return jax.jit(lambda diffs: [({}, obj(d)[1]) for obj, d in zip(objs, diffs)])

  def results(outs):
    found = []
    for g, (out, lse) in outs:
      res = {"out": out, **{f"d{n}": x for n, x in g.items()}}
      if with_lse:
        res["lse"] = lse
      found.append(res)
    return found

  every = list(range(len(cases)))
  diffs = [inputs[i][0] for i in every]
  run = program(fn, every)
  got = results(run(diffs))
  if jax.default_backend() != "cpu":
    # A second run must be bit-identical (no races, no nondeterministic
    # atomics). On the CPU every platform runs serially (XLA, or a kernel
    # interpreted), so a second run could not differ; it cost a third of
    # the interpret-mode suites' time.
    for first, again, vary in zip(got, results(run(diffs)), may_vary):
      np.testing.assert_array_equal(np.asarray(again["out"]), np.asarray(first["out"]),
                                    err_msg="output differs between two runs")
      for n, x in again.items():
        if not n.startswith("d"):
          continue
        if n[1:] not in vary:
          np.testing.assert_array_equal(np.asarray(x), np.asarray(first[n]),
                                        err_msg=f"{n} differs between two runs")
        else:
          _assert_reordered_sums_agree(x, first[n], n)
  got = [{n: _as_f32(x) for n, x in res.items()} for res in got]

  missing = [i for i in every if _kept_reference(ref_keys[i]) is None]
  if missing:
    outs = program(ref_fn, missing)([inputs[i][0] for i in missing])
    for i, res in zip(missing, results(outs)):
      _keep_reference(ref_keys[i], {n: _as_f32(x) for n, x in res.items()})
  return [(g, _REFERENCE_RESULTS[key]) for g, key in zip(got, ref_keys)]


def _assert_reordered_sums_agree(again, first, name: str):
  """Two runs of a gradient summed by atomic adds in no fixed order: each
  element within 2^-6 of the gradient's largest magnitude (two bf16 ulps there;
  reordered fp32 sums differ in their last bits, a race or a lost add by far
  more)."""
  a, b = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (again, first))
  bound = 2.0 ** -6 * float(np.abs(b).max())
  worst = float(np.abs(a - b).max())
  assert worst <= bound, f"{name} differs between two runs by {worst} > {bound}"


def split_by_subset(items):
  """``(kept, left out)`` of collected test items by their classes'
  ``ConformanceSuite.SUBSET``; a name there that is no test of the class raises,
  so a renamed test cannot silently drop out of an instance."""
  keep, drop = [], []
  for item in items:
    cls = getattr(item, "cls", None)
    subset = getattr(cls, "SUBSET", None)
    if subset is not None:
      unknown = sorted(n for n in subset if not callable(getattr(cls, n, None)))
      if unknown:
        raise ValueError(f"{cls.__name__}.SUBSET names no test: {unknown}")
    (drop if subset is not None and item.originalname not in subset
     else keep).append(item)
  return keep, drop


# (batch, seq_q, seq_k, heads_q, heads_kv, head_dim) of test_shapes, each without
# and with a causal band.
SHAPES = [
    (2, 128, 128, 4, 4, 64),     # MHA
    (1, 1, 1, 2, 1, 64),         # one token, GQA
    (1, 7, 7, 3, 3, 32),         # odd length
    (2, 7, 130, 4, 2, 64),       # Sq < Sk, GQA
    (1, 130, 7, 4, 1, 64),       # Sq > Sk, MQA
    (1, 1, 200, 8, 1, 64),       # decode step
    (2, 4, 300, 8, 2, 64),       # 4-token chunk: 16 rows per kv head
    (1, 16, 300, 2, 2, 64),      # 16-token chunk, MHA: 16 rows per kv head
    (2, 1, 300, 16, 1, 64),      # MQA step: 16 q heads on one kv head
    (1, 1000, 1000, 2, 2, 64),   # long, not a block multiple
    (1, 128, 1000, 4, 2, 64),
    (1, 1000, 128, 2, 1, 64),
]
# A single query row sees every key under a causal band (aligned bottom-right):
# the decode step's causal case stands for the other single-row shapes.
FULL_BAND_CAUSAL = {(1, 1, 1, 2, 1, 64), (2, 1, 300, 16, 1, 64)}
# (name, Case keyword arguments) of test_combinations.
COMBINATIONS = [
    ("causal+window", dict(causal=True, sliding_window=(30, 0))),
    ("causal+segments", dict(causal=True, segment_ids="packed")),
    ("window+segments+mask", dict(sliding_window=(20, 20), segment_ids="padded",
                                  mask_shape=(-1, 1, -1, -1))),
    ("bias+mask+softcap", dict(bias_shape=(1, -1, -1, -1), mask_shape=(-1, -1),
                               logits_soft_cap=3.0)),
    ("sinks+causal+softcap", dict(causal=True, sinks=2, logits_soft_cap=5.0)),
    ("dropout+causal+bias", dict(causal=True, dropout_rate=0.2,
                                 bias_shape=(-1, -1, -1, -1))),
    ("everything", dict(causal=True, sliding_window=(64, 0), segment_ids="packed",
                        bias_shape=(-1, 1, -1, -1), mask_shape=(-1, 1, 1, -1),
                        logits_soft_cap=4.0, sinks=1, dropout_rate=0.15)),
]


class ConformanceSuite(X64Cases, PackedSegmentCases, JvpChecks):
  """Base class; subclasses set ``CAPS`` and implement ``attention``."""

  CAPS: Capabilities
  # The test methods this instance runs, or None for all of them. A platform runs
  # the whole suite in one instance; another instance of it, with other tiles,
  # may name a subset (the conftest deselects the rest): the same kernels with
  # other tiles need the tests whose results depend on the tiling, not every
  # feature and error again.
  SUBSET: frozenset[str] | None = None

  # The tests whose results depend on the tiles: shapes, dtypes and head dims
  # (each picks its own default tiles), random draws of every feature, and
  # features combined at block edges.
  TILING_TESTS = frozenset({"test_shapes", "test_dtypes", "test_head_dims",
                            "test_random_cases", "test_combinations"})

  def attention(self, q, k, v, **kwargs):
    raise NotImplementedError("the platform's test must implement attention()")

  @pytest.fixture(autouse=True)
  def _share_reference_results(self, tmp_path_factory):
    share_reference_results(tmp_path_factory)

  # -- the checking engine ---------------------------------------------------

  def expected_error(self, case: Case) -> str | None:
    caps = self.CAPS
    missing = case.features - set(caps.features)
    if missing:
      return f"features {sorted(missing)}"
    if case.dtype not in caps.dtypes:
      return f"dtype {case.dtype}"
    if not caps.head_dim_ok(case.head_dim) or not caps.head_dim_ok(
        case.head_dim_v or case.head_dim):
      return f"head dim {case.head_dim}"
    if case.head_dim_v not in (None, case.head_dim) and not caps.different_v_head_dim:
      return "head_dim_v != head_dim"
    return None

  def may_vary(self, case: Case) -> frozenset:
    """Gradients of ``case`` (by argument name) whose last bits may differ
    between two runs: atomic adds in no fixed order. Those must agree to
    within a reordered sum's rounding; every other result must be
    bit-identical run to run."""
    return frozenset()

  def resolve(self, case: Case) -> Case:
    """``case`` with its dtype named (the platform's default where it has none)."""
    return dataclasses.replace(case, dtype=case.dtype or self.CAPS.default_dtype)

  def check(self, case: Case):
    """Checks ``case``: its numbers against the reference, or the error it must
    raise. Returns ``(platform, reference)`` results, or None for an error."""
    return self.check_cases([case])[0]

  def check_cases(self, cases):
    """:meth:`check` of each of ``cases``, whose numbers come from one program
    (:func:`run_cases`). Every case is checked; a failure names each failing
    case. Cases longer than the instance's ``max_seq_len`` are left out and the
    test reported as skipped, never as passed."""
    caps = self.CAPS
    cases = [self.resolve(case) for case in cases]
    long = [c for c in cases if max(c.seq_q, c.seq_k) > caps.max_seq_len]
    cases = [c for c in cases if c not in long]
    results = [None] * len(cases)
    run = []
    for i, case in enumerate(cases):
      if self.expected_error(case) is None:
        run.append(i)
        continue
      diff, const, static = make_inputs(case)
      with pytest.raises(NotImplementedError):
        jax.block_until_ready(self.attention(**diff, **const, **static,
                                             return_lse="lse" in caps.features))
    if run:
      picked = [cases[i] for i in run]
      try:
        found = run_cases(self.attention, picked, with_lse="lse" in caps.features,
                          grads=caps.gradients,
                          may_vary=[self.may_vary(c) for c in picked])
      except Exception as e:
        if len(picked) > 1:
          e.add_note(f"{caps.name}: while running {len(picked)} cases together: "
                     f"{picked}")
        raise
      failures = []
      for i, (got, ref) in zip(run, found):
        try:
          self._assert_matches(cases[i], got, ref)
        except AssertionError as e:
          failures.append(f"{cases[i]}:\n{e}")
        results[i] = got, ref
      if failures:
        raise AssertionError("\n\n".join(failures))
    if long:
      pytest.skip(f"{caps.name}: {len(long)} of {len(cases) + len(long)} cases have "
                  f"a sequence length above max_seq_len={caps.max_seq_len} for this "
                  f"suite instance" + (" (the others passed)" if cases else ""))
    return results

  def _assert_matches(self, case: Case, got, ref):
    caps = self.CAPS
    ftol = caps.forward_tol.get(case.dtype, tolerances.forward(case.dtype))
    gtol = caps.grad_tol.get(case.dtype, tolerances.grad(case.dtype))
    for name in ref:
      tol = ftol if name in ("out", "lse") else gtol
      tolerances.assert_close(got[name], ref[name], tol, name=f"{caps.name} {name}")

  # -- shapes ------------------------------------------------------------------
  # Cases of one shape are checked in one program (check_cases), where they
  # share most of what is traced and compiled; cases of different shapes share
  # little, and run one test each where they are many.

  @pytest.mark.parametrize("b,sq,sk,hq,hkv,d", SHAPES)
  def test_shapes(self, b, sq, sk, hq, hkv, d):
    """The shape without and with a causal band, in one program."""
    self.check_cases([Case(batch=b, seq_q=sq, seq_k=sk, heads_q=hq, heads_kv=hkv,
                           head_dim=d, causal=causal, seed=sq * 31 + sk)
                      for causal in (False, True)
                      if not (causal and (b, sq, sk, hq, hkv, d) in FULL_BAND_CAUSAL)])

  def test_head_dims(self):
    self.check_cases([Case(seq_q=96, seq_k=160, heads_q=2, heads_kv=1, head_dim=d,
                           causal=True, seed=d)
                      for d in (32, 64, 80, 96, 128, 192, 256, 512)])

  def test_value_head_dim_differs(self):
    self.check(Case(seq_q=64, seq_k=96, head_dim=64, head_dim_v=128, seed=5))

  def test_dtypes(self):
    """Each dtype over the full band, and the 16-bit ones under a causal band,
    where masked logits meet the dtype's range (the suite's other causal cases
    are fp32)."""
    self.check_cases([Case(seq_q=200, seq_k=333, dtype=dtype, causal=causal, seed=3)
                      for dtype in ALL_DTYPES for causal in (False, True)
                      if dtype != "float32" or not causal])

  def test_softmax_scale(self):
    self.check(Case(seq_q=100, seq_k=100, softmax_scale=0.3, causal=True, seed=8))

  # -- every mask kind alone ---------------------------------------------------

  def test_causal_alignment(self):
    self.check_cases([Case(seq_q=sq, seq_k=sk, causal=True, seed=sq + 2 * sk)
                      for sq, sk in ((200, 200), (300, 170), (170, 300))])

  def test_sliding_window(self):
    self.check_cases([Case(seq_q=190, seq_k=260, sliding_window=window, causal=causal,
                           seed=11)
                      for window, causal in (
                          ((16, 0), False), ((8, 8), False), ((None, 4), False),
                          ((40, -1), False), (32, False), ((20, 5), True),
                          ((0, 0), False))])

  def test_segment_ids(self):
    self.check_cases([Case(batch=2, seq_q=150, seq_k=150 if kind == "packed" else 210,
                           segment_ids=kind, seed=13)
                      for kind in ("packed", "padded", "disjoint")])

  def test_contiguous_segment_ids(self):
    """The promise that each id is one run (packed documents, a trailing
    padding id, documents in any order), under a band or none."""
    self.check_cases([Case(batch=2, seq_q=150, seq_k=210 if kind == "padded" else 150,
                           segment_ids=kind, contiguous_segments=True, seed=19,
                           **band)
                      for kind, band in (("packed", dict(causal=True)),
                                         ("padded", dict(sliding_window=(20, 5))),
                                         ("documents", dict()))])

  def test_bias(self):
    self.check_cases([Case(batch=2, seq_q=90, seq_k=140, bias_shape=shape, seed=17)
                      for shape in ((-1, -1, -1, -1), (1, -1, -1, -1), (-1, -1),
                                    (-1, 1, 1, -1), (-1, 1, -1))])

  def test_bias_in_the_inputs_dtype(self):
    """A bias in the inputs' dtype (how bf16 models pass it; the other cases
    pass fp32), broadcast over eight batch rows under a causal band: dbias
    summed over the batch, where a kernel may sum it itself."""
    self.check(Case(batch=8, seq_q=64, seq_k=96, heads_q=2, heads_kv=1,
                    bias_shape=(1, -1, -1, -1), bias_dtype="input", causal=True,
                    seed=18))

  def test_mask(self):
    self.check_cases([Case(batch=2, seq_q=90, seq_k=140, mask_shape=shape, seed=19)
                      for shape in ((-1, -1, -1, -1), (-1, 1, -1, -1), (-1, 1, 1, -1),
                                    (-1, -1))])

  def test_soft_cap(self):
    self.check(Case(seq_q=120, seq_k=120, logits_soft_cap=2.0, causal=True,
                    softmax_scale=1.0, seed=23))

  def test_sinks(self):
    self.check_cases([Case(seq_q=100, seq_k=150, sinks=n, seed=29) for n in (1, 3)])

  def test_dropout(self):
    self.check_cases([Case(batch=2, seq_q=100, seq_k=150, dropout_rate=rate, seed=31)
                      for rate in (0.1, 0.5)])

  def test_dropout_changes_output_and_depends_on_seed(self):
    if "dropout" not in self.CAPS.features:
      return self.check(Case(dropout_rate=0.2))
    # In the platform's own dtype: Mosaic-GPU has no fp32.
    diff, _, _ = make_inputs(self.resolve(Case(seq_q=64, seq_k=64, seed=37)))
    run = lambda **kw: np.asarray(jnp.asarray(
        self.attention(**diff, **kw), jnp.float32))
    plain = run()
    a = run(dropout_rate=0.3, dropout_seed=1)
    b = run(dropout_rate=0.3, dropout_seed=2)
    assert not np.allclose(a, plain) and not np.allclose(a, b)
    np.testing.assert_array_equal(a, run(dropout_rate=0.3, dropout_seed=1))

  # -- combinations ------------------------------------------------------------

  def test_combinations(self):
    self.check_cases([Case(batch=2, seq_q=160, seq_k=160, seed=len(name), **kwargs)
                      for name, kwargs in COMBINATIONS])

  # -- fully masked rows -------------------------------------------------------

  def test_fully_masked_rows(self):
    cases = [Case(**kwargs, seed=41) for kwargs in (
        dict(causal=True, seq_q=200, seq_k=80),  # first 120 rows see nothing
        dict(segment_ids="disjoint", seq_q=100, seq_k=120),
        dict(mask_shape=(-1, -1), seq_q=64, seq_k=64),
        dict(sliding_window=(3, 0), seq_q=90, seq_k=40),
        dict(causal=True, seq_q=150, seq_k=50, sinks=1),
    )]
    for case, res in zip(cases, self.check_cases(cases)):
      if res is None:
        continue
      got, ref = res
      empty = ~np.isfinite(ref["lse"]) if "lse" in ref else None
      if empty is not None and empty.any():
        # Rows that attend to nothing: exactly 0 and -inf, and zero dq.
        out = np.moveaxis(got["out"], 2, 1)  # [B, Hq, Sq, Dv]
        assert np.all(out[empty] == 0), f"{case}: fully masked rows must give output 0"
        assert np.all(got["lse"][empty] == -np.inf), case
        if "dq" in got:
          dq = np.moveaxis(got["dq"], 2, 1)
          assert np.all(dq[empty] == 0), f"{case}: fully masked rows must give dq = 0"
      for name, x in got.items():
        assert not np.isnan(x).any(), f"{case}: NaN in {name}"

  # -- declared gaps must raise --------------------------------------------------

  @pytest.mark.parametrize("feature", FEATURES)
  def test_each_feature_alone(self, feature):
    if feature in self.CAPS.features:
      # A declared feature's numbers are checked by its own tests above.
      pytest.skip(f"{self.CAPS.name} declares {feature}")
    kwargs = {"causal": dict(causal=True), "window": dict(sliding_window=(24, 3)),
              "segment_ids": dict(segment_ids="packed"),
              "bias": dict(bias_shape=(-1, -1, -1, -1)),
              "mask": dict(mask_shape=(-1, -1, -1, -1)),
              "soft_cap": dict(logits_soft_cap=1.5),
              "sinks": dict(sinks=1), "dropout": dict(dropout_rate=0.25),
              "lse": {}}[feature]
    self.check(Case(batch=2, seq_q=70, seq_k=70, seed=43, **kwargs))

  # -- random cases ----------------------------------------------------------------

  def test_random_cases(self):
    caps = self.CAPS
    limit = min(300, caps.max_seq_len)
    dtypes = [d for d in caps.dtypes if d in ALL_DTYPES]

    @st.composite
    def cases(draw):
      hkv = draw(st.sampled_from([1, 2]))
      return Case(
          batch=draw(st.integers(1, 2)),
          seq_q=draw(st.integers(1, limit)), seq_k=draw(st.integers(1, limit)),
          heads_kv=hkv, heads_q=hkv * draw(st.sampled_from([1, 2, 3])),
          head_dim=draw(st.sampled_from([32, 64, 128])),
          dtype=draw(st.sampled_from(dtypes)),
          causal=draw(st.booleans()),
          sliding_window=draw(st.sampled_from([None, (17, 0), (5, 9), 40])),
          segment_ids=draw(st.sampled_from([None, "padded", "disjoint"])),
          bias_shape=draw(st.sampled_from([None, (-1, -1), (-1, 1, 1, -1)])),
          mask_shape=draw(st.sampled_from([None, (-1, 1, 1, -1)])),
          logits_soft_cap=draw(st.sampled_from([None, 2.5])),
          sinks=draw(st.sampled_from([0, 1])),
          dropout_rate=draw(st.sampled_from([0.0, 0.3])),
          seed=draw(st.integers(0, 10**6)))

    @derandomized(caps.hypothesis_examples)
    @given(case=cases())
    def run(case):
      self.check(case)

    run()
