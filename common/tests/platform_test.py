"""The platform protocol's shared pieces (common/platform.py)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common import platform, reference, vjp
from flashjax.common import spec as spec_lib


def _spec(**kw):
  base = dict(batch=1, seq_q=8, seq_k=8, heads_q=2, head_dim=32, dtype="bfloat16")
  return spec_lib.abstract_spec(**{**base, **kw})


def test_capabilities_give_reasons_without_a_platform_name():
  caps = platform.Capabilities(dtypes=("bfloat16",), max_head_dim=128,
                               features=frozenset(spec_lib.FEATURES) - {"bias"})
  assert caps.unsupported(_spec(causal=True)) is None
  assert caps.unsupported(_spec(dtype="float32")) == (
      "dtype float32 (supported: bfloat16)")
  assert caps.unsupported(_spec(head_dim=64, head_dim_v=256)) == "head dim 256 > 128"
  bias = np.zeros((1, 1, 8, 8), np.float32)
  assert caps.unsupported(_spec(bias=bias)) == "features bias not in this kernel"
  assert caps.head_dim_ok(128) and not caps.head_dim_ok(129)
  assert platform.Capabilities(dtypes=("float32",)).head_dim_ok(4096)
  with pytest.raises(ValueError, match="features must be among"):
    platform.Capabilities(dtypes=("float32",), features=frozenset({"alibi"}))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Blocks:
  block_q: int = 64
  block_kv: int = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config:
  fwd: _Blocks = _Blocks()
  bwd: _Blocks = _Blocks()


class _Derived(_Config):
  pass


def test_config_type_is_exact_and_block_sizes_land_in_the_named_parts():
  assert platform.check_config(_Config(), _Config, "p") == _Config()
  with pytest.raises(ValueError, match=r"config must be a _Config \(platform 'p'\), "
                     "got _Derived"):
    platform.check_config(_Derived(), _Config, "p")
  fwd_only = platform.block_sizes(lambda spec: _Config(), ("fwd",))
  assert fwd_only(None, 128, None) == _Config(fwd=_Blocks(block_q=128))
  both = platform.block_sizes(lambda spec: _Config(), ("fwd", "bwd"))
  assert both(None, None, 16) == _Config(fwd=_Blocks(block_kv=16),
                                         bwd=_Blocks(block_kv=16))


def _dense(ops, spec, config):
  del config
  return reference.attention_from_operands(ops, spec)


def test_entry_runs_the_contract_and_names_the_platform_in_errors():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32)
             for _ in range(3))
  caps = platform.Capabilities(dtypes=("float32",))
  fa = platform.entry("dense", _dense, caps)
  out, lse = fa(q, k, v, causal=True, return_lse=True)
  ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6)
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
  assert fa(q, k, v).shape == q.shape  # no lse asked: the output alone
  with pytest.raises(ValueError, match="interpret=True: platform 'dense' has no"):
    fa(q, k, v, interpret=True)

  def gap(ops, spec, config):
    raise NotImplementedError("needs a TPU")

  with pytest.raises(NotImplementedError, match="^nowhere: needs a TPU$"):
    platform.entry("nowhere", gap, caps)(q, k, v)

  def second(ops, spec, config):
    raise vjp.SecondOrderError("second order")

  with pytest.raises(vjp.SecondOrderError, match="^second order$"):
    platform.entry("nowhere", second, caps)(q, k, v)


CHAIN = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import flashjax

ring = {ring}
if ring:
  mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
  attend = jax.shard_map(
      lambda q, k, v: flashjax.ring_attention(q, k, v, axis_name="seq",
                                              layout="zigzag", causal=True,
                                              platform="xla"),
      mesh=mesh, in_specs=(P(None, "seq"),) * 3, out_specs=P(None, "seq"),
      check_vma=False)
else:
  attend = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True,
                                                    platform="xla")

def size(layers):
  def loss(q, k, v):
    for _ in range(layers):
      q = attend(q, k, v)
    return jnp.sum(q)
  x = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
  return len(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).as_text())

print(size(1), size(4))
"""


@pytest.mark.parametrize("ring", [False, True])
def test_chained_calls_lower_each_kernel_once(ring):
  # platform.traced_once: a platform's forward and backward are lowered once
  # per distinct call, so the text of a program of many layers (or of a ring's
  # repeated hops) does not grow with them. Inline, four layers were four
  # copies. The ring needs two devices: its own process.
  import subprocess
  import sys
  from flashjax.common.env import cpu_devices_env
  proc = subprocess.run([sys.executable, "-c", CHAIN.format(ring=ring)],
                        env=cpu_devices_env(2), capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  one, four = (int(x) for x in proc.stdout.split())
  assert four < 1.3 * one, (one, four)


def test_traced_once_keeps_one_jitted_function_per_platform_function():
  f = lambda ops, spec, static: ops
  assert platform.traced_once(f) is platform.traced_once(f)
  assert platform.traced_once(f)(jnp.ones(2), "spec", ("static",)).shape == (2,)
