"""Entry points with the names and meaning of the libraries flashjax replaces.

One module per library: ``jax_nn`` (``jax.nn.dot_product_attention``),
``lucidrains`` (lucidrains' flash-attention-jax), ``jax_flash_attn2``
(``get_cached_flash_attention``) and ``flash_attn_jax`` (flash-attn-jax's and
flash-attn3-jax's ``flash_mha``, ``flash_mha_varlen``).
"""
