"""Inputs sharded over batch and heads on 4 CPU devices: each device computes its
shard (no all-gather in the compiled HLO), forward and backward, and the result
equals the unsharded reference. Covers the XLA platform and a kernel platform
(Pallas-Triton in interpret mode), both split by common/partition.py. These run in
a subprocess because the device count must be set before JAX starts. On a host
with several GPUs, ``test_data_parallel_on_gpus`` runs the GPU platforms so, in
this process."""

import subprocess
import sys
import textwrap

import jax
import pytest

from flashjax.common import hardware
from flashjax.common.env import cpu_devices_env

SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashjax
    from flashjax.common import reference

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    r = np.random.default_rng(1)
    # A bias shared by the batch and per-head sinks: their cotangents are sums
    # over batch shards.
    bias = jnp.asarray(r.normal(size=(1, 8, 64, 64)), jnp.float32)
    sinks = jnp.asarray(r.normal(size=(8, 1)), jnp.float32)
    seg = jnp.asarray(np.sort(r.integers(0, 3, size=(4, 64)), axis=1), jnp.int32)
    ks = jax.random.split(jax.random.key(0), 4)
    inputs = [jax.random.normal(ks[0], (4, 64, 8, 32)),
              jax.random.normal(ks[1], (4, 64, 4, 32)),
              jax.random.normal(ks[2], (4, 64, 4, 32)),
              jax.random.normal(ks[3], (4, 64, 8, 32))]

    def check(platform, spec, kw, expect_gather=False):
        label = (platform, spec, kw)
        kw = dict(kw)
        diff = {{n: kw.pop(n) for n in ("bias", "sinks") if n in kw}}
        extra = dict(platform=platform, interpret=True) if platform != "xla" else dict(
            platform="xla")
        sh = NamedSharding(mesh, P(*spec))
        q, k, v, do = (jax.device_put(x, sh) for x in inputs)

        def loss(q, k, v, do, diff):
            out = flashjax.flash_attention(q, k, v, **kw, **diff, **extra)
            return jnp.sum(out * do)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4)))
        hlo = step.lower(q, k, v, do, diff).compile().as_text()
        found = [op for op in ("all-gather", "all-to-all", "collective-permute")
                 if op in hlo]
        if expect_gather:
            assert found, ("control: sequence sharding must gather", label)
        else:
            assert not found, ("FOUND", found, label)
        val, grads = step(q, k, v, do, diff)
        host = lambda x: np.asarray(jax.device_get(x))
        if not expect_gather:
            for g in grads[:3]:
                assert g.sharding.is_equivalent_to(sh, 4), (g.sharding, sh, label)
        rq, rk, rv, rdo = map(host, (q, k, v, do))
        rval, rgrads = jax.jit(jax.value_and_grad(
            lambda q, k, v, diff: jnp.sum(reference.attention(q, k, v, **kw, **diff) * rdo),
            argnums=(0, 1, 2, 3)))(rq, rk, rv, diff)
        np.testing.assert_allclose(host(val), rval, rtol=1e-4, err_msg=str(label))
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(rgrads)):
            np.testing.assert_allclose(host(g), r, rtol=2e-4, atol=2e-4,
                                       err_msg=str(label))
        print("ok", label, flush=True)

    {calls}
    print("OK")
