#!/usr/bin/env python3
"""Writes data/templates/rendered.json: real Qwen chat templates rendered by Python's jinja2
the way transformers renders them (`apply_chat_template`: a sandboxed environment with
trim_blocks and lstrip_blocks, loop controls, `tojson` as json.dumps(ensure_ascii=False),
`raise_exception`), for conversations of system, user and assistant turns, tool calls, tool
answers and tools. Run from node/testkit (pinned: pip install jinja2==3.1.6):

    python3 scripts/chat_reference.py
"""
import json
import os

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
DIR = os.path.join(HERE, "..", "data", "templates")
TEMPLATES = ["Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1},
            },
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "one user turn": {"messages": [{"role": "user", "content": "Hello!"}]},
    "system, user, assistant, user": {
        "messages": [
            {"role": "system", "content": "You are terse. Answer in one line."},
            {"role": "user", "content": "What is a swarm?"},
            {"role": "assistant", "content": "Many small devices acting as one."},
            {"role": "user", "content": "And an expert?\nBe brief — «très» brief."},
        ]
    },
    "assistant with reasoning": {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
            {"role": "user", "content": "3+3?"},
        ]
    },
    "tools, a call and its answer": {
        "messages": [
            {"role": "system", "content": "Use tools when they help."},
            {"role": "user", "content": "Weather in Zürich, in celsius, for 2 days?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Zürich", "unit": "celsius", "days": 2},
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 3.5, \"sky\": \"snow\"}"},
        ],
        "tools": [WEATHER],
    },
    "two calls in a row": {
        "messages": [
            {"role": "user", "content": "Compare Oslo and Rome."},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}},
                ],
            },
            {"role": "tool", "content": "cold"},
            {"role": "tool", "content": "warm"},
        ],
        "tools": [WEATHER],
    },
    "thinking off": {
        "messages": [{"role": "user", "content": "Quick answer please."}],
        "enable_thinking": False,
    },
    "no generation prompt": {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
        ],
        "add_generation_prompt": False,
    },
}


def raise_exception(message):
    raise Exception(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    out = {"conversations": CONVERSATIONS, "rendered": {}}
    for name in TEMPLATES:
        with open(os.path.join(DIR, name), encoding="utf-8") as f:
            t = env.from_string(f.read())
        rendered = {}
        for key, conv in CONVERSATIONS.items():
            inputs = dict(conv)
            inputs.setdefault("add_generation_prompt", True)
            inputs.update(bos_token="", eos_token="<|im_end|>")
            rendered[key] = t.render(**inputs)
        out["rendered"][name] = rendered
    with open(os.path.join(DIR, "rendered.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    print(sum(len(r) for r in out["rendered"].values()), "renderings")


if __name__ == "__main__":
    main()
