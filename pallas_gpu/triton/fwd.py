"""Pallas-Triton forward kernel: grid (q blocks, B, Hq), one program per q tile
(or per pair of q tiles for causal bands, TritonForward.fold_causal), online
softmax in base 2 over the kv tiles the band reaches.

The kv loop runs in three stages: edge tiles that the band (or the padded key
tail) cuts need the positional mask, interior tiles do not, so most of a causal or
windowed problem runs the unmasked loop (FlashAttention-2's split of the causal
loop). Tiles are read straight from the [B, S, H, D] inputs (the head axis is a
squeezed block dim), so no transpose is materialised.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...common import dropout
from ...common.blocking import LN2, LOG2E
from . import plan as tp
from .. import split_tail, tail_merge


def tiles(r: dict, plan: tp.Plan, i, j, bq: int, bk: int):
  """Bias, mask and kv segment-id tiles of block (i, j) (None when absent)."""
  out = {}
  for name in ("bias", "mask"):
    if name in r:
      ref = r[name]
      rows = pl.ds(i * bq, bq) if ref.shape[0] > 1 else pl.ds(0, 1)
      cols = pl.ds(j * bk, bk) if ref.shape[1] > 1 else pl.ds(0, 1)
      out[name] = ref[rows, cols]
  out["kv_ids"] = r["kv_ids"][pl.ds(j * bk, bk)] if "kv_ids" in r else None
  return out


def stages(plan: tp.Plan, lo, lo_full, hi_full, hi, body, carry):
  """Runs ``body(j, carry, positional)`` over [lo, hi), masking only edge tiles."""
  if plan.spec.band.is_full and plan.seq_k_padded == plan.spec.seq_k:
    return jax.lax.fori_loop(lo, hi, functools.partial(body, positional=False), carry)
  carry = jax.lax.fori_loop(lo, lo_full, functools.partial(body, positional=True),
                            carry)
  carry = jax.lax.fori_loop(lo_full, hi_full,
                            functools.partial(body, positional=False), carry)
  return jax.lax.fori_loop(hi_full, hi, functools.partial(body, positional=True),
                           carry)


def folds(plan: tp.Plan, fold_causal: bool) -> bool:
  """Whether the forward pairs q blocks (TritonForward.fold_causal): only for a
  causal band, where q block i reaches i + 1 kv tiles and the pairs balance."""
  band = plan.spec.band
  return (fold_causal and band.left is None and band.right is not None
          and plan.num_q_blocks > 1)


def _program_coords(plan: tp.Plan, p):
  """Program ``p`` of the 3-D grid in launch order (q blocks fastest) -> (i, b, h)."""
  n = plan.num_q_blocks
  bh = p // n
  return p % n, bh % plan.spec.batch, bh // plan.spec.batch


def _kernel(*refs, plan: tp.Plan, names, fold: bool, tail):
  r = dict(zip(names, refs))
  if tail is not None:
    whole, p, part = split_tail.unit(tail, pl.program_id(0))
    i, b, h = _program_coords(plan, p)
    pl.when(whole)(lambda: _q_block(r, plan, i, False, b, h))
    pl.when(~whole)(lambda: _q_block(r, plan, i, False, b, h,
                                     part=(part, tail.parts)))
    return
  # Program ids are read here: the interpreter cannot lower them inside pl.when.
  p, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block = functools.partial(_q_block, r, plan, b=b, h=h, sliced=fold)
  if not fold:
    block(p)
    return
  # Heaviest block first: on an H200 that order, not the light-first one,
  # gave the long-key gain (2026-11-22, docs/BENCHMARKS.md).
  n = plan.num_q_blocks
  block(n - 1 - p)
  if n % 2:
    @pl.when(p != n - 1 - p)  # the middle block of an odd count runs once
    def _():
      block(p)
  else:
    block(p)


def _q_block(r: dict, plan: tp.Plan, i, sliced: bool, b, h, part=None):
  """Output and lse rows of q block i. ``sliced``: the q/o/lse/q_ids refs hold
  the whole sequence (folded launch), else just this block. ``part = (index,
  parts)``: only that share of the block's key tiles, written as fp32 partials
  (split_tail.py) instead of the output."""
  spec = plan.spec
  bq, bk = plan.block_q, plan.block_kv
  rows = pl.ds(i * bq, bq) if sliced else slice(None)
  q = r["q"][rows, :]
  q_ids = r["q_ids"][rows] if "q_ids" in r else None
  seed = r.get("seed")

  # Without bias or cap the row max is taken on the raw products and the scale
  # rides in the exp2 argument (one FMA per element instead of a multiply and a
  # subtract).
  raw = "bias" not in r and spec.logits_soft_cap is None
  mult = spec.softmax_scale * LOG2E if raw else 1.0

  def body(j, carry, positional):
    acc, m, l = carry
    t = tiles(r, plan, i, j, bq, bk)
    k = r["k"][pl.ds(j * bk, bk), :]
    v = r["v"][pl.ds(j * bk, bk), :]
    if raw:
      s = tp.dot(q, k, plan, trans_b=True)
    else:
      s, _ = tp.logits2(plan, q, k, t.get("bias"))
    ok = tp.allowed(plan, i, j, positional, q_ids, t["kv_ids"], t.get("mask"))
    if ok is not None:
      s = jnp.where(ok, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    # A row with nothing allowed yet keeps m = -inf; shift by 0 so exp2 gives 0.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = tp.exp2(s * mult - (m_safe * mult)[:, None], plan)
    alpha = tp.exp2((m - m_safe) * mult, plan)
    l = l * alpha + p.sum(axis=1)
    if seed is not None:
      p = jnp.where(tp.dropout_keep(plan, seed, b, h, i, j), p, 0.0)
    acc = acc * alpha[:, None] + tp.dot(p.astype(v.dtype), v, plan)
    return acc, m_new, l

  init = (jnp.zeros((bq, plan.head_dim_v_padded), jnp.float32),
          jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
  lo, lo_full, hi_full, hi = tp.narrow_to_segments(r, plan.kv_ranges(i), i)
  if part is not None:
    lo, hi = split_tail.key_range(lo, hi, *part)
    lo_full, hi_full = (jnp.clip(x, lo, hi) for x in (lo_full, hi_full))
  acc, m, l = stages(plan, lo, lo_full, hi_full, hi, body, init)
  if part is not None:
    r["part_acc"][...] = acc
    r["part_m"][...] = jnp.where(m == -jnp.inf, -jnp.inf, m * mult)
    r["part_l"][...] = l
    return
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  out = acc / safe_l[:, None]
  if spec.dropout_rate > 0:
    out = out * dropout.keep_scale(spec.dropout_rate)
  r["o"][rows, :] = out.astype(r["o"].dtype)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  r["lse"][rows] = jnp.where(nonempty, (m_safe * mult + jnp.log2(safe_l)) * LN2,
                             -jnp.inf)


def in_specs(x: tp.KernelOperands, plan: tp.Plan, q_map, kv_map, bh_map):
  """Block specs of the operands every kernel reads whole-sequence: (name, spec,
  array) for bias, mask, ids and seed; q/k/v are the caller's."""
  out = []
  for name in ("bias", "mask"):
    arr = getattr(x, name)
    if arr is not None:
      shape = arr.shape
      out.append((name, pl.BlockSpec(
          (None, None, shape[2], shape[3]),
          lambda *g, shape=shape: tuple(
              idx if n > 1 else 0 for idx, n in zip(bh_map(*g), shape[:2])) + (0, 0)),
          arr))
  if x.q_ids is not None:
    out.append(("q_ids", q_map, x.q_ids))
    out.append(("kv_ids", kv_map, x.kv_ids))
  if x.seed is not None:
    out.append(("seed", pl.BlockSpec((8,), lambda *g: (0,)), x.seed))
  return out


