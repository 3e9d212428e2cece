"""What the nested kernel configs share: a config of per-kernel parts (``fwd``,
``dq``, ``dkv``: each a frozen dataclass, the part's class given by its field's
default) checks its parts' classes, is rebuilt from its JSON form (the autotune
cache's), and replaces fields of one part.

Pallas-Triton's ``TritonConfig`` and triton's ``KernelsConfig``
(common/launch.py) and Mosaic-GPU's ``MosaicConfig`` use these.
"""

from __future__ import annotations

import dataclasses

PARTS = ("fwd", "dq", "dkv")


def part_classes(cls) -> dict[str, type]:
  """The class of each part of the nested config class ``cls``: its field's
  default's (a subclass's own default where it redeclares the field)."""
  return {f.name: type(f.default) for f in dataclasses.fields(cls)
          if f.name in PARTS and dataclasses.is_dataclass(f.default)}


def check_parts(cfg) -> None:
  """Raises ``ValueError`` naming the config's class, the field and the value
  where a part is not exactly its class (a subclass carries fields the kernel
  would not read)."""
  for name, kind in part_classes(type(cfg)).items():
    value = getattr(cfg, name)
    if type(value) is not kind:
      raise ValueError(f"{type(cfg).__name__}: {name} must be a {kind.__name__}, "
                       f"got {value!r}")


def from_dict(cls, d, where: str = ""):
  """``cls`` from its ``dataclasses.asdict`` form, each part's dict made its
  class (recursively). A field absent from ``d`` takes its default; an unknown
  field, a missing one without a default, or a part that is not a dict (an
  entry of an older layout) raises ``TypeError`` (as a dataclass does for an
  unknown keyword) naming the class, the field and the value; the autotune
  cache counts it as a miss. ``where`` names the enclosing config's field in
  those messages."""
  name = f"{where} ({cls.__name__})" if where else cls.__name__
  if not isinstance(d, dict):
    raise TypeError(f"{name}: expected a dict of its fields, got {d!r}")
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise TypeError(f"{name}: unknown field {unknown[0]!r} (value "
                    f"{d[unknown[0]]!r}); its fields: {', '.join(fields)}")
  missing = [k for k, f in fields.items() if k not in d and
             f.default is dataclasses.MISSING and
             f.default_factory is dataclasses.MISSING]
  if missing:
    raise TypeError(f"{name}: missing field {missing[0]!r}, got {d!r}")
  kwargs = {}
  for k, value in d.items():
    default = fields[k].default
    if dataclasses.is_dataclass(default):
      value = from_dict(type(default), value, f"{cls.__name__}.{k}")
    kwargs[k] = value
  return cls(**kwargs)


def with_part(cfg, part: str, **changes):
  """``cfg`` with fields of its part ``part`` ("fwd", "dq" or "dkv") replaced;
  the part keeps its class (a platform's forward class and its launch flags)."""
  if part not in part_classes(type(cfg)):
    raise ValueError(f"{type(cfg).__name__}: part must be one of "
                     f"{tuple(part_classes(type(cfg)))}, got {part!r}")
  return dataclasses.replace(
      cfg, **{part: dataclasses.replace(getattr(cfg, part), **changes)})
