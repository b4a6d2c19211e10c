"""Fused ops. One file per op: its Triton kernel, its pure-PyTorch chunk math and its autograd.Function.

`chunked.py` holds what the ops share: the row-chunk loop with the logit and gradient products.
"""
