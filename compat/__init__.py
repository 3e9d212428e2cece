"""Entry points with the names and meaning of the libraries flashjax replaces.

One module per library: ``jax_nn`` (``jax.nn.dot_product_attention``) and
``lucidrains`` (lucidrains' flash-attention-jax).
"""
