"""The official `anthropic` package against `megadecode serve`'s Anthropic Messages API: messages
whole and streamed (raw events and the SDK's stream helper), count_tokens, stop sequences, tools
with tool_choice, structured output, errors. Run by tests/server/python/run_openai_check.sh.

usage: anthropic_client_check.py MEGADECODE_BINARY MODEL_DIR
"""
import json
import os
import signal
import sys
import tempfile
import urllib.request

import anthropic

from openai_client_check import check, start_server


# Sampling fields the SDK no longer types, sent as extra fields (the server reads them).
GREEDY = {"temperature": 0, "ignore_eos": True}


def chat_text(port, messages, max_tokens, **extra):
    """The /v1/chat/completions answer to the same conversation (greedy)."""
    body = dict(messages=messages, max_tokens=max_tokens, temperature=0, **extra)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "Authorization": "Bearer k"})
    with urllib.request.urlopen(req) as resp:
        return json.loads(resp.read())["choices"][0]["message"]["content"]


def main():
    binary, model = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_server(binary, model, os.path.join(tmp, "log"))
        try:
            client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="k",
                                         max_retries=0)
            msgs = [{"role": "user", "content": "hello"}]
            m = client.messages.create(model="tiny", max_tokens=8, system="be brief",
                                       messages=msgs, extra_body=GREEDY)
            check(m.type == "message" and m.role == "assistant", "messages: the object")
            check(m.stop_reason == "max_tokens" and m.usage.output_tokens == 8,
                  f"messages: stop_reason / usage {m.stop_reason} {m.usage}")
            check(len(m.content) == 1 and m.content[0].type == "text", "messages: a text block")
            text = m.content[0].text
            check(text == chat_text(port, [{"role": "system", "content": "be brief"}] + msgs, 8,
                                    ignore_eos=True),
                  "messages: the chat answer to the same conversation")

            events = list(client.messages.create(model="tiny", max_tokens=8, system="be brief",
                                                 messages=msgs, stream=True, extra_body=GREEDY))
            types = [e.type for e in events]
            check(types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"],
                  f"messages stream: event types {types}")
            deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
            check(deltas == text, "messages stream: text deltas == the whole text")
            with client.messages.stream(model="tiny", max_tokens=8, system="be brief",
                                        messages=msgs, extra_body=GREEDY) as stream:
                streamed = "".join(stream.text_stream)
                final = stream.get_final_message()
            check(streamed == text and final.content[0].text == text and
                  final.stop_reason == "max_tokens" and final.usage.output_tokens == 8,
                  "messages.stream(): text_stream and the final message")

            n = client.messages.count_tokens(model="tiny", system="be brief", messages=msgs)
            check(n.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens,
                  f"count_tokens {n.input_tokens} against usage {m.usage}")

            # A stop sequence taken from the greedy answer ends it there, and is reported.
            stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                        if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
            s = client.messages.create(model="tiny", max_tokens=8, system="be brief",
                                       messages=msgs, stop_sequences=[stop], extra_body=GREEDY)
            before = "".join(b.text for b in s.content)
            check(s.stop_reason == "stop_sequence" and s.stop_sequence == stop and
                  text.startswith(before + stop), f"stop_sequences {stop!r}: {s}")

            # A prefill (a final assistant message) is continued: the chat endpoint's
            # continue_final_message gives the same continuation.
            p = client.messages.create(model="tiny", max_tokens=6,
                                       messages=msgs + [{"role": "assistant", "content": "It is"}],
                                       extra_body=GREEDY)
            check(p.content[0].text == chat_text(
                port, msgs + [{"role": "assistant", "content": "It is"}], 6, ignore_eos=True,
                continue_final_message=True, add_generation_prompt=False),
                  "prefill: the continuation of the final assistant message")

            tool = {"name": "get_weather", "description": "weather of a city",
                    "input_schema": {"type": "object", "additionalProperties": False,
                                     "properties": {"city": {"type": "string", "maxLength": 8}},
                                     "required": ["city"]}}
            for seed in range(3):
                t = client.messages.create(model="tiny", max_tokens=120, messages=msgs,
                                           tools=[tool], tool_choice={"type": "any"},
                                           extra_body={"temperature": 1, "seed": seed})
                uses = [b for b in t.content if b.type == "tool_use"]
                check(len(uses) >= 1, f"tool_choice any seed {seed}: {t.content}")
                # (The random model may run out of tokens in a second call.)
                for u in uses[:-1] if t.stop_reason == "max_tokens" else uses:
                    check(u.name == "get_weather" and set(u.input) == {"city"} and
                          len(u.input["city"]) <= 8, f"tool_use input seed {seed}: {u.input}")
                check(t.stop_reason in ("tool_use", "max_tokens"), f"stop_reason {t.stop_reason}")
            # The call's result goes back as a tool_result block.
            u = uses[0]
            back = client.messages.create(
                model="tiny", max_tokens=4, tools=[tool], extra_body={"temperature": 0},
                messages=msgs + [{"role": "assistant", "content": [u.model_dump()]},
                                 {"role": "user", "content": [{"type": "tool_result",
                                                               "tool_use_id": u.id,
                                                               "content": "12 C"}]}])
            check(back.usage.input_tokens + back.usage.cache_read_input_tokens >
                  t.usage.input_tokens, "a tool_result turn")

            fmt = {"format": {"type": "json_schema",
                              "schema": {"type": "object", "additionalProperties": False,
                                         "properties": {"a": {"type": "boolean"}},
                                         "required": ["a"]}}}
            j = client.messages.create(model="tiny", max_tokens=60, messages=msgs, output_config=fmt,
                                       extra_body={"temperature": 0})
            check(j.stop_reason == "end_turn" and
                  isinstance(json.loads(j.content[0].text)["a"], bool),
                  f"output_config.format: {j.content}")

            try:
                client.messages.create(model="tiny", max_tokens=0, messages=msgs)
                check(False, "max_tokens 0 accepted")
            except anthropic.BadRequestError as e:
                check(e.body["error"]["type"] == "invalid_request_error" and
                      "max_tokens" in e.body["error"]["message"], "an Anthropic-shaped 400")
            try:
                client.messages.create(model="other", max_tokens=2, messages=msgs)
                check(False, "unknown model accepted")
            except anthropic.NotFoundError:
                pass
            try:
                anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="wrong",
                                    max_retries=0).messages.create(model="tiny", max_tokens=2,
                                                                   messages=msgs)
                check(False, "wrong api key accepted")
            except anthropic.AuthenticationError:
                pass
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=20)
        check(rc == 0, f"serve exit status {rc}")
    print("anthropic client check: OK")


if __name__ == "__main__":
    main()
