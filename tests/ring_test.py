"""Ring attention (flashjax.ring_attention) on 2, 3, 4 and 8 fake CPU devices: outputs,
lse and gradients equal the reference on the whole sequences for every feature,
in both layouts; the compiled program moves K/V by collective-permute and gathers
nothing; per-device memory grows linearly in the local length. The multi-device
cases run in one subprocess per device count (the count must be set before JAX
starts); checks of the index math and of errors run here on one device."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import flashjax
from flashjax.common import hardware, reference
from flashjax.common.env import cpu_devices_env
from flashjax.common.mask import Band, band_allowed

PRELUDE = textwrap.dedent("""
    import sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import flashjax
    from flashjax.common import reference

    n = {n}
    assert len(jax.devices()) == n, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("seq",))
    B, S, H = 2, 48 if n == 3 else 64, 4  # zigzag: 2n chunks
    draws = iter(range(1000))
    rand = lambda *shape: jax.random.normal(jax.random.key(next(draws)), shape)
    seg = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 3, (B, S)), 1),
                      jnp.int32)
    arrays = dict(
        seg=(seg, seg), sinks=rand(H, 2), bias=rand(1, H, S, S),
        row_bias=rand(B, 1, 1, S),
        mask=jax.random.bernoulli(jax.random.key(99), 0.8, (B, 1, S, S)))
    # Operands that are laid out along the sequence: [axes of q rows, of keys].
    SEQ_AXES = dict(seg=([1], [1]), bias=([2], [3]), row_bias=([], [3]),
                    mask=([2], [3]))

    def check(layout, hkv=2, d=16, platform="xla", check_vma=True,
              dtype=jnp.float32, **kw):
        # bf16: the kernels' outputs reach the ring's fp32 accumulators in their
        # own dtype (common/ring.py, _Ring.result_dtype); checked against the
        # reference on the same rounded inputs at bf16 tolerances.
        t0 = time.time()
        named = {{name: kw.pop(name) for name in list(kw) if kw[name] in arrays}}
        q, k, v = rand(B, S, H, d), rand(B, S, hkv, d), rand(B, S, hkv, d)
        do = rand(B, S, H, d)
        q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
        tol = 2e-4 if dtype == jnp.float32 else 2e-2
        dlse = rand(B, H, S)
        zz = layout == "zigzag"
        order = lambda x, a=1: flashjax.zigzag_order(x, n, a) if zz else x
        restore = lambda x, a=1: flashjax.zigzag_restore(x, n, a) if zz else x

        def laid_out(name, x):
            if name == "seg":
                return tuple(order(y) for y in x)
            rows, cols = SEQ_AXES.get(name, ([], []))
            for a in rows + cols:
                x = order(x, a)
            return x

        def pspec(name, x):
            if name == "seg":
                return (P(None, "seq"), P(None, "seq"))
            rows = SEQ_AXES.get(name, ([], []))[0]
            return P(*["seq" if a in rows else None for a in range(x.ndim)])

        kwarg = dict(seg="segment_ids", row_bias="bias")
        extra = dict(platform=platform)
        if platform != "xla":
            extra.update(interpret=True, backend="gpu")

        def local(q, k, v, ops):
            ops = {{kwarg.get(n, n): x for n, x in ops.items()}}
            return flashjax.ring_attention(q, k, v, axis_name="seq", layout=layout,
                                           return_lse=True, **kw, **ops, **extra)

        ops = {{n: arrays[x] for n, x in named.items()}}
        ring = jax.shard_map(
            local, mesh=mesh, check_vma=check_vma,
            in_specs=(P(None, "seq"),) * 3 + (
                {{n: pspec(n, x) for n, x in ops.items()}},),
            out_specs=(P(None, "seq"), P(None, None, "seq")))

        # lse's cotangent is random too (its finite entries), so dlse is checked.
        total = lambda out, lse: (jnp.sum(out * do) + jnp.sum(
            jnp.where(jnp.isinf(lse), 0, lse) * dlse), (out, lse))

        def loss(q, k, v, ops):
            lops = {{n: laid_out(n, x) for n, x in ops.items()}}
            out, lse = ring(order(q), order(k), order(v), lops)
            return total(restore(out), restore(lse, 2))

        def ref_loss(q, k, v, ops):
            ops = {{kwarg.get(n, n): x for n, x in ops.items()}}
            return total(*reference.attention(q, k, v, return_lse=True, **kw, **ops))

        diff = {{n: x for n, x in ops.items() if n in ("bias", "row_bias", "sinks")}}
        fixed = {{n: x for n, x in ops.items() if n not in diff}}
        grad = lambda f: jax.value_and_grad(
            lambda q, k, v, diff: f(q, k, v, {{**diff, **fixed}}),
            argnums=(0, 1, 2, 3), has_aux=True)
        compiled = jax.jit(grad(loss)).lower(q, k, v, diff).compile()
        (_, (out, lse)), grads = compiled(q, k, v, diff)
        (_, (rout, rlse)), rgrads = jax.jit(grad(ref_loss))(q, k, v, diff)
        label = (layout, hkv, platform, kw, list(named))
        f32 = lambda x: np.asarray(x, np.float32)
        assert out.dtype == dtype and grads[0].dtype == dtype, (out.dtype, dtype)
        np.testing.assert_allclose(f32(out), f32(rout), rtol=tol, atol=tol,
                                   err_msg=str(label))
        np.testing.assert_allclose(lse, rlse, rtol=tol, atol=tol, err_msg=str(label))
        assert np.isfinite(f32(out)).all()
        assert float(jnp.std(f32(rout))) > 0.05, "a case that cannot fail"
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(rgrads)):
            np.testing.assert_allclose(f32(g), f32(r), rtol=2.5 * tol, atol=2.5 * tol,
                                       err_msg=str(label))
        print("ok", label, f"{{time.time() - t0:.1f}}s", flush=True)
        return compiled
