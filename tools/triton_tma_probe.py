"""Device probe: can a Triton kernel called through jax-triton use device-side
tensor descriptors (TMA) on this GPU?

Triton >= 3.4 builds such descriptors in a global scratch buffer that its own
launcher allocates; jax-triton's launch path has to provide that buffer too. This
runs one tiny descriptor copy kernel in a child process (a bad launch can poison
the CUDA context) and prints the kernel's scratch size and whether the result
is right. Used to decide whether triton_gpu can offer a TMA path.

  python -m tools.triton_tma_probe
"""

import subprocess
import sys

N, BM = 512, 128


def child():
  import jax
  import jax.numpy as jnp
  import jax_triton as jt
  import triton
  import triton.language as tl

  @triton.jit
  def double(x_ptr, o_ptr, n: tl.constexpr, bm: tl.constexpr):
    i = tl.program_id(0) * bm
    src = tl.make_tensor_descriptor(x_ptr, shape=[n, 64], strides=[64, 1],
                                    block_shape=[bm, 64])
    dst = tl.make_tensor_descriptor(o_ptr, shape=[n, 64], strides=[64, 1],
                                    block_shape=[bm, 64])
    dst.store([i, 0], src.load([i, 0]) * 2.0)

  x = jnp.arange(N * 64, dtype=jnp.float32).reshape(N, 64)
  out = jt.triton_call(x, kernel=double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(N // BM,), n=N, bm=BM)
  err = float(jnp.max(jnp.abs(out - 2 * x)))
  print(f"descriptor kernel ran: max error {err}", flush=True)
  sys.exit(0 if err == 0 else 1)


def main():
  if sys.argv[1:] == ["--child"]:
    return child()
  try:
    res = subprocess.run([sys.executable, "-m", "tools.triton_tma_probe",
                          "--child"], capture_output=True, text=True, timeout=120)
    print(res.stdout.strip() or "(no output)")
    if res.returncode:
      print(f"FAILED (exit {res.returncode}):\n{res.stderr[-3000:]}")
  except subprocess.TimeoutExpired:
    print("FAILED: no result in 120 s")


if __name__ == "__main__":
  main()
