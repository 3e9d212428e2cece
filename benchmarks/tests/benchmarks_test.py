"""The benchmark tool itself: FLOP counts, the wrong-output flag, reports."""

import csv
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.benchmarks import cli, impls, report, timing
from flashjax.common import shapes
from flashjax.common.shapes import Shape, get

SMALL = Shape(name="t", batch=1, seq_q=256, seq_k=256, heads_q=2, heads_kv=2,
              head_dim=32)


def test_flops_count_the_attended_pairs():
  s = get("standard")[0]  # B8 S2k H16 D128 non-causal
  assert timing.shape_flops(s, "fwd") == 4 * 8 * 16 * 2048 * 2048 * 128
  assert timing.shape_flops(s, "bwd") == 2.5 * timing.shape_flops(s, "fwd")
  causal = get("standard")[3]
  assert causal.causal and causal.seq_q == 2048
  # Exact pair count: half the square plus the diagonal.
  assert timing.shape_flops(causal, "fwd") == 4 * 8 * 16 * 128 * (2048 * 2049 // 2)


def test_wrong_implementation_is_flagged_not_ranked():
  def wrong(q, k, v, causal):
    return impls.IMPLS["xla"].build()(q, k, v, not causal)  # the other mask
  rows = timing.run_row("wrong", wrong, Shape(**{**SMALL.__dict__, "causal": True}),
                        jnp.float32, ["fwd"], iters=1, repeats=1)
  assert rows[0].status.startswith("WRONG") and rows[0].ms is None
  report.set_ratios(rows, "wrong")
  assert rows[0].ratio is None


def test_failing_implementation_is_reported():
  def broken(q, k, v, causal):
    raise RuntimeError("no kernel here")
  rows = timing.run_row("broken", broken, SMALL, jnp.float32, ["fwd"], iters=1,
                        repeats=1)
  assert "no kernel here" in rows[0].status


def test_unavailable_peer_has_a_reason():
  fn, reason = impls.build("jax-cudnn")  # GPU only
  assert fn is None and "backend" in reason
  fn, reason = impls.build("nonexistent")
  assert fn is None and "unknown" in reason


def test_backward_variants_run_when_named_only():
  """The Mosaic single pass and two kernels side by side: named in --impls,
  not in the default set, where "pallas" is the default config's choice."""
  gpu = impls.default_names("gpu")
  assert "pallas" in gpu
  assert "pallas-single-pass" not in gpu and "pallas-two-kernels" not in gpu
  for name in ("pallas-single-pass", "pallas-two-kernels"):
    assert impls.IMPLS[name].backends == ("gpu",)
    fn, reason = impls.build(name)  # GPU only
    assert fn is None and "backend" in reason


def _package_files(root):
  """Files under the package folder, less caches (.hypothesis, __pycache__,
  a checkout's .venv) that concurrent tests may write."""
  found = set()
  for d, subdirs, files in os.walk(root):
    subdirs[:] = [s for s in subdirs if not s.startswith(".") and s != "__pycache__"]
    found.update(os.path.join(d, f) for f in files)
  return found


def test_cli_writes_table_csv_markdown_and_plot_under_the_working_directory(
    tmp_path, monkeypatch, capsys):
  package = os.path.dirname(os.path.dirname(os.path.abspath(cli.__file__)))
  before = _package_files(package)
  monkeypatch.chdir(tmp_path)
  # The quick set's two 512-token shapes (its 2048-token ones took most of this
  # test's 45 s on the 2-core CI machine).
  rc = cli.main(["--shapes", "quick", "--shape-names", "B1-S512-",
                 "--impls", "xla,jax-xla,jax-cudnn",
                 "--directions", "fwd,bwd", "--iters", "1", "--repeats", "1",
                 "--memory-sweep", "512,1024"])
  assert rc == 0
  out = capsys.readouterr().out
  assert "x jax-xla" in out and "not run: jax-cudnn" in out
  (run,) = (tmp_path / "flashjax-bench").iterdir()  # the default: ./flashjax-bench/<time>
  with open(run / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert {r["impl"] for r in rows} == {"xla", "jax-xla"}
  assert all(float(r["ms"]) > 0 for r in rows if r["direction"] == "fwd")
  assert os.path.getsize(run / "tflops.png") > 10_000
  md = (run / "results.md").read_text()
  assert "Compiled memory" in md
  assert _package_files(package) == before  # nothing written into the package


def test_out_names_the_output_folder(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert cli.output_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
  default = cli.output_dir(None)
  assert os.path.dirname(default) == str(tmp_path / "flashjax-bench")


def test_memory_sweep_shows_linear_vs_quadratic():
  sweep = cli.memory_sweep([1024, 4096], jnp.float32)
  mib = {(m["impl"], m["seq"]): m["mib"] for m in sweep}
  # 4x the length: the blockwise one grows ~4x, dense ~16x.
  assert mib[("xla", 4096)] / mib[("xla", 1024)] < 6
  assert mib[("jax-xla", 4096)] / mib[("jax-xla", 1024)] > 10


def test_overlapping_shape_sets_run_each_shape_once():
  from flashjax.benchmarks import cli
  names = [s.name for s in cli.shape_list(["standard", "head_dim", "gqa"])]
  assert len(names) == len(set(names)) == 12
  assert names[:6] == [s.name for s in get("standard")]


def test_shape_names_keep_the_shapes_they_prefix():
  from flashjax.benchmarks import cli
  names = [s.name for s in cli.shape_list(["packed"], ["B1-8x2048", "B1-mixed"])]
  assert names == ["B1-8x2048-H16-D128", "B1-mixed16k-H16-D128",
                   "B1-8x2048-H16-D128-causal", "B1-mixed16k-H16-D128-causal"]
  with pytest.raises(SystemExit, match="--shape-names 'B9' matches no shape of "
                     "packed: B1-8x2048-H16-D128"):
    cli.shape_list(["packed"], ["B9"])


def test_cli_runs_only_the_named_shapes(tmp_path, capsys):
  every = [s.name for s in cli.shape_list(["quick"])]
  want = [n for n in every if n.endswith("-causal")][:1]
  assert want and len(every) > 1
  rc = cli.main(["--shapes", "quick", "--shape-names", want[0], "--impls", "xla",
                 "--directions", "fwd", "--iters", "1", "--repeats", "1",
                 "--out", str(tmp_path), "--no-plot", "--memory-sweep", ""])
  assert rc == 0
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert [r["shape"] for r in rows] == want


def test_interleaved_timing_rotates_rounds_and_reports_failures(monkeypatch):
  from flashjax.common import timer
  order = []

  def entry(name):
    def f():
      order.append(name)
      return jnp.zeros(())
    return f

  def fails():
    raise ValueError("cannot run")
  clock = iter(float(t) for t in range(1000))
  monkeypatch.setattr(timer.time, "perf_counter", lambda: next(clock))
  got = timer.time_interleaved_ms({"a": (entry("a"), ()), "b": (entry("b"), ()),
                                   "bad": (fails, ())}, iters=1, repeats=3)
  # Warm-up a, b; then rounds a b | b a | a b, each sample after one settling
  # call (one tick of the fake clock is 1000 ms, past settle_ms).
  assert order == ["a", "b"] + [x for x in "abbaab" for _ in range(2)]
  assert isinstance(got["bad"], ValueError)
  # Each sample spans one tick: 1000 ms per call.
  assert got["a"] == got["b"] == 1000.0


def test_run_shape_times_every_implementation_and_keeps_their_order():
  xla = impls.IMPLS["xla"].build()

  def broken(q, k, v, causal):
    raise RuntimeError("no kernel here")
  rows = timing.run_shape({"x1": xla, "broken": broken, "x2": xla}, SMALL,
                          jnp.float32, ["fwd", "bwd"], iters=1, repeats=2)
  assert [(r.impl, r.direction) for r in rows] == [
      ("x1", "fwd"), ("x1", "bwd"), ("broken", "fwd"), ("broken", "bwd"),
      ("x2", "fwd"), ("x2", "bwd")]
  timed = [r for r in rows if r.impl != "broken"]
  assert all(r.status == "ok" and r.ms is not None for r in timed)
  # bwd is a difference of two timings and may come out <= 0 on a tiny shape.
  assert all(r.ms > 0 for r in timed if r.direction == "fwd")
  assert all("no kernel here" in r.status for r in rows if r.impl == "broken")


def test_decode_shapes_get_their_key_length_and_bandwidth():
  shape = Shape(name="decode", batch=2, seq_q=1, seq_k=300, heads_q=4, heads_kv=2,
                head_dim=16)
  q, k, v, do = timing.random_inputs(shape, jnp.float32)
  assert q.shape == (2, 1, 4, 16) and k.shape == v.shape == (2, 300, 2, 16)
  assert do.shape == q.shape
  rows = timing.run_shape({"xla": impls.IMPLS["xla"].build()}, shape, jnp.float32,
                          ["fwd"], iters=1, repeats=1)
  assert rows[0].status == "ok"
  assert rows[0].gbs == pytest.approx(2 * k.size * 4 / (rows[0].ms * 1e-3) / 1e9)
  assert [(s.seq_q, s.seq_k) for s in get("decode")] == [
      (1, 8192), (1, 65536), (16, 4096), (1, 131072), (2, 4096), (4, 4096),
      (8, 4096)]


def test_ring_mode_smoke(capsys):
  # One CPU device here: the four modes run, and the table names them.
  assert cli.main(["--ring", "64", "--iters", "1", "--repeats", "1"]) == 0
  text = capsys.readouterr().out
  for mode in ("ring (contiguous)", "ring (zigzag)", "partitioned", "all-gather",
               "one device"):
    line = next(x for x in text.splitlines() if x.startswith(f"| {mode} | 64 |"))
    assert float(line.split("|")[-2]) < 1e-4, line  # max diff from one device


def test_ring_mode_shape_masks_and_modes(capsys):
  assert cli.main(["--ring", "32", "--ring-shape", "2,2,16", "--ring-masks", "causal",
                   "--ring-modes", "all-gather", "--iters", "1", "--repeats", "1"]) == 0
  text = capsys.readouterr().out
  assert "B,H,D 2,2,16" in text
  rows = [x for x in text.splitlines() if x.startswith("| ") and "| 32 |" in x]
  assert [r.split("|")[1].strip() for r in rows] == ["all-gather", "one device"]
  # One device: the ideal is the one-device time itself.
  assert rows[1].split("|")[6].strip() == "100%"
  for bad in (["--ring-shape", "2,2"], ["--ring-masks", "diagonal"],
              ["--ring-modes", "ring,allgather"]):
    with pytest.raises(SystemExit, match="--ring-"):
      cli.main(["--ring", "32", *bad])


def test_ring_layers_chain_calls_and_time_per_call(capsys, monkeypatch):
  from flashjax.benchmarks import ring
  # Three chained calls: the ring's output still matches one device's chain.
  assert cli.main(["--ring", "32", "--ring-shape", "1,2,16", "--ring-masks", "causal",
                   "--ring-modes", "ring (zig", "--ring-layers", "3", "--iters", "1",
                   "--repeats", "1"]) == 0
  text = capsys.readouterr().out
  assert "3 calls chained, times per call" in text
  line = next(x for x in text.splitlines() if x.startswith("| ring (zigzag) | 32 |"))
  assert float(line.split("|")[-2]) < 1e-4, line
  # Times are the chain's over the layer count; the fwd function runs the chain.
  monkeypatch.setattr(ring.timer, "time_interleaved_ms",
                      lambda calls, **kw: {key: 6.0 for key in calls})
  rows = ring.run(16, batch=1, heads=1, head_dim=8, causal_flags=[True],
                  only=["ring (zig"], layers=3)
  assert [r.fwd_ms for r in rows] == [2.0, 2.0]
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 16, 1, 8)) for i in range(3))
  once = ring._functions(lambda q, k, v, c: q * 2 + k, True, 3)[0](q, k, v)
  np.testing.assert_allclose(np.asarray(once), np.asarray(q * 8 + k * 7), rtol=1e-5, atol=1e-5)
  capsys.readouterr()
  with pytest.raises(SystemExit, match="--ring-layers"):
    cli.main(["--ring", "32", "--ring-layers", "0"])
  assert "chained" not in capsys.readouterr().out  # refused before the header


