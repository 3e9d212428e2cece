"""The benchmark tool itself: FLOP counts, the wrong-output flag, reports."""

import csv
import os

import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.benchmarks import cli, impls, report, timing
from flashjax.common.shapes import Shape, get

SMALL = Shape(name="t", batch=1, seq_q=256, seq_k=256, heads_q=2, heads_kv=2,
              head_dim=32)


def test_flops_follow_performance_md():
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


def test_cli_writes_table_csv_markdown_and_plot(tmp_path, capsys):
  rc = cli.main(["--shapes", "quick", "--impls", "xla,jax-xla,jax-cudnn",
                 "--directions", "fwd,bwd", "--iters", "1", "--repeats", "1",
                 "--memory-sweep", "512,1024", "--out", str(tmp_path)])
  assert rc == 0
  out = capsys.readouterr().out
  assert "x jax-xla" in out and "not run: jax-cudnn" in out
  with open(tmp_path / "results.csv") as f:
    rows = list(csv.DictReader(f))
  assert {r["impl"] for r in rows} == {"xla", "jax-xla"}
  assert all(float(r["ms"]) > 0 for r in rows if r["direction"] == "fwd")
  assert os.path.getsize(tmp_path / "tflops.png") > 10_000
  md = (tmp_path / "results.md").read_text()
  assert "Compiled memory" in md


def test_memory_sweep_shows_linear_vs_quadratic():
  sweep = cli.memory_sweep([1024, 4096], jnp.float32)
  mib = {(m["impl"], m["seq"]): m["mib"] for m in sweep}
  # 4x the length: the blockwise one grows ~4x, dense ~16x.
  assert mib[("xla", 4096)] / mib[("xla", 1024)] < 6
  assert mib[("jax-xla", 4096)] / mib[("jax-xla", 1024)] > 10


def test_pallas_triton_sweep_parses_candidates():
  import jax
  from flashjax.benchmarks import pallas_triton_sweep
  from flashjax.pallas_gpu import pallas_triton
  q = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16)
  cfg = pallas_triton_sweep._config("128,64,8,4", q, q, q, causal=True)
  assert (cfg.fwd.block_q, cfg.fwd.block_kv, cfg.fwd.num_warps,
          cfg.fwd.num_stages) == (128, 64, 8, 4)
  default = pallas_triton_sweep._config("-", q, q, q, causal=False)
  assert cfg.dq == default.dq and cfg.dkv == default.dkv
  assert default.fwd.block_kv == 128
  assert default.fold_causal and cfg.fold_causal  # the long-key default folds
  off = pallas_triton_sweep._config("-,nofold", q, q, q, causal=True)
  assert not off.fold_causal and off.fwd == default.fwd
  on = pallas_triton_sweep._config("128,64,4,2,fold", q, q, q, causal=True)
  assert on.fold_causal and on.fwd.num_warps == 4
  assert default.split_tail  # long keys at 2 bytes split the forward's last wave
  both = pallas_triton_sweep._config("-,nofold,nosplit", q, q, q, causal=False)
  assert not both.fold_causal and not both.split_tail and both.fwd == default.fwd


def test_sweep_rows_time_candidates_against_the_baseline(capsys):
  import jax
  from flashjax.benchmarks import sweeps

  def candidate(text, shp, q, k, v):
    if text == "bad":
      raise ValueError("does not fit")
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=shp.causal)

  sweeps.forward_rows("quick", ["good", "bad"], "xla",
                      lambda shp: lambda q, k, v: jax.nn.dot_product_attention(
                          q, k, v, is_causal=shp.causal), candidate,
                      iters=1, repeats=1)
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("B1")]
  assert len(rows) == len(get("quick"))
  for r in rows:
    assert " xla " in r and "good " in r and "x) |" in r
    assert "bad ERR ValueError: does not fit" in r


