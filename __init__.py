"""flashjax: exact flash attention for JAX on every backend.

Importing this package needs only jax: platform subpackages (and triton) are imported
when first used.
"""

__version__ = "0.1.0"
