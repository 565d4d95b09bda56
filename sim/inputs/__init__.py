"""What a run is given: the scenario file (schema, loading, overrides) and the requests it
generates or reads from a trace (the workload).
"""
