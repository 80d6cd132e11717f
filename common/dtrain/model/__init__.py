"""The model: `gpt` (the shared GPT, torch), `args` (GPTConfig, presets, parameter counts; no
torch), `flops` (model FLOPs per token), `perf` (MFU, TF32, the CPU matmul probe) and `timing`
(timing that means the same on CPU and GPU)."""
