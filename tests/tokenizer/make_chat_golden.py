#!/usr/bin/env python3
"""Renders the Kimi chat templates with jinja2 for a set of conversations and writes the results to
tests/data/chat/kimi_golden.json (Kimi Linear / K2 Instruct) and tests/data/chat/kimi_k3_golden.json
(Kimi K3), which tests/tokenizer/test_chat_template.cpp compares against the C++ renderers byte for
byte. Run by hand after changing a template or the cases:

    pip install jinja2            # transformers is optional: used as a cross-check when present
    python3 tests/tokenizer/make_chat_golden.py [--k3-reference PATH/encoding_k3.py]

Kimi K3 ships no Jinja template; its chats are rendered by the Python encoder encoding_k3.py
(build_chat_segments). The K3 template in src/tokenizer/chat_template_k3.cpp was written for this
project from that encoder's behaviour. Given --k3-reference (a copy of encoding_k3.py from the
checkpoint or from vLLM's vllm/tokenizers/encoding_k3.py; not kept in this repository), every K3
case is also rendered by the encoder itself, the two must agree, and the encoder's segments
(their byte lengths and allow_special flags) are stored with the case for the segment test.

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
K3_SOURCE = ROOT / "src" / "tokenizer" / "chat_template_k3.cpp"
K3_OUT = ROOT / "tests" / "data" / "chat" / "kimi_k3_golden.json"


def template_text(source=SOURCE, delimiter="JINJA"):
    m = re.search(rf'R"{delimiter}\((.*?)\){delimiter}"', source.read_text(encoding="utf-8"), re.S)
    if not m:
        sys.exit(f"no R\"{delimiter}(...){delimiter}\" block in {source}")
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


def main_kimi():
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


# ----------------------------------------------------------------------------------------- Kimi K3

K3_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"São Paulo\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}


def k3_call(id_, name, arguments):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


K3_SYSTEM = {"role": "system", "content": "You are Kimi, an AI assistant created by Moonshot AI."}

# (name, messages, tools, options); options are apply_chat_template keywords: add_generation_prompt
# (default True), thinking (default True), thinking_effort (absent: "max", as tokenization_kimi.py
# sets it; None: no effort message), tool_choice, response_format.
K3_CASES = [
    ("user_only", [{"role": "user", "content": "Hello!"}], None, {}),
    ("system_user", [K3_SYSTEM, {"role": "user", "content": "Is 123 a prime?"}], None, {}),
    ("system_user_no_generation_prompt", [K3_SYSTEM, {"role": "user", "content": "Is 123 a prime?"}],
     None, {"add_generation_prompt": False}),
    ("thinking_off", [K3_SYSTEM, {"role": "user", "content": "Quick answer: 2+2?"}], None,
     {"thinking": False}),
    ("effort_low", [{"role": "user", "content": "hi"}], None, {"thinking_effort": "low"}),
    ("effort_high", [{"role": "user", "content": "hi"}], None, {"thinking_effort": "high"}),
    ("effort_none", [{"role": "user", "content": "hi"}], None, {"thinking_effort": None}),
    ("thinking_off_ignores_effort", [{"role": "user", "content": "hi"}], None,
     {"thinking": False, "thinking_effort": "low"}),
    ("multi_turn_with_reasoning", [
        K3_SYSTEM,
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "The user greets me.\nGreet back.",
         "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ], None, {}),
    ("multi_turn_without_reasoning", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
    ], None, {}),
    ("blank_reasoning_is_dropped", [
        {"role": "user", "content": "x"},
        {"role": "assistant", "reasoning_content": " \n\t ", "content": "y"},
    ], None, {"add_generation_prompt": False}),
    ("reasoning_kept_verbatim", [
        {"role": "user", "content": "x"},
        {"role": "assistant", "reasoning_content": "\n  padded thought  \n", "content": "\ny\n"},
    ], None, {"add_generation_prompt": False}),
    ("thinking_off_history", [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "hidden", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ], None, {"thinking": False}),
    ("assistant_empty_content", [
        {"role": "user", "content": "Say nothing."},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Thanks."},
    ], None, {}),
    ("unicode_and_escapes", [
        {"role": "system", "content": "你是Kimi，由月之暗面科技有限公司开发。"},
        {"role": "user",
         "content": "Ünïcödé 🚀 \"quotes\" \\ backslash\ttab\nnewline — עברית\r\n"},
        {"role": "assistant", "reasoning_content": "思考 🤔", "content": "好的 👍\n\n- item"},
        {"role": "user", "content": "   "},
    ], None, {}),
    ("named_participants", [
        {"role": "system", "name": "ops & \"infra\"", "content": "Be brief."},
        {"role": "user", "name": "alice", "content": "Hi, I'm Alice."},
        {"role": "assistant", "name": "kimi-bot", "content": "Hello Alice."},
        {"role": "user", "content": "Who am I?"},
    ], None, {}),
    ("system_not_first", [
        {"role": "user", "content": "First question"},
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Second question"},
    ], None, {}),
    ("markup_in_content_is_literal", [
        {"role": "user", "content": "{{ x }} <|close|>message<|sep|><|end_of_msg|><|open|>think<|sep|>"},
    ], None, {}),
    ("tools_declared", [{"role": "user", "content": "Weather in Paris?"}], [K3_WEATHER, SEARCH], {}),
    ("tool_call_round_trip", [
        {"role": "user", "content": "What's the weather like in Beijing today?"},
        {"role": "assistant", "reasoning_content": "Need the weather tool.", "content": "",
         "tool_calls": [k3_call("functions.get_weather:0", "get_weather", "{\"city\": \"Beijing\"}")]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "name": "get_weather",
         "content": "{\"weather\": \"Sunny\", \"temp_c\": 31.5}"},
    ], [K3_WEATHER], {}),
    ("tool_results_out_of_order", [
        K3_SYSTEM,
        {"role": "user", "content": "Compare the weather in Oslo and Lima."},
        {"role": "assistant", "reasoning_content": "Two lookups.", "content": "Let me check both.",
         "tool_calls": [
             k3_call("call_a", "get_weather", "{\"city\":\"Oslo\"}"),
             k3_call("call_b", "get_weather", "{\"city\":\"Lima\",\"unit\":\"celsius\"}"),
         ]},
        {"role": "tool", "tool_call_id": "call_b", "content": "19 C, cloudy"},
        {"role": "tool", "tool_call_id": "call_a", "name": "wrong_name", "content": "-3 C, snow"},
        {"role": "assistant", "reasoning_content": "Summarise.",
         "content": "Oslo is snowy at -3 C; Lima is cloudy at 19 C."},
    ], [K3_WEATHER], {"add_generation_prompt": False}),
    ("tool_results_unresolved_keep_order", [
        {"role": "user", "content": "Search twice."},
        {"role": "assistant", "content": "", "tool_calls": [
            k3_call("s1", "search", "{\"query\": \"kittens\"}"),
            k3_call("s2", "get_weather", "{\"city\": \"Rome\"}")]},
        {"role": "tool", "tool_call_id": "s2", "content": "sunny"},
        {"role": "tool", "content": "unmatched: named after the call at its position (2)"},
        {"role": "tool", "name": "custom_tool", "content": "[]"},
    ], [SEARCH, K3_WEATHER], {"add_generation_prompt": False}),
    ("tool_result_positional_name", [
        {"role": "user", "content": "Search for kittens."},
        {"role": "assistant", "content": "", "tool_calls": [
            k3_call("functions.search:0", "search", "{\"query\": \"kittens\"}")]},
        {"role": "tool", "content": "[]"},
        {"role": "user", "content": "And puppies?"},
    ], [SEARCH], {}),
    ("tool_arguments_typed", [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "reasoning_content": "r", "content": None, "tool_calls": [
            k3_call("c1", "search",
                    "{\"query\": \"São Paulo \\\"centro\\\"\", \"limit\": 5, \"threshold\": 0.25, "
                    "\"exp\": 1e-7, \"big\": 1E20, \"whole\": 2.0, \"safe\": true, \"off\": false, "
                    "\"none\": null, \"filters\": {\"z\": 1, \"a\": [1, 2.5, \"x\", {\"é\": null}]}, "
                    "\"tags\": [\"a\", \"b\"], \"empty\": \"\", \"emptyobj\": {}, \"emptyarr\": []}")]},
    ], [SEARCH], {"add_generation_prompt": False}),
    ("tool_arguments_raw_and_blank", [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            k3_call("c1", "search", "{\"query\": \"unterminated"),
            k3_call("c2", "search", ""),
            k3_call("c3", "search", "  \n"),
            k3_call("c4", "search", "{}"),
        ]},
    ], [SEARCH], {"add_generation_prompt": False}),
    ("tool_name_escaping", [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "", "tool_calls": [
            k3_call("c1", "a&b\"c &quot; d", "{\"k&\\\"\": \"v&\\\"\"}")]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ], None, {}),
    ("tool_choice_required", [{"role": "user", "content": "Weather in Oslo?"}], [K3_WEATHER],
     {"tool_choice": "required"}),
    ("tool_choice_none", [{"role": "user", "content": "Weather in Oslo?"}], [K3_WEATHER],
     {"tool_choice": "none"}),
    ("tool_choice_auto", [{"role": "user", "content": "Weather in Oslo?"}], [K3_WEATHER],
     {"tool_choice": "auto"}),
    ("response_format_json_object", [{"role": "user", "content": "List three colours."}], None,
     {"response_format": {"type": "json_object"}}),
    ("response_format_json_schema", [{"role": "user", "content": "List three colours."}], None,
     {"response_format": {"type": "json_schema", "json_schema": {"name": "colours", "schema": {
         "type": "object", "required": ["colours"],
         "properties": {"colours": {"type": "array", "items": {"type": "string"}}}}}},
      "thinking": False}),
    ("response_format_text", [{"role": "user", "content": "Hi"}], None,
     {"response_format": {"type": "text"}}),
    ("assistant_last_no_generation_prompt", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Add.", "content": "4"},
    ], None, {"add_generation_prompt": False}),
    ("only_system", [K3_SYSTEM], None, {}),
    ("empty_conversation", [], None, {}),
    ("empty_conversation_no_generation_prompt", [], None, {"add_generation_prompt": False,
                                                          "thinking_effort": None}),
    ("empty_conversation_with_tools", [], [SEARCH], {"add_generation_prompt": False}),
    ("empty_tool_list", [{"role": "user", "content": "No tools here."}], [], {}),
]


def k3_for_jinja(messages):
    """The conversation as a transformers-style template receives it: tool-call arguments that are
    JSON objects given as mappings (key order kept), blank ones as {}, others left as strings."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                c = dict(c)
                f = dict(c["function"])
                a = f.get("arguments")
                if isinstance(a, str):
                    if not a.strip():
                        a = {}
                    else:
                        try:
                            parsed = json.loads(a)
                        except json.JSONDecodeError:
                            parsed = a
                        if not isinstance(parsed, (dict, str)):
                            sys.exit("K3 tool-call arguments must be a JSON object")
                        a = parsed
                f["arguments"] = a
                c["function"] = f
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


