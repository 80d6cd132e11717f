"""fsdp-scaling."""