def test_ring_table_sets_each_row_against_one_device_over_its_count():
  from flashjax.benchmarks import ring
  rows = [ring.RingRow("ring (zigzag)", 64, 4, True, 2.0, 10.0, 1.0,
                       ideal_fwd_ms=1.5, ideal_fwd_bwd_ms=6.0),
          ring.RingRow("one device", 64, 1, True, 6.0, 24.0, 1.0,
                       ideal_fwd_ms=6.0, ideal_fwd_bwd_ms=24.0),
          ring.RingRow("all-gather", 64, 4, True, None, None, None, error="boom",
                       ideal_fwd_ms=1.5, ideal_fwd_bwd_ms=6.0)]
  cells = [[c.strip() for c in line.split("|")[1:-1]]
           for line in ring.table(rows).splitlines()[2:]]
  assert cells[0][5] == "75%" and cells[0][7] == "60%"   # 1.5 / 2.0, 6 / 10
  assert cells[1][5] == cells[1][7] == "100%"
  assert cells[2][4:8] == ["-"] * 4


def test_packed_set_runs_packed_batched_and_varlen_side_by_side():
  """The packed sets' rule at tiny size (mixed lengths, causal): every variant is
  checked against the reference with segment ids, then timed."""
  from flashjax.common import shapes
  assert {s.documents for s in get("packed")} >= {(2048,) * 8, (512,) * 32}
  assert all(16384 <= s.seq_q <= 32768 and sum(s.documents) == s.seq_q
             for s in get("packed"))
  xla = impls.IMPLS["xla"].build()
  shape = shapes.packed([(16, 48, 16)], heads=2, head_dim=32)[1]  # causal
  rows = timing.run_shape({"xla": xla}, shape, jnp.float32, ["fwd"], iters=1,
                          repeats=1)
  assert [r.impl for r in rows] == ["xla", "xla[contiguous]", "xla[batched]",
                                    "flash_mha_varlen"]
  assert all(r.status == "ok" and r.ms > 0 for r in rows), rows
  assert timing.shape_flops(shape, "fwd") == sum(
      timing.shape_flops(Shape(name="d", batch=1, seq_q=n, seq_k=n, heads_q=2,
                               heads_kv=2, head_dim=32, causal=True), "fwd")
      for n in shape.documents)


