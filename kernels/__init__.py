"""Fast paths for the model's operators, each beside its pure-PyTorch reference.

Kept free of imports on purpose: transformers probes for a top-level ``kernels`` module
(the name of a Hugging Face package) and imports it when found, and every subpackage
here (``kernels.kda``) is imported on demand.
"""
