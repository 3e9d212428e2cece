"""The nested-config helpers of common/configs.py on the kernels config of
common/launch.py and a platform-style subclass with its own forward class: the
part check, the JSON form read back (old layouts a clear error, a cache miss),
one part's fields replaced, and the candidate tables chosen by head dim."""

import dataclasses
import json

import pytest

from flashjax.common import autotune, configs
from flashjax.common import spec as spec_lib
from flashjax.common.launch import KernelConfig, KernelsConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Forward(KernelConfig):
  fold: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config(KernelsConfig):
  fwd: _Forward = _Forward(block_q=64, block_kv=32)


CFG = _Config(fwd=_Forward(block_q=32, block_kv=16, num_warps=8, fold=True),
              dq=KernelConfig(block_q=16, block_kv=64, num_stages=3),
              dkv=KernelConfig(block_q=64, block_kv=16, num_warps=2),
              fp32_precision="tf32")


def test_part_classes_follow_the_subclass():
  assert configs.part_classes(KernelsConfig) == dict(
      fwd=KernelConfig, dq=KernelConfig, dkv=KernelConfig)
  assert configs.part_classes(_Config)["fwd"] is _Forward


@pytest.mark.parametrize("cls, kw, match", [
    (_Config, dict(fwd=KernelConfig(block_q=32, block_kv=32)),
     r"^_Config: fwd must be a _Forward, got KernelConfig\(block_q=32"),
    (KernelsConfig, dict(fwd=_Forward(block_q=32, block_kv=32)),
     r"^KernelsConfig: fwd must be a KernelConfig, got _Forward\(block_q=32"),
    (KernelsConfig, dict(dkv={"block_q": 64, "block_kv": 64}),
     r"^KernelsConfig: dkv must be a KernelConfig, got \{'block_q': 64"),
])
def test_check_parts_names_class_field_and_value(cls, kw, match):
  with pytest.raises(ValueError, match=match):
    cls(**kw)


def test_from_dict_round_trips_and_defaults_absent_fields():
  d = dataclasses.asdict(CFG)
  assert json.loads(json.dumps(d)) == d
  back = _Config.from_json(json.loads(json.dumps(d)))
  assert back == CFG and type(back.fwd) is _Forward and back.fwd.fold
  partial = configs.from_dict(_Config, {"dq": {"block_q": 32, "block_kv": 32}})
  assert partial == dataclasses.replace(_Config(), dq=KernelConfig(block_q=32,
                                                                   block_kv=32))


@pytest.mark.parametrize("d, match", [
    ({"fwd_tiles": [64, 64]},
     r"^_Config: unknown field 'fwd_tiles' \(value \[64, 64\]\)"),
    ({"fwd": {"block_q": 64, "block_kv": 64, "warps": 4}},
     r"^_Config.fwd \(_Forward\): unknown field 'warps' \(value 4\)"),
    ({"dq": {"block_q": 64}},
     r"^_Config.dq \(KernelConfig\): missing field 'block_kv', got \{'block_q': 64\}"),
    ({"dkv": [64, 64, 4, 2]},
     r"^_Config.dkv \(KernelConfig\): expected a dict of its fields, got \[64, 64, 4, 2\]"),
    ([128, 64], r"^_Config: expected a dict of its fields, got \[128, 64\]"),
])
def test_from_dict_errors_name_class_field_and_value(d, match):
  with pytest.raises(TypeError, match=match):
    configs.from_dict(_Config, d)


def test_an_old_layout_in_the_cache_is_a_miss(tmp_path, monkeypatch):
  monkeypatch.setenv("FLASHJAX_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
  spec = spec_lib.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2, head_dim=32)
  cache = autotune.JsonCache("test", dataclasses.asdict, _Config.from_json)
  cache.store(spec, CFG)
  assert cache.lookup(spec) == CFG
  path = tmp_path / "tune.json"
  (key, entry), = json.loads(path.read_text()).items()
  entry["fwd"]["tiles"] = entry["fwd"].pop("block_q")  # a field renamed since
  path.write_text(json.dumps({key: entry}))
  assert cache.lookup(spec) is None


def test_with_part_replaces_one_part_and_keeps_its_class():
  cfg = configs.with_part(CFG, "fwd", block_kv=64, fold=False)
  assert type(cfg.fwd) is _Forward and (cfg.fwd.block_q, cfg.fwd.block_kv) == (32, 64)
  assert not cfg.fwd.fold and cfg.fwd.num_warps == 8
  assert (cfg.dq, cfg.dkv, cfg.fp32_precision) == (CFG.dq, CFG.dkv, "tf32")
  assert configs.with_part(CFG, "dkv", num_stages=4).dkv == dataclasses.replace(
      CFG.dkv, num_stages=4)
  bad_part = r"^_Config: part must be one of \('fwd', 'dq', 'dkv'\), got 'bwd'"
  with pytest.raises(ValueError, match=bad_part):
    configs.with_part(CFG, "bwd", num_stages=4)
  with pytest.raises(ValueError, match="block_q must be a power of two"):
    configs.with_part(CFG, "dq", block_q=48)


def test_by_head_dim_takes_the_wide_tables_over_128():
  narrow, wide = ("fwd", "bwd"), ("wide fwd", "wide bwd")
  pick = autotune.by_head_dim(narrow, wide)
  spec = lambda d, dv=None: spec_lib.abstract_spec(batch=1, seq_q=8, seq_k=8, heads_q=1,
                                                   head_dim=d, head_dim_v=dv)
  assert pick(spec(128)) == narrow and pick(spec(64, 128)) == narrow
  assert pick(spec(129)) == wide and pick(spec(64, 256)) == wide