def test_packed_variants_take_their_ids_and_offsets_as_arguments():
  """The timed programs get a packed row's ids (offsets for the varlen entries)
  as arguments, so their preparation is timed: other operands give the other
  documents' result, and the jitted forward's parameters include them."""
  import dataclasses
  from flashjax.benchmarks import packed
  from flashjax.common import reference
  xla = impls.IMPLS["xla"].build()
  shape = shapes.packed([(16, 48, 16)], heads=2, head_dim=32)[1]
  other = dataclasses.replace(shape, documents=(48, 16, 16))
  q, k, v, _ = timing.random_inputs(shape, jnp.float32)
  ids = jnp.asarray(packed.segment_ids(other))
  want = reference.attention(q, k, v, causal=True, segment_ids=(ids, ids))
  for name, build in packed.variants({"xla": xla}).items():
    fn = build(shape)
    ops = packed.operands(fn)
    if name.endswith("[batched]"):
      assert ops == (), name
      continue
    assert len(ops) == 1 and ops[0].dtype == jnp.int32, name
    fwd, _ = timing.functions(fn, True)
    # jit drops unused arguments from the program: the ids must be a parameter.
    main = next(line for line in fwd.lower(q, k, v, *ops).as_text().splitlines()
                if "@main(" in line)
    assert "%arg3" in main, (name, main)
    swap = ids if ops[0].ndim == 2 else jnp.asarray(packed.cu_seqlens(other))
    np.testing.assert_allclose(fwd(q, k, v, swap), want, rtol=2e-5, atol=2e-5,
                               err_msg=name)
    assert not np.allclose(fwd(q, k, v, *ops), want, atol=1e-3), name


