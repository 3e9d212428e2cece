"""Triton kernels of the triton_gpu platform: forward, dq and dkv.

Inputs are contiguous, padded ``[B, S, H, D]`` arrays addressed directly (no
transposes). Block ranges come from per-block int32 tables built on the host from
the static band, so each program runs three loops: masked edge blocks, unmasked
interior blocks, masked edge blocks. Softmax runs in base 2 (exp2). The dkv kernel
owns one kv head's block and walks the whole query group, so GQA needs no partial
buffers and no atomics: runs are deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tanh(x):
  # 1 - 2 / (e^{2x} + 1): exact limits at +-inf, no NaN.
  return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _logits(qk, SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr):
  """Base-2 logits of a q.k tile and, with a soft cap, tanh (else 0)."""
  if HAS_CAP:
    t = _tanh(qk * (SCALE / CAP))
    return t * (CAP * 1.4426950408889634), t
  return qk * (SCALE * 1.4426950408889634), qk * 0.0


@triton.jit
def _allowed(rows, cols, q_ids, kv_ids, MASKED: tl.constexpr, HAS_SEG: tl.constexpr,
             SEQ_K: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
             HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr):
  """Bool tile: band (FA2 bottom-right alignment), key tail, segment ids. ``rows``
  and ``cols`` broadcast against each other."""
  ok = (rows >= 0) & (cols >= 0)
  if MASKED:
    d = cols - (rows + OFFSET)
    ok = ok & (cols < SEQ_K)
    if HAS_LEFT:
      ok = ok & (d >= -LEFT)
    if HAS_RIGHT:
      ok = ok & (d <= RIGHT)
  if HAS_SEG:
    ok = ok & (q_ids == kv_ids)
  return ok


@triton.jit
def _fwd_step(j, acc, m, l, q, q_ids, K, V, KvIds, b, hk, offs_m,
              SK: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
              BN: tl.constexpr, SEQ_K: tl.constexpr, SCALE: tl.constexpr,
              CAP: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SEG: tl.constexpr,
              MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr,
              PRECISION: tl.constexpr):
  offs_n = j * BN + tl.arange(0, BN)
  kt = tl.load(K + ((b * SK + offs_n[None, :]) * HKV + hk) * D + tl.arange(0, D)[:, None])
  qk = tl.dot(q, kt, input_precision=PRECISION)
  s, _ = _logits(qk, SCALE, CAP, HAS_CAP)
  if MASKED or HAS_SEG:
    kv_ids = offs_n
    if HAS_SEG:
      kv_ids = tl.load(KvIds + b * SK + offs_n)
    ok = _allowed(offs_m[:, None], offs_n[None, :], q_ids[:, None], kv_ids[None, :],
                  MASKED, HAS_SEG, SEQ_K, HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET)
    s = tl.where(ok, s, float("-inf"))
  m_new = tl.maximum(m, tl.max(s, 1))
  # Rows with nothing allowed yet keep m = -inf: shift by 0 so exp2 gives 0.
  m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
  p = tl.exp2(s - m_safe[:, None])
  alpha = tl.exp2(m - m_safe)
  l = l * alpha + tl.sum(p, 1)
  v = tl.load(V + ((b * SK + offs_n[:, None]) * HKV + hk) * DV + tl.arange(0, DV)[None, :])
  acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
  return acc, m_new, l


@triton.jit
def fwd_kernel(Q, K, V, QIds, KvIds, Table, O, Lse,
               SQ: tl.constexpr, SK: tl.constexpr, HQ: tl.constexpr,
               HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, SEQ_K: tl.constexpr,
               SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
               HAS_SEG: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr,
               PRECISION: tl.constexpr):
  i = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // HQ
  h = bh % HQ
  hk = h // (HQ // HKV)
  offs_m = i * BM + tl.arange(0, BM)
  q = tl.load(Q + ((b * SQ + offs_m[:, None]) * HQ + h) * D + tl.arange(0, D)[None, :])
  q_ids = offs_m
  if HAS_SEG:
    q_ids = tl.load(QIds + b * SQ + offs_m)
  lo = tl.load(Table + i * 4)
  a = tl.load(Table + i * 4 + 1)
  bb = tl.load(Table + i * 4 + 2)
  hi = tl.load(Table + i * 4 + 3)
  m = tl.full([BM], float("-inf"), tl.float32)
  l = tl.zeros([BM], tl.float32)
  acc = tl.zeros([BM, DV], tl.float32)
  for j in range(lo, a):
    acc, m, l = _fwd_step(j, acc, m, l, q, q_ids, K, V, KvIds, b, hk, offs_m, SK, HKV,
                          D, DV, BN, SEQ_K, SCALE, CAP, HAS_CAP, HAS_SEG, True,
                          HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET, PRECISION)
  for j in range(a, bb):
    acc, m, l = _fwd_step(j, acc, m, l, q, q_ids, K, V, KvIds, b, hk, offs_m, SK, HKV,
                          D, DV, BN, SEQ_K, SCALE, CAP, HAS_CAP, HAS_SEG, False,
                          HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET, PRECISION)
  for j in range(bb, hi):
    acc, m, l = _fwd_step(j, acc, m, l, q, q_ids, K, V, KvIds, b, hk, offs_m, SK, HKV,
                          D, DV, BN, SEQ_K, SCALE, CAP, HAS_CAP, HAS_SEG, True,
                          HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET, PRECISION)
  has = l > 0.0
  safe_l = tl.where(has, l, 1.0)
  out = acc / safe_l[:, None]
  tl.store(O + ((b * SQ + offs_m[:, None]) * HQ + h) * DV + tl.arange(0, DV)[None, :],
           out.to(O.dtype.element_ty))
  m_safe = tl.where(m == float("-inf"), 0.0, m)
  lse = tl.where(has, (m_safe + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))
  tl.store(Lse + bh * SQ + offs_m, lse)


@triton.jit
def _p_ds(qk, lse2, dp, delta, ok, SCALE: tl.constexpr, CAP: tl.constexpr,
          HAS_CAP: tl.constexpr, MASKED_OR_SEG: tl.constexpr):
  """p and ds (gradient w.r.t. the pre-cap scaled logits) of one tile; ``lse2``
  and ``delta`` already broadcast to the tile's orientation."""
  s, t = _logits(qk, SCALE, CAP, HAS_CAP)
  p = tl.exp2(s - lse2)
  if MASKED_OR_SEG:
    p = tl.where(ok, p, 0.0)
  ds = p * (dp - delta)
  if HAS_CAP:
    ds = ds * (1.0 - t * t)
  return p, ds