def load_k3_reference(path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("encoding_k3_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def main_k3(reference_path):
    text = template_text(K3_SOURCE, "K3JINJA")
    tmpl = environment().from_string(text)
    reference = load_k3_reference(reference_path) if reference_path else None
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:
        render_jinja_template = None
    if reference is None:
        print("no --k3-reference: K3 goldens come from the Jinja template alone, without segments",
              file=sys.stderr)
    cases = []
    for name, messages, tools, options in K3_CASES:
        options = dict(options)
        gen = options.pop("add_generation_prompt", True)
        sorted_tools = deep_sort_dict(tools) if tools is not None else None
        kwargs = dict(options)
        if "response_format" in kwargs:
            kwargs["response_format"] = deep_sort_dict(kwargs["response_format"])
        expected = tmpl.render(messages=k3_for_jinja(messages), tools=sorted_tools,
                               add_generation_prompt=gen, **kwargs)
        if render_jinja_template is not None:
            rendered, _ = render_jinja_template(conversations=[k3_for_jinja(messages)],
                                                tools=sorted_tools, chat_template=text,
                                                add_generation_prompt=gen, **kwargs)
            if rendered[0] != expected:
                sys.exit(f"K3 {name}: jinja2 and transformers disagree")
        case = {"name": name, "messages": messages, "tools": sorted_tools,
                "add_generation_prompt": gen, "options": options, "expected": expected}
        if reference is not None:
            ref_kwargs = dict(options)
            ref_kwargs.setdefault("thinking_effort", "max")  # tokenization_kimi.py's default
            segments = reference.build_chat_segments(messages, tools=tools,
                                                     add_generation_prompt=gen, **ref_kwargs)
            joined = "".join(s.text for s in segments)
            if joined != expected:
                sys.exit(f"K3 {name}: the Jinja template and the reference encoder disagree:\n"
                         f"  jinja:     {expected!r}\n  reference: {joined!r}")
            # The segments as UTF-8 byte lengths of consecutive pieces of `expected`, "s" marking
            # the allow_special ones: "8s 7 13 7s" is <|open|>, "message", ' role="user"', <|sep|>.
            case["segments"] = " ".join(
                f"{len(seg.text.encode('utf-8'))}{'s' if seg.allow_special else ''}"
                for seg in segments)
        cases.append(case)

    doc = {
        "comment": "Generated by tests/tokenizer/make_chat_golden.py; do not edit by hand.",
        "template": "kimi-k3",
        "template_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "reference_sha256": (hashlib.sha256(pathlib.Path(reference_path).read_bytes()).hexdigest()
                             if reference_path else None),
        "cases": cases,
    }
    K3_OUT.parent.mkdir(parents=True, exist_ok=True)
    K3_OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {K3_OUT.relative_to(ROOT)}")


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k3-reference", help="a copy of Kimi K3's encoding_k3.py to cross-check with")
    args = ap.parse_args()
    main_kimi()
    main_k3(args.k3_reference)


if __name__ == "__main__":
    main()
