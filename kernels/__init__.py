"""Triton kernels with plain-torch twins; installed as localchat.kernels (the kernels issue fills this in)."""
