#!/usr/bin/env python3
"""The server under mpirun: `mpirun -np 2 megadecode serve --tp 2` (and --ep 2, and with n-gram
speculation) listens on rank 0 while rank 1 runs its steps (exec/step_mirror.h). On the golden
`small` weights (with a tokenizer of the same vocabulary beside them) the greedy completion of the
golden prompt over its clean stretch (golden.json: the steps before the first router near-tie,
where no summation order can flip a token) must be the single-process server's text, alone and as
four concurrent requests (batched steps, slots taken and freed while others run), and once more
restored from the prefix cache (every rank copies its slices of the kept state); sampled and chat
requests must complete; SIGTERM to mpirun must end every rank with status 0 within seconds; a
layout the server cannot run is a one-line error, not a hang.

Usage: cli_serve.py MPIEXEC MEGADECODE TESTS_DIR
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

mpiexec, cli, tests_dir = sys.argv[1:4]
golden_dir = os.path.join(tests_dir, "data", "golden", "small")
greedy = json.load(open(os.path.join(golden_dir, "golden.json")))["greedy"]
clean = greedy["clean_steps"]
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        failures.append(what)


work = tempfile.mkdtemp(prefix="md-cli-serve-")
model = os.path.join(work, "small")
os.mkdir(model)
for f in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(golden_dir, f), model)
# make-model's tokenizer for the preset's vocabulary (the golden weights come without one).
subprocess.run([cli, "make-model", "--preset", "small", "--seed", "1", "--out",
                os.path.join(work, "tok"), "--force"], check=True, capture_output=True)
for f in ("tiktoken.model", "tokenizer_config.json"):
    shutil.copy(os.path.join(work, "tok", f), model)


class Server:
    def __init__(self, launcher, flags):
        self.log = open(os.path.join(work, "server.log"), "w+")
        # (The golden prompt is 8 tokens: a prefix cache that keeps states of 4 or more.)
        self.proc = subprocess.Popen(launcher + [cli, "serve", "--model", model, "--port", "0",
                                                 "--executor", "megakernel",
                                                 "--prefix-cache-min-tokens", "4"] + flags,
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.time() + 60
        self.port = None
        while time.time() < deadline and self.proc.poll() is None:
            m = re.search(r"http://127\.0\.0\.1:(\d+)", self.text())
            if m:
                self.port = int(m.group(1))
                break
            time.sleep(0.1)
        if self.port is None:
            self.proc.kill()
            raise RuntimeError("the server did not start: " + self.text())

    def text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def post(self, path, body):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.load(r)

    def rank0_pid(self):
        """Rank 0's process under mpirun (its child with OMPI_COMM_WORLD_RANK=0), else ours."""
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                with open(f"/proc/{d}/environ", "rb") as f:
                    if b"OMPI_COMM_WORLD_RANK=0\0" in f.read():
                        return int(d)
            except (OSError, ValueError, IndexError):
                continue
        return self.proc.pid

    def stop(self, whom):
        """SIGTERM to the launcher or to rank 0; the launcher's status and seconds to exit."""
        t0 = time.time()
        os.kill(self.rank0_pid() if whom == "rank 0" else self.proc.pid, signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = None
        return rc, time.time() - t0


golden_req = {"prompt": greedy["prompt_ids"], "max_tokens": clean, "temperature": 0,
              "ignore_eos": True}


def session(launcher, flags, stop="launcher"):
    """The requests every server gets: the golden greedy completion alone and four at once, a
    sampled request with two choices and a chat request."""
    s = Server(launcher, flags)
    out = {}
    try:
        status, body = s.post("/v1/completions", golden_req)
        out["greedy"] = (status, body["choices"][0]["text"], body["usage"]["completion_tokens"])
        results = [None] * 4

        def one(i):
            results[i] = s.post("/v1/completions", golden_req)[1]["choices"][0]["text"]
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["concurrent"] = results
        # The prompt again: its whole state and last logits come from the prefix cache.
        status, body = s.post("/v1/completions", golden_req)
        out["cached"] = (status, body["choices"][0]["text"],
                         body["usage"]["prompt_tokens_details"]["cached_tokens"])
        status, body = s.post("/v1/completions", {"prompt": "Hello there", "max_tokens": 12,
                                                  "temperature": 0.9, "seed": 3, "n": 2,
                                                  "ignore_eos": True})
        out["sampled"] = (status, [c["finish_reason"] for c in body["choices"]], body["usage"]["completion_tokens"])
        status, body = s.post("/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                               "ignore_eos": True})
        out["chat"] = (status, body["usage"]["completion_tokens"])
    finally:
        out["stop"] = s.stop(stop)
        out["log"] = s.text()
    return out


single = session([], [])
want = single["greedy"][1]
check(single["greedy"][0] == 200 and single["greedy"][2] == clean,
      f"the single-process server completes the golden prompt ({clean} tokens)")
check(single["cached"] == (200, want, len(greedy["prompt_ids"])),
      f"the single-process server restores the golden prompt from its prefix cache "
      f"({single['cached']})")

mpi = [mpiexec, "--oversubscribe", "-np", "2"]
for flags, stop in ((["--tp", "2"], "rank 0"), (["--ep", "2"], "launcher"),
                    (["--tp", "2", "--speculative", "ngram"], "rank 0")):
    name = "mpirun -np 2 serve " + " ".join(flags)
    try:
        got = session(mpi, flags, stop)
    except Exception as e:  # noqa: BLE001 (the failure is reported, the other layouts still run)
        check(False, f"{name}: {e}")
        continue
    check(got["greedy"] == single["greedy"],
          f"{name}: the golden greedy completion is the single process's "
          f"({got['greedy'][1]!r} vs {want!r})")
    check(all(t == want for t in got["concurrent"]),
          f"{name}: four concurrent golden requests give the same text")
    check(got["cached"] == (200, want, len(greedy["prompt_ids"])),
          f"{name}: the golden request restored from the prefix cache gives the same text "
          f"({got['cached']})")
    check(got["sampled"][0] == 200 and got["sampled"][1] == ["length", "length"] and
          got["sampled"][2] == 24, f"{name}: a sampled request with n=2 completes")
    check(got["chat"] == (200, 5), f"{name}: a chat completion completes")
    rc, dt = got["stop"]
    steps = re.search(r"rank 1 ran (\d+) steps of rank 0 and stopped", got["log"])
    # SIGTERM to rank 0 is the server's own shutdown: the job's status is 0. SIGTERM to mpirun
    # makes mpirun end the job (it signals every rank and reports status 1 whatever they do):
    # both ranks must still stop cleanly.
    clean_stop = steps is not None and int(steps.group(1)) > 0 and \
        "megadecode serve: stopped" in got["log"] and dt < 15
    check(clean_stop and (rc == 0 or stop == "launcher"),
          f"{name}: SIGTERM to the {stop} stops both ranks cleanly (status {rc}, {dt:.1f} s, "
          f"rank 1 ran {steps.group(1) if steps else 'no'} steps)")
    if failures:
        print(got["log"])

# A layout the server refuses: one line on every rank, and the job ends.
p = subprocess.run(mpi + [cli, "serve", "--model", model, "--port", "0", "--tp", "2",
                          "--executor", "reference"], capture_output=True, text=True, timeout=60)
check(p.returncode != 0 and "need a plan executor" in p.stderr,
      f"serve --tp 2 --executor reference is an error (status {p.returncode})")

shutil.rmtree(work, ignore_errors=True)
sys.exit(1 if failures else 0)
