"""The official `openai` package against `megadecode serve`: completions and chat, streamed and
not, include_usage, logprobs, errors. Run by tests/server/python/run_openai_check.sh.

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
