"""The differentiation wrapper (common/vjp.py) under JAX's transformations: forward
mode runs the common tangent, reverse mode the platform's own backward, vmap,
jacfwd, linearize and checkpoint work, second order raises one clear error, and the
conformance jvp check fails a wrong tangent."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import conformance, reference, spec as spec_lib, tolerances, vjp
from flashjax.common.conformance_jvp import run_jvp

TOL = tolerances.grad("float32")


def _forward(ops, spec, config):
  del config
  return reference.attention_from_operands(ops, spec)


def _marked_backward(ops, spec, config, out, lse, do, dlse):
  """Not a gradient: a constant per operand, so a test can tell that reverse mode
  reached this function and not a transposed tangent."""
  del spec, config, out, lse, do, dlse
  mark = lambda x, c: None if x is None else jnp.full(x.shape, c, x.dtype)
  return ops._replace(q=mark(ops.q, 1.0), k=mark(ops.k, 2.0), v=mark(ops.v, 3.0),
                      bias=mark(ops.bias, 4.0), sinks=mark(ops.sinks, 5.0))


def _dense_backward(ops, spec, config, out, lse, do, dlse):
  """The reference's own vjp, as a platform backward."""
  del config, out, lse
  names = ("q", "k", "v", "bias", "sinks")
  diff = {n: getattr(ops, n) for n in names}
  f = lambda diff: reference.attention_from_operands(ops._replace(**diff), spec)
  return ops._replace(**jax.vjp(f, diff)[1]((do, dlse))[0])


def _platform(backward, q, k, v, **kwargs):
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  out, lse = vjp.attention(_forward, backward, ops, spec, None)
  return (out, lse) if spec.return_lse else out


# The wrapper on dense stand-ins (cheap to compile): one whose backward only marks
# that it ran, one with a real backward. The platforms' own kernels are checked by
# the conformance suite.
_stub = functools.partial(_platform, _marked_backward)
_dense = functools.partial(_platform, _dense_backward)


def _normal(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _inputs(seed=0, b=1, s=24, h=2, d=16):
  rng = np.random.default_rng(seed)
  q, k, v, tq, tk, tv = (_normal(rng, b, s, h, d) for _ in range(6))
  return (q, k, v), (tq, tk, tv)


def test_reverse_mode_runs_the_platform_backward_and_forward_mode_the_tangent():
  (q, k, v), tangents = _inputs()
  bias = jnp.ones((1, 2, 24, 24))
  sinks = jnp.zeros((2,))
  loss = lambda q, k, v, bias, sinks: jnp.sum(_stub(q, k, v, bias=bias, sinks=sinks,
                                                    causal=True))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, bias, sinks)
  for g, c in zip(grads, (1.0, 2.0, 3.0, 4.0, 5.0)):
    np.testing.assert_array_equal(g, jnp.full(g.shape, c))
  # jvp ignores the (wrong) backward: it equals the reference's jvp.
  f = lambda q, k, v: _stub(q, k, v, causal=True)
  r = lambda q, k, v: reference.attention(q, k, v, causal=True)
  got = jax.jit(lambda *t: jax.jvp(f, (q, k, v), t)[1])(*tangents)
  want = jax.jit(lambda *t: jax.jvp(r, (q, k, v), t)[1])(*tangents)
  tolerances.assert_close(got, want, TOL, name="jvp")


def test_grad_of_some_operands_only():
  # Symbolic-zero tangents of the other operands never reach the transpose.
  (q, k, v), _ = _inputs(seed=1)
  bias = _normal(np.random.default_rng(9), 1, 1, 24, 24)

  @functools.partial(jax.jit, static_argnums=0)
  def grads(fn, q, bias):
    loss = lambda q, bias: jnp.sum(jnp.sin(fn(q, k, v, bias=bias)))
    return (*jax.grad(loss, argnums=(0, 1))(q, bias),
            jax.grad(lambda b: jnp.sum(fn(q, k, v, bias=b) ** 2))(bias))

  for g, w in zip(grads(_dense, q, bias), grads(reference.attention, q, bias)):
    tolerances.assert_close(g, w, TOL, name="grad")


def test_vmap_of_jvp_and_of_grad_and_jacfwd():
  (q, k, v), (tq, tk, tv) = _inputs(seed=2, s=12, d=8)
  stack = lambda x: jnp.stack([x, 0.5 * x])

  @functools.partial(jax.jit, static_argnums=0)
  def transforms(fn, q, k, v):
    f = lambda q, k, v: fn(q, k, v, causal=True)
    jv = jax.vmap(lambda q, tq: jax.jvp(lambda q: f(q, k, v), (q,), (tq,))[1])(
        stack(q), stack(tq))
    # k and v batched, their tangents not: the vmap rule broadcasts tangents.
    jv2 = jax.vmap(lambda k, v: jax.jvp(f, (q, k, v), (tq, tk, tv))[1])(
        stack(k), stack(v))
    gv = jax.vmap(jax.grad(lambda q: jnp.sum(f(q, k, v) ** 2)))(stack(q))
    jac = jax.jacfwd(lambda q: f(q, k, v)[0, :2, 0, :2])(q)
    return jv, jv2, gv, jac

  for g, w in zip(transforms(_dense, q, k, v),
                  transforms(reference.attention, q, k, v)):
    tolerances.assert_close(g, w, TOL, name="vmap/jacfwd")