def test_dropout_set_runs_each_flashjax_call_with_and_without_dropout():
  """The dropout set's rule at tiny size: a flashjax implementation runs with
  dropout (checked against the reference with the same dropout, so a kernel
  without the hash would be flagged WRONG) and without it; a peer's row says it
  has none."""
  import dataclasses
  assert {s.dropout_rate for s in get("dropout")} == {0.1}
  assert all(s.name.endswith("-dropout0.1") for s in get("dropout"))
  with pytest.raises(ValueError, match="dropout_rate"):
    Shape(name="t", batch=1, seq_q=8, seq_k=8, heads_q=1, heads_kv=1, head_dim=8,
          dropout_rate=1.0)
  xla = impls.IMPLS["xla"].build()
  shape = dataclasses.replace(SMALL, causal=True, dropout_rate=0.3)
  peer = lambda q, k, v, causal: xla(q, k, v, causal)
  rows = timing.run_shape({"xla": xla, "jax-xla": peer}, shape, jnp.float32, ["fwd"],
                          iters=1, repeats=1)
  by = {r.impl: r for r in rows}
  assert list(by) == ["xla", "xla[no dropout]", "jax-xla"]
  assert by["xla"].status == by["xla[no dropout]"].status == "ok"
  assert by["xla"].ms > 0 and by["xla[no dropout]"].ms > 0
  assert "no dropout" in by["jax-xla"].status
  # A flashjax call that ignores dropout is flagged, not timed.
  rows = timing.run_shape({"xla": lambda q, k, v, causal, **kw: xla(q, k, v, causal)},
                          shape, jnp.float32, ["fwd"], iters=1, repeats=1)
  assert rows[0].status.startswith("WRONG"), rows[0]