""")

FOUR = PRELUDE + textwrap.dedent("""
    compiled = check("contiguous", hkv=1, causal=True, sinks="sinks", seg="seg",
                     bias="bias", mask="mask")
    hlo = compiled.as_text()
    assert "collective-permute" in hlo
    for op in ("all-gather", "all-to-all"):
        assert op not in hlo, op
    # One message per hop: K, V and their ids travel as one buffer, sent at hop
    # 0 and once in the body of the scan over the middle hops.
    import re
    fwd = jax.jit(jax.shard_map(
        lambda q, k, v, s: flashjax.ring_attention(
            q, k, v, axis_name="seq", causal=True, segment_ids=(s, s)),
        mesh=mesh, in_specs=(P(None, "seq"),) * 4, out_specs=P(None, "seq")))
    x = rand(B, S, H, 16)
    permutes = lambda f: len(re.findall(r"collective-permute(-start)?\\(",
                                        f.lower(x, x, x, seg).compile().as_text()))
    assert permutes(fwd) == 2
    # The backward: the block of its first hop (the forward's first message,
    # sent once for both), hop 1's block, one in the scan (block and dK/dV),
    # hop 3's dK/dV, and dK/dV going home: 6 with the forward's 2.
    assert permutes(jax.jit(jax.grad(lambda *a: jnp.sum(fwd(*a)), (0, 1, 2)))) == 6
    # bf16 (the causal zigzag alone: FOUR_IN_PLACE): with a window and dropout,
    # pair calls whose parts are merged and summed in fp32. A wrong hop offset
    # of the window or of the dropout hash moves whole probabilities, far beyond
    # bf16's tolerance; THREE checks an fp32 window with dropout in the
    # contiguous layout. Ids and a row bias in the zigzag layout: TWO, THREE and
    # EIGHT; with them here the program took 58 s to build and run on a
    # two-core CPU against 38 s without (2026-11-29).
    check("zigzag", sliding_window=(20, 3), dropout_rate=0.2, dropout_seed=3,
          dtype=jnp.bfloat16)
    print("OK")
""")

FOUR_IN_PLACE = PRELUDE + textwrap.dedent("""
    # A platform that reads its operands in place (rows.takes_rows, as the
    # Mosaic kernels do) gets the forward's K and V as windows of the hop's
    # message and a chunk's q rows as windows of q; the results stay exact.
    from flashjax import ring as ring_module
    from flashjax.common import rows
    seen = []
    plain = ring_module.HopKernel.__call__

    def in_place(self, ops, spec):
        fwd, bwd, config = plain(self, ops, spec)

        def wrap(fn, kind):
            def f(ops, *args):
                got = [ops.q, ops.k, ops.v] + list(args[2:5:2])  # bwd: out, do
                seen.append((kind, [(x.at, x.base.shape[:2], x.length)
                                    if isinstance(x, rows.Rows) else None
                                    for x in got]))
                return fn(*rows.materialize((ops,) + args))
            return rows.takes_rows(f)
        return wrap(fwd, "fwd"), wrap(bwd, "bwd"), config

    ring_module.HopKernel.__call__ = in_place
    try:
        check("zigzag", causal=True, dtype=jnp.bfloat16)
    finally:
        ring_module.HopKernel.__call__ = plain
    c = S // n // 2  # rows of a chunk
    fwd_kv = [w[1:3] for kind, w in seen if kind == "fwd" and w[1] and w[1][1][0] > B]
    # The message holds K then V: batch entries [0, B) and [B, 2B) of its rows.
    assert fwd_kv and all(k[0] == (0, 0) and v[0] == (B, 0) for k, v in fwd_kv), seen
    assert any(k[2] == c for k, _ in fwd_kv), seen  # the first chunk of a block
    q_rows = [w[0] for _, w in seen if w[0][0] != (0, 0)]
    assert q_rows and all(q == ((0, c), (B, 2 * c), c) for q in q_rows), seen
    # The backward gets dO and out windows of the same rows as q.
    assert all(w[3] == w[4] == w[0] for kind, w in seen if kind == "bwd"), seen
    print("ok in place", len(seen), flush=True)
    # Window bounds of single hops lie off the diagonal (left -12, right -13).
    check("contiguous", platform="pallas-triton", check_vma=False,
          sliding_window=(20, 3), sinks="sinks")
    print("OK")