""")

BATCH_HEADS = ("data", None, "model", None)
CASES = [
    ("xla", BATCH_HEADS, "dict(causal=True)"),
    ("xla", ("data", None, None, None),
     "dict(sliding_window=(16, 0), dropout_rate=0.1, dropout_seed=7)"),
    ("xla", (None, None, "model", None), "dict(logits_soft_cap=5.0)"),
    ("xla", (("data", "model"), None, None, None), "dict(bias=bias, sinks=sinks)"),
    ("pallas-triton", BATCH_HEADS,
     "dict(causal=True, bias=bias, sinks=sinks, segment_ids=(seg, seg))"),
    ("pallas-triton", (None, None, "model", None),
     "dict(sliding_window=(16, 4), logits_soft_cap=5.0)"),
    ("pallas-triton", (("data", "model"), None, None, None), "dict(sinks=sinks)"),
    # Each shard hashes dropout at its global batch and head indices.
    ("pallas-triton", BATCH_HEADS,
     "dict(causal=True, dropout_rate=0.2, dropout_seed=11, sinks=sinks)"),
    ("pallas-triton", (("data", "model"), None, None, None),
     "dict(dropout_rate=0.3, dropout_seed=5, segment_ids=(seg, seg))"),
]


@pytest.mark.parametrize("platform", ["xla", "pallas-triton"])
def test_sharded_inputs_run_per_shard(platform):
  """The platform's CASES in one process (the device count must be set before
  JAX starts; one process per case paid JAX's start and warm-up each time).
  Then a control: attention needs whole rows, so a sequence-sharded input moves
  K/V between devices (the ring, whose collective-permutes ring_test.py
  checks) and the check for moved data is a real check; the result stays
  exact."""
  calls = [f"check({p!r}, {spec!r}, {kwargs})" for p, spec, kwargs in CASES
           if p == platform]
  calls.append(f"check({platform!r}, ('data', 'model', None, None), "
               "dict(causal=True), expect_gather=True)")
  script = SCRIPT.format(calls="\n".join(calls))
  res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=cpu_devices_env(4), timeout=900)
  assert res.returncode == 0 and res.stdout.rstrip().endswith("OK"), (
      res.stdout + res.stderr[-3000:])


VMAP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import flashjax
    from flashjax.common import reference
    # custom_partitioning has no batching rule; the per-shard wrapper must add one.
    q = jax.random.normal(jax.random.key(1), (3, 2, 32, 4, 16))
    f = lambda q: flashjax.flash_attention(q, q, q, causal=True, platform="pallas-triton",
                                           interpret=True)
    r = lambda q: reference.attention(q, q, q, causal=True)
    np.testing.assert_allclose(jax.jit(jax.vmap(f))(q), jax.vmap(r)(q), rtol=1e-4, atol=1e-5)
    g = jax.jit(jax.vmap(jax.grad(lambda q: (f(q) ** 2).sum())))(q)
    np.testing.assert_allclose(g, jax.jit(jax.vmap(jax.grad(lambda q: (r(q) ** 2).sum())))(q),
                               rtol=2e-4, atol=2e-4)
    print("OK")
""")


def test_vmap_of_kernel_platform_on_many_devices():
  env = cpu_devices_env(4)
  res = subprocess.run([sys.executable, "-c", VMAP_SCRIPT], capture_output=True,
                       text=True, env=env, timeout=900)
  assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr[-3000:]


