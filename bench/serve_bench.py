#!/usr/bin/env python3
"""A streaming load client for `megadecode serve`, in the style of `vllm bench serve`.

bench mode: for each concurrency level, N requests of random token-id prompts of --input-len
tokens, each generating exactly --output-len tokens (ignore_eos), streamed; prints request
throughput, output tokens/s, time to first token and inter-token latency (p50/p99).

prefill-probe mode (--prefill-probe LEN): --concurrency streams decode --output-len tokens; once
all are streaming, a request with a LEN-token prompt (max_tokens 1) arrives; prints the running
streams' inter-token latency p50/p99/max before it and while its prompt is prefilled, and its
time to first token (the target: the p99 rises by at most one prefill chunk's time).

soak mode (--soak SECONDS): --concurrency streaming clients loop for that long; prints errors
(must be 0), requests served, and the server's RSS (--server-pid) at the start, after a tenth of
the run (warm: buffers sized, pools filled) and at the end; fails if the end is more than 5% +
16 MiB above the warm figure (a leak), or on any error.

Standard library only, so it runs anywhere the server does. One thread drives every connection
through a selector and parses HTTP/1.1 chunked SSE by hand: on a host with few cores the client
shares the CPUs with the server's workers, and every cycle it spends is taken from them, so it
does as little per event as it can (a JSON parse only for the usage chunk and for errors). A
thread per client with http.client cost about 3x the CPU here (bench/RESULTS.md).

  python3 bench/serve_bench.py --port 8000 --input-len 128 --output-len 64 --concurrency 1,2,4,8
  python3 bench/serve_bench.py --port 8000 --soak 600 --concurrency 64 --server-pid PID
"""
import argparse
import json
import random
import selectors
import socket
import sys
import time


# The streaming endpoints and how their streams end (--endpoint).
PATHS = {"completions": b"/v1/completions", "chat": b"/v1/chat/completions",
         "responses": b"/v1/responses", "messages": b"/v1/messages"}


class Stream:
    """One streamed request on its own connection; feed() takes the bytes as they arrive. The
    body's "_endpoint" key (popped) picks the route (default: completions)."""

    def __init__(self, host, port, body):
        body = dict(body)
        self.endpoint = body.pop("_endpoint", "completions")
        payload = json.dumps(body).encode()
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.t0 = time.perf_counter()
        self.sock.sendall(b"POST %s HTTP/1.1\r\nHost: %s\r\n" % (PATHS[self.endpoint], host.encode())
                          + b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                          b"Connection: close\r\n\r\n" % len(payload) + payload)
        self.sock.setblocking(False)
        self.raw = bytearray()      # bytes not yet parsed (headers, then chunk framing)
        self.sse = bytearray()      # de-chunked body not yet split into events
        self.status = None
        self.ttft = None
        self.last = None
        self.gaps = []
        self.arrivals = None        # every event's arrival time, when asked for (probe mode)
        self.tokens = 0
        self.done = False           # saw data: [DONE]
        self.error = None

    def feed(self, data, now):
        self.raw += data
        if self.status is None:
            end = self.raw.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.raw[:end]).decode("latin-1")
            del self.raw[:end + 4]
            self.status = int(head.split(" ", 2)[1])
            if self.status != 200:
                self.error = f"HTTP {self.status}"
        while True:  # chunked transfer coding: "<hex size>\r\n<data>\r\n", size 0 ends it
            eol = self.raw.find(b"\r\n")
            if eol < 0:
                break
            size = int(bytes(self.raw[:eol]).split(b";")[0], 16) if eol else 0
            if len(self.raw) < eol + 2 + size + 2:
                break
            self.sse += self.raw[eol + 2:eol + 2 + size]
            del self.raw[:eol + 2 + size + 2]
        while True:
            end = self.sse.find(b"\n\n")
            if end < 0:
                return
            event = bytes(self.sse[:end])
            del self.sse[:end + 2]
            self.event(event, now)

    def event(self, event, now):
        if event.startswith(b"event: "):  # the Responses and Messages APIs' typed events
            return self.typed_event(event, now)
        if not event.startswith(b"data: "):
            return  # an SSE comment (keep-alive)
        data = event[6:]
        if data == b"[DONE]":
            self.done = True
        elif b'"error"' in data[:16]:
            self.error = json.loads(data)["error"]["message"]
        elif b'"usage":{' in data:
            chunk = json.loads(data)
            self.tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                self.arrival(now)
        else:
            self.arrival(now)

    def typed_event(self, event, now):
        nl = event.find(b"\n")
        kind, data = event[7:nl], event[nl + 7:]
        if kind in (b"response.output_text.delta", b"content_block_delta"):
            self.arrival(now)
        elif kind in (b"response.completed", b"response.incomplete"):
            self.tokens = json.loads(data)["response"]["usage"]["output_tokens"]
            self.done = True
        elif kind == b"message_delta":
            self.tokens = json.loads(data)["usage"]["output_tokens"]
        elif kind == b"message_stop":
            self.done = True
        elif kind in (b"error", b"response.failed"):
            self.error = data.decode("utf-8", "replace")

    def arrival(self, now):
        if self.arrivals is not None:
            self.arrivals.append(now)
        if self.ttft is None:
            self.ttft = now - self.t0
        else:
            self.gaps.append(now - self.last)
        self.last = now

    def result(self):
        """(ttft, gaps, tokens), or raises with what went wrong."""
        if self.error:
            raise RuntimeError(self.error)
        if not self.done:
            raise RuntimeError(f"{self.endpoint} stream ended without its last event")
        return self.ttft or 0.0, self.gaps, self.tokens


