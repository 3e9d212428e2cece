"""The experiment scripts of tools/: sweep candidates, profile and trace parsing,
the CPU step-cost model (no GPU needed)."""

import jax.numpy as jnp
import numpy as np
import pytest

from flashjax.common.shapes import get
from flashjax.common.env import cpu_devices_env


def test_pallas_triton_sweep_parses_candidates():
  import jax
  from tools import pallas_triton_sweep
  from flashjax.pallas_gpu.triton import pallas_triton
  q = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16)
  cfg = pallas_triton_sweep._config("128,64,8,4", q, q, q, causal=True)
  assert (cfg.fwd.block_q, cfg.fwd.block_kv, cfg.fwd.num_warps,
          cfg.fwd.num_stages) == (128, 64, 8, 4)
  default = pallas_triton_sweep._config("-", q, q, q, causal=False)
  assert cfg.dq == default.dq and cfg.dkv == default.dkv
  assert default.fwd.block_kv == 128
  assert default.fwd.fold_causal and cfg.fwd.fold_causal  # the long-key default folds
  tiles = lambda c: (c.fwd.block_q, c.fwd.block_kv, c.fwd.num_warps, c.fwd.num_stages)
  off = pallas_triton_sweep._config("-,nofold", q, q, q, causal=True)
  assert not off.fwd.fold_causal and tiles(off) == tiles(default)
  on = pallas_triton_sweep._config("128,64,4,2,fold", q, q, q, causal=True)
  assert on.fwd.fold_causal and on.fwd.num_warps == 4
  assert default.fwd.split_tail  # long keys at 2 bytes split the forward's last wave
  both = pallas_triton_sweep._config("-,nofold,nosplit", q, q, q, causal=False)
  assert not both.fwd.fold_causal and not both.fwd.split_tail
  assert tiles(both) == tiles(default)


def test_mosaic_sweep_parses_candidates():
  from tools import mosaic_sweep
  from flashjax.pallas_gpu import mosaic
  assert mosaic_sweep.config("-") == mosaic.MosaicConfig()
  cfg = mosaic_sweep.config("fwd.block_kv=64,fwd.num_stages=3,fwd.persistent=0,"
                            "dq.block_kv=128,dkv.num_stages=3,bwd_one_launch=0,"
                            "bwd_single_pass=1")
  assert cfg == mosaic.MosaicConfig(
      fwd=mosaic.MosaicForward(block_kv=64, num_stages=3, persistent=False),
      dq=mosaic.MosaicDq(block_kv=128), dkv=mosaic.MosaicDkv(num_stages=3),
      bwd_one_launch=False, bwd_single_pass=True)
  with pytest.raises(TypeError):
    mosaic_sweep.config("stages=3")  # the old flat field names


def test_sweep_rows_time_candidates_against_the_baseline(capsys):
  import jax
  from tools import sweeps

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
  from tools import kernel_profile
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


def test_launch_gaps_reads_device_events_and_splits_busy_from_idle(tmp_path):
  import gzip
  import json
  from tools import launch_gaps
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


def test_launch_gaps_runs_the_packed_set_as_the_packed_benchmark(monkeypatch, capsys):
  """In a packed set each implementation runs with segment ids (also promised
  contiguous, ``[contiguous]``), as ``[batched]`` calls on the same documents
  and through the varlen entry, each forward and backward measured once."""
  from tools import launch_gaps
  calls = []
  monkeypatch.setattr(launch_gaps, "measure",
                      lambda fn, args, n: (calls.append(n), (1.0, None))[1])
  launch_gaps.main(["xla", "B1-8x512-H8-D64-causal", "3", "packed_cpu"])
  lines = [l for l in capsys.readouterr().out.splitlines() if "wall" in l]
  assert [l.split()[1:3] for l in lines] == [
      [v, d] for v in ("xla", "xla[contiguous]", "xla[batched]", "flash_mha_varlen")
      for d in ("fwd", "bwd")]
  assert calls == [3] * 8