""")

FOUR_AUTO = PRELUDE + textwrap.dedent("""
    # Automatic: under jit, flash_attention on inputs split along the sequence
    # (an Explicit mesh axis) runs the ring, with batch split on another axis.
    from jax.sharding import AxisType, NamedSharding
    mesh2 = jax.make_mesh((2, 2), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
    q, k, v, do = rand(B, S, H, 8), rand(B, S, 2, 8), rand(B, S, 2, 8), rand(B, S, H, 8)
    kw = dict(causal=True, dropout_rate=0.1, dropout_seed=5)
    put = lambda x: jax.device_put(x, NamedSharding(mesh2, P("data", "seq")))
    loss = lambda f, do: lambda q, k, v, s: jnp.sum(f(q, k, v, sinks=s, **kw) * do)
    step = jax.jit(jax.value_and_grad(loss(flashjax.flash_attention, put(do)),
                                      argnums=(0, 1, 2, 3)))
    args = (put(q), put(k), put(v), arrays["sinks"])
    hlo = step.lower(*args).compile().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo
    val, grads = step(*args)
    rval, rgrads = jax.jit(jax.value_and_grad(loss(reference.attention, do),
                                              argnums=(0, 1, 2, 3)))(
        q, k, v, arrays["sinks"])
    np.testing.assert_allclose(val, rval, rtol=1e-4)
    for g, r in zip(grads, rgrads):
        np.testing.assert_allclose(g, r, rtol=5e-4, atol=5e-4)
    assert grads[0].sharding.spec[:2] == ("data", "seq"), grads[0].sharding
    print("ok automatic", flush=True)

    # Auto mesh axes (a Mesh built by hand): the split is decided after tracing,
    # and the kernel platform's partitioned call (common/partition.py) runs the
    # ring on the shards it is given; zigzag for causal, with dropout.
    mesh3 = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "seq"))

    def auto(pspec, sq=S, **kw):
        sh = NamedSharding(mesh3, P(*pspec))
        q, k, v = rand(B, sq, H, 16), rand(B, S, 2, 16), rand(B, S, 2, 16)
        do, dlse = rand(B, sq, H, 16), rand(B, H, sq)
        diff = {{n: arrays[kw.pop(n)] for n in ("sinks", "row_bias") if n in kw}}
        extra = dict(platform="pallas-triton", interpret=True, backend="gpu")
        total = lambda out, lse: (jnp.sum(out * do) + jnp.sum(lse * dlse), (out, lse))
        call = lambda f, q, k, v, diff, **x: total(*f(
            q, k, v, return_lse=True, bias=diff.get("row_bias"),
            sinks=diff.get("sinks"), **kw, **x))
        step = jax.jit(jax.value_and_grad(
            lambda *a: call(flashjax.flash_attention, *a, **extra),
            argnums=(0, 1, 2, 3), has_aux=True))
        put = lambda x: jax.device_put(x, sh)
        compiled = step.lower(put(q), put(k), put(v), diff).compile()
        (_, (out, lse)), grads = compiled(put(q), put(k), put(v), diff)
        (_, (rout, rlse)), rgrads = jax.jit(jax.value_and_grad(
            lambda *a: call(reference.attention, *a), argnums=(0, 1, 2, 3),
            has_aux=True))(q, k, v, diff)
        np.testing.assert_allclose(out, rout, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(lse, rlse, rtol=2e-4, atol=2e-4)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(rgrads)):
            np.testing.assert_allclose(g, r, rtol=5e-4, atol=5e-4)
        assert grads[0].sharding.spec[:2] == pspec[:2], grads[0].sharding
        print("ok auto", pspec, kw, list(diff), flush=True)
        return compiled.as_text()

    hlo = auto(("data", "seq"), causal=True, dropout_rate=0.2, dropout_seed=4,
               sinks="sinks")
    assert "collective-permute" in hlo and "all-gather" not in hlo
    # Sq != Sk, the band off the diagonal, a bias row for all queries (its
    # gradient summed over the ring), heads split on the other axis.
    auto((None, "seq", "data"), sq=32, sliding_window=(20, 3), row_bias="row_bias")

    # Per-device memory of fwd+bwd grows linearly in the local length (fixed
    # block sizes, so no kernel tile grows with it).
    from flashjax.xla_cpu import BlockSizes, XlaConfig
    blocks = BlockSizes(block_q=32, block_kv=32)
    cfg = XlaConfig(fwd=blocks, bwd=blocks)

    def memory(s):
        local = lambda q, k, v: flashjax.ring_attention(
            q, k, v, axis_name="seq", causal=True, config=cfg)
        ring = jax.shard_map(local, mesh=mesh, in_specs=(P(None, "seq"),) * 3,
                             out_specs=P(None, "seq"))
        x = jax.ShapeDtypeStruct((1, s, 2, 32), jnp.float32)
        step = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v)),
                                argnums=(0, 1, 2)))
        m = step.lower(x, x, x).compile().memory_analysis()
        return m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes

    small, large = memory(1024), memory(4096)
    print("memory", small, large, large / small)
    assert large / small < 4.6, (small, large)  # linear: 4x; quadratic: 16x
    print("OK")
