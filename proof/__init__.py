# SPDX-License-Identifier: Apache-2.0
"""The example's own proof and measurement, not to copy:

rounds              Proof, the one object main() and colocated_job call, around the job; RoundProof, one round
preflight           the proof's flags, and what is refused before any GPU work
logprob_gate        vLLM's log-probabilities against the trainer's, the tolerances, the trainer's kernel noise
rank_measurement    in each trainer rank: its sends timed and fingerprinted (the exact check's trainer half)
exact_check_driver  the exact check from the driver: prepare, start beside the gate, verdict
exact_check_engine  the exact check's engine half (the server's worker extension)
exact_placement     where each sent tensor lands in an engine's vLLM parameters, learned before the first sync
exact_derived       the parameters vLLM derives after loading, checked on each engine after a sync
exact_accounting    every sent tensor accounted for on an engine; which parameters are compared in place
fingerprint         the fingerprint both halves compare: three exact sums of a tensor's elements, on any device
coverage            --check-coverage: did a sync write every vLLM parameter
memory              each GPU's memory after a sync, the trainer's and the server's
report              a round's record and lines, the run's table, JSON and exit code
program             the script's signals, exit codes and Ray start
toy_rl              the toy RL step (--train)
"""
