"""The target model: Nemotron-H (``nemotron_h``) and its caches (``cache``), the layers any model
uses (``layers``), the linear layers over the converted checkpoint layout (``quant``) and how a
checkpoint's tensors become those layers (``weights``)."""
