"""Tolerances per input dtype, for comparing a platform with the reference.

The reference is computed from the *same* (already rounded) inputs in fp32 or fp64,
so the budget only covers the platform's own rounding: its output rounded to the
input dtype (2**-8 relative for bf16, 2**-11 for fp16), probabilities fed to the
second matmul in the input dtype, and fp32 accumulation in a different order.
Gradients go through two more matmuls in the input dtype, hence a wider budget.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tolerance:
  atol: float  # elementwise, together with rtol (np.testing.assert_allclose)
  rtol: float
  rel_l2: float  # ||x - ref|| / ||ref|| over the whole tensor


_FORWARD = {
    "float64": Tolerance(atol=1e-9, rtol=1e-9, rel_l2=1e-10),
    "float32": Tolerance(atol=2e-5, rtol=2e-5, rel_l2=1e-5),
    "float16": Tolerance(atol=4e-3, rtol=4e-3, rel_l2=2e-3),
    "bfloat16": Tolerance(atol=3e-2, rtol=3e-2, rel_l2=1.2e-2),
}
_GRAD = {
    "float64": Tolerance(atol=1e-8, rtol=1e-8, rel_l2=1e-9),
    "float32": Tolerance(atol=1e-4, rtol=1e-4, rel_l2=5e-5),
    "float16": Tolerance(atol=2e-2, rtol=2e-2, rel_l2=6e-3),
    "bfloat16": Tolerance(atol=1e-1, rtol=5e-2, rel_l2=2.5e-2),
}
# TF32 (10-bit mantissa) matmuls on GPU for fp32 inputs: bf16-like inputs rounding
# with fp16-like precision.
TF32_FORWARD = Tolerance(atol=2e-3, rtol=2e-3, rel_l2=1e-3)
TF32_GRAD = Tolerance(atol=1e-2, rtol=1e-2, rel_l2=3e-3)


def forward(dtype) -> Tolerance:
  return _FORWARD[np.dtype(dtype).name if not isinstance(dtype, str) else dtype]


def grad(dtype) -> Tolerance:
  return _GRAD[np.dtype(dtype).name if not isinstance(dtype, str) else dtype]


def rel_l2(x, ref) -> float:
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  denom = np.linalg.norm(ref)
  return float(np.linalg.norm(x - ref) / (denom if denom > 0 else 1.0))


def assert_close(x, ref, tol: Tolerance, *, name: str = "value"):
  """Elementwise and relative-L2 check; NaN never passes; -inf must match."""
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  if x.shape != ref.shape:
    raise AssertionError(f"{name}: shape {x.shape} != reference {ref.shape}")
  if np.isnan(x).any():
    raise AssertionError(f"{name}: {int(np.isnan(x).sum())} NaN values")
  inf_x, inf_r = np.isinf(x), np.isinf(ref)
  if not np.array_equal(inf_x, inf_r) or not np.array_equal(x[inf_x], ref[inf_r]):
    raise AssertionError(f"{name}: infinities differ from the reference "
                         f"({int(inf_x.sum())} vs {int(inf_r.sum())})")
  fx, fr = np.where(inf_x, 0, x), np.where(inf_r, 0, ref)
  np.testing.assert_allclose(fx, fr, atol=tol.atol, rtol=tol.rtol,
                             err_msg=f"{name} differs from the reference")
  err = rel_l2(fx, fr)
  if err > tol.rel_l2:
    raise AssertionError(f"{name}: relative L2 error {err:.3g} > {tol.rel_l2:.3g}")


def assert_matches(x, one, ref, tol: Tolerance, *, name: str):
  """``x``, a split or sharded call's result, against the same call on one device
  (``one``) and against the reference: :func:`assert_close` of each."""
  assert_close(x, one, tol, name=f"{name} vs one device")
  assert_close(x, ref, tol, name=f"{name} vs ref")
