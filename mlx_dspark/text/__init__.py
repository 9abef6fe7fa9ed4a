"""Text in and out: the tokenizer, chat templates, reasoning (``<think>``) and tool-call
parsing."""
