# megadecode: quick start is `make demo` and `make test` (each installs what it needs).
BUILD      ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
JOBS       ?= $(shell nproc)
CMAKE_FLAGS ?=
MODELS     ?= models
BIN        := $(BUILD)/megadecode

.PHONY: all deps build test test-asan test-tsan test-release fuzz demo bench-small bench-kl48 bench-llamacpp format \
        clean cuda-archs gpu-bundle soak

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) > /dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# Release tests, then the unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer,
# then the plan and executor tests under ThreadSanitizer.
test: test-release test-asan test-tsan

# The CUDA simulation's tests run in the Release suite; the sanitizer runs leave out the heaviest
# (small model, goldens, seeds: minutes under ASan) and TSan takes a few representative ones.
# The server's tests are named Server* (ServerRequest, ServerEngine, ServerHttp, ServerHttpAuth,
# ServerCli, ServerOpenAI, ServerSchemathesis), so a regex can take them in or out of a run; ASan
# runs them all but the schemathesis run (~15 s of generated requests, covered by Release), the
# openai package's run (~18 s under ASan; ServerHttp drives the same handlers under ASan) and the
# C++ load client's run (~28 s under ASan; its parsing is the client's, the server's side is
# ServerHttp's), the
# speculative sampling G-tests (8000 seeded runs each, host arithmetic whose pieces the
# Acceptance tests cover), the speculative greedy runs on the small models (tiny ones stay), the
# plan-drafted speculative runs and the simulation's draft-against-host run (the draft plan's
# CPU and CUDA tiles run under ASan in DraftPlan's and CudaDraft's other tests),
# the CLI's CUDA-simulation run, the simulation's K3 FP32 run, device sampling and
# device-generated weights (its other suites run under ASan), the golden-model executor suite
# (the Executor suites run the same tiles under ASan) and the full-vocabulary sampler run (host
# arithmetic that the other Sampler tests cover at smaller vocabularies).
# The sanitizer builds compile the library at -O1 and the code driving it (the tests, the CLI's
# tools/ files, the fuzz replays) at -O0: their build time dominates `make test` on two cores
# (-O1 + UBSan costs a test file ~30 s, -O0 ~20 s), and the suites still run in a few minutes.
SAN_FLAGS := -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DMEGADECODE_DRIVER_FLAGS=-O0
# Under ASan + UBSan the drivers skip UBSan's instrumentation (a third of their compile time); the
# library they drive keeps it (CMakeLists.txt: MEGADECODE_DRIVER_FLAGS).
ASAN_DRIVER_FLAGS := "-DMEGADECODE_DRIVER_FLAGS=-O0;-fno-sanitize=undefined"

test-release: build
	@bash scripts/check-cuda.sh $(BUILD)
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

test-asan: deps
	@cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DMEGADECODE_SANITIZE=address,undefined -DMEGADECODE_BENCH=OFF -DMEGADECODE_CUDA=OFF -DMEGADECODE_MPI=OFF \
	  $(SAN_FLAGS) $(ASAN_DRIVER_FLAGS) > /dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)
	@cd $(ASAN_BUILD) && UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j $(JOBS) \
	  -E '^CudaSim\.(Small|GoldenModels|RandomSchedules|AuxCapture)|^Cli\.DeviceCudaSim$$|^CudaSim\.(K3TinyFp32|SamplingOnTheDevice)|^CudaRandomWeights\.|^ExecutorGolden\.|^Sampler\.CombinedFullVocabulary$$|^Server(Schemathesis|OpenAI)\.|^ServerCli\.ServeBenchDrivesTheServer$$|^SpeculativeSampling\.|^Models/SpeculativeGreedy\..*/(small|k3_small)_|^DraftPlan\.SpeculativeDecoding|^CudaDraft\.(DraftsAs|Speculative)'