EDGE_SCRIPT = textwrap.dedent("""
    import time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashjax
    from flashjax.common import reference

    mesh = Mesh(np.array(jax.devices()), ("x",))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    ks = jax.random.split(jax.random.key(2), 3)

    def check(q, k, v, gathers=True, **extra):
        # Forward and gradients of the platform against the reference.
        extra = extra or dict(platform="pallas-triton", interpret=True)
        f = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True, **extra)
        loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
        step = jax.jit(lambda q, k, v: (
            f(q, k, v), jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)))
        step = step.lower(q, k, v).compile()
        if not gathers:
            assert "all-gather" not in step.as_text()
        out, grads = step(q, k, v)
        host = [np.asarray(jax.device_get(x)) for x in (q, k, v)]
        ref = lambda q, k, v: reference.attention(q, k, v, causal=True)
        np.testing.assert_allclose(jax.device_get(out), jax.jit(ref)(*host), rtol=1e-4,
                                   atol=1e-5)
        for g, r in zip(grads, jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(*host)):
            np.testing.assert_allclose(jax.device_get(g), r, rtol=2e-4, atol=2e-4)

    # MQA, batch-sharded: a size-1 kv head factor must not join a compound dim.
    check(put(jax.random.normal(ks[0], (4, 16, 4, 16)), "x"),
          put(jax.random.normal(ks[1], (4, 16, 1, 16)), "x"),
          put(jax.random.normal(ks[2], (4, 16, 1, 16)), "x"))
    # GQA with q heads split 4 ways and Hkv = 2 replicated: each shard's two
    # query heads read one kv head, which it slices; dK/dV summed over shards.
    gqa = (put(jax.random.normal(ks[0], (1, 16, 8, 16)), None, None, "x"),
           jax.random.normal(ks[1], (1, 16, 2, 16)), jax.random.normal(ks[2], (1, 16, 2, 16)))
    check(*gqa, gathers=False)
    check(*gqa, gathers=False, platform="xla")
    # MQA, heads split: XLA's own partitioner split the xla platform so, no gather.
    check(put(jax.random.normal(ks[0], (1, 16, 4, 16)), None, None, "x"),
          gqa[1][:, :, :1], gqa[2][:, :, :1], gathers=False, platform="xla")
    # TPU interpret mode under jit with several devices raises at trace time (it
    # deadlocked XLA's collectives and aborted the process after 40 s).
    q = put(jax.random.normal(ks[0], (4, 16, 4, 16)), None, None, "x")
    start = time.time()
    try:
        jax.jit(lambda q: flashjax.flash_attention(
            q, q, q, backend="tpu", platform="pallas", interpret=True))(q)
    except NotImplementedError as e:
        assert "interpret mode runs on one device" in str(e), e
    else:
        raise AssertionError("pallas-tpu interpret ran sharded under jit")
    assert time.time() - start < 20
    print("OK")
""")


def test_mqa_gqa_and_tpu_interpret_with_sharded_inputs():
  env = cpu_devices_env(4)
  res = subprocess.run([sys.executable, "-c", EDGE_SCRIPT], capture_output=True,
                       text=True, env=env, timeout=900)
  assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr[-3000:]


JVP_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import flashjax
    from flashjax.common import reference
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    r = np.random.default_rng(1)
    bias = jnp.asarray(r.normal(size=(1, 8, 64, 64)), jnp.float32)
    sinks = jnp.asarray(r.normal(size=(8, 1)), jnp.float32)
    ks = jax.random.split(jax.random.key(0), 6)
    hs = (8, 4, 4) * 2
    sh = NamedSharding(mesh, P("data", None, "model", None))
    args = [jax.device_put(jax.random.normal(key, (4, 64, h, 32)), sh)
            for key, h in zip(ks, hs)]
    kw = dict(causal=True, bias=bias, sinks=sinks, dropout_rate=0.1, dropout_seed=7)
    host = lambda x: np.asarray(jax.device_get(x))
    ref = jax.jit(lambda p, t: jax.jvp(
        lambda q, k, v: reference.attention(q, k, v, **kw), p, t))(
        tuple(map(host, args[:3])), tuple(map(host, args[3:])))
    for extra in (dict(platform="xla"), dict(platform="pallas-triton", interpret=True)):
        f = lambda q, k, v: flashjax.flash_attention(q, k, v, **kw, **extra)
        run = jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))
        hlo = run.lower(*args).compile().as_text()
        assert not [op for op in ("all-gather", "all-to-all", "collective-permute")
                    if op in hlo], extra
        out, tangent = run(*args)
        assert tangent.sharding.is_equivalent_to(sh, 4), tangent.sharding
        np.testing.assert_allclose(host(out), ref[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(host(tangent), ref[1], rtol=2e-4, atol=2e-4)
    # Inside shard_map with varying axes checked, on local shards: grad (whose
    # linearisation traces the tangent's loops) and jvp.
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))
    mine = lambda q, k, v: flashjax.flash_attention(q, k, v, causal=True,
                                                    platform="xla")
    spec4 = P("data", None, "model", None)
    local = jax.jit(jax.shard_map(
        lambda *a: (jax.grad(loss(mine), argnums=(0, 1, 2))(*a[:3]),
                    jax.jvp(mine, a[:3], a[3:])[1]),
        mesh=mesh, in_specs=(spec4,) * 6, out_specs=((spec4,) * 3, spec4),
        check_vma=True))
    grads, tangent = local(*args)
    plain = lambda q, k, v: reference.attention(q, k, v, causal=True)
    want = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(*map(host, args[:3]))
    for g, r in zip(grads, want):
        np.testing.assert_allclose(host(g), r, rtol=2e-4, atol=2e-4)
    want = jax.jit(lambda p, t: jax.jvp(plain, p, t)[1])(
        tuple(map(host, args[:3])), tuple(map(host, args[3:])))
    np.testing.assert_allclose(host(tangent), want, rtol=2e-4, atol=2e-4)
    print("OK")
