"""Triton kernels of the triton_gpu platform: forward, dq and dkv.

Inputs are contiguous, padded ``[B, S, H, D]`` arrays addressed directly (no
transposes). Block ranges come from per-block int32 tables ``[B, n, 4]``, built
on the host from the static band and, with segment ids, narrowed per batch
element to the blocks the ids leave visible (common/segments.py), so each program
runs three loops: masked edge blocks, unmasked interior blocks, masked edge
blocks. Softmax runs in base 2 (exp2). The dkv kernel
owns one kv head's block and walks the whole query group, so GQA needs no partial
buffers and no atomics: runs are deterministic.

Bias (fp32) and mask (int8) are read through strides that are 0 on broadcast dims,
so a ``[1, H, 1, Sk]`` bias costs no copy. Dropout recomputes the common hash of
common/dropout.py in uint32 arithmetic (bit-identical to the reference); the seed
operand carries the offsets of the shard's batch and heads and of a ring hop's
rows and keys (``dropout.kernel_seed``).
With a bias, the dq kernel also writes ``ds`` for dbias.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The kernels write log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453
# (common.blocking.LOG2E, LN2) as literals: a @triton.jit body reads no module
# global that is not a tl.constexpr.


@triton.jit
def _fmix(x):
  # MurmurHash3's finaliser on uint32 (common/dropout.py): wrap-around products,
  # logical shifts.
  x = x ^ (x >> 16)
  x = x * 0x85EBCA6B
  x = x ^ (x >> 13)
  x = x * 0xC2B2AE35
  return x ^ (x >> 16)


@triton.jit
def _mix_element(x):
  # common/dropout.mix_element: two multiply-xorshift rounds.
  x = x * 0x9E3779B1
  x = x ^ (x >> 15)
  return x * 0xC2B2AE35


@triton.jit
def _row_keys(Seed, b, h, rows):
  """uint32 key per query row at global (batch, head, row): local ids plus the
  offsets in ``Seed[1:4]`` (``dropout.kernel_seed(..., positions=True)``)."""
  seed = tl.load(Seed).to(tl.uint32, bitcast=True)
  bg = (b + tl.load(Seed + 1)).to(tl.uint32)
  hg = (h + tl.load(Seed + 2)).to(tl.uint32)
  rg = (rows + tl.load(Seed + 3)).to(tl.uint32)
  x = _fmix(seed ^ (bg * 0x9E3779B1))
  x = _fmix(x ^ (hg * 0x85EBCA77))
  return _fmix(x ^ (rg * 0xC2B2AE3D))


@triton.jit
def _keep(Seed, keys, cols, THRESH: tl.constexpr):
  """Keep-mask of row keys and local key positions (broadcast against each
  other); ``Seed[4]`` is the global offset of the keys."""
  cols = cols + tl.load(Seed + 4)
  bits = _mix_element(keys ^ (cols.to(tl.uint32) * 0x27D4EB2F))
  return (bits >> 8).to(tl.int32, bitcast=True) >= THRESH


@triton.jit
def _tanh(x):
  # 1 - 2 / (e^{2x} + 1): exact limits at +-inf, no NaN.
  return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _logits(qk, bias, SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
            HAS_BIAS: tl.constexpr):
  """Base-2 logits of a q.k tile (plus bias) and, with a soft cap, tanh (else 0)."""
  if HAS_BIAS:
    x = qk * SCALE + bias
    if HAS_CAP:
      t = _tanh(x * (1.0 / CAP))
      return t * (CAP * 1.4426950408889634), t
    return x * 1.4426950408889634, x * 0.0
  if HAS_CAP:
    t = _tanh(qk * (SCALE / CAP))
    return t * (CAP * 1.4426950408889634), t
  return qk * (SCALE * 1.4426950408889634), qk * 0.0


@triton.jit
def _tile(ptr, rows, cols, ROW_STRIDE: tl.constexpr, COL_STRIDE: tl.constexpr):
  """A bias or mask tile; strides are 0 on broadcast dims."""
  return tl.load(ptr + rows * ROW_STRIDE + cols * COL_STRIDE)


@triton.jit
def _allowed(rows, cols, q_ids, kv_ids, mask, MASKED: tl.constexpr,
             HAS_SEG: tl.constexpr, HAS_MASK: tl.constexpr, SEQ_K: tl.constexpr,
             HAS_LEFT: tl.constexpr, LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             RIGHT: tl.constexpr, OFFSET: tl.constexpr):
  """Bool tile: band (FA2 bottom-right alignment), key tail, segment ids, the
  mask tile. ``rows`` and ``cols`` broadcast against each other."""
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
  if HAS_MASK:
    ok = ok & (mask != 0)
  return ok


# Constexpr parameters shared by the three kernels (plan.constexprs fills them):
# SQ/SK padded lengths, HQ/HKV heads, D/DV padded head dims, BM/BN tile, SEQ_K real
# key count, SCALE, CAP/HAS_CAP soft cap, HAS_SEG, band (HAS_LEFT, LEFT, HAS_RIGHT,
# RIGHT, OFFSET), HAS_BIAS with element strides BSB/BSH/BSQ/BSK (0 where
# broadcast), HAS_MASK with MSB/MSH/MSQ/MSK, HAS_DROP with THRESH and DROP_SCALE
# (1 / (1 - rate)), PRECISION of fp32 products.


@triton.jit
def _qk(q, K, b, hk, j, SK: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        BN: tl.constexpr, PRECISION: tl.constexpr):
  """q . k^T of kv block j (issued on the tensor cores, awaited where used)."""
  offs_n = j * BN + tl.arange(0, BN)
  kt = tl.load(K + ((b * SK + offs_n[None, :]) * HKV + hk) * D + tl.arange(0, D)[:, None])
  return tl.dot(q, kt, input_precision=PRECISION)


@triton.jit
def _fwd_step(qk, j, m, l, acc, V, KvIds, bias_ptr, mask_ptr, b, hk, offs_m, q_ids,
              keys, Seed, MASKED: tl.constexpr, SK: tl.constexpr, HKV: tl.constexpr,
              DV: tl.constexpr, BN: tl.constexpr, SEQ_K: tl.constexpr,
              SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
              HAS_SEG: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr,
              HAS_BIAS: tl.constexpr, BSQ: tl.constexpr, BSK: tl.constexpr,
              HAS_MASK: tl.constexpr, MSQ: tl.constexpr, MSK: tl.constexpr,
              HAS_DROP: tl.constexpr, THRESH: tl.constexpr, PRECISION: tl.constexpr,
              MULT: tl.constexpr):
  """Online-softmax update of one kv block from its q.k^T tile."""
  offs_n = j * BN + tl.arange(0, BN)
  if HAS_BIAS or HAS_CAP:
    bias = qk
    if HAS_BIAS:
      bias = _tile(bias_ptr, offs_m[:, None], offs_n[None, :], BSQ, BSK)
    s, _ = _logits(qk, bias, SCALE, CAP, HAS_CAP, HAS_BIAS)
  else:
    s = qk  # the scale rides in the exp2 argument (MULT)
  if MASKED or HAS_SEG or HAS_MASK:
    kv_ids = offs_n
    if HAS_SEG:
      kv_ids = tl.load(KvIds + b * SK + offs_n)
    mask = offs_n[None, :]
    if HAS_MASK:
      mask = _tile(mask_ptr, offs_m[:, None], offs_n[None, :], MSQ, MSK)
    ok = _allowed(offs_m[:, None], offs_n[None, :], q_ids[:, None], kv_ids[None, :],
                  mask, MASKED, HAS_SEG, HAS_MASK, SEQ_K, HAS_LEFT, LEFT, HAS_RIGHT,
                  RIGHT, OFFSET)
    s = tl.where(ok, s, float("-inf"))
  m_new = tl.maximum(m, tl.max(s, 1))
  # Rows with nothing allowed yet keep m = -inf: shift by 0 so exp2 gives 0.
  m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
  p = tl.exp2(s * MULT - (m_safe * MULT)[:, None])
  alpha = tl.exp2((m - m_safe) * MULT)
  l = l * alpha + tl.sum(p, 1)
  if HAS_DROP:
    p = tl.where(_keep(Seed, keys[:, None], offs_n[None, :], THRESH), p, 0.0)
  v = tl.load(V + ((b * SK + offs_n[:, None]) * HKV + hk) * DV + tl.arange(0, DV)[None, :])
  acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
  return m_new, l, acc


@triton.jit
def fwd_kernel(Q, K, V, QIds, KvIds, Bias, Mask, Seed, Table, O, Lse,
               SQ: tl.constexpr, SK: tl.constexpr, HQ: tl.constexpr,
               HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, SEQ_K: tl.constexpr,
               SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
               HAS_SEG: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr,
               HAS_BIAS: tl.constexpr, BSB: tl.constexpr, BSH: tl.constexpr,
               BSQ: tl.constexpr, BSK: tl.constexpr, HAS_MASK: tl.constexpr,
               MSB: tl.constexpr, MSH: tl.constexpr, MSQ: tl.constexpr,
               MSK: tl.constexpr, HAS_DROP: tl.constexpr, THRESH: tl.constexpr,
               DROP_SCALE: tl.constexpr, PRECISION: tl.constexpr):
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
  bias_ptr = Bias + b * BSB + h * BSH
  mask_ptr = Mask + b * MSB + h * MSH
  keys = offs_m.to(tl.uint32)
  if HAS_DROP:
    keys = _row_keys(Seed, b, h, offs_m)
  # Without bias or cap the row max is taken on the raw products and the scale
  # rides in the exp2 argument (one FMA per element, not a multiply and a subtract).
  MULT: tl.constexpr = 1.0 if (HAS_BIAS or HAS_CAP) else SCALE * 1.4426950408889634
  m = tl.full([BM], float("-inf"), tl.float32)  # running max (logit units)
  l = tl.zeros([BM], tl.float32)
  acc = tl.zeros([BM, DV], tl.float32)
  for phase in tl.static_range(3):
    lo = tl.load(Table + (b * (SQ // BM) + i) * 4 + phase)
    hi = tl.load(Table + (b * (SQ // BM) + i) * 4 + phase + 1)
    if phase == 1:
      # Interior blocks: issue block j + 1's q.k^T before block j's softmax, so
      # the tensor cores work while the softmax runs (FlashAttention-3's
      # intra-warpgroup overlap); the last block is peeled.
      if hi > lo:
        qk = _qk(q, K, b, hk, lo, SK, HKV, D, BN, PRECISION)
        for j in range(lo, hi - 1):
          qk_next = _qk(q, K, b, hk, j + 1, SK, HKV, D, BN, PRECISION)
          m, l, acc = _fwd_step(
              qk, j, m, l, acc, V, KvIds, bias_ptr, mask_ptr, b, hk, offs_m, q_ids,
              keys, Seed, False, SK, HKV, DV, BN, SEQ_K, SCALE, CAP, HAS_CAP, HAS_SEG,
              HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET, HAS_BIAS, BSQ, BSK, HAS_MASK,
              MSQ, MSK, HAS_DROP, THRESH, PRECISION, MULT)
          qk = qk_next
        m, l, acc = _fwd_step(
            qk, hi - 1, m, l, acc, V, KvIds, bias_ptr, mask_ptr, b, hk, offs_m, q_ids,
            keys, Seed, False, SK, HKV, DV, BN, SEQ_K, SCALE, CAP, HAS_CAP, HAS_SEG,
            HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET, HAS_BIAS, BSQ, BSK, HAS_MASK,
            MSQ, MSK, HAS_DROP, THRESH, PRECISION, MULT)
    else:
      for j in range(lo, hi):
        qk = _qk(q, K, b, hk, j, SK, HKV, D, BN, PRECISION)
        m, l, acc = _fwd_step(
            qk, j, m, l, acc, V, KvIds, bias_ptr, mask_ptr, b, hk, offs_m, q_ids,
            keys, Seed, phase != 1, SK, HKV, DV, BN, SEQ_K, SCALE, CAP, HAS_CAP, HAS_SEG,
            HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET, HAS_BIAS, BSQ, BSK, HAS_MASK,
            MSQ, MSK, HAS_DROP, THRESH, PRECISION, MULT)
  has = l > 0.0
  safe_l = tl.where(has, l, 1.0)
  out = acc / safe_l[:, None]
  if HAS_DROP:
    out = out * DROP_SCALE
  tl.store(O + ((b * SQ + offs_m[:, None]) * HQ + h) * DV + tl.arange(0, DV)[None, :],
           out.to(O.dtype.element_ty))
  m_safe = tl.where(m == float("-inf"), 0.0, m)
  lse = tl.where(has, (m_safe * MULT + tl.log2(safe_l)) * 0.6931471805599453,
                 float("-inf"))
  tl.store(Lse + bh * SQ + offs_m, lse)


@triton.jit
def _p_ds(qk, bias, lse2, dp, delta, ok, SCALE: tl.constexpr, CAP: tl.constexpr,
          HAS_CAP: tl.constexpr, HAS_BIAS: tl.constexpr, MASKED_OR_SEG: tl.constexpr):
  """p and ds (gradient w.r.t. the pre-cap scaled, biased logits) of one tile;
  ``lse2`` and ``delta`` already broadcast to the tile's orientation, ``dp``
  already through dropout."""
  s, t = _logits(qk, bias, SCALE, CAP, HAS_CAP, HAS_BIAS)
  p = tl.exp2(s - lse2)
  if MASKED_OR_SEG:
    p = tl.where(ok, p, 0.0)
  ds = p * (dp - delta)
  if HAS_CAP:
    ds = ds * (1.0 - t * t)
  return p, ds


@triton.jit
def dq_kernel(Q, K, V, DO, Lse, Delta, QIds, KvIds, Bias, Mask, Seed, Table, DQ, DS,
              SQ: tl.constexpr, SK: tl.constexpr, HQ: tl.constexpr,
              HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, SEQ_K: tl.constexpr,
              SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
              HAS_SEG: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr,
              HAS_BIAS: tl.constexpr, BSB: tl.constexpr, BSH: tl.constexpr,
              BSQ: tl.constexpr, BSK: tl.constexpr, HAS_MASK: tl.constexpr,
              MSB: tl.constexpr, MSH: tl.constexpr, MSQ: tl.constexpr,
              MSK: tl.constexpr, HAS_DROP: tl.constexpr, THRESH: tl.constexpr,
              DROP_SCALE: tl.constexpr, PRECISION: tl.constexpr):
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
  bias_ptr = Bias + b * BSB + h * BSH
  mask_ptr = Mask + b * MSB + h * MSH
  keys = offs_m.to(tl.uint32)
  if HAS_DROP:
    keys = _row_keys(Seed, b, h, offs_m)
  dq = tl.zeros([BM, D], tl.float32)
  for phase in tl.static_range(3):
    lo = tl.load(Table + (b * (SQ // BM) + i) * 4 + phase)
    hi = tl.load(Table + (b * (SQ // BM) + i) * 4 + phase + 1)
    for j in range(lo, hi):
      offs_n = j * BN + tl.arange(0, BN)
      kt = tl.load(K + ((b * SK + offs_n[None, :]) * HKV + hk) * D + offs_d[:, None])
      k = tl.trans(kt)
      vt = tl.load(V + ((b * SK + offs_n[None, :]) * HKV + hk) * DV + offs_dv[:, None])
      qk = tl.dot(q, kt, input_precision=PRECISION)
      kv_ids = offs_n
      if HAS_SEG:
        kv_ids = tl.load(KvIds + b * SK + offs_n)
      bias = qk
      if HAS_BIAS:
        bias = _tile(bias_ptr, offs_m[:, None], offs_n[None, :], BSQ, BSK)
      mask = offs_n[None, :]
      if HAS_MASK:
        mask = _tile(mask_ptr, offs_m[:, None], offs_n[None, :], MSQ, MSK)
      ok = _allowed(offs_m[:, None], offs_n[None, :], q_ids[:, None], kv_ids[None, :],
                    mask, (phase != 1), HAS_SEG, HAS_MASK, SEQ_K, HAS_LEFT, LEFT, HAS_RIGHT,
                    RIGHT, OFFSET)
      dp = tl.dot(do, vt, input_precision=PRECISION)
      if HAS_DROP:
        keep = _keep(Seed, keys[:, None], offs_n[None, :], THRESH)
        dp = tl.where(keep, dp * DROP_SCALE, 0.0)
      _, ds = _p_ds(qk, bias, lse2[:, None], dp, delta[:, None], ok, SCALE, CAP,
                    HAS_CAP, HAS_BIAS, (phase != 1) or HAS_SEG or HAS_MASK)
      if HAS_BIAS:
        tl.store(DS + ((b * HQ + h) * SQ + offs_m[:, None]) * SK + offs_n[None, :], ds)
      dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
  tl.store(DQ + ((b * SQ + offs_m[:, None]) * HQ + h) * D + offs_d[None, :],
           (dq * SCALE).to(DQ.dtype.element_ty))


@triton.jit
def dkv_kernel(Q, K, V, DO, Lse, Delta, QIds, KvIds, Bias, Mask, Seed, Table, DK, DV_,
               SQ: tl.constexpr, SK: tl.constexpr, HQ: tl.constexpr,
               HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, SEQ_K: tl.constexpr,
               SCALE: tl.constexpr, CAP: tl.constexpr, HAS_CAP: tl.constexpr,
               HAS_SEG: tl.constexpr, HAS_LEFT: tl.constexpr, LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, RIGHT: tl.constexpr, OFFSET: tl.constexpr,
               HAS_BIAS: tl.constexpr, BSB: tl.constexpr, BSH: tl.constexpr,
               BSQ: tl.constexpr, BSK: tl.constexpr, HAS_MASK: tl.constexpr,
               MSB: tl.constexpr, MSH: tl.constexpr, MSQ: tl.constexpr,
               MSK: tl.constexpr, HAS_DROP: tl.constexpr, THRESH: tl.constexpr,
               DROP_SCALE: tl.constexpr, PRECISION: tl.constexpr):
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
    bias_ptr = Bias + b * BSB + h * BSH
    mask_ptr = Mask + b * MSB + h * MSH
    for phase in tl.static_range(3):
      lo = tl.load(Table + (b * (SK // BN) + j) * 4 + phase)
      hi = tl.load(Table + (b * (SK // BN) + j) * 4 + phase + 1)
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
        bias = qkt
        if HAS_BIAS:
          bias = _tile(bias_ptr, offs_m[None, :], offs_n[:, None], BSQ, BSK)
        mask = offs_n[:, None]
        if HAS_MASK:
          mask = _tile(mask_ptr, offs_m[None, :], offs_n[:, None], MSQ, MSK)
        ok = _allowed(offs_m[None, :], offs_n[:, None], q_ids[None, :],
                      kv_ids[:, None], mask, (phase != 1), HAS_SEG, HAS_MASK, SEQ_K,
                      HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, OFFSET)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if HAS_DROP:
          keep = _keep(Seed, _row_keys(Seed, b, h, offs_m)[None, :], offs_n[:, None],
                       THRESH)
          dpt = tl.where(keep, dpt * DROP_SCALE, 0.0)
        pt, dst = _p_ds(qkt, bias, lse2[None, :], dpt, delta[None, :], ok, SCALE, CAP,
                        HAS_CAP, HAS_BIAS, (phase != 1) or HAS_SEG or HAS_MASK)
        if HAS_DROP:
          pt = tl.where(keep, pt * DROP_SCALE, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)
  tl.store(DK + ((b * SK + offs_n[:, None]) * HKV + hk) * D + offs_d[None, :],
           (dk * SCALE).to(DK.dtype.element_ty))
  tl.store(DV_ + ((b * SK + offs_n[:, None]) * HKV + hk) * DV + offs_dv[None, :],
           dv.to(DV_.dtype.element_ty))
