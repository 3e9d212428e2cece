"""Hardware detection (common/hardware.py) from device records, and its "no GPU"
answers on the machine running the tests."""

import types

import jax

from flashjax.common import hardware


def _gpu(cc, kind="NVIDIA", cores=None):
  return types.SimpleNamespace(platform="gpu", compute_capability=cc, device_kind=kind,
                               core_count=cores)


def test_gpu_generation_from_the_device():
  assert hardware.gpu_target(_gpu("9.0", "NVIDIA H200")).hopper
  assert hardware.gpu_target(_gpu("8.0", "NVIDIA A100-SXM4-80GB")).name == (
      "ampere-datacenter")
  assert hardware.gpu_target(_gpu("8.9", "NVIDIA L40S")).shared_memory == 99 * 1024
  assert hardware.gpu_target(_gpu("gfx942", "AMD Instinct MI300X")) == hardware.AMD
  assert hardware.gpu_target(_gpu("8.1")).name.startswith("ampere")  # same major
  assert hardware.gpu_target(_gpu("")) == hardware.HOPPER  # unknown
  assert hardware.gpu_target(types.SimpleNamespace(platform="cpu")) == hardware.HOPPER


def test_hopper_capability_and_sm_count():
  assert hardware.compute_capability(_gpu("9.0")) == (9, 0)
  assert hardware.compute_capability(_gpu("gfx942", "AMD Instinct MI300X")) is None
  assert hardware.is_hopper(_gpu("9.0", "NVIDIA H100 80GB HBM3"))
  assert not hardware.is_hopper(_gpu("8.0", "NVIDIA A100"))
  assert not hardware.is_hopper(_gpu("10.0", "NVIDIA B200"))
  assert hardware.num_sms(_gpu("9.0", cores=114)) == 114
  assert hardware.num_sms(_gpu("9.0")) == 132


def test_tpu_generation():
  tpu = lambda kind: types.SimpleNamespace(platform="tpu", device_kind=kind)
  assert hardware.tpu_generation(tpu("TPU v4")) == "v4"
  assert hardware.tpu_generation(tpu("TPU v5 lite")) == "v5e"
  assert hardware.tpu_generation(tpu("TPU v5p")) == "v5p"
  assert hardware.tpu_generation(tpu("TPU v6 lite")) == "v6e"
  assert hardware.tpu_generation(tpu("TPU v3")) is None
  assert hardware.tpu_generation(_gpu("9.0")) is None


def test_answers_on_this_machine():
  if jax.default_backend() != "cpu":
    return
  assert hardware.gpu_device() is None and hardware.compute_capability() is None
  assert hardware.gpu_count() == 0
  assert not hardware.is_hopper() and hardware.tpu_generation() is None
  assert hardware.gpu_target() == hardware.HOPPER and hardware.num_sms() == 132
