"""The search driver of common/autotune.py with a fake run and timer (no GPU):
rounds from the previous winner, failures skipped, the winner cached and read
back, unreadable entries a miss."""

import dataclasses
import json

import pytest

from flashjax.common import autotune
from flashjax.common import spec as spec_lib
from flashjax.common.launch import KernelsConfig, kernel_configs, kernel_pairs


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Config:
  a: int = 0
  b: int = 0


def _cache():
  return autotune.JsonCache("test", dataclasses.asdict, lambda d: _Config(**d))


SPEC = spec_lib.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2, head_dim=32)


def test_rounds_start_from_the_previous_winner_and_cache_it(tmp_path, monkeypatch):
  monkeypatch.setenv("FLASHJAX_AUTOTUNE_CACHE", str(tmp_path / "tune.json"))
  times = {(0, 0): 5.0, (1, 0): 3.0, (2, 0): 4.0, (1, 1): 2.0, (1, 2): 6.0}
  timed = []

  def run(cfg, with_grad):
    if cfg.a == 3:
      raise RuntimeError("does not fit")  # skipped, not fatal
    return (cfg, with_grad), ()

  def timer(fn, args):
    timed.append(fn)
    return times[(fn[0].a, fn[0].b)]

  rounds = lambda spec: (
      autotune.Round(False, lambda best: [_Config(a=a) for a in (1, 0, 2, 3, 1)]),
      autotune.Round(True, lambda best: []),  # skipped: nothing to time
      autotune.Round(True, lambda best: [dataclasses.replace(best, b=b) for b in (2, 1)]))
  tuner = autotune.Tuner(_cache(), rounds)
  assert tuner.lookup(SPEC) is None
  cfg = tuner.tune(SPEC, run, base=_Config(), timer=timer)
  assert cfg == _Config(a=1, b=1)
  # The base first, each distinct candidate once, the winner again first.
  assert [(c.a, c.b, g) for c, g in timed] == [
      (0, 0, False), (1, 0, False), (2, 0, False),
      (1, 0, True), (1, 2, True), (1, 1, True)]
  assert tuner.lookup(SPEC) == cfg
  resolve = lambda config=None: tuner.resolve(SPEC, config, attention=None,
                                              default=_Config(a=9), may_tune=False)
  assert resolve() == cfg and resolve(_Config(b=4)) == _Config(b=4)

  # An entry the config cannot read (a field renamed since) is a miss.
  path = tmp_path / "tune.json"
  data = json.loads(path.read_text())
  data = {k: {"old_name": 1} for k in data}
  path.write_text(json.dumps(data))
  assert tuner.lookup(SPEC) is None and resolve() == _Config(a=9)

  with pytest.raises(NotImplementedError, match="test autotune: no candidate ran"):
    tuner.tune(SPEC, lambda cfg, g: run(_Config(a=3), g), base=_Config(),
               timer=timer)


def test_kernel_rounds_search_the_forward_then_the_backward_pairs():
  fwd = kernel_configs((128, 64, 8, 3), (64, 64, 4, 2))
  bwd = kernel_pairs((64, 64, 4, 2), ((128, 64, 8, 2), (64, 128, 8, 2)))
  assert bwd[0][0] == bwd[0][1] and bwd[1][0].block_q == 128 == bwd[1][1].block_kv
  first, second = autotune.kernel_rounds(fwd, bwd)
  base = KernelsConfig()
  assert not first.with_grad and second.with_grad
  assert [c.fwd for c in first.candidates(base)] == list(fwd)
  assert all(c.dq == base.dq for c in first.candidates(base))
  assert [(c.dq, c.dkv) for c in second.candidates(base)] == list(bwd)


def test_random_run_keeps_dropout_and_the_band():
  """Tuning runs the call it tunes for: dropout (no extra arrays) is passed, so
  its hash's cost counts, as are the band and scale."""
  seen = {}

  def attention(q, k, v, config, **kw):
    seen.update(kw, config=config, q=q.shape)
    return q

  spec = spec_lib.abstract_spec(batch=1, seq_q=64, seq_k=64, heads_q=2, head_dim=32,
                                causal=True, dropout_rate=0.25)
  fn, inputs = autotune.random_run(spec, attention)("cfg", False)
  fn(*inputs)
  assert seen["dropout_rate"] == 0.25 and seen["dropout_seed"] is not None
  assert seen["causal"] and seen["config"] == "cfg" and seen["q"] == (1, 64, 2, 32)
  plain = dataclasses.replace(spec, dropout_rate=0.0)
  seen.clear()
  fn, inputs = autotune.random_run(plain, attention)("cfg", False)
  fn(*inputs)
  assert "dropout_rate" not in seen
