"""The target model: Nemotron-H (``nemotron_h``) and its caches (``cache``), the layers any model
uses (``layers``), the linear layers over the converted checkpoint layout (``quant``), how a
checkpoint's tensors become those layers (``weights``), and mlx-lm's layout read as it is
(``mlx_lm_layout``)."""
