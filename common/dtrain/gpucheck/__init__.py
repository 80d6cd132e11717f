"""`make gpu-check`: the GPU paths checked and measured on one GPU (see __main__.py)."""