@pytest.mark.parametrize("what", ["mask", "bias"])
def test_mask_and_bias_sets_run_each_flashjax_call_with_and_without(what):
  """The mask and bias sets' rule at tiny size: the flashjax call takes the
  shape's mask or bias as an argument of the timed program (a bias
  differentiated too) and is checked against the reference with it; a call
  that ignores it is flagged, not timed."""
  import dataclasses
  from flashjax.benchmarks import features, packed
  assert all(getattr(s, what) and s.name.endswith("-" + what) for s in get(what))
  with pytest.raises(ValueError, match="one feature"):
    dataclasses.replace(SMALL, mask=True, dropout_rate=0.1)
  with pytest.raises(ValueError, match="plain shapes"):
    dataclasses.replace(SMALL, bias=True, documents=(128, 128))
  xla = impls.IMPLS["xla"].build()
  shape = dataclasses.replace(SMALL, causal=True, **{what: True})
  peer = lambda q, k, v, causal: xla(q, k, v, causal)
  rows = timing.run_shape({"xla": xla, "jax-xla": peer}, shape, jnp.float32,
                          ["fwd", "bwd"], iters=1, repeats=1)
  by = {(r.impl, r.direction): r for r in rows}
  assert [r.impl for r in rows[::2]] == ["xla", f"xla[no {what}]", "jax-xla"]
  for name in ("xla", f"xla[no {what}]"):
    # bwd is forward+backward minus forward: from one sample each on a busy
    # CPU it can come out below zero, so only that it was timed is asserted.
    assert by[(name, "fwd")].status == by[(name, "bwd")].status == "ok", by
    assert by[(name, "fwd")].ms > 0 and np.isfinite(by[(name, "bwd")].ms), by
  assert f"no {what}" in by[("jax-xla", "fwd")].status
  # The operand is a parameter of the programs; the bias is differentiated.
  q, k, v, do = timing.random_inputs(shape, jnp.float32)
  fn = features.variants({"xla": xla}, shape, q, k)["xla"](shape)
  (op,) = packed.operands(fn)
  want = (1, 2, 256, 256) if what == "bias" else (1, 1, 256, 256)
  assert op.shape == want and (op.dtype == jnp.bool_) == (what == "mask")
  assert 0.8 < float(jnp.mean(op)) < 0.95 if what == "mask" else float(jnp.std(op)) > 0.5
  fwd, fwd_bwd = timing.functions(fn, True)
  main = next(line for line in fwd.lower(q, k, v, op).as_text().splitlines()
              if "@main(" in line)
  assert "%arg3" in main, main
  grads = fwd_bwd(q, k, v, do, op)
  assert len(grads) == (4 if what == "bias" else 3)
  assert float(jnp.abs(grads[-1]).max()) > 0
  # A flashjax call that ignores the feature is flagged, not timed.
  rows = timing.run_shape({"xla": lambda q, k, v, causal, **kw: xla(q, k, v, causal)},
                          shape, jnp.float32, ["fwd"], iters=1, repeats=1)
  assert rows[0].status.startswith("WRONG"), rows[0]