# The plan executors (persistent workers, counters, barriers; multi-row steps; a draft plan's
# steps), the server's engine loop and HTTP front end (the engine thread, request streams,
# cancel, shutdown, streaming handlers; the parser mutation run is left out, it is
# single-threaded), and the CUDA simulation (its runtime, two attention tiles, the megakernel's
# watchdog; a whole model takes minutes under TSan) under ThreadSanitizer: any data race or report
# fails the target. Only the test binary is built, from the test directories those suites live in
# (MEGADECODE_TEST_DIRS; the plan compiler's tests are single-threaded and stay out). Left to the
# other runs: the executor suites on the small models and the golden-model suite (the tiny ones
# exercise the same workers, counters and barriers), and the engine's speculative runs
# (ServerEngine.Sp*: the engine thread drives them exactly as plain steps, whose tests stay).
# tests/tsan.supp ignores the memory accesses of the uninstrumented cpp-httplib library itself.
test-tsan: deps
	@cmake -S . -B $(TSAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DMEGADECODE_SANITIZE=thread -DMEGADECODE_BENCH=OFF -DMEGADECODE_CUDA=OFF -DMEGADECODE_MPI=OFF $(SAN_FLAGS) \
	  "-DMEGADECODE_TEST_DIRS=exec;server;cuda" > /dev/null
	@cmake --build $(TSAN_BUILD) -j $(JOBS) --target megadecode_tests
	@cd $(TSAN_BUILD) && TSAN_OPTIONS=halt_on_error=1:abort_on_error=1:second_deadlock_stack=1:suppressions=$(CURDIR)/tests/tsan.supp \
	  ctest --output-on-failure -j $(JOBS) -E '^Executor\.(Small|K3Small)' -R '^(Executor|MultiRowErrors|CudaSimRuntime)\.|^DraftPlan\.RingWraps|^Golden/MultiRow\.|^CudaAttention\.(KdaChainedRowsWithRowLog|MlaCoreBf16Cache)|^CudaSim\.Watchdog|^ServerEngine\.[^S]|^ServerEngine\.S[^p]|^ServerHttp\.|^ServerHttpQueued\.|^ServerHttpResponses\.|^ServerHttpAnthropic\.|^RequestStreamConsumer\.'

# The CUDA kernels for every target architecture (sm_80 with its fallbacks, sm_90a, sm_100a), with
# the portability and SASS checks on the result; ~3 minutes of nvcc on two cores.
cuda-archs: deps
	@cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DMEGADECODE_TESTS=OFF \
	  -DMEGADECODE_BENCH=OFF "-DMEGADECODE_CUDA_ARCHS=80-real;90a-real;100a-real" > /dev/null
	@cmake --build build-cuda -j $(JOBS) --target megadecode
	@bash scripts/check-cuda.sh build-cuda

# What bench/gpu-check.sh runs on a lent GPU machine, which cannot install the dependencies: the
# CLI and the test binary built here for sm_90a, with their shared libraries and loader, in
# gpu-bundle/ (carry it: device run with carry ["gpu-bundle"], command bash bench/gpu-check.sh).
gpu-bundle: build
	@bash scripts/check-cuda.sh $(BUILD)
	@bash scripts/gpu-bundle.sh $(BUILD) gpu-bundle

# libFuzzer harnesses (tests/fuzz), built with clang in $(FUZZ_BUILD) and run FUZZ_SECONDS each;
# any finding fails the target. make test only replays their committed corpora (with g++).
FUZZ_BUILD   ?= build-fuzz
FUZZ_SECONDS ?= 60
fuzz:
	@FUZZ_BUILD=$(FUZZ_BUILD) FUZZ_SECONDS=$(FUZZ_SECONDS) JOBS=$(JOBS) bash scripts/fuzz.sh

$(MODELS)/small/config.json: | build
	@$(BIN) make-model --preset small --seed 1 --out $(MODELS)/small --force

$(MODELS)/kl48-e32/config.json: | build
	@$(BIN) make-model --preset kl48-e32 --seed 1 --out $(MODELS)/kl48-e32 --shards 8 --force

demo: build $(MODELS)/small/config.json
	@echo "== inspect =="
	@$(BIN) inspect --model $(MODELS)/small
	@echo "== greedy generation (ids) =="
	@$(BIN) generate --model $(MODELS)/small --ids 1,2,3,4,5 --max-tokens 24 --ignore-eos
	@echo "== decode benchmark, batch 1 =="
	@$(BIN) bench --model $(MODELS)/small --steps 64 --reps 5

bench-small: build $(MODELS)/small/config.json
	@$(BIN) bench --model $(MODELS)/small --batch 1,2,4,8 --steps 64 --reps 7 \
	  --json bench/small.json --plot bench/small.svg

# ~16 GB of files; needs the disk and ~17 GB of memory for the page cache.
bench-kl48: build $(MODELS)/kl48-e32/config.json
	@$(BIN) bench --model $(MODELS)/kl48-e32 --batch 1,4 --steps 8 --reps 3 \
	  --json bench/kl48-e32.json --plot bench/kl48-e32.svg

# megadecode against llama.cpp (fetched from PyPI's llama-cpp-python sdist and built under
# build/llamacpp, never committed) on the kl48-e32 weights: speed at B = 1/4/8 and KL divergence.
# ~1 h and ~45 GB of disk (the model, its bf16 / Q8_0 / Q4_K_M GGUFs); bench/llamacpp/compare.sh.
bench-llamacpp: build $(MODELS)/kl48-e32/config.json
	@bash bench/llamacpp/compare.sh $(MODELS)/kl48-e32

# `megadecode serve` under SOAK_CLIENTS streaming clients for SOAK_SECONDS on the small model
# (loopback only): errors (must be 0), requests served, the server's RSS at start and end.
SOAK_SECONDS ?= 600
SOAK_CLIENTS ?= 64
soak: build $(MODELS)/small/config.json
	@bash scripts/soak.sh $(BIN) $(MODELS)/small $(SOAK_SECONDS) $(SOAK_CLIENTS)

format:
	@clang-format -i $$(git ls-files '*.cpp' '*.h')

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD) $(FUZZ_BUILD) build-cuda