def pump(sel, timeout=600):
    """Feeds the ready streams what arrived; returns those that ended (their sockets closed)."""
    ended = []
    for key, _ in sel.select(timeout=timeout):
        s = key.data
        try:
            data = s.sock.recv(65536)
        except OSError as e:
            data, s.error = b"", s.error or f"recv: {e}"
        if data:
            s.feed(data, time.perf_counter())
            continue
        sel.unregister(s.sock)
        s.sock.close()
        ended.append(s)
    return ended


def drive(host, port, bodies, concurrency, deadline=None, on_done=None):
    """Runs the bodies with at most `concurrency` streams open; on_done(stream) after each. With a
    deadline, bodies() is a generator consulted until then."""
    sel = selectors.DefaultSelector()
    open_streams = 0
    source = iter(bodies)

    def start():
        nonlocal open_streams
        if deadline is not None and time.time() >= deadline:
            return False
        body = next(source, None)
        if body is None:
            return False
        try:
            s = Stream(host, port, body)
        except OSError as e:
            on_done(None, f"connect: {e}")
            return True
        sel.register(s.sock, selectors.EVENT_READ, s)
        open_streams += 1
        return True

    for _ in range(concurrency):
        if not start():
            break
    while open_streams:
        for s in pump(sel):
            open_streams -= 1
            on_done(s, None)
            start()


def request_body(args, rng):
    # The shared prefix: the same ids in every request (a generator of their own, from the seed).
    shared = random.Random(args.seed ^ 0x9E3779B97F4A7C15)
    prompt = [shared.randrange(1, args.vocab) for _ in range(args.prefix_len)]
    prompt += [rng.randrange(1, args.vocab) for _ in range(args.input_len)]
    endpoint = args.endpoint
    if endpoint == "mixed":
        endpoint = rng.choice(sorted(PATHS))
    common = {"ignore_eos": True, "temperature": 0, "stream": True, "_endpoint": endpoint}
    if endpoint == "completions":
        return dict(common, prompt=prompt, max_tokens=args.output_len,
                    stream_options={"include_usage": True})
    # The text endpoints take words (one or a few tokens each) instead of ids.
    text = " ".join(f"w{i}" for i in prompt)
    if endpoint == "chat":
        return dict(common, messages=[{"role": "user", "content": text}],
                    max_tokens=args.output_len, stream_options={"include_usage": True})
    if endpoint == "responses":
        return dict(common, input=text, max_output_tokens=args.output_len)
    return dict(common, messages=[{"role": "user", "content": text}], max_tokens=args.output_len)


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def bench(args):
    print(f"{'conc':>5} {'req/s':>8} {'out tok/s':>10} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'itl p50':>8} {'itl p99':>8}  (ms)")
    for conc in [int(c) for c in args.concurrency.split(",")]:
        n = max(args.num_requests, conc)
        rng = random.Random(args.seed + conc)
        bodies = [request_body(args, rng) for _ in range(n)]
        ttfts, gaps, tokens, errors = [], [], [0], []
        if args.warmup:  # not counted: a fresh server's first steps touch its pages and buffers
            warm = [dict(request_body(args, rng), max_tokens=4) for _ in range(conc)]
            drive(args.host, args.port, warm, conc, on_done=lambda s, err: None)

        def done(s, err):
            try:
                if err:
                    raise RuntimeError(err)
                t, g, k = s.result()
                ttfts.append(t)
                gaps.extend(g)
                tokens[0] += k
            except Exception as e:  # reported, never hidden
                errors.append(str(e))

        t0 = time.perf_counter()
        drive(args.host, args.port, bodies, conc, on_done=done)
        wall = time.perf_counter() - t0
        print(f"{conc:>5} {len(ttfts) / wall:>8.2f} {tokens[0] / wall:>10.1f} "
              f"{pct(ttfts, 50) * 1e3:>9.1f} {pct(ttfts, 99) * 1e3:>9.1f} "
              f"{pct(gaps, 50) * 1e3:>8.2f} {pct(gaps, 99) * 1e3:>8.2f}"
              + (f"  errors: {len(errors)} ({errors[0]})" if errors else ""), flush=True)
    return 0


