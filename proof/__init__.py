# SPDX-License-Identifier: Apache-2.0
"""The example's own proof and measurement, not to copy: the checks that wrap each round (the exact
check's trainer half, the logprob gate, coverage, memory, the report and its JSON: checks), the exact
check's engine half (exact_check_engine), the script's signals, exit codes and Ray start (program) and
its toy RL step (toy_rl)."""
