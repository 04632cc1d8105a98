#!/usr/bin/env bash
# Compiler launcher of the nvcc build (CMake RULE_LAUNCH_COMPILE): runs the compile, keeps what it
# printed (ptxas -v's registers, spills and shared memory per kernel) in the log given first.
log="$1"
shift
"$@" 2> >(tee "$log" >&2)
