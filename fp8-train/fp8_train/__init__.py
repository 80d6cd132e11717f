"""fp8-train."""
