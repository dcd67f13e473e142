# SPDX-License-Identifier: Apache-2.0
"""Parts of the sync to copy beside helpers.py: what a trainer rank sends and the direct loader's trainer
half (sources), the direct loader's server half (direct_load); optional: FP8 experts (fp8_experts), more
than one node (multinode), each rank reading its own shards of a checkpoint and the presets (models,
model_families). Nothing here imports the proof."""
