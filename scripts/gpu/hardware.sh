#!/usr/bin/env bash
# The machine a GPU script measured on, for its logs: the GPU (name, driver, memory) where
# nvidia-smi answers, and the CPU's model and count.
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
lscpu | grep -E '^Model name|^CPU\(s\)'
