"""A small agent loop against real `mlx-dspark serve` processes, printed as a transcript (the
closing note of issue 22 quotes it): the client asks, the model calls two tools, gets their
results, answers.

The demo pair is a 3.9 M-parameter model trained on Python source: left to itself it never
writes a call. When `tool_choice` names the function the call is constrained by grammar
(docs/grammar.md), so it comes back well formed with typed arguments, though what a code model
puts in them is no answer. So the loop runs twice: on the demo pair with a forced call, and on
`testkit.scripted`, a stand-in target that writes the replies below token by
token, to show the whole loop through the real server and client.

    .venv/bin/python docs/agent_loop.py
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]     # testkit/, and the test's replies
from test_agents_server import REPLIES, TIME, WEATHER  # noqa: E402

from testkit.server import launch  # noqa: E402

TOOLS = {"get_weather": lambda city, days=1: f"sunny, 18 C in {city} for {days} days",
         "get_time": lambda city: f"14:05 in {city}"}


def show(role, text):
    print(f"{role:>10} | " + text.replace("\n", "\n" + " " * 10 + " | "))


def loop(client, model, max_tokens, **extra):
    messages = [{"role": "user", "content": "What is the weather and the time in Oslo?"}]
    show("user", messages[0]["content"])
    for _ in range(3):
        r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME],
                                           max_tokens=max_tokens, temperature=0, **extra)
        m = r.choices[0].message
        if (m.model_extra or {}).get("reasoning_content"):
            show("thinking", m.model_extra["reasoning_content"].strip())
        if m.content:
            show("assistant", m.content)
        for c in m.tool_calls or []:
            show("call", f"{c.function.name}({c.function.arguments})  id={c.id}")
        show("finish", f"{r.choices[0].finish_reason}, {r.usage.completion_tokens} tokens "
                       f"({r.usage.completion_tokens_details.reasoning_tokens} thinking)")
        messages.append(m.model_dump(exclude_none=True, exclude={"reasoning_content"}))
        if not m.tool_calls:
            return
        for c in m.tool_calls:
            result = TOOLS[c.function.name](**json.loads(c.function.arguments))
            show("tool", f"{c.function.name} -> {result}")
            messages.append({"role": "tool", "tool_call_id": c.id, "content": result})
        extra.pop("tool_choice", None)
        extra.pop("parallel_tool_calls", None)


def main():
    print("== the demo pair, tool_choice naming get_weather (grammar-constrained) ==")
    proc, url = launch(["--speculative", "on"], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    try:
        loop(openai.OpenAI(base_url=url + "/v1", api_key="-"), "mlx-dspark-demo", 60,
             tool_choice={"type": "function", "function": {"name": "get_weather"}},
             parallel_tool_calls=False)
    finally:
        proc.terminate()
        proc.wait()
    print()
    print("== a scripted stand-in target (testkit.scripted), same server and client ==")
    with tempfile.TemporaryDirectory() as tmp:
        replies = Path(tmp) / "replies.json"
        replies.write_text(json.dumps(REPLIES))
        proc, url = launch(command=("testkit.scripted", str(replies)),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            loop(openai.OpenAI(base_url=url + "/v1", api_key="-"), "scripted", 300,
                 extra_body={"chat_template_kwargs": {"enable_thinking": True}})
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