def test_cli_times_forward_mode_against_the_forward(tmp_path, capsys, monkeypatch):
  from flashjax.common import shapes
  monkeypatch.setitem(shapes.SHAPE_SETS, "small", (SMALL,))
  rc = cli.main(["--shapes", "small", "--impls", "xla", "--directions",
                 "fwd,jvp",
                 "--iters", "1", "--repeats", "1", "--no-plot", "--out",
                 str(tmp_path)])
  assert rc == 0
  out = capsys.readouterr().out
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  jvp = [r for r in rows if r["direction"] == "jvp"]
  assert [r["impl"] for r in jvp] == ["xla"]
  assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in jvp)
  assert "xla t: jvp / fwd = " in out


# A KV cache at tiny size: GQA 4:2, 64 positions per row in pages of 16.
KV_PAGED = Shape(name="kv-page16", batch=2, seq_q=2, seq_k=64, heads_q=4, heads_kv=2,
                 head_dim=16, page_size=16)
KV_CONTIGUOUS = Shape(**{**KV_PAGED.__dict__, "name": "kv-cache", "page_size": 0})


def test_kvcache_sets_hold_the_decode_sizes_contiguous_and_paged():
  want = set(shapes.DECODE)
  got = get("kvcache")
  assert {(s.batch, s.seq_q, s.seq_k) for s in got} == want
  assert sorted(s.page_size for s in got) == sorted([0, 16, 64, 256] * 4)
  assert all(s.name.endswith("-cache" if not s.page_size else f"-page{s.page_size}")
             for s in got)
  with pytest.raises(ValueError, match="page_size"):
    Shape(**{**KV_PAGED.__dict__, "page_size": 24})  # 64 is not whole pages of 24


def test_kvcache_rows_are_checked_on_the_gathered_keys(monkeypatch):
  """The paged cache's pages are scattered over the pool; flashjax's entry is
  checked on the keys gathered back through the page table and timed, a variant
  that reads the pool in pool order is flagged, a peer that does not import is
  reported, and the backward is skipped by name."""
  import sys

  import jax

  from flashjax.benchmarks import kvcache
  from flashjax.common import reference
  table = kvcache.page_table(KV_PAGED)
  assert table.shape == (2, 4)
  assert sorted(table.ravel()) == list(range(8)) and (table.ravel() != range(8)).any()

  def pool_order(shape):  # ignores the page table
    return lambda q, c, causal: reference.attention(
        q, c.k.reshape(shape.batch, -1, *c.k.shape[2:]),
        c.v.reshape(shape.batch, -1, *c.v.shape[2:]), causal=causal).astype(q.dtype)
  monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # import fails
  builders = kvcache.variants({"xla": impls.IMPLS["xla"].build(),
                               "flash-attn3-jax": None})
  # On an accelerator xla[kvcache], the fallback, runs beside the automatic choice.
  beside = [] if jax.default_backend() == "cpu" else ["xla[kvcache]"]
  assert list(builders) == ["flashjax[kvcache]", *beside, "flash-attn3-jax[kvcache]"]
  builders["pool-order"] = pool_order
  rows = kvcache.run_variants(builders, KV_PAGED, jnp.float32, ["fwd", "bwd"],
                              iters=1, repeats=1)
  by = {(r.impl, r.direction): r for r in rows}
  ok = by["flashjax[kvcache]", "fwd"]
  assert ok.status == "ok" and ok.ms > 0
  kv_bytes = 2 * 2 * 64 * 2 * 16 * 4
  assert ok.gbs == pytest.approx(kv_bytes / (ok.ms * 1e-3) / 1e9)
  assert by["pool-order", "fwd"].status.startswith("WRONG")
  assert "flash_attn3_jax" in by["flash-attn3-jax[kvcache]", "fwd"].status
  assert all(r.status == kvcache.SKIPPED for r in rows if r.direction == "bwd")


