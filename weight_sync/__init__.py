"""Optional parts of the sync, to copy beside colocated_sync.py: the direct loader's server half
(direct_load), FP8 experts (fp8_experts), more than one node (multinode), each rank reading its own
shards of a checkpoint and the presets (models, model_families), the server's watchdog
(server_watchdog). Nothing here imports the proof."""