""")

THREE = PRELUDE + textwrap.dedent("""
    # Three devices: a middle hop, but no scan in the backward.
    check("zigzag", causal=True, seg="seg", sinks="sinks", row_bias="row_bias")
    check("contiguous", sliding_window=(20, 3), dropout_rate=0.2, dropout_seed=3)
    print("OK")
""")

TWO = PRELUDE + textwrap.dedent("""
    # Two devices: the first hop, then the last (no scan between them).
    check("zigzag", causal=True, seg="seg", sinks="sinks", bias="bias")
    check("contiguous", causal=True, dropout_rate=0.2, dropout_seed=3, mask="mask")
    print("OK")
""")

EIGHT = PRELUDE + textwrap.dedent("""
    check("zigzag", causal=True, seg="seg", sinks="sinks")
    print("OK")
""")


def _run(script, n):
  env = cpu_devices_env(n)
  proc = subprocess.run([sys.executable, "-c", script.format(n=n)], env=env,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), (
      proc.stdout[-3000:] + proc.stderr[-6000:])


def test_ring_two_devices():
  _run(TWO, 2)


def test_ring_three_devices():
  _run(THREE, 3)


# Three scripts, so that test workers can share them.
def test_ring_four_devices():
  _run(FOUR, 4)


def test_ring_four_devices_in_place_and_pallas_triton():
  _run(FOUR_IN_PLACE, 4)


def test_ring_four_devices_automatic_and_auto_mesh():
  _run(FOUR_AUTO, 4)


def test_ring_eight_devices():
  _run(EIGHT, 8)


def test_sub_block_is_the_slice_of_the_band():
  rng = np.random.default_rng(0)
  for _ in range(150):
    sq, sk = rng.integers(1, 24, size=2)
    left, right = (None if rng.random() < 0.3 else int(rng.integers(0, 30))
                   for _ in range(2))
    band = Band(seq_q=int(sq), seq_k=int(sk), left=left, right=right)
    q0, k0 = rng.integers(0, sq), rng.integers(0, sk)
    bq, bk = rng.integers(1, sq - q0 + 1), rng.integers(1, sk - k0 + 1)
    dense = lambda b: np.broadcast_to(band_allowed(
        np.arange(b.seq_q)[:, None], np.arange(b.seq_k)[None, :], b),
        (b.seq_q, b.seq_k))
    want = dense(band)[q0:q0 + bq, k0:k0 + bk]
    sub = band.sub_block(int(q0), int(bq), int(k0), int(bk))
    if sub is None:
      assert not want.any(), (band, q0, bq, k0, bk)
    else:
      np.testing.assert_array_equal(dense(sub), want)


def test_zigzag_order_and_restore():
  x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
  z = flashjax.zigzag_order(x, 2)
  chunks = np.asarray(z[0, :, 0]).reshape(4, 4) // 3 // 4
  np.testing.assert_array_equal(chunks[:, 0], [0, 3, 1, 2])
  np.testing.assert_array_equal(flashjax.zigzag_restore(z, 2), x)
  np.testing.assert_array_equal(
      flashjax.zigzag_restore(flashjax.zigzag_order(x, 4, axis=-2), 4, axis=-2), x)
  with pytest.raises(ValueError, match="multiple of 2 \\* num_shards"):
    flashjax.zigzag_order(x, 3)


@pytest.mark.parametrize("platform,backend", [
    ("pallas-triton", "gpu"), ("pallas", "tpu"), ("triton", "gpu"), ("pallas", "gpu")])
def test_kernel_dropout_takes_hop_offsets(platform, backend):
  """On one device the zigzag layout's second chunk starts at row and key S/2:
  the kernels (Pallas in interpret mode; Mosaic-GPU, bf16, on Hopper) must hash
  those global positions, as the reference does on the whole sequence. (4
  devices: the FOUR script.)"""
  mosaic = (platform, backend) == ("pallas", "gpu")
  interpret = platform != "triton" and not mosaic
  if not interpret and jax.default_backend() != "gpu":
    pytest.skip("needs a GPU")
  if mosaic and not hardware.is_hopper():
    pytest.skip("needs a Hopper GPU")
  ks = jax.random.split(jax.random.key(0), 4)
  dtype = jnp.bfloat16 if mosaic else jnp.float32
  # Mosaic's blocks are 64 rows or more: a longer sequence, so each zigzag
  # chunk spans blocks and the offsets land inside a kernel's walk.
  s, d = (512, 64) if mosaic else (16, 16)
  q, do = (jax.random.normal(x, (1, s, 2, d), dtype) for x in ks[:2])
  k, v = (jax.random.normal(x, (1, s, 1, d), dtype) for x in ks[2:])
  kw = dict(dropout_rate=0.3, dropout_seed=11)

  def ring(q, k, v):
    return _one_device(lambda q, k, v: flashjax.ring_attention(
        q, k, v, axis_name="seq", layout="zigzag", platform=platform,
        backend=backend, interpret=interpret, **kw), q, k, v)

  def check(f):
    return jax.value_and_grad(lambda *a: jnp.sum(f(*a) * do), argnums=(0, 1, 2))

  val, grads = jax.jit(check(ring))(q, k, v)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  rval, rgrads = jax.jit(check(lambda *a: reference.attention(*a, **kw)))(*f32)
  assert float(jnp.std(rgrads[0])) > 0.05
  if mosaic:
    from flashjax.common import tolerances
    # Without the offsets the kernels drop other entries: the output's and the
    # gradients' errors would be of order one, far outside bf16's tolerances.
    tolerances.assert_close(np.asarray(jax.jit(ring)(q, k, v), np.float32),
                            reference.attention(*f32, **kw),
                            tolerances.forward("bfloat16"), name="out")
    for name, g, r in zip("qkv", grads, rgrads):
      tolerances.assert_close(np.asarray(g, np.float32), r,
                              tolerances.grad("bfloat16"), name=f"d{name}")
    return
  np.testing.assert_allclose(val, rval, rtol=1e-4)
  for g, r in zip(grads, rgrads):
    np.testing.assert_allclose(g, r, rtol=5e-4, atol=5e-4)


MULTI_GPU = pytest.mark.skipif(hardware.gpu_count() < 2,
                               reason="needs 2 or more GPUs")


def _auto_mesh_ring(platform, rows_per_device=256, split="ring", **extra):
  """bf16 causal attention split over every device by an Auto mesh axis, under
  jit. ``split``: "ring", the sequences of q, k and v (the partitioned call runs
  the ring: collective-permutes, no all-gather); "rows", q's rows alone (K/V
  whole); "heads", MQA with q's heads split and K/V whole (each shard slices its
  kv head). The last two move nothing but the K/V cotangents' sum. Outputs and
  gradients match the fp32 reference on the same inputs, with dropout."""
  from jax.sharding import NamedSharding
  from flashjax.common import tolerances
  n = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  sh = NamedSharding(mesh, P(None, None, "seq") if split == "heads" else P(None, "seq"))
  ks = jax.random.split(jax.random.key(0), 4)
  shape = lambda h: (2, rows_per_device * n, h, 64)
  hq, hkv = (2 * n, 1) if split == "heads" else (4, 2)
  q, do = (jax.random.normal(x, shape(hq), jnp.bfloat16) for x in ks[:2])
  k, v = (jax.random.normal(x, shape(hkv), jnp.bfloat16) for x in ks[2:])
  kw = dict(causal=True, dropout_rate=0.1, dropout_seed=7)

  def loss(f, **more):
    def run(q, k, v):
      out = f(q, k, v, **kw, **more)
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out
    return jax.value_and_grad(run, argnums=(0, 1, 2), has_aux=True)

  step = jax.jit(loss(flashjax.flash_attention, platform=platform, **extra))
  kv_sh = sh if split == "ring" else NamedSharding(mesh, P())
  args = [jax.device_put(q, sh)] + [jax.device_put(x, kv_sh) for x in (k, v)]
  compiled = step.lower(*args).compile()
  hlo = compiled.as_text()
  assert "all-gather" not in hlo
  assert ("collective-permute" in hlo) == (split == "ring")
  (_, out), grads = compiled(*args)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  (_, ref), ref_grads = jax.jit(loss(reference.attention))(*f32)
  tolerances.assert_close(np.asarray(out, np.float32), ref,
                          tolerances.forward("bfloat16"), name="out")
  for name, g, r in zip("qkv", grads, ref_grads):
    tolerances.assert_close(np.asarray(g, np.float32), r,
                            tolerances.grad("bfloat16"), name=f"d{name}")


@MULTI_GPU
@pytest.mark.parametrize("platform", ["pallas", "pallas-triton", "triton"])
def test_auto_mesh_ring_on_gpus(platform):
  _auto_mesh_ring(platform)


@MULTI_GPU
@pytest.mark.parametrize("platform", ["pallas", "pallas-triton", "triton"])
@pytest.mark.parametrize("split", ["rows", "heads"])
def test_auto_mesh_rows_and_heads_on_gpus(platform, split):
  _auto_mesh_ring(platform, split=split)


def _explicit_ring_on_gpus(platform, layout, rows_per_device=512):
  """bf16 ``ring_attention`` in ``shard_map`` over every GPU (NCCL), causal, GQA
  4:2, sinks, segment ids and dropout: output,
  lse and gradients equal the unsharded call of the same platform on one GPU,
  and both equal the fp32 reference."""
  from flashjax.common import tolerances
  n = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("seq",))
  s = rows_per_device * n
  ks = jax.random.split(jax.random.key(3), 6)
  q, do = (jax.random.normal(x, (2, s, 4, 64), jnp.bfloat16) for x in ks[:2])
  k, v = (jax.random.normal(x, (2, s, 2, 64), jnp.bfloat16) for x in ks[2:4])
  sinks = jax.random.normal(ks[4], (4,), jnp.float32)
  # Documents of random lengths, some crossing the devices' boundaries.
  seg = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 5, (2, s)), 1),
                    jnp.int32)
  kw = dict(causal=True, sinks=sinks, platform=platform, dropout_rate=0.1,
            dropout_seed=5)
  zz = layout == "zigzag"
  order = (lambda x: flashjax.zigzag_order(x, n)) if zz else (lambda x: x)
  restore = (lambda x, a=1: flashjax.zigzag_restore(x, n, a)) if zz else (
      lambda x, a=1: x)
  ring = jax.shard_map(
      lambda q, k, v, ids: flashjax.ring_attention(
          q, k, v, axis_name="seq", layout=layout, segment_ids=(ids, ids),
          return_lse=True, **kw),
      mesh=mesh, in_specs=(P(None, "seq"),) * 4,
      out_specs=(P(None, "seq"), P(None, None, "seq")), check_vma=False)

  def split(q, k, v):
    out, lse = ring(order(q), order(k), order(v), order(seg))
    return restore(out), restore(lse, 2)

  def whole(q, k, v, **more):
    return flashjax.flash_attention(q, k, v, segment_ids=(seg, seg),
                                    return_lse=True, **kw, **more)

  def grads(f):
    def loss(q, k, v, do):
      out, lse = f(q, k, v)
      return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), (out, lse)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  step = grads(split)
  hlo = step.lower(q, k, v, do).compile().as_text()
  assert "collective-permute" in hlo and "all-gather" not in hlo
  (_, got), dgot = step(q, k, v, do)
  one = jax.devices()[0]
  (_, want), dwant = grads(whole)(*(jax.device_put(x, one) for x in (q, k, v, do)))
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  ref_kw = {n: x for n, x in kw.items() if n != "platform"}
  (_, ref), dref = grads(lambda q, k, v: reference.attention(
      q, k, v, segment_ids=(seg, seg), return_lse=True, **ref_kw))(*f32)
  for name, a, b, r in (("out", got[0], want[0], ref[0]),
                        ("lse", got[1], want[1], ref[1])):
    tolerances.assert_matches(a, b, r, tolerances.forward("bfloat16"), name=name)
  for name, a, b, r in zip("qkv", dgot, dwant, dref):
    tolerances.assert_matches(a, b, r, tolerances.grad("bfloat16"), name=f"d{name}")
  assert float(jnp.std(dref[0])) > 0.01, "a case that cannot fail"


@MULTI_GPU
@pytest.mark.parametrize("platform", ["pallas", "pallas-triton", "triton"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_explicit_ring_on_gpus(platform, layout):
  _explicit_ring_on_gpus(platform, layout)


def _one_device(fn, *args):
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  return jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "seq"),) * len(args),
                       out_specs=P(None, "seq"), check_vma=False)(*args)


def test_errors():
  q = jax.random.normal(jax.random.key(0), (1, 6, 2, 8))
  ring = lambda **kw: (lambda q: flashjax.ring_attention(q, q, q, axis_name="seq",
                                                         **kw))
  with pytest.raises(ValueError, match="layout must be one of"):
    _one_device(ring(layout="ring"), q)
  with pytest.raises(ValueError, match="even local sequence lengths"):
    _one_device(ring(layout="zigzag"), q[:, :5])
  with pytest.raises(ValueError, match="axis_name='nope'"):
    _one_device(lambda q: flashjax.ring_attention(q, q, q, axis_name="nope"), q)
  with pytest.raises(ValueError, match="bias of shape"):
    _one_device(ring(bias=jnp.zeros((1, 2, 6, 5))), q)


XLA_AUTO = PRELUDE + textwrap.dedent("""
    # The xla platform on Auto mesh axes: its calls run per shard in
    # custom_partitioning like the kernel platforms', so a sequence split runs the
    # ring (collective-permutes, no all-gather); results equal the unsplit call's.
    from jax.sharding import NamedSharding

    def xla_auto(mesh, pspec, kv_pspec=None, sq=S, sk=S, hkv=2, **kw):
        t0 = time.time()
        sh = NamedSharding(mesh, P(*pspec))
        kv_sh = NamedSharding(mesh, P(*(pspec if kv_pspec is None else kv_pspec)))
        q, k, v = rand(B, sq, H, 16), rand(B, sk, hkv, 16), rand(B, sk, hkv, 16)
        do, dlse = rand(B, sq, H, 16), rand(B, H, sq)
        sinks = arrays["sinks"]
        total = lambda out, lse: (jnp.sum(out * do) + jnp.sum(
            jnp.where(jnp.isinf(lse), 0, lse) * dlse), (out, lse))
        grad = lambda f: jax.value_and_grad(lambda q, k, v, s: total(*f(
            q, k, v, sinks=s, return_lse=True, **kw)), argnums=(0, 1, 2, 3),
            has_aux=True)
        call = lambda *a, **x: flashjax.flash_attention(*a, platform="xla", **x)
        step = jax.jit(grad(call))
        args = (jax.device_put(q, sh), jax.device_put(k, kv_sh),
                jax.device_put(v, kv_sh), sinks)
        compiled = step.lower(*args).compile()
        hlo = compiled.as_text()
        (_, (out, lse)), grads = compiled(*args)
        # The unsharded call (one device's program) and the reference.
        (_, (uout, ulse)), ugrads = jax.jit(grad(call))(q, k, v, sinks)
        (_, (rout, rlse)), rgrads = jax.jit(grad(reference.attention))(q, k, v, sinks)
        np.testing.assert_allclose(out, uout, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, ulse, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out, rout, rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(lse, rlse, rtol=2e-4, atol=2e-4)
        assert float(jnp.std(rout)) > 0.05, "a case that cannot fail"
        for g, u, r in zip(grads, ugrads, rgrads):
            np.testing.assert_allclose(g, u, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(g, r, rtol=5e-4, atol=5e-4)
        assert grads[0].sharding.spec[:2] == tuple(pspec[:2]), grads[0].sharding
        print("ok xla auto", pspec, kv_pspec, sq, sk, kw, f"{{time.time() - t0:.1f}}s", flush=True)
        return hlo

    def ring_only(hlo):
        assert "collective-permute" in hlo
        for op in ("all-gather", "all-to-all"):
            assert op not in hlo, op

    seq = Mesh(np.array(jax.devices()), ("seq",))
    data_seq = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "seq"))
    # Causal: the zigzag layout, with dropout (global positions in the hash).
    ring_only(xla_auto(seq, (None, "seq"), causal=True, dropout_rate=0.2,
                       dropout_seed=4))
    # Not causal, batch split on the other axis; MQA.
    ring_only(xla_auto(data_seq, ("data", "seq"), hkv=1))
    # Sq != Sk (contiguous rows), the band off the diagonal, heads on "data".
    ring_only(xla_auto(data_seq, (None, "seq", "data"), sq=32,
                       sliding_window=(20, 3)))
    # Only q's rows split: K/V stay whole, each device attends its rows (XLA's
    # own partitioning of the xla platform did so too). Sq > Sk: the first rows
    # reach no key, the sinks alone.
    hlo = xla_auto(data_seq, ("data", "seq"), ("data",), sk=32, causal=True,
                   dropout_rate=0.1, dropout_seed=2)
    for op in ("all-gather", "all-to-all", "collective-permute"):
        assert op not in hlo, op

    # Mosaic TPU in interpret mode: each kernel call waits for every device (the
    # interpreter's rendezvous), and ring devices whose hops take different
    # branches never meet (a hang); it refuses several devices at trace time.
    x = rand(1, S, 2, 128)
    try:
        jax.jit(jax.shard_map(lambda x: flashjax.ring_attention(
            x, x, x, axis_name="seq", causal=True, platform="pallas",
            backend="tpu", interpret=True), mesh=seq, in_specs=P(None, "seq"),
            out_specs=P(None, "seq"), check_vma=False))(x)
    except NotImplementedError as e:
        assert "interpret mode runs on one device" in str(e), e
    else:
        raise AssertionError("pallas-tpu interpret ran a ring on several devices")
    print("OK")