def test_kernel_profile_summary_groups_kernels_under_their_marker(tmp_path):
  from flashjax.benchmarks import kernel_profile
  header = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
  rows = [
      ("0", "mark_pallas_B2_S8k_H16_D128_bwd", "SOL", "Duration", "ns", "1,024"),
      ("1", "dq_kernel(int)", "SOL", "Duration", "ms", "1.50"),
      ("1", "dq_kernel(int)", "CWA", "Issue Slots Busy", "%", "40.5"),
      ("1", "dq_kernel(int)", "cmd",
       "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active", "%", "61.2"),
      ("2", "dkv_kernel(int)", "SOL", "Duration", "usecond", "2,500.5"),
      ("3", "mark_jax_cudnn_B2_S8k_H16_D128_bwd", "SOL", "Duration", "nsecond", "900"),
      ("4", "cudnn_bwd", "SOL", "Duration", "usecond", "3000"),
  ]
  path = tmp_path / "prof.csv"
  path.write_text("==PROF== Connected\n" + header + "".join(
      ",".join(f'"{c}"' for c in r) + "\n" for r in rows))
  text = kernel_profile.summarize(str(path))
  pallas, cudnn = text.split("== ")[1:]
  assert pallas.startswith("pallas_B2_S8k_H16_D128 bwd")
  assert "us=1500.0" in pallas and "issue%=40.5" in pallas
  assert "pipe_tensor_op_gmma_cycles_active=61.2" in pallas
  assert "total 4000.5 us" in pallas
  assert "total 3000.0 us" in cudnn and "mark_" not in text.replace("== ", "")


def test_overlapping_shape_sets_run_each_shape_once():
  from flashjax.benchmarks import cli
  names = [s.name for s in cli.shape_list(["standard", "head_dim", "gqa"])]
  assert len(names) == len(set(names)) == 12
  assert names[:6] == [s.name for s in get("standard")]


def test_launch_gaps_reads_device_events_and_splits_busy_from_idle(tmp_path):
  import gzip
  import json
  from flashjax.benchmarks import launch_gaps
  events = [
      {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
      {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
      {"ph": "X", "pid": 1, "name": "host_op", "ts": 0, "dur": 500},
      # Two calls: kernel a then b; b overlaps a's tail on another stream.
      {"ph": "X", "pid": 7, "name": "a", "ts": 100, "dur": 50},
      {"ph": "X", "pid": 7, "name": "b", "ts": 140, "dur": 20},
      {"ph": "X", "pid": 7, "name": "a", "ts": 200, "dur": 50},
      {"ph": "X", "pid": 7, "name": "b", "ts": 260, "dur": 40},
  ]
  sub = tmp_path / "plugins" / "profile" / "run"
  sub.mkdir(parents=True)
  with gzip.open(sub / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  got = launch_gaps.device_events(str(tmp_path))
  assert [e[0] for e in got] == ["a", "b", "a", "b"]
  span, busy, idle, kernels = launch_gaps.summarize(got, n=2)
  # Span 100..300 = 200 us; busy = [100, 160] + [200, 250] + [260, 300] = 150 us.
  assert (span, busy, idle) == (100.0, 75.0, 25.0)
  assert kernels == {"a": 50.0, "b": 30.0}
  assert launch_gaps.summarize([], n=1) is None


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


def test_cpu_step_costs_counts_the_causal_schedule():
  from flashjax.benchmarks import cpu_step_costs as c
  from flashjax.xla_cpu.config import XlaConfig
  # 512x256 blocks at S = 2048: 4 q blocks x 8 kv blocks; q block i runs 2i
  # interior steps, one masked full step and one half-height step.
  assert c.causal_steps(2048) == (16, 4, 32)
  assert c.causal_floor(2048, 1.0, 0.5) == 18 / 32
  assert c.causal_floor(2048, 2.0, 2.0) == 20 / 32
  assert c.causal_steps(4096) == (64, 8, 128)
  # Odd-sized blocks: no half-height steps.
  full, half, total = c.causal_steps(64, XlaConfig(block_q=15, block_kv=16))
  assert half == 0 and 0 < full < total


def test_cpu_step_loop_is_an_online_softmax_and_measure_reports_each_tile():
  from flashjax.benchmarks import cpu_step_costs as c
  f, (q, kt, v) = c.step_loop(4, 8, heads=2, head_dim=3, steps=3)
  m, l, acc = f(q, kt, v)
  s = np.einsum("hqd,hdk->hqk", np.asarray(q)[0, :, 0], np.asarray(kt)[0]) * 0.125
  ok = np.arange(8)[None, :] <= np.arange(4)[:, None] + 4
  s = np.where(np.tile(ok, (1, 3))[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("hqk,hkd->hqd", p / p.sum(-1, keepdims=True), np.asarray(v)[0])
  np.testing.assert_allclose(np.asarray(acc / l[..., None])[0, :, 0], want,
                             rtol=1e-5, atol=1e-6)
  got = c.measure(((8, 4), (4, 8)), rounds=2, steps=2, heads=1, head_dim=4)
  assert set(got) == {(8, 4), (4, 8)}
  assert all(0 < mn <= med for mn, med in got.values())


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
