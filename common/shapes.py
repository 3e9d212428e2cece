"""Named shape sets shared by tests, benchmarks and tuning."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
  name: str
  batch: int
  seq_q: int
  seq_k: int
  heads_q: int
  heads_kv: int
  head_dim: int
  causal: bool = False
  # Packed rows: the lengths of the documents each row holds, in order (their
  # sum is seq_q = seq_k); empty for rows of one sequence.
  documents: tuple[int, ...] = ()
  # KV-cache shapes (flash_mha_with_kvcache over a full cache of seq_k positions
  # per row; benchmarks/kvcache.py): 0 = a contiguous cache, n > 0 = pages of n
  # positions; None = not a cache shape.
  page_size: int | None = None
  # One feature of the call, which benchmarks/features.py runs with and without:
  # dropout on the probabilities (0 = none), a dense random mask, or a bias
  # broadcast over the batch and differentiated.
  dropout_rate: float = 0.0
  mask: bool = False
  bias: bool = False

  def __post_init__(self):
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}")
    named = [n for n, on in (("dropout_rate", self.dropout_rate), ("mask", self.mask),
                             ("bias", self.bias)) if on]
    if len(named) > 1:
      raise ValueError(f"a shape has one feature, got {' and '.join(named)}")
    if named and (self.documents or self.page_size is not None):
      raise ValueError(f"{named[0]} is for plain shapes: packed and KV-cache shapes "
                       "run their own variants without it")
    p = self.page_size
    if p is not None and (p < 0 or p and self.seq_k % p):
      raise ValueError(f"page_size must be None, 0 (contiguous cache) or a positive "
                       f"divisor of seq_k = {self.seq_k}, got {p}")

  @property
  def head_dim_v(self) -> int:
    return self.head_dim


def packed(documents_sets, heads=16, head_dim=128, label=None):
  """Shapes of one row (B = 1) packing each tuple of document lengths, causal
  and not. Named ``B1-<n>x<len>`` for equal lengths, else ``B1-mixed<total>``."""
  out = []
  for causal in (False, True):
    for docs in documents_sets:
      total = sum(docs)
      if len(set(docs)) == 1:
        what = f"{len(docs)}x{docs[0]}"
      else:
        what = f"mixed{total // 1024}k" if total >= 1024 else f"mixed{total}"
      out.append(Shape(name=f"B1-{what}-H{heads}-D{head_dim}"
                       + ("-causal" if causal else ""), batch=1, seq_q=total,
                       seq_k=total, heads_q=heads, heads_kv=heads,
                       head_dim=head_dim, causal=causal, documents=tuple(docs)))
  return tuple(out)


def kvcache(sizes, heads_q=32, heads_kv=8, head_dim=128, page_sizes=(0, 16, 64, 256)):
  """KV-cache shapes: each ``(batch, seq_q, seq_k)`` of ``sizes`` with a
  contiguous cache (``-cache``) and with pages of each size (``-page<n>``)."""
  return tuple(
      Shape(name=f"B{b}-Sq{sq}-Sk{_k(sk)}-H{heads_q}:{heads_kv}-D{head_dim}-"
            + (f"page{p}" if p else "cache"), batch=b, seq_q=sq, seq_k=sk,
            heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, page_size=p)
      for b, sq, sk in sizes for p in page_sizes)


def _k(n: int) -> str:
  return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# One-token steps and a 16-token chunk against long caches: the decode set's
# first sizes and the whole KV-cache set's.
DECODE = ((64, 1, 8192), (8, 1, 65536), (32, 16, 4096), (1, 1, 131072))
# Chunks of 2, 4 and 8 tokens (speculative decoding): 8, 16 and 32 packed q rows
# per kv head at GQA 32:8, so below, at and above the 16-row tile.
DECODE_CHUNKS = ((32, 2, 4096), (32, 4, 4096), (32, 8, 4096))

# 64 to 8192 tokens in one 16k row, long and short documents interleaved.
MIXED_16K = (8192, 64, 2048, 512, 128, 4096, 1024, 256, 64)


def _training(tokens=16384, heads=16, head_dim=128, seqs=(2048, 8192, 16384),
              dropout_rate=0.0, mask=False, bias=False):
  out = []
  for causal in (False, True):
    for s in seqs:
      out.append(Shape(name=f"B{tokens // s}-S{s // 1024}k-H{heads}-D{head_dim}"
                       + ("-causal" if causal else "")
                       + (f"-dropout{dropout_rate:g}" if dropout_rate else "")
                       + ("-mask" if mask else "") + ("-bias" if bias else ""),
                       batch=tokens // s, seq_q=s, seq_k=s, heads_q=heads,
                       heads_kv=heads, head_dim=head_dim, causal=causal,
                       dropout_rate=dropout_rate, mask=mask, bias=bias))
  return tuple(out)


SHAPE_SETS: dict[str, tuple[Shape, ...]] = {
    # The standard training set (as in FlashAttention-2/3's benchmarks): B*S = 16k
    # tokens, H = 16, D = 128.
    "standard": _training(),
    # The standard set's short and middle columns with dropout 0.1, a dense
    # [B, 1, S, S] mask (90% kept) or a trained [1, H, S, S] bias: each flashjax
    # implementation with and without it (benchmarks/features.py).
    "dropout": _training(seqs=(2048, 8192), dropout_rate=0.1),
    "mask": _training(seqs=(2048, 8192), mask=True),
    "bias": _training(seqs=(2048, 8192), bias=True),
    "head_dim": tuple(
        Shape(name=f"B2-S8k-H{2048 // d}-D{d}" + ("-causal" if c else ""),
              batch=2, seq_q=8192, seq_k=8192, heads_q=2048 // d,
              heads_kv=2048 // d, head_dim=d, causal=c)
        for d in (64, 128, 256) for c in (False, True)),
    "gqa": tuple(
        Shape(name=f"B2-S8k-H32:8-D128" + ("-causal" if c else ""), batch=2,
              seq_q=8192, seq_k=8192, heads_q=32, heads_kv=8, head_dim=128,
              causal=c) for c in (False, True)),
    # D = 64, non-causal, B*S = 16k: head counts whose tile counts leave different
    # last rounds on 132 SMs (H12: 84 of 1536 tiles; H32: 4 of 4096), for the
    # Mosaic forward's split tail.
    "d64_tails": tuple(
        Shape(name=f"B{16384 // s}-S{s // 1024}k-H{h}-D64", batch=16384 // s,
              seq_q=s, seq_k=s, heads_q=h, heads_kv=h, head_dim=64)
        for h in (12, 32) for s in (2048, 8192)),
    # Decode (GQA 32:8, D = 128): one-token steps and chunks of 2 to 16 tokens
    # against a long cache; memory-bound, so compare bytes of K and V read per
    # second.
    "decode": tuple(
        Shape(name=f"B{b}-Sq{sq}-Sk{sk // 1024}k-H32:8-D128", batch=b, seq_q=sq,
              seq_k=sk, heads_q=32, heads_kv=8, head_dim=128)
        for b, sq, sk in DECODE + DECODE_CHUNKS),
    # The decode sizes through flash_mha_with_kvcache (benchmarks/kvcache.py),
    # full caches, contiguous and paged (random page order): 16, 64, 256.
    "kvcache": kvcache(DECODE),
    # CPU: fp32, GQA 8:2, D = 64.
    "kvcache_cpu": kvcache(((4, 1, 4096), (1, 16, 8192)), heads_q=8, heads_kv=2,
                           head_dim=64, page_sizes=(0, 16, 256)),
    # CPU: fp32, B=1, H=8, D=64 (the CPU table of docs/BENCHMARKS.md).
    "cpu": tuple(
        Shape(name=f"B1-S{s}-H8-D64" + ("-causal" if c else ""), batch=1,
              seq_q=s, seq_k=s, heads_q=8, heads_kv=8, head_dim=64, causal=c)
        for s in (512, 1024, 2048, 4096) for c in (False, True)),
    "cpu_long": tuple(
        Shape(name=f"B1-S{s // 1024}k-H8-D64" + ("-causal" if c else ""), batch=1,
              seq_q=s, seq_k=s, heads_q=8, heads_kv=8, head_dim=64, causal=c)
        for s in (8192, 16384, 32768, 65536) for c in (True,)),
    # Documents packed into 16k-32k tokens with segment ids; the benchmark runs
    # each beside the same documents as batched calls (benchmarks/packed.py).
    "packed": packed([(2048,) * 8, (512,) * 32, MIXED_16K, (2048,) * 16]),
    # CPU: 8 documents of 512 tokens, fp32, H = 8, D = 64.
    "packed_cpu": packed([(512,) * 8], heads=8, head_dim=64),
    "quick": tuple(
        Shape(name=f"B1-S{s}-H4-D64" + ("-causal" if c else ""), batch=1,
              seq_q=s, seq_k=s, heads_q=4, heads_kv=4, head_dim=64, causal=c)
        for s in (512, 2048) for c in (False, True)),
}


def get(name: str) -> tuple[Shape, ...]:
  try:
    return SHAPE_SETS[name]
  except KeyError:
    raise ValueError(f"unknown shape set {name!r}; known: {sorted(SHAPE_SETS)}")
