"""The spec every platform implements: validation, mask, dropout hash, reference,
tolerances, FLOP counts, named shapes and the conformance suite (imported on its
own, since it needs pytest and hypothesis)."""

from . import dropout, flops, mask, reference, shapes, spec, tolerances
from .spec import FEATURES, AttentionSpec, Operands, canonicalize
