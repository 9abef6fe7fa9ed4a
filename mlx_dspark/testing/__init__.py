"""Scaffolding for tests, benchmarks and fixture scripts, kept out of the runtime: NumPy-only
synthetic ModelOpt exports (``synthetic``), random-weight models (``toy``), a drafter with a
chosen acceptance (``oracle_drafter``), a child ``mlx-dspark serve`` (``server``), and the
three-mode comparison on token-id prompts (``compare``). Nothing under ``mlx_dspark`` outside
this package imports it."""
