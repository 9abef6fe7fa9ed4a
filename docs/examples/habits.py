"""The Python side of docs/mlx-lm-habits.md: the public names, the CLI's words for
``speculative``, streaming with the finish reason on the last token's chunk, and peak memory."""

import mlx_dspark as md

print([name for name in dir(md) if not name.startswith("_")])
pair = md.load()                     # the embedded demo pair
for chunk in md.stream_generate(pair, "def fibonacci(n):", max_tokens=12, speculative="on"):
    print(repr(chunk.text), chunk.token, chunk.finish_reason)
res = md.generate(pair, "def fibonacci(n):", max_tokens=12, speculative="off")
print(res.finish_reason, len(res.tokens), "tokens,", f"{res.stats['peak_memory_gb']:.3f} GB peak")
