"""Inputs sharded over batch and heads on 4 CPU devices: each device computes its
shard (no all-gather in the compiled HLO), forward and backward, and the result
equals the unsharded reference. Runs in a subprocess because the device count must
be set before JAX starts."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashjax
    from flashjax.common import reference

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    spec = {spec!r}
    kw = {kwargs}
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (4, 128, 8, 32))
    k = jax.random.normal(ks[1], (4, 128, 4, 32))
    v = jax.random.normal(ks[2], (4, 128, 4, 32))
    do = jax.random.normal(ks[3], (4, 128, 8, 32))
    sh = NamedSharding(mesh, P(*spec))
    q, k, v, do = (jax.device_put(x, sh) for x in (q, k, v, do))

    def loss(q, k, v, do):
        return jnp.sum(flashjax.flash_attention(q, k, v, **kw) * do)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    hlo = step.lower(q, k, v, do).compile().as_text()
    for op in ("all-gather", "all-to-all", "collective-permute"):
        if op in hlo:
            print("FOUND", op); sys.exit(3)
    val, grads = step(q, k, v, do)
    for g in grads:
        assert g.sharding.spec == sh.spec, (g.sharding, sh)
    host = lambda x: np.asarray(jax.device_get(x))
    rq, rk, rv, rdo = map(host, (q, k, v, do))
    rval, rgrads = jax.value_and_grad(
        lambda q, k, v: jnp.sum(reference.attention(q, k, v, **kw) * rdo),
        argnums=(0, 1, 2))(rq, rk, rv)
    np.testing.assert_allclose(host(val), rval, rtol=1e-4)
    for g, r in zip(grads, rgrads):
        np.testing.assert_allclose(host(g), r, rtol=2e-4, atol=2e-4)
    print("OK")
""")


@pytest.mark.parametrize("spec,kwargs", [
    (("data", None, "model", None), "dict(causal=True)"),
    (("data", None, None, None), "dict(sliding_window=(16, 0), dropout_rate=0.1, "
     "dropout_seed=7)"),
    ((None, None, "model", None), "dict(logits_soft_cap=5.0)"),
    ((("data", "model"), None, None, None), "dict()"),
])
def test_sharded_inputs_run_per_shard(spec, kwargs):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", SCRIPT.format(spec=spec, kwargs=kwargs)],
                       capture_output=True, text=True, env=env, timeout=600)
  assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr[-3000:]
