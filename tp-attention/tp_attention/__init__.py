"""tp-attention."""
