"""Images and audio in prompts: the content parts that carry them (parts.py, MLX-free) and an
Omni parent's towers that turn them into prompt positions (omni.py, the ``omni`` extra)."""
