"""Expert parallelism: each rank of an ep group holds E / ep experts of every MoE layer; tokens go
to their experts' ranks and back with uneven all-to-alls (dispatch.py), and the trainer's
`apply_expert_parallel` (trainer_ep.py) slices the experts and swaps the layers' dispatcher.
"""