def test_kvcache_peer_row_builds_and_runs(monkeypatch):
  """The flash-attn3-jax row past its import: its split count is taken from the
  device and the call it builds is run and checked (a stand-in module with the
  peer's signature, answering with flashjax's own entry)."""
  import sys
  import types

  import flashjax
  from flashjax.benchmarks import kvcache
  seen = {}

  def peer(q, k, v, *, num_splits, **kw):
    seen["num_splits"] = num_splits
    return flashjax.flash_mha_with_kvcache(q, k, v, num_splits=0, **kw)
  monkeypatch.setitem(sys.modules, "flash_attn3_jax",
                      types.SimpleNamespace(flash_mha_with_kvcache=peer))
  builders = kvcache.variants({"xla": impls.IMPLS["xla"].build(),
                               "flash-attn3-jax": None})
  rows = kvcache.run_variants({"flash-attn3-jax[kvcache]":
                               builders["flash-attn3-jax[kvcache]"]},
                              KV_PAGED, jnp.float32, ["fwd"], iters=1, repeats=1)
  assert [r.status for r in rows] == ["ok"]
  assert seen["num_splits"] >= 1


def test_cli_runs_kvcache_shapes_with_the_copy_limit(tmp_path, capsys, monkeypatch):
  import jax

  from flashjax.benchmarks import kvcache
  from flashjax.common import shapes
  monkeypatch.setitem(shapes.SHAPE_SETS, "kv_tiny", (KV_CONTIGUOUS, KV_PAGED))
  rc = cli.main(["--shapes", "kv_tiny", "--impls", "xla,flash-attn3-jax",
                 "--directions", "fwd,bwd", "--iters", "1", "--repeats", "1",
                 "--no-plot", "--out", str(tmp_path)])
  assert rc == 0
  out = capsys.readouterr().out
  copy = float(out.split(", copy ")[1].split(" GB/s")[0])
  assert copy > 0
  if jax.default_backend() == "cpu":
    assert "not run: flash-attn3-jax" in out
  with open(tmp_path / "results.csv") as f:
    rows = [r for r in csv.DictReader(f) if r["impl"] == "flashjax[kvcache]"]
  assert [(r["shape"], r["direction"]) for r in rows] == [
      ("kv-cache", "fwd"), ("kv-cache", "bwd"), ("kv-page16", "fwd"),
      ("kv-page16", "bwd")]
  for r in rows:
    if r["direction"] == "fwd":
      assert r["status"] == "ok" and float(r["x_copy"]) > 0
      # The header's copy bandwidth is rounded to whole GB/s: off by at most 0.5
      # GB/s, so x_copy times it is off by at most 0.5 x_copy GB/s (a loaded
      # 2-core machine copies at a few GB/s, where that is over 10%).
      x = float(r["x_copy"])
      assert x * copy == pytest.approx(float(r["gbs"]), abs=0.5 * x + 1e-9)
    else:
      assert r["status"] == kvcache.SKIPPED and not r["x_copy"]
  md = (tmp_path / "results.md").read_text()
  assert "x copy" in md and " GB/s (read + write)" in md.splitlines()[0]


def test_copy_bandwidth_is_measured_and_sets_the_x_copy_column():
  gbs = timing.copy_gbs(4, iters=1, repeats=1)
  assert 0 < gbs < 1e5
  rows = [timing.Row(impl="a", shape="s", seq=1, causal=False, direction="fwd",
                     ms=1.0, gbs=2 * gbs),
          timing.Row(impl="a", shape="s", seq=1, causal=False, direction="bwd",
                     ms=1.0)]
  report.set_copy_ratios(rows, gbs)
  assert rows[0].x_copy == pytest.approx(2.0) and rows[1].x_copy is None