def test_linearize_and_checkpoint_policy():
  (q, k, v), (tq, tk, tv) = _inputs(seed=3, s=16, d=8)
  f = lambda q, k, v: _dense(q, k, v, causal=True, logits_soft_cap=3.0)
  r = lambda q, k, v: reference.attention(q, k, v, causal=True, logits_soft_cap=3.0)
  got = jax.jit(lambda *t: jax.linearize(f, q, k, v)[1](*t))(tq, tk, tv)
  want = jax.jit(lambda *t: jax.jvp(r, (q, k, v), t)[1])(tq, tk, tv)
  tolerances.assert_close(got, want, TOL, name="linearize")
  policy = jax.checkpoint_policies.save_only_these_names(vjp.OUT_NAME, vjp.LSE_NAME)
  loss = lambda q: jnp.sum(f(q, k, v) ** 2)
  g = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))(q)
  want = jax.jit(jax.grad(lambda q: jnp.sum(r(q, k, v) ** 2)))(q)
  tolerances.assert_close(g, want, TOL, name="checkpointed grad")


@pytest.mark.parametrize("kind", ["jvp of grad", "grad of grad", "grad of jvp",
                                  "jvp of jvp", "hessian", "frontend"])
def test_second_order_raises_one_clear_error(kind):
  import flashjax
  (q, k, v), (tq, _, _) = _inputs(seed=4, s=8, d=8)
  fn = flashjax.flash_attention if kind == "frontend" else _dense
  f = lambda q: jnp.sum(fn(q, k, v, causal=True) ** 2)
  jvp_f = lambda q: jax.jvp(f, (q,), (tq,))[1]
  run = {"jvp of grad": lambda: jax.jvp(jax.grad(f), (q,), (tq,)),
         # Not turned into "no platform can run this call" by the fallback.
         "frontend": lambda: jax.jvp(jax.grad(f), (q,), (tq,)),
         "grad of grad": lambda: jax.grad(lambda q: jnp.sum(jax.grad(f)(q)))(q),
         "grad of jvp": lambda: jax.grad(jvp_f)(q),
         "jvp of jvp": lambda: jax.jvp(jvp_f, (q,), (tq,)),
         "hessian": lambda: jax.hessian(lambda x: f(q.at[0, 0, 0, :2].set(x)))(
             q[0, 0, 0, :2])}[kind]
  with pytest.raises(vjp.SecondOrderError) as e:
    run()
  assert str(e.value).startswith("flashjax attention is differentiable to first order")
  assert "jax.jvp" in str(e.value) and "jax.grad" in str(e.value)


def _wrong_tangent(q, k, v, **kwargs):
  """Right values, tangent off by 1% in q's direction."""
  @jax.custom_jvp
  def f(q, k, v):
    return reference.attention(q, k, v, **kwargs)

  @f.defjvp
  def _jvp(primals, tangents):
    (q, k, v), (tq, tk, tv) = primals, tangents
    return jax.jvp(f.fun, (q, k, v), (1.01 * tq, tk, tv))

  return f(q, k, v)


def test_jvp_check_fails_a_wrong_tangent():
  case = conformance.Case(seq_q=16, seq_k=16, heads_q=2, heads_kv=2, head_dim=16)
  got, ref = run_jvp(_wrong_tangent, case, with_lse=False)
  tolerances.assert_close(got["out"], ref["out"], tolerances.forward("float32"))
  with pytest.raises(AssertionError):
    tolerances.assert_close(got["t_out"], ref["t_out"], TOL)


@pytest.mark.parametrize("block_q,block_kv", [(16, 8), (7, 5)])
def test_tangent_over_many_blocks_with_band_skipping(block_q, block_kv):
  from flashjax.common import tangent
  kwargs = dict(causal=True, sliding_window=(9, 0), logits_soft_cap=2.0,
                return_lse=True)
  rng = np.random.default_rng(5)
  shapes = [(2, 53, 4, 8), (2, 29, 2, 8), (2, 29, 2, 8)] * 2  # rows 0-23 see nothing
  q, k, v, tq, tk, tv = (_normal(rng, *s) for s in shapes)
  ops, spec = spec_lib.canonicalize(q, k, v, **kwargs)
  ranges = tangent.kv_block_ranges(spec, block_q, block_kv)
  n_kv = -(-29 // block_kv)
  assert (ranges[:, 1] - ranges[:, 0]).max() < n_kv  # blocks are skipped
  assert (ranges[:, 0] == ranges[:, 1]).any()  # rows that see nothing
  out, lse = jax.jit(reference.attention_from_operands, static_argnums=1)(ops, spec)
  got = jax.jit(functools.partial(tangent.attention_tangent, spec=spec,
                                  block_q=block_q, block_kv=block_kv))(
      ops, spec_lib.Operands(q=tq, k=tk, v=tv), out=out, lse=lse)
  want = jax.jit(lambda *t: jax.jvp(
      lambda q, k, v: reference.attention(q, k, v, **kwargs), (q, k, v), t)[1])(
          tq, tk, tv)
  for g, w, name in zip(got, want, ("t_out", "t_lse")):
    tolerances.assert_close(g, w, TOL, name=name)
