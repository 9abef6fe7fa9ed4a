"""``mlx-dspark serve``: the HTTP app (``app``), the engine thread that runs generations
(``engine``), the OpenAI and Anthropic request and reply shapes (``openai``, ``anthropic``,
``answer``, ``logprobs``) and the guards in front of them (``http_guard``, ``connections``)."""
