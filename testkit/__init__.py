"""The test scaffolding, at the top of the checkout and never installed: NumPy-only synthetic
ModelOpt exports (``synthetic``, ``codecs``), random-weight models (``toy``, ``latent``, ``omni``),
a drafter with a chosen acceptance (``oracle_drafter``), a child ``mlx-dspark serve``
(``server``), the three-mode comparison (``compare``), the tests' helpers (``*_helpers``,
``cli_pair``) and the float64 references (``reference_*``). Tests import it through pytest's
``pythonpath``; benchmarks and scripts put the checkout on ``sys.path`` first. Nothing under
``mlx_dspark`` imports it."""