def prefill_probe(args):
    """The running streams' inter-token gaps before and during a long prompt's prefill."""
    rng = random.Random(args.seed)
    sel = selectors.DefaultSelector()
    streams = []
    for _ in range(args.concurrency_max):
        s = Stream(args.host, args.port, request_body(args, rng))
        s.arrivals = []
        sel.register(s.sock, selectors.EVENT_READ, s)
        streams.append(s)
    probe, t_probe, t_first, open_n = None, None, None, len(streams)
    while open_n:
        now = time.perf_counter()
        if probe is None and all(s.arrivals and now - s.arrivals[0] > args.probe_after
                                 for s in streams):
            body = request_body(args, rng)
            body = dict(body, _endpoint="completions", stream_options={"include_usage": True})
            body.pop("messages", None)
            body.pop("input", None)
            body.pop("max_output_tokens", None)
            body["prompt"] = [rng.randrange(1, args.vocab) for _ in range(args.prefill_probe)]
            body["max_tokens"] = 1
            probe = Stream(args.host, args.port, body)
            t_probe = probe.t0
            sel.register(probe.sock, selectors.EVENT_READ, probe)
            open_n += 1
        for s in pump(sel):
            open_n -= 1
            if s is probe:
                probe.result()
                t_first = probe.t0 + probe.ttft
    if probe is None:
        print("the streams ended before the probe was sent: raise --output-len")
        return 1
    for s in streams:
        s.result()
    before, during = [], []
    for s in streams:
        a = s.arrivals
        for t0, t1 in zip(a, a[1:]):
            if t1 <= t_probe:
                before.append(t1 - t0)
            elif t0 < t_first:  # a gap that overlaps the prefill
                during.append(t1 - t0)
    if not during:
        print("no stream token overlapped the prefill: raise --output-len")
        return 1
    ms = lambda xs, p: pct(xs, p) * 1e3
    print(f"{args.concurrency_max} streams; a {args.prefill_probe}-token prompt arrived, first "
          f"token after {(t_first - t_probe) * 1e3:.1f} ms")
    print(f"  inter-token ms before: p50 {ms(before, 50):.2f} p99 {ms(before, 99):.2f} "
          f"max {max(before) * 1e3:.2f} ({len(before)} gaps)")
    print(f"  inter-token ms during: p50 {ms(during, 50):.2f} p99 {ms(during, 99):.2f} "
          f"max {max(during) * 1e3:.2f} ({len(during)} gaps)")
    print(f"  p99 rise: {ms(during, 99) - ms(before, 99):.2f} ms")
    return 0


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def soak(args):
    conc = int(args.concurrency.split(",")[-1])
    rng = random.Random(args.seed)
    served, errors = [0], []
    rss_start = rss_kib(args.server_pid) if args.server_pid else -1
    rss_warm = [-1]
    t_warm = time.time() + args.soak / 10

    def bodies():
        while True:
            yield request_body(args, rng)

    def done(s, err):
        try:
            if err:
                raise RuntimeError(err)
            s.result()
            served[0] += 1
        except Exception as e:
            errors.append(str(e))
        if args.server_pid and rss_warm[0] < 0 and time.time() >= t_warm:
            rss_warm[0] = rss_kib(args.server_pid)

    drive(args.host, args.port, bodies(), conc, deadline=time.time() + args.soak, on_done=done)
    rss_end = rss_kib(args.server_pid) if args.server_pid else -1
    print(f"soak: {conc} clients for {args.soak:.0f} s: {served[0]} requests served, "
          f"{len(errors)} errors; server RSS {rss_start} KiB at start, {rss_warm[0]} KiB warm, "
          f"{rss_end} KiB at end")
    for e in errors[:5]:
        print("  error:", e)
    grew = rss_warm[0] > 0 and rss_end > rss_warm[0] * 1.05 + 16 * 1024
    if grew:
        print("  the server's RSS grew after warm-up: a leak?")
    return 1 if errors or grew or served[0] == 0 else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--num-requests", type=int, default=32, help="per concurrency level")
    ap.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [1, vocab)")
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="ids every prompt starts with before its --input-len random ones (a "
                         "shared system prompt: what the server's prefix cache restores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--endpoint", default="completions", choices=sorted(PATHS) + ["mixed"],
                    help="the streaming route (mixed: each request picks one at random; the "
                         "text routes take words instead of ids)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="bench: first run `concurrency` uncounted 4-token requests (0: none)")
    ap.add_argument("--soak", type=float, default=0, help="soak mode: seconds to run")
    ap.add_argument("--server-pid", type=int, default=0, help="soak: the server, for its RSS")
    ap.add_argument("--prefill-probe", type=int, default=0,
                    help="prefill-probe mode: the arriving prompt's length")
    ap.add_argument("--probe-after", type=float, default=1.0,
                    help="prefill-probe: seconds every stream has streamed before the probe")
    args = ap.parse_args()
    args.concurrency_max = max(int(c) for c in args.concurrency.split(","))
    if args.prefill_probe > 0:
        sys.exit(prefill_probe(args))
    sys.exit(soak(args) if args.soak > 0 else bench(args))


if __name__ == "__main__":
    main()