""")


def test_xla_platform_auto_mesh_ring():
  _run(XLA_AUTO, 4)


def test_pallas_tpu_zigzag_ring_one_device():
  """Mosaic TPU (interpret mode) as the ring's hop kernel: causal with a window,
  GQA and sinks; out, lse and gradients (dq, dk, dv, dsinks) against the
  reference. One device (zigzag order is the plain order there), whose two
  chunks meet as two diagonal pairs, a windowed pair and an empty one; several
  devices refuse interpret mode (XLA_AUTO)."""
  ks = jax.random.split(jax.random.key(5), 6)
  q, do = (jax.random.normal(x, (1, 64, 4, 32)) for x in ks[:2])
  k, v = (jax.random.normal(x, (1, 64, 2, 32)) for x in ks[2:4])
  dlse = jax.random.normal(ks[4], (1, 4, 64))
  sinks = jax.random.normal(ks[5], (4,))
  kw = dict(causal=True, sliding_window=(40, 0), return_lse=True)
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))

  def ring(q, k, v, sinks):
    local = lambda q, k, v: flashjax.ring_attention(
        q, k, v, axis_name="seq", layout="zigzag", platform="pallas", backend="tpu",
        interpret=True, sinks=sinks, **kw)
    row = P(None, "seq")
    return jax.shard_map(local, mesh=mesh, in_specs=(row,) * 3,
                         out_specs=(row, P(None, None, "seq")), check_vma=False)(
                             q, k, v)

  def check(f):
    def total(*args):
      out, lse = f(*args)
      return jnp.sum(out * do) + jnp.sum(lse * dlse), (out, lse)
    return jax.value_and_grad(total, argnums=(0, 1, 2, 3), has_aux=True)

  (_, (out, lse)), grads = jax.jit(check(ring))(q, k, v, sinks)
  (_, (rout, rlse)), rgrads = jax.jit(check(
      lambda q, k, v, s: reference.attention(q, k, v, sinks=s, **kw)))(q, k, v, sinks)
  np.testing.assert_allclose(out, rout, rtol=2e-4, atol=2e-4)
  np.testing.assert_allclose(lse, rlse, rtol=2e-4, atol=2e-4)
  for g, r in zip(grads, rgrads):
    np.testing.assert_allclose(g, r, rtol=5e-4, atol=5e-4)
  assert float(jnp.std(rgrads[0])) > 0.05


def test_ring_hops_compare_ids_under_contiguous_segments(monkeypatch):
  """ring_attention accepts contiguous_segments but its hops compare ids: a
  shard's ids (two far-apart chunks in the zigzag layout) need not lie within
  its own length, as segments.spans requires. Every hop's kernel call (here
  and in the sharded calls under jit, common/partition.py) takes its spec from
  ring.hop_spec. The result is the reference's."""
  from flashjax.common import ring as ring_lib
  seen = []
  hop_spec = ring_lib.hop_spec

  def recording(spec, band):
    out = hop_spec(spec, band)
    seen.append((spec.contiguous_segments, out.contiguous_segments))
    return out
  monkeypatch.setattr(ring_lib, "hop_spec", recording)
  ks = jax.random.split(jax.random.key(9), 3)
  q, k, v = (jax.random.normal(x, (1, 64, 2, 16)) for x in ks)
  ids = jnp.asarray(np.repeat(np.arange(4), [10, 30, 4, 20])[None], jnp.int32)
  mesh = Mesh(np.array(jax.devices()[:1]), ("seq",))
  row = P(None, "seq")
  local = lambda q, k, v, ids: flashjax.ring_attention(
      q, k, v, axis_name="seq", layout="zigzag", causal=True, platform="xla",
      segment_ids=(ids, ids), contiguous_segments=True)
  out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(row,) * 3 + (row,),
                              out_specs=row, check_vma=False))(q, k, v, ids)
  assert seen and all(given and not hop for given, hop in seen), seen
  ref = reference.attention(q, k, v, causal=True, segment_ids=(ids, ids))
  np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