def test_cpu_step_costs_counts_the_causal_schedule():
  from tools import cpu_step_costs as c
  from flashjax.xla_cpu.config import BlockSizes, XlaConfig
  # 512x256 blocks at S = 2048: 4 q blocks x 8 kv blocks; q block i runs 2i
  # interior steps, one masked full step and one half-height step.
  assert c.causal_steps(2048) == (16, 4, 32)
  assert c.causal_floor(2048, 1.0, 0.5) == 18 / 32
  assert c.causal_floor(2048, 2.0, 2.0) == 20 / 32
  assert c.causal_steps(4096) == (64, 8, 128)
  # Odd-sized blocks: no half-height steps.
  full, half, total = c.causal_steps(64, XlaConfig(fwd=BlockSizes(block_q=15,
                                                                  block_kv=16)))
  assert half == 0 and 0 < full < total


def test_cpu_step_loop_is_an_online_softmax_and_measure_reports_each_tile():
  from tools import cpu_step_costs as c
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


def test_ring_profile_splits_transfers_into_hidden_and_exposed():
  from tools import ring_profile
  events = [("ncclDevKernel_SendRecv", 0.0, 100.0),   # 40 us beside kernel a
            ("entry_mosaic_gpu_kernel", 60.0, 100.0),  # a: 60-160
            ("memcpy128", 150.0, 30.0),                # 150-180, overlaps a
            ("ncclDevKernel_SendRecv", 200.0, 50.0)]   # alone
  o = ring_profile.overlap(events, n=2)
  assert o["span"] == pytest.approx(125.0)
  assert o["compute"] == pytest.approx(60.0)   # union 60-180, per call
  assert o["comm"] == pytest.approx(75.0)
  assert o["hidden"] == pytest.approx(20.0)
  assert o["exposed"] == pytest.approx(55.0)
  # Compute 60-180 us: the attention kernel 60-160, the copy beside it 160-180.
  assert o["kernels"] == pytest.approx(50.0) and o["beside"] == pytest.approx(10.0)
  assert ring_profile.is_attention("entry_mosaic_gpu_kernel")
  assert ring_profile.is_attention("flashjax_pallas_triton_bwd_dkv")
  assert not ring_profile.is_attention("loop_add_fusion")
  assert ring_profile.intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
  assert not ring_profile.is_comm("entry_mosaic_gpu_kernel")
  assert not ring_profile.is_comm("memcpy128")  # XLA's copy kernel
  assert ring_profile.is_comm("MemcpyP2P")  # a peer copy (copy engines)
  # No compute before 60 and after 180 (the transfers run alone): 130 us, per call.
  assert o["no_compute"] == pytest.approx(65.0)
  assert o["after_d2h"] == 0.0


def test_ring_profile_counts_the_idle_time_after_host_copies():
  # A conditional's index goes to the host (MemcpyD2H) and the branch's kernel
  # starts 40 us later: that gap counts; the gap after a kernel does not, nor
  # a D2H copy that ends inside a compute interval.
  from tools import ring_profile
  events = [("entry_mosaic_gpu_kernel", 0.0, 100.0),
            ("MemcpyD2H", 100.0, 5.0),                 # ends the interval 0-105
            ("entry_mosaic_gpu_kernel", 145.0, 100.0),  # 40 us after it
            ("MemcpyD2H", 150.0, 5.0),                 # inside the kernel
            ("loop_add_fusion", 265.0, 10.0),           # 20 us after a kernel
            ("MemcpyP2P", 240.0, 80.0)]                 # a transfer, not compute
  o = ring_profile.overlap(events)
  assert o["after_d2h"] == pytest.approx(40.0)
  assert o["no_compute"] == pytest.approx(320.0 - 105.0 - 100.0 - 10.0)
  assert ring_profile.is_host_copy("MemcpyD2H") and not ring_profile.is_host_copy(
      "MemcpyD2D")