@triton.jit
def dq_kernel(Q, K, V, DO, Lse, Delta, QIds, KvIds, Table, DQ,
              SQ: tl.constexpr, SK: tl.constexpr, HQ: tl.constexpr,
              HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, SEQ_K: tl.constexpr,
              SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
              HAS_SEG: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr,
              PRECISION: tl.constexpr):
  i = tl.program_id(0)
  bh = tl.program_id(1)
  b = bh // HQ
  h = bh % HQ
  hk = h // (HQ // HKV)
  offs_m = i * BM + tl.arange(0, BM)
  offs_d = tl.arange(0, D)
  offs_dv = tl.arange(0, DV)
  q = tl.load(Q + ((b * SQ + offs_m[:, None]) * HQ + h) * D + offs_d[None, :])
  do = tl.load(DO + ((b * SQ + offs_m[:, None]) * HQ + h) * DV + offs_dv[None, :])
  lse2 = tl.load(Lse + bh * SQ + offs_m) * 1.4426950408889634
  delta = tl.load(Delta + bh * SQ + offs_m)
  q_ids = offs_m
  if HAS_SEG:
    q_ids = tl.load(QIds + b * SQ + offs_m)
  dq = tl.zeros([BM, D], tl.float32)
  for phase in tl.static_range(3):
    lo = tl.load(Table + i * 4 + phase)
    hi = tl.load(Table + i * 4 + phase + 1)
    for j in range(lo, hi):
      offs_n = j * BN + tl.arange(0, BN)
      kt = tl.load(K + ((b * SK + offs_n[None, :]) * HKV + hk) * D + offs_d[:, None])
      k = tl.trans(kt)
      vt = tl.load(V + ((b * SK + offs_n[None, :]) * HKV + hk) * DV + offs_dv[:, None])
      qk = tl.dot(q, kt, input_precision=PRECISION)
      kv_ids = offs_n
      if HAS_SEG:
        kv_ids = tl.load(KvIds + b * SK + offs_n)
      ok = _allowed(offs_m[:, None], offs_n[None, :], q_ids[:, None], kv_ids[None, :],
                    phase != 1, HAS_SEG, SEQ_K, HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET)
      dp = tl.dot(do, vt, input_precision=PRECISION)
      _, ds = _p_ds(qk, lse2[:, None], dp, delta[:, None], ok, SCALE, CAP, HAS_CAP,
                    (phase != 1) or HAS_SEG)
      dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
  tl.store(DQ + ((b * SQ + offs_m[:, None]) * HQ + h) * D + offs_d[None, :],
           (dq * SCALE).to(DQ.dtype.element_ty))


