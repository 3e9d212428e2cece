"""Forward-mode (``jax.jvp``) cases of the conformance suite.

:class:`JvpChecks` is a mixin of ``conformance.ConformanceSuite``, so every
platform instance runs these cases: random inputs and random tangents of q, k, v,
bias and sinks, ``jax.jvp`` of the platform against ``jax.jvp`` of the dense
reference, on the output and the lse, under ``jit``. A case that uses a feature,
dtype or head dim the platform does not declare must raise ``NotImplementedError``,
as in the rest of the suite. Shapes are small: the tangent is the common blockwise
one on every platform, and the forward kernels are covered by the main suite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from . import reference, tolerances


def _tangents(diff: dict, seed: int) -> dict:
  rng = np.random.default_rng(seed + 2)
  return {n: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32), x.dtype)
          for n, x in diff.items()}


def run_jvp(fn, case, *, with_lse: bool):
  """``(platform, reference)`` dicts of numpy fp32 arrays: ``out``, ``lse`` and
  their tangents ``t_out``, ``t_lse``."""
  from .conformance import kept_reference, make_inputs
  diff, const, static = make_inputs(case)
  tangents = _tangents(diff, case.seed)
  ref_fn = functools.partial(reference.attention, precision="float32")

  def run(f):
    call = lambda d: f(**d, **const, **static, return_lse=with_lse)
    primal, tangent = jax.jit(lambda d, t: jax.jvp(call, (d,), (t,)))(
        diff, tangents)
    res = {"out": primal, "t_out": tangent}
    if with_lse:
      res = {"out": primal[0], "t_out": tangent[0], "lse": primal[1],
             "t_lse": tangent[1]}
    return {n: np.asarray(x).astype(np.float32) for n, x in res.items()}

  # Every instance checks the same cases: the reference's results are kept.
  x64 = bool(jax.config.jax_enable_x64)
  return run(fn), kept_reference(("jvp", case, with_lse, x64), lambda: run(ref_fn))


# (name, Case keyword arguments): every feature of the contract and every dtype,
# in few cases (each costs two compilations on CPU). The first needs only what the
# Mosaic-GPU platform declares (bf16/fp16, causal, window, soft cap, sinks, lse).
JVP_CASES = [
    ("bf16+gqa+causal+window+softcap+sinks",
     dict(seq_q=40, seq_k=56, heads_q=4, heads_kv=2, dtype="bfloat16", causal=True,
          sliding_window=(24, 0), logits_soft_cap=2.0, sinks=2)),
    ("fp32+mqa+segments+bias+mask+dropout",
     dict(batch=2, seq_q=48, seq_k=64, heads_q=2, heads_kv=1, segment_ids="padded",
          bias_shape=(1, -1, -1, -1), mask_shape=(-1, 1, -1, -1), dropout_rate=0.25)),
]


class JvpChecks:
  """Mixin: forward-mode cases on ``self.attention`` (needs ``CAPS``,
  ``expected_error`` and ``attention`` of ``ConformanceSuite``)."""

  def check_jvp(self, case):
    from .conformance import make_inputs
    caps = self.CAPS
    case = self.resolve(case)
    if max(case.seq_q, case.seq_k) > caps.max_seq_len:
      pytest.skip(f"{caps.name}: sequence length above max_seq_len="
                  f"{caps.max_seq_len} for this suite instance")
    with_lse = "lse" in caps.features
    if self.expected_error(case) is not None:
      diff, const, static = make_inputs(case)
      call = lambda d: self.attention(**d, **const, **static, return_lse=with_lse)
      with pytest.raises(NotImplementedError):
        jax.block_until_ready(jax.jvp(call, (diff,), (_tangents(diff, case.seed),)))
      return None
    got, ref = run_jvp(self.attention, case, with_lse=with_lse)
    ftol = caps.forward_tol.get(case.dtype, tolerances.forward(case.dtype))
    gtol = caps.grad_tol.get(case.dtype, tolerances.grad(case.dtype))
    for name in ref:
      tol = gtol if name.startswith("t_") else ftol
      tolerances.assert_close(got[name], ref[name], tol,
                              name=f"{caps.name} jvp {name}")
    return got, ref

  @pytest.mark.parametrize("name,kwargs", JVP_CASES, ids=[c[0] for c in JVP_CASES])
  def test_jvp(self, name, kwargs):
    from .conformance import Case
    self.check_jvp(Case(seed=len(name) + 100, head_dim=32, **kwargs))

  def test_jvp_fully_masked_rows(self):
    from .conformance import Case
    # Causal with Sq > Sk: the first 28 rows see nothing; a window (4, 0) keeps
    # the others short. Zero tangents there, and no NaN anywhere.
    case = Case(seq_q=48, seq_k=20, heads_q=2, heads_kv=1, head_dim=32,
                dtype="float16", causal=True, sliding_window=(4, 0), seed=47)
    res = self.check_jvp(case)
    if res is None:
      return
    got, ref = res
    for name, x in got.items():
      assert not np.isnan(x).any(), f"NaN in {name}"
    if "lse" not in ref:
      return
    empty = ~np.isfinite(ref["lse"])
    assert empty.any() and not empty.all()
    t_out = np.moveaxis(got["t_out"], 2, 1)  # [B, Hq, Sq, Dv]
    assert np.all(t_out[empty] == 0), "fully masked rows must have zero tangent"
    assert np.all(got["t_lse"][empty] == 0)
    assert np.abs(got["t_out"]).max() > 0, "the tangent of the other rows is not 0"
