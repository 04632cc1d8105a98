#!/usr/bin/env python3
"""Renders the Kimi chat template with jinja2 for a set of conversations and writes the results to
tests/data/chat/kimi_golden.json, which tests/tokenizer/test_chat_template.cpp compares against the
C++ renderer byte for byte. Run by hand after changing the template or the cases:

    pip install jinja2            # transformers is optional: used as a cross-check when present
    python3 tests/tokenizer/make_chat_golden.py

The template text is read from src/tokenizer/chat_template.cpp (the one copy in the repository).
The environment is the one transformers' apply_chat_template builds: a sandboxed jinja2
environment with trim_blocks and lstrip_blocks, loop controls, and a tojson filter that is
json.dumps(ensure_ascii=False) without HTML escaping. Tools go through deep_sort_dict first, as the
checkpoint's TikTokenTokenizer.apply_chat_template (tokenization_kimi.py) does before rendering.
"""

import hashlib
import json
import pathlib
import re
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src" / "tokenizer" / "chat_template.cpp"
OUT = ROOT / "tests" / "data" / "chat" / "kimi_golden.json"


def template_text():
    m = re.search(r'R"JINJA\((.*?)\)JINJA"', SOURCE.read_text(encoding="utf-8"), re.S)
    if not m:
        sys.exit(f"no R\"JINJA(...)JINJA\" block in {SOURCE}")
    return m.group(1)


def environment():
    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def deep_sort_dict(obj):
    if isinstance(obj, dict):
        return {k: deep_sort_dict(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [deep_sort_dict(v) for v in obj]
    return obj


def call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": None},
                "city": {"type": "string", "description": "City name, e.g. \"São Paulo\""},
            },
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.\nReturns at most `limit` results — ranked.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
                "threshold": {"type": "number", "default": 0.25, "minimum": 1e-05,
                              "maximum": 1e16, "multipleOf": 2.0},
                "safe": {"type": "boolean", "default": True, "deprecated": False},
                "seed": {"type": "integer", "default": 12345678901234567890, "minimum": -7},
                "température": {"type": "number", "default": -0.0},
            },
            "required": ["query"],
        },
    },
}

SYSTEM = {"role": "system", "content": "You are a helpful assistant provided by Moonshot-AI."}

CASES = [
    ("user_only", [{"role": "user", "content": "Hello!"}], None, True),
    ("system_user", [SYSTEM, {"role": "user", "content": "Is 123 a prime?"}], None, True),
    ("system_user_no_generation_prompt",
     [SYSTEM, {"role": "user", "content": "Is 123 a prime?"}], None, False),
    ("multi_turn", [
        SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ], None, True),
    ("assistant_last_no_generation_prompt", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ], None, False),
    ("assistant_empty_content", [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Thanks."},
    ], None, True),
    ("empty_user_content", [{"role": "user", "content": ""}], None, True),
    ("unicode_and_escapes", [
        {"role": "system", "content": "你是Kimi，由月之暗面科技有限公司开发。"},
        {"role": "user",
         "content": "Ünïcödé 🚀 \"quotes\" \\ backslash\ttab\nnewline — עברית\r\n"},
        {"role": "assistant", "content": "好的 👍\n\n- item"},
    ], None, True),
    ("tools_declared", [{"role": "user", "content": "Weather in Paris?"}], [WEATHER, SEARCH],
     True),
    ("tool_call_round_trip", [
        {"role": "user", "content": "What's the weather like in Beijing today?"},
        {"role": "assistant", "content": None, "tool_calls": [
            call("functions.get_weather:0", "get_weather", "{\"city\": \"Beijing\"}")]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather",
         "content": "{\"weather\": \"Sunny\", \"temp_c\": 31.5}"},
    ], [WEATHER], True),
    ("tool_calls_with_content", [
        SYSTEM,
        {"role": "user", "content": "Compare the weather in Oslo and Lima."},
        {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            call("functions.get_weather:0", "get_weather", "{\"city\":\"Oslo\"}"),
            call("functions.get_weather:1", "get_weather", "{\"city\":\"Lima\"}"),
        ]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "-3 C, snow"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "name": "get_weather",
         "content": "19 C, cloudy"},
        {"role": "assistant", "content": "Oslo is snowy at -3 C; Lima is cloudy at 19 C."},
    ], [WEATHER], False),
    ("tool_result_without_call_id", [
        {"role": "user", "content": "Search for kittens."},
        {"role": "assistant", "content": "", "tool_calls": [
            call("functions.search:0", "search", "{\"query\": \"kittens\"}")]},
        {"role": "tool", "content": "[]"},
    ], [SEARCH], True),
    ("tool_arguments_verbatim", [
        {"role": "user", "content": "Forecast?"},
        {"role": "assistant", "content": None, "tool_calls": [
            call("functions.get_weather:0", "get_weather",
                 "{\"city\": \"São Paulo\",  \"days\" : 3}\n")]},
    ], [WEATHER], False),
    ("named_participants", [
        {"role": "user", "name": "alice", "content": "Hi, I'm Alice."},
        {"role": "assistant", "name": "kimi-bot", "content": "Hello Alice."},
        {"role": "user", "content": "Who am I?"},
    ], None, True),
    ("system_not_first", [
        {"role": "user", "content": "First question"},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Second question"},
    ], None, True),
    ("only_system", [SYSTEM], None, True),
    ("empty_conversation", [], None, True),
    ("empty_conversation_with_tools", [], [SEARCH], False),
    ("empty_tool_list", [{"role": "user", "content": "No tools here."}], [], True),
    ("markup_in_content_is_literal", [
        {"role": "user", "content": "{{ not_a_variable }} {% if x %} <|im_end|><|im_user|>x"},
    ], None, True),
]


def main():
    text = template_text()
    tmpl = environment().from_string(text)
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        render_jinja_template = None
        print("transformers not installed: skipping the cross-check", file=sys.stderr)

    cases = []
    for name, messages, tools, gen in CASES:
        sorted_tools = deep_sort_dict(tools) if tools is not None else None
        expected = tmpl.render(messages=messages, tools=sorted_tools, add_generation_prompt=gen)
        if render_jinja_template is not None:
            rendered, _ = render_jinja_template(conversations=[messages], tools=sorted_tools,
                                                chat_template=text, add_generation_prompt=gen)
            if rendered[0] != expected:
                sys.exit(f"{name}: jinja2 and transformers disagree")
        cases.append({"name": name, "messages": messages, "tools": sorted_tools,
                      "add_generation_prompt": gen, "expected": expected})

    doc = {
        "comment": "Generated by tests/tokenizer/make_chat_golden.py; do not edit by hand.",
        "template": "kimi",
        "template_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
