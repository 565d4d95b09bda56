"""Deployments of several engine instances (replicas behind a router, a disaggregated
prefill/decode pair) and sweeps over scenario grids.
"""