@triton.jit
def dkv_kernel(Q, K, V, DO, Lse, Delta, QIds, KvIds, Table, DK, DV_,
               SQ: tl.constexpr, SK: tl.constexpr, HQ: tl.constexpr,
               HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, SEQ_K: tl.constexpr,
               SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
               HAS_SEG: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr,
               PRECISION: tl.constexpr):
  j = tl.program_id(0)
  bhk = tl.program_id(1)
  b = bhk // HKV
  hk = bhk % HKV
  G: tl.constexpr = HQ // HKV
  offs_n = j * BN + tl.arange(0, BN)
  offs_d = tl.arange(0, D)
  offs_dv = tl.arange(0, DV)
  k = tl.load(K + ((b * SK + offs_n[:, None]) * HKV + hk) * D + offs_d[None, :])
  v = tl.load(V + ((b * SK + offs_n[:, None]) * HKV + hk) * DV + offs_dv[None, :])
  kv_ids = offs_n
  if HAS_SEG:
    kv_ids = tl.load(KvIds + b * SK + offs_n)
  dk = tl.zeros([BN, D], tl.float32)
  dv = tl.zeros([BN, DV], tl.float32)
  for g in range(G):
    h = hk * G + g
    for phase in tl.static_range(3):
      lo = tl.load(Table + j * 4 + phase)
      hi = tl.load(Table + j * 4 + phase + 1)
      for i in range(lo, hi):
        offs_m = i * BM + tl.arange(0, BM)
        q = tl.load(Q + ((b * SQ + offs_m[:, None]) * HQ + h) * D + offs_d[None, :])
        do = tl.load(DO + ((b * SQ + offs_m[:, None]) * HQ + h) * DV + offs_dv[None, :])
        lse2 = tl.load(Lse + (b * HQ + h) * SQ + offs_m) * 1.4426950408889634
        delta = tl.load(Delta + (b * HQ + h) * SQ + offs_m)
        q_ids = offs_m
        if HAS_SEG:
          q_ids = tl.load(QIds + b * SQ + offs_m)
        # Transposed tiles [BN, BM]: keys down, queries across.
        qkt = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        ok = _allowed(offs_m[None, :], offs_n[:, None], q_ids[None, :],
                      kv_ids[:, None], phase != 1, HAS_SEG, SEQ_K, HAS_LEFT, LEFT,
                      HAS_RIGHT, RIGHT, OFFSET)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        pt, dst = _p_ds(qkt, lse2[None, :], dpt, delta[None, :], ok, SCALE, CAP,
                        HAS_CAP, (phase != 1) or HAS_SEG)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
  tl.store(DK + ((b * SK + offs_n[:, None]) * HKV + hk) * D + offs_d[None, :],
           (dk * SCALE).to(DK.dtype.element_ty))
  tl.store(DV_ + ((b * SK + offs_n[:, None]) * HKV + hk) * DV + offs_dv[None, :],
           dv.to(DV_.dtype.element_ty))