""")


def test_jvp_of_sharded_inputs_runs_per_shard():
  env = cpu_devices_env(4)
  res = subprocess.run([sys.executable, "-c", JVP_SCRIPT], capture_output=True,
                       text=True, env=env, timeout=900)
  assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr[-3000:]


@pytest.mark.skipif(hardware.gpu_count() < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("platform", ["pallas", "pallas-triton", "triton"])
@pytest.mark.parametrize("split", ["batch", "heads"])
def test_data_parallel_on_gpus(platform, split):
  """Batch or heads split over every GPU (data parallel, bf16, causal, GQA 2:1,
  sinks; dropout where the platform has it): the compiled step moves nothing
  between devices, each gradient keeps its input's sharding, and output and
  gradients equal the unsharded call on one GPU and the fp32 reference."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import flashjax
  from flashjax.common import reference, tolerances
  n = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  b, hq = (2 * n, 4) if split == "batch" else (2, 4 * n)
  ks = jax.random.split(jax.random.key(4), 5)
  q, do = (jax.random.normal(x, (b, 512, hq, 64), jnp.bfloat16) for x in ks[:2])
  k, v = (jax.random.normal(x, (b, 512, hq // 2, 64), jnp.bfloat16) for x in ks[2:4])
  sinks = jax.random.normal(ks[4], (hq,), jnp.float32)
  kw = dict(causal=True, sinks=sinks)
  if platform != "pallas":
    kw.update(dropout_rate=0.1, dropout_seed=9)
  sh = NamedSharding(mesh, P("data") if split == "batch" else P(None, None, "data"))

  def grads(f):
    def loss(q, k, v, do):
      out = f(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  step = grads(lambda q, k, v: flashjax.flash_attention(q, k, v, platform=platform,
                                                        **kw))
  args = [jax.device_put(x, sh) for x in (q, k, v, do)]
  hlo = step.lower(*args).compile().as_text()
  # (The loss's sum is one all-reduce of a scalar; nothing else may move.)
  moved = [op for op in ("all-gather", "all-to-all", "collective-permute")
           if op in hlo]
  assert not moved, moved
  (_, out), dgot = step(*args)
  for g in dgot:
    assert g.sharding.is_equivalent_to(sh, 4), (g.sharding, sh)
  one = jax.devices()[0]
  (_, want), dwant = step(*(jax.device_put(x, one) for x in (q, k, v, do)))
  (_, ref), dref = grads(lambda q, k, v: reference.attention(q, k, v, **kw))(
      *(x.astype(jnp.float32) for x in (q, k, v, do)))
  tolerances.assert_matches(out, want, ref, tolerances.forward("bfloat16"), name="out")
  for name, a, w, r in zip("qkv", dgot, dwant, dref):
    tolerances.assert_matches(a, w, r, tolerances.grad("bfloat16"), name=f"d{name}")
