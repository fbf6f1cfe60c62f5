"""The command-line tools: `policy-validate` (torch-free) and `streamwise` (demo, quantize)."""
