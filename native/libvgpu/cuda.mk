# cuda.mk — where cuda.h and nvml.h come from (included by this Makefile and the tests' one).
# An installed toolkit ($(CUDA_HOME)/include) wins; otherwise the headers of the pip packages
# nvidia-cuda-runtime (nvidia/cu13/include/cuda.h) and nvidia-nvml-dev (nvml.h), found through
# $(PYTHON): a fresh machine needs no CUDA toolkit.
CUDA_MK_DIR := $(dir $(lastword $(MAKEFILE_LIST)))
PYTHON ?= $(firstword $(wildcard $(abspath $(CUDA_MK_DIR)../../.venv/bin/python)) python3)
CUDA_HOME ?= /usr/local/cuda
PIP_CUDA_INC := $(shell $(PYTHON) -c "import importlib.util as u, glob, os; s = u.find_spec('nvidia'); print(' '.join(d for p in (s.submodule_search_locations if s else []) for d in sorted(glob.glob(os.path.join(p, '*', 'include')))))" 2>/dev/null)
CUDA_INC_DIRS := $(CUDA_HOME)/include $(PIP_CUDA_INC)
CUDA_H_DIR := $(patsubst %/cuda.h,%,$(firstword $(wildcard $(addsuffix /cuda.h,$(CUDA_INC_DIRS)))))
NVML_H_DIR := $(patsubst %/nvml.h,%,$(firstword $(wildcard $(addsuffix /nvml.h,$(CUDA_INC_DIRS)))))
ifeq ($(CUDA_H_DIR),)
$(error cuda.h not found: install a CUDA toolkit or `pip install nvidia-cuda-runtime` (PYTHON=$(PYTHON)))
endif
ifeq ($(NVML_H_DIR),)
$(error nvml.h not found: `pip install nvidia-nvml-dev` (PYTHON=$(PYTHON)))
endif
CUDA_CPPFLAGS := -I$(CUDA_H_DIR) -I$(NVML_H_DIR)