def test_ring_gpu_runs_plans_each_gpu_count(tmp_path):
  # The dry run names one scaling run per GPU count (2, 4, ... up to the host's)
  # and tokens per GPU (8k, 32k), each on the first n GPUs, between the GPU
  # tests and the profile.
  import os
  import subprocess
  script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "ring_gpu_runs.sh")
  run = lambda n: subprocess.run(["bash", script, "--dry-run", str(n)], text=True,
                                 capture_output=True, env=dict(os.environ, OUT=str(tmp_path)),
                                 check=True).stdout.splitlines()
  lines = run(4)
  assert "tests/ring_test.py tests/sharding_test.py -k gpus" in lines[0]
  scaling = [l for l in lines if "flashjax.benchmarks" in l]
  want = [("0,1", 16384), ("0,1", 65536), ("0,1,2,3", 32768), ("0,1,2,3", 131072)]
  assert len(scaling) == len(want)
  for line, (devices, seq) in zip(scaling, want):
    assert f"CUDA_VISIBLE_DEVICES={devices} " in line and f"--ring {seq} " in line
    assert ("--iters 3" in line) == (seq // len(devices.split(",")) == 32768)
  assert "tools.ring_profile 32768" in lines[-1]
  assert len(run(2)) == 4 and len(run(8)) == 8
  assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_ring_gpu_runs_picks_counts_and_parts(tmp_path):
  # RING_COUNTS and RING_PARTS split the runs over several shorter calls;
  # WORKERS sets the test processes.
  import os
  import subprocess
  script = os.path.join(os.path.dirname(os.path.dirname(__file__)), "ring_gpu_runs.sh")

  def run(**env):
    return subprocess.run(["bash", script, "--dry-run", "4"], text=True,
                          capture_output=True, check=True,
                          env=dict(os.environ, OUT=str(tmp_path), **env)).stdout.splitlines()

  lines = run(RING_COUNTS="4", RING_PARTS="scaling profile")
  assert len(lines) == 3 and all("CUDA_VISIBLE_DEVICES=0,1,2,3 " in l for l in lines[:2])
  assert "tools.ring_profile 32768" in lines[2]
  lines = run(RING_PARTS="tests", WORKERS="4")
  assert len(lines) == 1 and "WORKERS=4 " in lines[0] and "tests/ring_test.py" in lines[0]
  lines = run(RING_COUNTS="2", RING_PARTS="scaling")
  assert len(lines) == 2 and all("CUDA_VISIBLE_DEVICES=0,1 " in l for l in lines)
  bad = subprocess.run(["bash", script, "--dry-run", "4"], text=True,
                       capture_output=True, env=dict(os.environ, OUT=str(tmp_path),
                                                     RING_PARTS="tests,profile"))
  assert bad.returncode == 2 and "RING_PARTS" in bad.stderr and not bad.stdout


def test_ring_profile_lists_the_first_calls_kernels_and_times_calls():
  from tools import ring_profile
  # Two calls of two attention kernels each, a fusion between them.
  events = [("entry_mosaic_gpu_kernel", 0.0, 400.0),
            ("loop_add_fusion", 400.0, 40.0),
            ("entry_mosaic_gpu_kernel", 440.0, 1300.0),
            ("entry_mosaic_gpu_kernel", 2000.0, 410.0),
            ("entry_mosaic_gpu_kernel", 2410.0, 1310.0)]
  assert ring_profile.first_call_kernels(events, 2) == [400.0, 1300.0]
  assert ring_profile.first_call_kernels(events[:1], 2) == [400.0]
  calls = []
  wall, ahead = ring_profile.wall_clock_ms(lambda x: calls.append(x) or x, (1,),
                                           calls=3)
  assert calls == [1, 1, 1] and wall >= 0 and ahead >= 0


def test_ring_profile_full_mask_runs_the_ring_without_switches():
  # A full mask gives every device the same call at every hop (one branch, no
  # lax.switch), which is what the MASK argument compares against the causal
  # ring; the tool runs on fake CPU devices (no GPU events to read there).
  import pathlib
  import subprocess
  import sys
  from flashjax.common import ring
  from flashjax.common.mask import Band
  for layout in ("contiguous", "zigzag"):
    plan = ring.RingPlan(axis_name="seq", num_shards=4, layout=layout,
                         band=Band(seq_q=64, seq_k=64))
    chunk = 16 // plan.num_chunks
    for hop in range(4):
      assert len({plan.hop_calls(r, hop, chunk, chunk) for r in range(4)}) == 1
  root = pathlib.Path(__file__).resolve().parents[2]
  env = cpu_devices_env(4)
  run = lambda *args: subprocess.run(
      [sys.executable, "-m", "tools.ring_profile", "64", "1,2,16", *args],
      cwd=root, env=env, capture_output=True, text=True, timeout=300)
  done = run("contiguous", "1", "full")
  assert done.returncode == 0, done.stderr[-2000:]
  assert "contiguous, full" in done.stdout
  assert done.stdout.count("wall clock") == 2 and "no GPU events" in done.stdout
  bad = run("contiguous", "1", "sliding")
  assert bad.returncode != 0 and "MASK is causal or full" in bad.stderr


def test_mosaic_sass_dump_packs_the_kernels_dumps(tmp_path):
  """tools/mosaic_sass.sh dump: the command runs with Mosaic's PTX and ptxas
  dumps pointed at the folder, each kernel's spill line is printed, the dumps
  are packed for the trip off the GPU host, and the command's exit status is
  the stage's. (The sass stage needs CUDA 13.5's ptxas from pip.)"""
  import pathlib
  import subprocess
  import tarfile
  script = pathlib.Path(__file__).resolve().parents[1] / "mosaic_sass.sh"
  fake_compile = (
      'test "$MOSAIC_GPU_DUMP_PTX$MOSAIC_GPU_DUMP_PTXAS" = 11 || exit 9; '
      'echo ".version 9.0" > "$MOSAIC_GPU_DUMP_TO/entry_0.ptx"; '
      'echo "    8 bytes spill stores, 24 bytes spill loads" '
      '> "$MOSAIC_GPU_DUMP_TO/entry_0.ptxas"; '
      'echo ".version 9.0" > "$MOSAIC_GPU_DUMP_TO/body_1.ptx"; '
      'echo "    0 bytes spill stores, 0 bytes spill loads" '
      '> "$MOSAIC_GPU_DUMP_TO/body_1.ptxas"; '
      'echo log > "$MOSAIC_GPU_DUMP_TO/entry_0.mlir"; exit 3')
  dump = tmp_path / "dump"
  done = subprocess.run(["bash", str(script), "dump", str(dump), "bash", "-c",
                         fake_compile], capture_output=True, text=True, timeout=60)
  assert done.returncode == 3, done.stderr
  assert "entry_0.ptxas:    8 bytes spill stores, 24 bytes spill loads" in done.stdout
  with tarfile.open(dump / "ptx.tar.xz") as packed:
    # Every kernel, whatever its name (body: pl.kernel's), not the pass logs.
    assert sorted(packed.getnames()) == ["body_1.ptx", "body_1.ptxas", "entry_0.ptx",
                                         "entry_0.ptxas"]
  # A folder of earlier dumps is refused; a command that compiles no kernel
  # fails even when it exits 0.
  again = subprocess.run(["bash", str(script), "dump", str(dump), "true"],
                         capture_output=True, text=True, timeout=60)
  assert again.returncode == 2 and "not empty" in again.stderr
  none = subprocess.run(["bash", str(script), "dump", str(tmp_path / "new"), "true"],
                        capture_output=True, text=True, timeout=60)
  assert none.returncode == 1 and "no NAME_N.ptx" in none.stderr
  for args in ([], ["dump", str(dump)], ["sass", str(tmp_path / "none")],
               ["sass", str(tmp_path / "new")], ["nonsense", str(dump)]):
    bad = subprocess.run(["bash", str(script), *args], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2, (args, bad.stderr)


def _fake_cuda_tools(tmp_path, report):
  """tools/mosaic_sass.sh's path, with stand-ins for ptxas and nvdisasm in a
  venv under ``tmp_path`` (pass it as SASS_VENV): the fake ptxas copies the PTX
  (``$src``) to the cubin and prints what the shell lines ``report`` print; the
  fake nvdisasm prints the cubin."""
  import pathlib
  bin_dir = tmp_path / "venv/lib/python3.11/site-packages/nvidia/cu13/bin"
  bin_dir.mkdir(parents=True)
  (bin_dir / "ptxas").write_text(
      '#!/usr/bin/env bash\n'
      '[ "$1" = --version ] && { echo "Build fake"; exit 0; }\n'
      'for a in "$@"; do case "$a" in *.ptx) src="$a";; esac; done\n'
      'while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
      'cp "$src" "$out"\n' + report)
  (bin_dir / "nvdisasm").write_text('#!/usr/bin/env bash\ncat "$2"\n')
  for tool in ("ptxas", "nvdisasm"):
    (bin_dir / tool).chmod(0o755)
  return pathlib.Path(__file__).resolve().parents[1] / "mosaic_sass.sh"


def test_mosaic_sass_compiles_another_register_split(tmp_path):
  """tools/mosaic_sass.sh sass with REGISTERS=C/M: each kernel's setmaxnreg
  values are rewritten in a copy that ptxas compiles, a kernel without them is
  named and left alone, a split past 64K registers per CTA is flagged, and a
  malformed split is refused before anything is installed. ptxas and nvdisasm
  are stand-ins here: the fake ptxas reports the .inc value it was given as
  its spill bytes."""
  import os
  import subprocess
  script = _fake_cuda_tools(
      tmp_path,
      'n=$(grep -o "inc.sync.aligned.u32 [0-9]*" "$src" | grep -o "[0-9]*$" | head -1)\n'
      'echo "    0 bytes stack frame, ${n:-0} bytes spill stores, 0 bytes spill loads"\n')
  dump = tmp_path / "dump"
  dump.mkdir()
  (dump / "entry_0.ptx").write_text(
      ".maxntid 384, 1, 1\n\tsetmaxnreg.inc.sync.aligned.u32 232;\n"
      "\tsetmaxnreg.dec.sync.aligned.u32 40;\n")
  (dump / "body_1.ptx").write_text(".maxntid 128, 1, 1\n")

  def sass(registers):
    env = dict(os.environ, SASS_VENV=str(tmp_path / "venv"), REGISTERS=registers)
    return subprocess.run(["bash", str(script), "sass", str(dump)], env=env,
                          capture_output=True, text=True, timeout=60)

  done = sass("240/24")
  assert done.returncode == 0, done.stderr
  assert "regs240-24_entry_0: 240 bytes spill stores, 0 bytes spill loads" in done.stdout
  assert "body_1: no setmaxnreg" in done.stdout
  copy = (dump / "regs240-24_entry_0.ptx").read_text()
  assert "u32 240;" in copy and "u32 24;" in copy and "232" not in copy
  assert "u32 232;" in (dump / "entry_0.ptx").read_text()  # the dump is kept
  assert "exceed 64K" not in done.stderr
  over = sass("256/24")
  assert over.returncode == 0 and "exceed 64K" in over.stderr
  assert "regs256-24_entry_0: 256 bytes spill stores" in over.stdout
  plain = sass("")
  assert "entry_0: 232 bytes spill stores" in plain.stdout
  assert "regs240-24" not in plain.stdout  # the earlier copies are not kernels
  for bad in ("240", "241/24", "240/16", "x/24"):
    refused = sass(bad)
    assert refused.returncode == 2 and "REGISTERS must be C/M" in refused.stderr


def test_mosaic_sass_flags_serialized_wgmmas(tmp_path):
  """tools/mosaic_sass.sh sass names the kernels whose wgmmas ptxas serialized
  (its C7512 report: no product overlaps anything, whatever the spills), and
  only those. The fake ptxas reports C7512 for a PTX that asks for it."""
  import os
  import subprocess
  script = _fake_cuda_tools(
      tmp_path,
      'grep -q serial "$src" && echo "ptxas info    : (C7512) Potential Performance'
      ' Loss: wgmma.mma_async instructions are serialized"\n'
      'echo "    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads"\n')
  dump = tmp_path / "dump"
  dump.mkdir()
  (dump / "entry_0.ptx").write_text("// plain\n")
  (dump / "body_1.ptx").write_text("// serial\n")
  done = subprocess.run(["bash", str(script), "sass", str(dump)],
                        env=dict(os.environ, SASS_VENV=str(tmp_path / "venv")),
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  lines = {line.split(":")[0]: line for line in done.stdout.splitlines()}
  assert "WGMMA SERIALIZED (ptxas C7512)" in lines["body_1"]
  assert "SERIALIZED" not in lines["entry_0"]
  assert "8 bytes spill stores" in lines["entry_0"]


def test_spread_tests_deals_every_case_once_and_reports_each_gpu(
    tmp_path, capsys, monkeypatch):
  # A throwaway suite of five cases, one failing: dealt over two "GPUs" (on
  # the CPU CUDA_VISIBLE_DEVICES changes nothing), every case runs once, each
  # GPU's summary is printed, the failure named, and the exit code says so.
  # Node ids are relative to pytest's rootdir: run from the suite's folder, as
  # from the repository root for flashjax's suites.
  from tools import spread_tests
  monkeypatch.chdir(tmp_path)
  suite = tmp_path / "suite_test.py"
  suite.write_text("import pytest\n\n"
                   "@pytest.mark.parametrize('i', range(5))\n"
                   "def test_case(i):\n"
                   "  import os\n"
                   "  open(f'{__file__}.{i}', 'a').write(\n"
                   "      os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', '-'))\n"
                   "  assert i != 3\n")
  ids = spread_tests.collect([str(suite), "-v"], timeout=60)
  assert len(ids) == 5
  dealt = spread_tests.deal(ids, 2)
  assert [len(c) for c in dealt] == [3, 2] and sorted(sum(dealt, [])) == sorted(ids)
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  assert spread_tests.main(["--gpus", "2", "--dry-run", str(suite), "-q", "--tb=line"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 2 and lines[1].startswith("CUDA_VISIBLE_DEVICES=1 ")
  assert "-n 3" in lines[0] and lines[0].endswith("<3 cases>")
  # Options reach the runs; the suite's path does not (its ids do).
  assert "--tb=line" in lines[0] and str(suite) not in lines[0]
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
  assert spread_tests.main(["--dry-run", str(suite)]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [l.split()[0] for l in lines] == ["CUDA_VISIBLE_DEVICES=5", "CUDA_VISIBLE_DEVICES=7"]
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  assert not list(tmp_path.glob("suite_test.py.*"))  # a dry run runs nothing
  out = tmp_path / "out"
  rc = spread_tests.main(["--gpus", "2", "--workers", "0", "--out", str(out), str(suite),
                          "--tb=line"])
  printed = capsys.readouterr().out
  assert rc == 1
  assert "GPU 0: " in printed and "GPU 1: " in printed and "1 failed" in printed
  assert "FAILED" in printed and "test_case[3]" in printed
  assert sorted(p.name for p in out.iterdir()) == ["test-gpu0.log", "test-gpu1.log"]
  for i in range(5):
    # Each run allocates GPU memory as it goes, so its workers share the GPU.
    assert (tmp_path / f"suite_test.py.{i}").read_text() == "false"
  with pytest.raises(SystemExit):
    spread_tests.main(["--workers", "-1", str(suite)])
  # A run past the limit is stopped, and counts as a failure.
  import time
  slow = tmp_path / "slow_test.py"
  slow.write_text("import time\n\ndef test_sleeps():\n  time.sleep(120)\n")
  t0 = time.monotonic()
  assert spread_tests.main(["--gpus", "1", "--workers", "0", "--limit", "6",
                            "--out", str(out), str(slow)]) == 1
  assert time.monotonic() - t0 < 60
  assert "stopped at the 6 s limit" in capsys.readouterr().out


def test_lowered_kernels_fingerprints_each_program_and_ignores_source_lines(
    capsys, monkeypatch):
  """Each lowered program gets a line; the same tree gives the same lines, a
  different kernel different ones, and moving source lines changes nothing."""
  from tools import lowered_kernels
  from flashjax.pallas_gpu.mosaic import pipeline

  only = "{'bias': True, 'causal': True}"
  first = lowered_kernels.fingerprints(only)
  assert len(first) >= 2 and {name for name, _, _ in first} == {only}
  # A kernel traced from other source lines (a wrapper frame) is the same kernel.
  skip_slot = pipeline.skip_slot
  monkeypatch.setattr(pipeline, "skip_slot", lambda *a: skip_slot(*a))
  assert lowered_kernels.fingerprints(only) == first
  # One more barrier wait in each skip step is another kernel.
  monkeypatch.setattr(pipeline, "skip_slot",
                      lambda slot, waits, reads, frees: skip_slot(
                          slot, tuple(waits) + tuple(waits[:1]), reads, frees))
  changed = lowered_kernels.fingerprints(only)
  assert [d for *_, d in changed] != [d for *_, d in first]
  assert lowered_kernels.main(["-k", "no such variant"]) == 2
  assert "no variant matches" in capsys.readouterr().err
  import jax
  assert jax.config.jax_traceback_in_locations_limit != 0  # restored
