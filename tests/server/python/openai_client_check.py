"""The official `openai` package against `megadecode serve`: completions, chat and responses,
streamed and not, include_usage, logprobs, errors. Run by tests/server/python/run_openai_check.sh.

usage: openai_client_check.py MEGADECODE_BINARY MODEL_DIR
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from typing import List, Literal, Optional

import openai
from openai import OpenAI
from pydantic import BaseModel, Field
from typing_extensions import Annotated


# Structured output as the SDK's parse() asks for it (a strict JSON schema made from pydantic
# models: nested model, bounds, a pattern, lengths, an enum, an optional, a list).
class Address(BaseModel):
    city: str = Field(min_length=1, max_length=10)
    zip: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    score: float = Field(gt=0, lt=1)
    unit: Literal["c", "f"]
    home: Address
    tags: List[Annotated[str, Field(max_length=6)]] = Field(max_length=3)
    nick: Optional[Annotated[str, Field(max_length=8)]]


def start_server(binary, model, log_path):
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [binary, "serve", "--model", model, "--port", "0", "--workers", "1", "--max-batch", "4",
         "--served-model-name", "tiny", "--api-key", "k", "--max-model-len", "512"],
        stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline:
        m = re.search(r"http://127\.0\.0\.1:(\d+)", open(log_path).read())
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            raise SystemExit("serve exited: " + open(log_path).read())
        time.sleep(0.05)
    raise SystemExit("serve did not start")


def check(cond, what):
    if not cond:
        raise SystemExit("FAILED: " + what)


def check_responses(client):
    """The Responses API as the SDK drives it: create (whole, streamed, the stream helper that
    rebuilds the response from the events), retrieve, input_items, previous_response_id, delete,
    function tools and parse() with a pydantic text_format."""
    ignore_eos = {"ignore_eos": True}
    r1 = client.responses.create(model="tiny", input="hello", instructions="be brief",
                                 max_output_tokens=8, temperature=0, extra_body=ignore_eos)
    check(r1.object == "response" and r1.status == "incomplete", "responses: the object")
    check(r1.incomplete_details.reason == "max_output_tokens", "responses: incomplete_details")
    check(r1.usage.output_tokens == 8, "responses: usage")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hello"}],
        max_tokens=8, temperature=0, extra_body=ignore_eos)
    check(r1.output_text == chat.choices[0].message.content,
          "responses: the chat answer to the same conversation")
    events = list(client.responses.create(model="tiny", input="hello", instructions="be brief",
                                          max_output_tokens=8, temperature=0, stream=True,
                                          extra_body=ignore_eos))
    types = [e.type for e in events]
    check(types[:2] == ["response.created", "response.in_progress"] and
          types[-1] == "response.incomplete", f"responses stream: event types {types}")
    check("".join(e.delta for e in events if e.type == "response.output_text.delta") ==
          r1.output_text, "responses stream: deltas == the whole text")
    check([e.sequence_number for e in events] == list(range(len(events))),
          "responses stream: sequence numbers")
    # The SDK's stream helper rebuilds the response from the events (and wants it completed:
    # a small JSON schema ends the answer).
    fmt = {"format": {"type": "json_schema", "name": "yn", "strict": True,
                      "schema": {"type": "object", "additionalProperties": False,
                                 "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}
    with client.responses.stream(model="tiny", input="yes?", text=fmt, max_output_tokens=60,
                                 temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    whole = client.responses.create(model="tiny", input="yes?", text=fmt, max_output_tokens=60,
                                    temperature=0)
    check(final.status == "completed" and final.output_text == deltas == whole.output_text and
          isinstance(json.loads(whole.output_text)["a"], bool),
          f"responses.stream(): the final response {final.output_text!r}")

    got = client.responses.retrieve(r1.id)
    check(got.id == r1.id and got.output_text == r1.output_text, "responses.retrieve")
    items = client.responses.input_items.list(r1.id)
    check(len(items.data) == 1 and items.data[0].content[0].text == "hello",
          "responses.input_items.list")
    r2 = client.responses.create(model="tiny", previous_response_id=r1.id, input="and then?",
                                 max_output_tokens=4, temperature=0, extra_body=ignore_eos)
    chat2 = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"},
                                {"role": "assistant", "content": r1.output_text},
                                {"role": "user", "content": "and then?"}],
        max_tokens=4, temperature=0, extra_body=ignore_eos)
    check(r2.output_text == chat2.choices[0].message.content,
          "previous_response_id: the conversation goes on (without the instructions)")
    client.responses.delete(r1.id)
    try:
        client.responses.retrieve(r1.id)
        check(False, "a deleted response retrieved")
    except openai.NotFoundError:
        pass

    tool = {"type": "function", "name": "get_weather", "strict": True,
            "parameters": {"type": "object", "additionalProperties": False,
                           "properties": {"city": {"type": "string", "maxLength": 8}},
                           "required": ["city"]}}
    for seed in range(3):
        r = client.responses.create(model="tiny", input="weather in Paris?", tools=[tool],
                                    tool_choice="required", max_output_tokens=120,
                                    temperature=1, extra_body={"seed": seed})
        # (The random model may write several calls and run out of tokens in a later one,
        # which is then "incomplete".)
        calls = [o for o in r.output if o.type == "function_call" and o.status == "completed"]
        check(len(calls) >= 1, f"tool_choice required seed {seed}: {r.output}")
        for call in calls:
            args = json.loads(call.arguments)
            check(call.name == "get_weather" and set(args) == {"city"} and
                  len(args["city"]) <= 8, f"function_call arguments seed {seed}: {args}")
    parsed = 0
    for seed in range(4):
        p = client.responses.parse(model="tiny", input="a person", text_format=Person,
                                   max_output_tokens=440, temperature=1,
                                   extra_body={"seed": seed})
        if p.status != "completed":
            continue
        check(isinstance(p.output_parsed, Person), f"responses.parse seed {seed}: a Person")
        parsed += 1
    print(f"responses.parse(): {parsed} of 4 sampled answers complete and valid")
    check(parsed >= 2, f"responses.parse(): {parsed} of 4 sampled answers complete and valid")
    try:
        client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
        check(False, "a web_search tool accepted")
    except openai.BadRequestError as e:
        check(e.body["param"] == "tools.0.type", "an unsupported tool refused by name")


def main():
    binary, model = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_server(binary, model, os.path.join(tmp, "log"))
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
            models = client.models.list()
            check(models.data[0].id == "tiny", "models.list")

            c = client.completions.create(model="tiny", prompt="Once upon", max_tokens=6,
                                          temperature=0, logprobs=2,
                                          extra_body={"ignore_eos": True})
            check(c.object == "text_completion", "completion object")
            check(c.usage.completion_tokens == 6, "completion usage")
            check(len(c.choices[0].logprobs.tokens) == 6, "completion logprobs")
            check(len(c.choices[0].logprobs.top_logprobs[0]) <= 2, "top logprobs")

            text = ""
            usage = None
            for chunk in client.completions.create(model="tiny", prompt="Once upon", max_tokens=6,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    usage = chunk.usage
            check(text == c.choices[0].text, "streamed completion text == non-streamed")
            check(usage is not None and usage.completion_tokens == 6, "stream include_usage")

            messages = [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "hello"}]
            r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                               temperature=0, logprobs=True, top_logprobs=2,
                                               extra_body={"ignore_eos": True})
            check(r.choices[0].message.role == "assistant", "chat role")
            check(len(r.choices[0].logprobs.content) == 8, "chat logprobs")
            check(r.usage.total_tokens == r.usage.prompt_tokens + 8, "chat usage")

            content = ""
            finish = None
            for chunk in client.chat.completions.create(model="tiny", messages=messages,
                                                        max_tokens=8, temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}):
                if chunk.choices:
                    content += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
            check(content == r.choices[0].message.content, "streamed chat == non-streamed")
            check(finish == "length", "chat finish_reason")

            # A chat's next turn: the conversation so far is restored from the prefix cache
            # (on by default; prefixes of at least 64 tokens), as the SDK's usage reports.
            turn = [{"role": "system", "content": "be brief. " * 40},
                    {"role": "user", "content": "hello"}]
            t1 = client.chat.completions.create(model="tiny", messages=turn, max_tokens=4,
                                                temperature=0)
            check(t1.usage.prompt_tokens_details.cached_tokens == 0, "first turn: nothing cached")
            turn += [{"role": "assistant", "content": t1.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
            t2 = client.chat.completions.create(model="tiny", messages=turn, max_tokens=4,
                                                temperature=0)
            check(t2.usage.prompt_tokens_details.cached_tokens >= t1.usage.prompt_tokens,
                  "next turn: the first turn's prompt restored from the prefix cache")

            # parse() with a pydantic model: every answer that ends ("stop") parses and passes
            # pydantic's validation (its bounds, pattern and lengths); the random model may
            # run out of tokens in a long string or number, which parse() reports as such.
            parsed = 0
            for seed in range(6):
                try:
                    p = client.beta.chat.completions.parse(
                        model="tiny", messages=[{"role": "user", "content": "a person"}],
                        response_format=Person, max_tokens=440, temperature=1, seed=seed)
                except openai.LengthFinishReasonError:
                    continue
                person = p.choices[0].message.parsed
                check(isinstance(person, Person), f"parse() seed {seed}: a Person")
                parsed += 1
            print(f"parse(): {parsed} of 6 sampled answers complete and valid")
            check(parsed >= 3, f"parse(): {parsed} of 6 sampled answers complete and valid")

            # vLLM's structured outputs, passed as the SDK passes extra fields: a choice (chat,
            # streamed) and a regex (completions), sampled from the random model.
            choices = ["positive", "negative", "neutral"]
            for seed in range(3):
                text = "".join(
                    c.choices[0].delta.content or ""
                    for c in client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "classify"}],
                        max_tokens=10, temperature=1, seed=seed, stream=True,
                        extra_body={"structured_outputs": {"choice": choices}})
                    if c.choices)
                check(text in choices, f"structured_outputs.choice seed {seed}: {text!r}")
            pattern = r"[A-Z]{2}-\d{3}"
            for seed in range(3):
                r = client.completions.create(model="tiny", prompt="code:", max_tokens=12,
                                              temperature=1, seed=seed,
                                              extra_body={"guided_regex": pattern})
                check(r.choices[0].finish_reason == "stop" and
                      re.fullmatch(pattern, r.choices[0].text) is not None,
                      f"guided_regex seed {seed}: {r.choices[0].text!r}")
            grammar = 'root ::= answer (", " answer)?\nanswer ::= "yes" | "no"'
            r = client.completions.create(model="tiny", prompt="answers:", max_tokens=12,
                                          temperature=1, seed=1,
                                          extra_body={"structured_outputs": {"grammar": grammar}})
            check(r.choices[0].finish_reason == "stop" and
                  re.fullmatch(r"(yes|no)(, (yes|no))?", r.choices[0].text) is not None,
                  f"structured_outputs.grammar: {r.choices[0].text!r}")
            nested = 'root ::= "x" | "(" root ")"'
            r = client.completions.create(model="tiny", prompt="nest:", max_tokens=40,
                                          temperature=1, seed=2,
                                          extra_body={"guided_grammar": nested})
            t = r.choices[0].text
            check(r.choices[0].finish_reason == "length" or
                  re.fullmatch(r"\(*x\)*", t) is not None and t.count("(") == t.count(")"),
                  f"a recursive guided_grammar: {t!r}")
            try:
                client.completions.create(
                    model="tiny", prompt="x", max_tokens=2,
                    extra_body={"structured_outputs": {"grammar": 'root ::= root "x" | "x"'}})
                check(False, "a left-recursive grammar accepted")
            except openai.BadRequestError as e:
                check(e.body["param"] == "structured_outputs.grammar",
                      "a left-recursive grammar refused by name")

            # logit_bias as the SDK sends it ({"id": bias}): +100 on one token makes every
            # greedy token that one (its text: /detokenize of it four times).
            forced = 5
            b = client.completions.create(model="tiny", prompt="Once upon", max_tokens=4,
                                          temperature=0, logit_bias={str(forced): 100},
                                          extra_body={"ignore_eos": True})
            check(b.usage.completion_tokens == 4, "logit_bias completion usage")
            req = urllib.request.Request(f"http://127.0.0.1:{port}/detokenize",
                                         data=json.dumps({"tokens": [forced] * 4}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req) as resp:
                want = json.loads(resp.read())["prompt"]
            check(b.choices[0].text == want, "logit_bias +100 forces the token")
            try:
                client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                          logit_bias={"x": 1})
                check(False, "a logit_bias key that is not a token id accepted")
            except openai.BadRequestError as e:
                check(e.body["param"] == "logit_bias", "logit_bias error names the field")

            check_responses(client)

            try:
                client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
                check(False, "empty messages accepted")
            except openai.BadRequestError as e:
                check(e.body["param"] == "messages", "error names the field")
            try:
                client.completions.create(model="other", prompt="x", max_tokens=2)
                check(False, "unknown model accepted")
            except openai.NotFoundError:
                pass
            try:
                OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong",
                       max_retries=0).models.list()
                check(False, "wrong api key accepted")
            except openai.AuthenticationError:
                pass
        finally:
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=20)
        check(rc == 0, f"serve exit status {rc}")
    print("openai client check: OK")


if __name__ == "__main__":
    main()