def segment_specs(visible, batch_map):
  """(name, spec, array) of the visible-range tables (whole rows per batch)."""
  if visible is None:
    return []
  n = visible[0].shape[1]
  return [(name, pl.BlockSpec((None, n), batch_map), arr)
          for name, arr in zip(("seg_lo", "seg_hi"), visible)]


def splits_tail(plan: tp.Plan, fold: bool, slots: int):
  """The key split of the last wave (TritonForward.split_tail), or None: only for
  equal programs (the full band, unfolded) without dropout, whose 1/(1 - rate)
  scaling the partials would skip."""
  if fold or not plan.spec.band.is_full or plan.spec.dropout_rate > 0:
    return None
  programs = plan.num_q_blocks * plan.spec.batch * plan.spec.heads_q
  return split_tail.plan(programs, slots, plan.num_kv_blocks)


def forward(x: tp.KernelOperands, plan: tp.Plan, cfg: tp.KernelConfig, interpret,
            fold_causal: bool = False, tail_slots: int = 0, visible=None):
  """``out [B, Sqp, Hq, Dvp]`` (input dtype), ``lse [B, Hq, Sqp]`` (fp32, rows
  only, no sinks). ``tail_slots``: programs that run at once, > 0 to split the
  last wave along the keys (split_tail.py). ``visible``: per q block, the kv
  blocks segment ids leave (tp.visible_blocks), or None."""
  spec = plan.spec
  bq, g = plan.block_q, spec.group_size
  dp, dvp = plan.head_dim_padded, plan.head_dim_v_padded
  sqp, skp = plan.seq_q_padded, plan.seq_k_padded
  fold = folds(plan, fold_causal)
  tail = splits_tail(plan, fold, tail_slots)
  # A folded program reaches two q blocks, so its q-side blocks span the sequence.
  rq = sqp if fold else bq
  qi = (lambda i: 0) if fold else (lambda i: i)
  if tail is None:
    coords = lambda i, b, h: (i, b, h)
  else:  # one grid axis of units (split_tail.unit)
    coords = lambda t: _program_coords(plan, split_tail.unit(tail, t)[1])

  def index(fn):
    return lambda *grid: fn(*coords(*grid))

  specs = [
      ("q", pl.BlockSpec((None, rq, None, dp), index(lambda i, b, h: (b, qi(i), h, 0))),
       x.q),
      ("k", pl.BlockSpec((None, skp, None, dp), index(lambda i, b, h: (b, 0, h // g, 0))),
       x.k),
      ("v", pl.BlockSpec((None, skp, None, dvp),
                         index(lambda i, b, h: (b, 0, h // g, 0))), x.v),
  ] + in_specs(x, plan,
               pl.BlockSpec((None, rq), index(lambda i, b, h: (b, qi(i)))),
               pl.BlockSpec((None, skp), index(lambda i, b, h: (b, 0))),
               index(lambda i, b, h: (b, h)))
  specs += segment_specs(visible, index(lambda i, b, h: (b, 0)))
  names = [n for n, _, _ in specs] + ["o", "lse"]
  out_shape = [jax.ShapeDtypeStruct((spec.batch, sqp, spec.heads_q, dvp), x.q.dtype),
               jax.ShapeDtypeStruct((spec.batch, spec.heads_q, sqp), jnp.float32)]
  out_specs = [pl.BlockSpec((None, rq, None, dvp),
                            index(lambda i, b, h: (b, qi(i), h, 0))),
               pl.BlockSpec((None, None, rq), index(lambda i, b, h: (b, h, qi(i))))]
  n = plan.num_q_blocks
  grid = ((n + 1) // 2 if fold else n, spec.batch, spec.heads_q)
  if tail is not None:
    grid = (tail.units,)
    part = lambda t: split_tail.part_of(tail, t)
    names += ["part_acc", "part_m", "part_l"]
    rows = (tail.count, tail.parts, bq)
    out_shape += [jax.ShapeDtypeStruct(rows + (dvp,), jnp.float32),
                  jax.ShapeDtypeStruct(rows, jnp.float32),
                  jax.ShapeDtypeStruct(rows, jnp.float32)]
    out_specs += [pl.BlockSpec((None, None, bq, dvp), lambda t: (*part(t), 0, 0)),
                  pl.BlockSpec((None, None, bq), lambda t: (*part(t), 0)),
                  pl.BlockSpec((None, None, bq), lambda t: (*part(t), 0))]
  outs = pl.pallas_call(
      functools.partial(_kernel, plan=plan, names=names, fold=fold, tail=tail),
      grid=grid,
      in_specs=[s for _, s, _ in specs], out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=interpret, name="flashjax_pallas_triton_fwd",
  )(*(a for _, _, a in specs))
  if tail is None:
    return outs
  return tail_merge.combine(outs[0], outs[1], outs[2:], tail,
                            functools.partial(_program_coords, plan), bq, interpret)
