#!/usr/bin/env python3
"""A streaming load client for `megadecode serve`, in the style of `vllm bench serve`.

bench mode: for each concurrency level, N requests of random token-id prompts of --input-len
tokens, each generating exactly --output-len tokens (ignore_eos), streamed; prints request
throughput, output tokens/s, time to first token and inter-token latency (p50/p99).

soak mode (--soak SECONDS): --concurrency streaming clients loop for that long; prints errors
(must be 0), requests served, and the server's RSS at start and end (--server-pid).

Standard library only (http.client, threads), so it runs anywhere the server does.

  python3 bench/serve_bench.py --port 8000 --input-len 128 --output-len 64 --concurrency 1,2,4,8
  python3 bench/serve_bench.py --port 8000 --soak 600 --concurrency 64 --server-pid PID
"""
import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time


def stream_completion(host, port, body, timeout=600):
    """Sends one streamed completion; returns (ttft, inter-token gaps, output tokens) or raises."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    ttft, last, gaps, tokens, done = None, None, [], 0, False
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        now = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if not chunk.get("choices"):
            continue
        if ttft is None:
            ttft = now - t0
        elif last is not None:
            gaps.append(now - last)
        last = now
    conn.close()
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    return ttft or 0.0, gaps, tokens


def request_body(args, rng):
    prompt = [rng.randrange(1, args.vocab) for _ in range(args.input_len)]
    return {"prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


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
        lock = threading.Lock()
        ttfts, gaps, tokens, errors = [], [], [0], []

        def worker(queue):
            while True:
                with lock:
                    if not queue:
                        return
                    body = queue.pop()
                try:
                    t, g, k = stream_completion(args.host, args.port, body)
                    with lock:
                        ttfts.append(t)
                        gaps.extend(g)
                        tokens[0] += k
                except Exception as e:  # reported, never hidden
                    with lock:
                        errors.append(str(e))

        queue = list(bodies)
        t0 = time.perf_counter()
        threads = [threading.Thread(target=worker, args=(queue,)) for _ in range(conc)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        print(f"{conc:>5} {len(ttfts) / wall:>8.2f} {tokens[0] / wall:>10.1f} "
              f"{pct(ttfts, 50) * 1e3:>9.1f} {pct(ttfts, 99) * 1e3:>9.1f} "
              f"{pct(gaps, 50) * 1e3:>8.2f} {pct(gaps, 99) * 1e3:>8.2f}"
              + (f"  errors: {len(errors)} ({errors[0]})" if errors else ""))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def soak(args):
    conc = int(args.concurrency.split(",")[-1])
    stop = time.time() + args.soak
    lock = threading.Lock()
    served, errors = [0], []
    rss_start = rss_kib(args.server_pid) if args.server_pid else -1

    def worker(i):
        rng = random.Random(args.seed + i)
        while time.time() < stop:
            try:
                stream_completion(args.host, args.port, request_body(args, rng))
                with lock:
                    served[0] += 1
            except Exception as e:
                with lock:
                    errors.append(str(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rss_end = rss_kib(args.server_pid) if args.server_pid else -1
    print(f"soak: {conc} clients for {args.soak:.0f} s: {served[0]} requests served, "
          f"{len(errors)} errors; server RSS {rss_start} KiB at start, {rss_end} KiB at end")
    for e in errors[:5]:
        print("  error:", e)
    return 1 if errors else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--num-requests", type=int, default=32, help="per concurrency level")
    ap.add_argument("--vocab", type=int, default=1000, help="prompt ids are drawn from [1, vocab)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soak", type=float, default=0, help="soak mode: seconds to run")
    ap.add_argument("--server-pid", type=int, default=0, help="soak: the server, for its RSS")
    args = ap.parse_args()
    if args.soak > 0:
        sys.exit(soak(args))
    bench(args)


if __name__ == "__main__":
    main()
