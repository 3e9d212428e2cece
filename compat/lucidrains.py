"""lucidrains' flash-attention-jax entry points on flashjax's platforms.

That library works on ``[batch, heads, seq, dim]`` (``flash_attention``) and on
``[..., seq, dim]`` (``causal_flash_attention``) and returns ``(out, stats)``;
here the second element is the lse ``[batch, heads, seq]`` (resp. ``[..., seq]``).
Keys masked out by ``key_mask`` are never attended; a row with no key left gives
0 (lucidrains' finite mask value gives the mean of the values there instead).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from .. import api
from ..common import reference


def _bshd(x):
  return jnp.swapaxes(x, 1, 2)


def flash_attention(q, k, v, key_mask, **kwargs):
  """``q, k, v [batch, heads, seq, dim]``, ``key_mask`` bool ``[batch, seq_k]``
  (True = attend). Returns ``(out [batch, heads, seq_q, dim], lse)``; extra
  keywords go to :func:`flashjax.flash_attention`."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if jnp.ndim(x) != 4:
      raise ValueError(f"{name} must be [batch, heads, seq, dim], got shape "
                       f"{jnp.shape(x)}")
  out, lse = api.flash_attention(
      _bshd(q), _bshd(k), _bshd(v), key_padding_mask=jnp.asarray(key_mask, bool),
      return_lse=True, **kwargs)
  return _bshd(out), lse


def causal_flash_attention(q, k, v, **kwargs):
  """Causal attention on ``[..., seq, dim]`` (the leading axes are independent
  heads; with ``seq_q != seq_k`` the diagonal is aligned bottom-right). Returns
  ``(out [..., seq_q, dim], lse [..., seq_q])``."""
  if jnp.ndim(q) < 2 or jnp.shape(q)[:-2] != jnp.shape(k)[:-2] or (
      jnp.shape(k)[:-1] != jnp.shape(v)[:-1]):
    raise ValueError("q, k, v must be [..., seq, dim] with the same leading axes, "
                     f"got {jnp.shape(q)}, {jnp.shape(k)}, {jnp.shape(v)}")
  lead = jnp.shape(q)[:-2]
  flat = lambda x: x.reshape((1, -1) + x.shape[-2:]).swapaxes(1, 2)
  out, lse = api.flash_attention(flat(q), flat(k), flat(v), causal=True,
                                 return_lse=True, **kwargs)
  out = out.swapaxes(1, 2).reshape(lead + out.shape[1:2] + out.shape[-1:])
  return out, lse.reshape(lead + lse.shape[-1:])


@jax.jit
def plain_attention(q, k, v, key_mask):
  """Dense attention on ``[batch, heads, seq, dim]`` with a ``[batch, seq_k]`` key
  mask: flashjax's reference, the oracle its tests use."""
  seq_q = q.shape[2]
  q_ids = jnp.zeros((q.shape[0], seq_q), jnp.int32)
  kv_ids = jnp.where(jnp.asarray(key_mask, bool), 0, -1).astype(jnp.int32)
  out = reference.attention(_bshd(q), _bshd(k), _bshd(v),
                            segment_ids=(q_ids, kv_ids))
  return _bshd(out).astype(q.dtype)


def _summed(fn):
  def total(*args):
    out = fn(*args)
    return jnp.sum(out[0] if isinstance(out, tuple) else out)
  return jax.value_and_grad(total, argnums=(0, 1, 2))


def value_and_grad_difference(fn1, fn2, seed=42, batch=2, heads=4, q_seq_len=4096,
                              k_seq_len=8192, add_key_mask=True, dim=512):
  """The largest absolute differences between two attention functions: of
  ``sum(out)``, and of its gradients with respect to q, k and v, on random
  inputs (as lucidrains' sanity check)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (batch, heads, q_seq_len, dim))
  k = jax.random.normal(keys[1], (batch, heads, k_seq_len, dim))
  v = jax.random.normal(keys[2], (batch, heads, k_seq_len, dim))
  args = (q, k, v)
  if add_key_mask:
    args += (jax.random.randint(keys[3], (batch, k_seq_len), 0, 2) == 1,)
  (o1, g1), (o2, g2) = (_summed(f)(*args) for f in (fn1, fn2))
  diff = lambda a, b: jnp.max(jnp.abs(a - b))
  return diff(o1, o2), [diff(a, b) for a, b in zip(g1, g2)]
